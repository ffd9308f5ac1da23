"""Nothing lost: a killed or preempted BERT run resumes into exactly the run that would have happened; a second run
on its directory, or a resume on other training data, is refused."""
import os
import re
import resource
import shutil
import signal
import socket
from pathlib import Path

import pytest
from conftest import (ACCELERATE, FAKE_GPU, HANG_S, ROOT, TORCHRUN, assert_attempts_kept_apart, assert_group_restarted,
                      assert_job_left_in_grace, assert_same_curve, assert_same_weights, descendants, end_all, free_port,
                      kill_job, launch, launch_cmd, rank_tracebacks, read_json, run, run_here, run_on, start, stop_job,
                      wait_for, workers)
from safetensors.torch import load_file

from utils.outputs import read_sample_indices

SCRIPT = "train_bert_cls.py"
STEPS = 60  # 800 samples / 16 = 50 steps per epoch: checkpoints every 10 steps fall mid-epoch, and a resume crosses
# into the second epoch


def resume_args(data, out, *extra):
    return ["--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch", "--do_train",
            "--max_seq_len", "32", "--train_batch_size", "16", "--eval_batch_size", "16", "--learning_rate", "1e-3",
            "--max_train_steps", str(STEPS), "--checkpointing_steps", "10", "--logging_steps", "5",
            "--save_total_limit", "2", "--log_sample_indices", "--output_dir", out, *extra]


def checkpoint_steps(out):
    return sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))


def assert_same_run(reference, resumed, stopped_at=None):
    assert_same_weights(load_file(reference / "checkpoints" / f"step_{STEPS}" / "model.safetensors"),
                        load_file(resumed / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))
    assert_same_curve(reference, resumed, ("loss", "lr", "accuracy"), stopped_at)
    assert read_sample_indices(resumed) == read_sample_indices(reference)  # the same samples, step by step
    assert checkpoint_steps(resumed) == [STEPS - 10, STEPS]  # rotation still works after resuming


def test_4_processes_train_the_samples_of_1_step_by_step(uninterrupted):
    """--log_sample_indices: each step's global batch, the processes' shares joined in rank order, is the 1-process
    step's, over the epoch boundary too."""
    one = read_sample_indices(uninterrupted[1])
    assert list(one) == list(range(1, STEPS + 1)) and read_sample_indices(uninterrupted[4]) == one


@pytest.fixture(scope="module")
def uninterrupted(text_data, tmp_path_factory):
    """The reference runs on 1 and 4 processes (a ring all-reduce over 3 or more ranks sums in an order set by DDP's
    gradient buckets: 2 would prove nothing of it). The 4-process run keeps every checkpoint, and starts with a soft
    limit on open files below what its ranks need (it raises the limit itself, and says so)."""
    runs = {1: tmp_path_factory.mktemp("uninterrupted_1"), 4: tmp_path_factory.mktemp("uninterrupted_4")}
    run_on(1, SCRIPT, resume_args(text_data, runs[1]))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    limit = f"--nofile=64:{'unlimited' if hard == resource.RLIM_INFINITY else hard}"
    proc = run(["prlimit", limit, *launch_cmd(SCRIPT, resume_args(text_data, runs[4], "--save_total_limit", "0"),
                                              num_processes=4)], env=FAKE_GPU)
    (runs[4] / "stdout.txt").write_text(proc.stdout)
    return runs


def test_a_low_soft_limit_on_open_files_is_raised_with_one_line(uninterrupted):
    printed = (uninterrupted[4] / "stdout.txt").read_text().splitlines()
    said = [line for line in printed if line.startswith("open files")]
    assert len(said) == 1 and said[0].startswith("open files: raised the soft limit (ulimit -n) from 64 to "), said
    assert "each rank of this 4-process launch may hold about" in said[0], said


def test_a_checkpoint_its_batches_do_not_divide_over_3_processes_is_refused_in_one_line(uninterrupted, text_data,
                                                                                        tmp_path):
    """The uninterrupted 4-process run's checkpoint on 3 processes, which its global batches (16) do not divide: one
    line listing the counts that can continue it, before anything is written."""
    three = tmp_path / "three"
    (three / "checkpoints").mkdir(parents=True)
    shutil.copytree(uninterrupted[4] / "checkpoints" / "step_20", three / "checkpoints" / "step_20")
    proc = launch(SCRIPT, resume_args(text_data, three, "--resume_from_checkpoint", "latest"), num_processes=3,
                  check=False)
    line = f"error: {three / 'checkpoints' / 'step_20'} cannot continue on 3 processes: --train_batch_size 16 and " \
           "--eval_batch_size 16 must divide evenly over them"
    assert proc.returncode != 0 and line in proc.stderr, proc.stderr[-3000:]
    assert "it can continue on 1, 2, 4, 8 or 16 processes" in proc.stderr
    assert not rank_tracebacks(proc.stderr, SCRIPT), proc.stderr[-3000:]  # the launcher's own traceback is its own
    assert sorted(p.name for p in three.iterdir()) == ["checkpoints"]  # nothing written


def train_here(args, check=True):
    """A 1-process run in this process (run_here)."""
    return run_here(SCRIPT, ["--cpu", *args], check=check)


def complete(out, step):
    return lambda: (out / "checkpoints" / f"step_{step}" / "training_state.json").exists()


def test_sigkill_then_resume_latest_is_bitwise_identical(uninterrupted, text_data, tmp_path):
    """1 process; 4 processes: the torchrun restart below (one worker killed, the group resumed by the launcher)."""
    out = tmp_path / "killed"
    job = start(launch_cmd(SCRIPT, resume_args(text_data, out), num_processes=1), tmp_path / "killed.log")
    wait_for(complete(out, 20), job)
    kill_job(job, signal.SIGKILL)
    job.wait()
    latest = checkpoint_steps(out)[-1]
    assert 20 <= latest < STEPS, latest
    train_here(resume_args(text_data, out, "--resume_from_checkpoint", "latest"))
    assert_same_run(uninterrupted[1], out)


def test_torchrun_restarts_a_killed_worker_from_the_latest_checkpoint(uninterrupted, text_data, tmp_path):
    """4 processes, elastic: under `torchrun --max-restarts 2` with `--resume_from_checkpoint latest` from the start,
    one worker SIGKILLed mid-epoch; the agent restarts the group, which resumes from the latest checkpoint and ends
    bitwise as the uninterrupted run, with no step logged twice. The c10d rendezvous as torch sets it up, its store
    shared with the restarted group: no variable set, the script keeps each attempt's keys apart."""
    out = tmp_path / "elastic"
    cmd = [*TORCHRUN, "--nnodes", "1", "--nproc_per_node", "4", "--max-restarts", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{free_port()}", SCRIPT, "--cpu",
           *resume_args(text_data, out, "--resume_from_checkpoint", "latest")]
    job = start(cmd, tmp_path / "elastic.log")
    wait_for(complete(out, 20), job)
    os.kill(max(workers(job, out)), signal.SIGKILL)
    job.wait(timeout=HANG_S)
    log = (tmp_path / "elastic.log").read_text()
    assert job.returncode == 0, log[-3000:]
    assert_group_restarted(log)  # a restart, not a run that went on
    assert_attempts_kept_apart(log)
    assert_same_run(uninterrupted[4], out)
    assert not (out / ".lock").exists()  # the restarted group held the directory and let go at the end


C10D_CONFIG = ROOT / "accelerate_configs" / "multinode_c10d.yaml"


def c10d_machine(machine, port, script_args):
    """One of two "machines" on this host: the command of multinode_c10d.yaml's header for `machine`, with the
    sizes and the address a user of one host gives on the command line (1 process each) and `--max_restarts 2`."""
    line = next(line for line in C10D_CONFIG.read_text().splitlines() if line.startswith(f"#   machine {machine}:"))
    words = line.split(":", 1)[1].split()
    assert words[:2] == ["accelerate", "launch"] and SCRIPT in words, line
    return [*ACCELERATE, *words[2:words.index(SCRIPT)], "--num_processes", "4", "--num_machines", "2",
            "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--max_restarts", "2", SCRIPT, "--cpu",
            *script_args]


def accepting(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.long  # two 4-process launches with a restart each, twice: the restart's own path is the torchrun test's
@pytest.mark.parametrize("first", [0, 1], ids=["machine_0_first", "machine_1_first"])
def test_two_c10d_machines_restart_a_killed_rank_from_the_latest_checkpoint(first, uninterrupted, text_data, tmp_path):
    """The shipped multinode_c10d.yaml with its header's commands, as two machines of two processes each on this host,
    `--max_restarts 2` and `--resume_from_checkpoint latest`, no variable set: machine 1's first rank SIGKILLed
    mid-epoch, both launchers restart their workers, which resume from the latest checkpoint and end bitwise as the
    uninterrupted 4-process run. c10d numbers the machines itself (on one host by their launchers' process IDs, here
    the order they started in), so the killed rank is rank 2 with machine 0 first, and rank 0, the output
    directory's lock holder, with machine 1 first. Machine 1 first is where its launcher, without the header's
    `--rdzv_conf is_host=0`, hosts the rendezvous store on machine 0's port (127.0.0.1 is its own address too), and
    machine 0's accelerate then stops at its port check."""
    out = tmp_path / "out"
    port = free_port()
    args = resume_args(text_data, out, "--resume_from_checkpoint", "latest")
    logs = {machine: tmp_path / f"machine{machine}.log" for machine in (0, 1)}
    jobs = {}
    try:
        jobs[first] = start(c10d_machine(first, port, args), logs[first])
        if first == 0:  # its launcher hosts the rendezvous store
            wait_for(lambda: accepting(port), jobs[0])
        else:  # torch's line as its launcher goes to the rendezvous
            wait_for(lambda: "node_rank is only used for static rdzv_backend" in logs[1].read_text(), jobs[1])
        jobs[1 - first] = start(c10d_machine(1 - first, port, args), logs[1 - first])
        wait_for(complete(out, 20), jobs[1])
        ranks = {int(dict(entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0")
                          if "=" in entry)["RANK"]): pid for pid in workers(jobs[1], out)}
        os.kill(ranks[min(ranks)], signal.SIGKILL)
        for job in jobs.values():
            job.wait(timeout=HANG_S)
    finally:
        for job in jobs.values():
            if job.poll() is None:
                kill_job(job, signal.SIGKILL)
                job.wait()
    log = "\n".join(logs[machine].read_text() for machine in (0, 1))
    assert [jobs[0].returncode, jobs[1].returncode] == [0, 0], log[-6000:]
    assert_group_restarted(log)
    assert_attempts_kept_apart(log)
    assert_same_run(uninterrupted[4], out)
    assert not (out / ".lock").exists()


def test_sigterm_checkpoints_at_the_next_step_and_exits_cleanly(uninterrupted, text_data, tmp_path):
    """The core of bitwise at any process count, then Slurm's time limit and scancel: a fresh 4-process launch
    resumes the uninterrupted run's own mid-epoch checkpoint; SIGTERM to the launcher, the ranks and their DataLoader
    workers at once; the ranks save at one step and leave before the launcher's grace ends, no process of the job is
    left, and the 4-process resume ends exactly as the uninterrupted run (which loaded its batches without
    workers)."""
    out = tmp_path / "preempted"
    later = [f"step_{step}" for step in range(30, STEPS + 1, 10)]
    shutil.copytree(uninterrupted[4], out, ignore=shutil.ignore_patterns(*later, "all_results.json", "stdout.txt"))
    job = start(launch_cmd(SCRIPT, resume_args(text_data, out, "--num_workers", "2", "--resume_from_checkpoint",
                                               "latest"), num_processes=4),
                tmp_path / "preempted.log")
    processes = []
    try:
        wait_for(complete(out, 30), job)
        wait_for(lambda: len(workers(job, out)) >= 4 + 4 * 2, job)  # the ranks and each one's 2 loader workers
        # a second run on the directory, started while the job holds it: one line naming the holder, nothing written
        # (the curve and the weights below are exactly the uninterrupted run's); the job is paused meanwhile, so
        # that it still holds the directory however fast it trains
        kill_job(job, signal.SIGSTOP)
        second = run_here(SCRIPT, ["--cpu", *resume_args(text_data, out, "--resume_from_checkpoint", "latest")],
                          check=False)
        refusal = re.search(rf"error: {out}: another run is using this directory \(host \S+, PID (\d+)",
                            second.stderr)
        assert second.returncode == 2 and refusal, second.stderr[-2000:]
        processes = [job.pid, *descendants(job.pid)]
        assert int(refusal.group(1)) in processes and job.poll() is None  # the job's main process holds it
        # Slurm and cloud preemption signal every process of the job; the SIGTERM, pending while the job is paused,
        # arrives as it goes on
        seconds, ended = stop_job(job, processes, signal.SIGTERM, signal.SIGCONT)
    finally:
        end_all([job.pid, *processes])
    log = (tmp_path / "preempted.log").read_text()
    assert "stopped on SIGTERM after saving a checkpoint" in log, log[-3000:]
    assert_job_left_in_grace(log, SCRIPT, ended)
    assert not (out / ".lock").exists()  # the first run ended as a preempted run does, and let go
    results = read_json(out / "all_results.json")
    assert results["preempted"] is True
    assert checkpoint_steps(out)[-1] == results["train_steps"] < STEPS
    print(f"SIGTERM to every process, --num_workers 2: launcher exit {job.returncode}, checkpoint step "
          f"{results['train_steps']}, {seconds:.1f} s")
    launch(SCRIPT, resume_args(text_data, out, "--resume_from_checkpoint", "latest"), num_processes=4)
    assert_same_run(uninterrupted[4], out, stopped_at=results["train_steps"])


@pytest.fixture(scope="module")
def twenty_steps(text_data, tmp_path_factory):
    """A finished 20-step run on 1 process (checkpoints step_10 and step_20); each test below resumes its own copy."""
    out = tmp_path_factory.mktemp("twenty_steps") / "out"
    train_here(resume_args(text_data, out, "--max_train_steps", "20"))
    return out


def test_kill_during_save_leaves_latest_complete(twenty_steps, text_data, tmp_path):
    """Debris of an interrupted save (a .tmp- directory without training_state.json) is never `latest`."""
    out = tmp_path / "out"
    shutil.copytree(twenty_steps, out)
    debris = out / "checkpoints" / ".tmp-step_30"
    debris.mkdir()
    (debris / "model.safetensors").write_bytes(b"truncated")
    half = out / "checkpoints" / "step_40"  # renamed but state missing: cannot happen, must still be ignored
    half.mkdir()
    proc = train_here(resume_args(text_data, out, "--max_train_steps", "30", "--resume_from_checkpoint", "latest"))
    assert f"Resumed from {out / 'checkpoints' / 'step_20'} at step 20" in proc.stdout
    assert checkpoint_steps(out)[-1] == 40 and (out / "checkpoints" / "step_30" / "training_state.json").exists()


def test_resume_refuses_another_label_set(twenty_steps, text_data, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(twenty_steps, out)
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(sorted((out / "labels.txt").read_text().split()) + ["汽车"]) + "\n")
    proc = train_here(resume_args(text_data, out, "--max_train_steps", "30", "--labels_file", labels,
                                  "--resume_from_checkpoint", "latest"), check=False)
    assert proc.returncode != 0
    assert "error: " in proc.stderr and "training_state.json: checkpoint has labels=" in proc.stderr


def test_resume_on_changed_training_data_is_refused_unless_allowed(twenty_steps, text_data, tmp_path):
    """The training file lost most of its lines since the checkpoint: resuming would skip the rest of the epoch."""
    out = tmp_path / "out"
    shutil.copytree(twenty_steps, out)
    shorter = tmp_path / "train.txt"
    shorter.write_text("".join((text_data / "train.txt").read_text(encoding="utf-8").splitlines(keepends=True)[:300]),
                       encoding="utf-8")
    args = resume_args(text_data, out, "--train_file", shorter, "--max_train_steps", "30", "--resume_from_checkpoint",
                       "latest")
    proc = train_here(args, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert f"{shorter}: the training data differ from those of {out / 'checkpoints' / 'step_20'} (800 -> 300 " \
           "examples)" in errors[0] and "--allow_data_change" in errors[0]
    assert checkpoint_steps(out) == [10, 20]
    proc = train_here([*args, "--allow_data_change"])
    assert "(800 -> 300 examples); resuming as --allow_data_change asks" in proc.stdout
    assert checkpoint_steps(out)[-1] == 30
