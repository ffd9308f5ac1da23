"""Stops as schedulers, containers and machines deliver them, on 2 processes through `accelerate launch`: SIGTERM to
the launcher alone during a validation longer than its grace, SIGKILL to the launcher, a frozen rank, SIGTERM to every
process of a prediction run. Each ends with a resumable checkpoint or one line, and no process left behind. SIGTERM to
every process of a training job, DataLoader workers included (Slurm's time limit, scancel), is where its resume is
proven exact: tests/test_resnet.py and tests/test_bert_resume.py."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader
from conftest import (FEW_DIGITS_TRAIN, GRACE, HANG_S, LAUNCHER_SIGKILL, assert_job_left_in_grace, descendants, end_all,
                      gone_within, kill_job, launch_cmd, rank_tracebacks, read_json, read_jsonl, run_here, start,
                      stop_job, wait_for, workers)

from utils.runtime import loader_settings

RESNET_STEPS_PER_EPOCH = FEW_DIGITS_TRAIN // 64  # the few digits' training images, -b 64, drop_last


def resnet_args(data, out, *extra):
    return [data, "--arch", "resnet18", "--image_size", "16", "--val_resize", "16", "-b", "64", "--lr", "0.02",
            "--momentum", "0", "-j", "2", "-p", "5", "--epochs", "2", "--checkpointing_steps", "2",
            "--output_dir", out, *extra]


def bert_args(data, out, *extra):
    return ["--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch", "--do_train",
            "--max_seq_len", "32", "--train_batch_size", "16", "--eval_batch_size", "16", "--num_workers", "2",
            "--max_train_steps", "60", "--checkpointing_steps", "5", "--logging_steps", "5", "--output_dir", out,
            *extra]


# The resume after a stop runs in this process, on 1 process without loader workers: what is under test is the
# checkpoint the stop left (exact resumes on 2 processes: tests/test_resnet.py, tests/test_bert_resume.py).
RESNET_RESUME = ["-j", "0", "--resume", "latest"]


def complete(out, step):
    return lambda: (out / "checkpoints" / f"step_{step}" / "training_state.json").exists()


def checkpoint_steps(out):
    return sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))


def signals_pending(pid):
    """Whether a signal sent to `pid` is still waiting for it (/proc's SigPnd and ShdPnd masks): one it ignores is
    dropped as it is sent, one it blocks stays pending until the thread that waits for it takes it."""
    masks = [line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(int(mask, 16) for mask in masks)


def test_loader_workers_leave_on_their_parents_sigterm_alone():
    """A worker ignores Ctrl-C and a SIGTERM from anyone else (a scheduler signalling every process): the epoch goes
    on. Its parent's SIGTERM (multiprocessing's exit ends daemon workers so) ends it at once, with exit status 0."""
    try:
        settings = loader_settings(2)  # what every loader of both scripts is built with
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # loader_settings asked PartialState for the device
    earlier = {child.pid for child in psutil.Process().children()}  # what earlier tests in this process left running
    batches = iter(DataLoader(list(range(64)), batch_size=4, **settings))
    next(batches)
    next(batches)  # from the second worker: both have started (a signal before the start is torch's to handle)
    started = [child for child in psutil.Process().children() if child.pid not in earlier]
    pids = [str(child.pid) for child in started]
    assert len(pids) == 2
    for sig in ("-TERM", "-INT"):
        subprocess.run(["kill", sig, *pids], check=True)  # from another process
    deadline = time.monotonic() + HANG_S  # until each worker has taken the signals (a dead one has none pending)
    while any(child.is_running() and signals_pending(child.pid) for child in started):
        assert time.monotonic() < deadline, "a worker left a signal pending"
        time.sleep(0.01)
    assert len(list(batches)) == 14 and all(child.status() != psutil.STATUS_ZOMBIE for child in started)
    started[0].send_signal(signal.SIGTERM)  # from the parent
    assert started[0].wait(timeout=HANG_S) == 0
    started[1].send_signal(signal.SIGTERM)
    assert started[1].wait(timeout=HANG_S) == 0


def long_validation_copy(digits, root, copies):
    """The few digits with `copies` hard links of every validation image beside it: a validation of minutes, the same
    training data (the links are removed again before the resume)."""
    root.mkdir()
    (root / "train").symlink_to(digits / "train")
    for image in sorted((digits / "val").rglob("*.png")):
        folder = root / "val" / image.parent.name
        folder.mkdir(parents=True, exist_ok=True)
        os.link(image, folder / image.name)
        for copy in range(copies):
            os.link(image, folder / f"copy{copy}_{image.name}")
    return root


def test_sigterm_to_the_launcher_during_a_validation_longer_than_its_grace_saves(few_digits, tmp_path):
    """docker stop, kubectl delete: SIGTERM to PID 1 (the launcher), which passes it on and SIGKILLs the ranks once
    its grace is over (30 s by default). The stop abandons the epoch's validation (minutes long here, longer than
    that grace) instead of finishing it, saves the epoch's end with the validation still due, leaves without the
    launcher's SIGKILL, and the resumed run validates that epoch first. The signal is sent once epoch 1's last step
    is logged: the next thing each rank does is that validation, which checks for a stop before every batch."""
    data, out = long_validation_copy(few_digits, tmp_path / "data", copies=800), tmp_path / "out"
    args = resnet_args(data, out, "--epochs", "2", "--checkpointing_steps", "1000")  # no checkpoint but the stop's
    job = start(launch_cmd("train_resnet.py", args, num_processes=2), tmp_path / "job.log")
    processes = []
    try:
        # the log line of epoch 1's last step (5), which ends the epoch and starts the validation
        wait_for(lambda: (out / "metrics.jsonl").exists() and any(
            e["event"] == "train" and e["step"] == RESNET_STEPS_PER_EPOCH for e in read_jsonl(out / "metrics.jsonl")),
            job)
        processes = [job.pid, *descendants(job.pid)]
        signaled = time.monotonic()
        os.kill(job.pid, signal.SIGTERM)
        job.wait(timeout=GRACE + HANG_S)
        seconds = time.monotonic() - signaled
        ended = gone_within(processes, HANG_S)
    finally:
        end_all([job.pid, *processes])
    log = (tmp_path / "job.log").read_text()
    assert f"evaluation after step {RESNET_STEPS_PER_EPOCH} abandoned on SIGTERM" in log, log[-3000:]
    assert checkpoint_steps(out) == [RESNET_STEPS_PER_EPOCH], log[-3000:]
    state = json.loads((out / "checkpoints" / f"step_{RESNET_STEPS_PER_EPOCH}" / "training_state.json").read_text())
    assert state["validation_due"] is True
    assert LAUNCHER_SIGKILL not in log and ended, log[-3000:]
    print(f"launcher SIGTERM during validation: launcher exit {job.returncode}, checkpoint step "
          f"{RESNET_STEPS_PER_EPOCH}, {seconds:.1f} s")
    for copy in (data / "val").rglob("copy*.png"):
        copy.unlink()
    run_here("train_resnet.py", ["--cpu", *resnet_args(data, out, "--epochs", "2", "--checkpointing_steps", "1000"),
                                 *RESNET_RESUME])
    evals = [(e["step"], e["epoch"]) for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "eval"]
    steps = RESNET_STEPS_PER_EPOCH
    assert evals == [(steps, 1), (2 * steps, 2)], evals  # the abandoned validation, then the next epoch's
    assert read_json(out / "all_results.json")["train_steps"] == 2 * steps


def test_sigkill_to_the_launcher_stops_the_ranks_and_frees_the_directory(text_data, tmp_path):
    """The OOM killer or kill -9 on the launcher: torchrun started the ranks in sessions of their own, so no signal
    reaches them. They notice their launcher's death, save where they agree, and leave; a new run takes the
    directory."""
    out = tmp_path / "out"
    job = start(launch_cmd("train_bert_cls.py", bert_args(text_data, out, "--max_train_steps", "5000"),
                           num_processes=2), tmp_path / "job.log")
    processes = []
    try:
        wait_for(complete(out, 10), job)
        processes = [*descendants(job.pid)]
        killed = time.monotonic()
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        ended = gone_within(processes, HANG_S)
        seconds = time.monotonic() - killed
    finally:
        end_all(processes)
    assert ended, f"processes of the job still running {seconds:.0f} s after the launcher's death"
    log = (tmp_path / "job.log").read_text()
    assert "stopped on SIGTERM after saving a checkpoint" in log, log[-3000:]
    assert not (out / ".lock").exists()
    step = checkpoint_steps(out)[-1]
    print(f"launcher SIGKILL: ranks gone after {seconds:.1f} s, checkpoint step {step}")
    run_here("train_bert_cls.py", ["--cpu", *bert_args(text_data, out, "--num_workers", "0", "--max_train_steps",
                                                       str(step + 1), "--resume_from_checkpoint", "latest")])
    assert read_json(out / "all_results.json")["train_steps"] == step + 1


def test_a_frozen_rank_is_named_by_the_survivor_and_the_job_ends_within_the_timeout(text_data, tmp_path):
    """A rank SIGSTOPped (or stuck on a filesystem): the survivor's collective times out after --ddp_timeout and it
    prints one line naming the rank; the frozen process on its machine is ended by the survivor, so the launcher does
    not wait its grace for it (its log would say it SIGKILLed one)."""
    out, timeout = tmp_path / "out", 15
    job = start(launch_cmd("train_bert_cls.py", bert_args(text_data, out, "--max_train_steps", "5000",
                                                          "--ddp_timeout", str(timeout)), num_processes=2),
                tmp_path / "job.log")
    processes = []
    try:
        wait_for(complete(out, 10), job)
        processes = [*descendants(job.pid)]
        rank1 = [pid for pid in workers(job, out) if "RANK=1\0" in Path(f"/proc/{pid}/environ").read_text()]
        stopped = time.monotonic()
        os.kill(rank1[0], signal.SIGSTOP)
        job.wait(timeout=timeout + GRACE + HANG_S)
        seconds = time.monotonic() - stopped
    finally:
        end_all([job.pid, *processes])
    log = (tmp_path / "job.log").read_text()
    lines = [line for line in log.splitlines() if line.startswith("rank 0: rank 1 stopped answering")]
    assert len(lines) == 1 and f"no reply within --ddp_timeout {timeout} s" in lines[0], log[-3000:]
    assert "rank 1 stopped answering: frozen (a stopped process on this machine), ended here" in lines[0], lines[0]
    assert not rank_tracebacks(log, "train_bert_cls.py"), log[-3000:]
    assert job.returncode != 0 and LAUNCHER_SIGKILL not in log, log[-3000:]
    print(f"frozen rank: launcher exit {job.returncode}, {seconds:.1f} s")


def test_sigterm_to_every_process_of_a_prediction_run_stops_it_at_once_with_one_line(text_data, tmp_path):
    """An evaluation-only or prediction run has no training position to save: SIGTERM to every process of the job
    stops it at once, one line per rank, exit status 143 from each (the launcher reports it), nothing half-written
    and the directory free. The job is paused from its start while the signal is sent, so the signal lands inside
    the run however fast it is."""
    model = tmp_path / "trained"
    run_here("train_bert_cls.py", ["--cpu", *bert_args(text_data, model, "--num_workers", "0",
                                                       "--max_train_steps", "2")])
    texts = tmp_path / "many.txt"
    texts.write_text((text_data / "test.txt").read_text(encoding="utf-8") * 200, encoding="utf-8")  # 19,800 texts
    out = tmp_path / "predicted"
    job = start(launch_cmd("train_bert_cls.py", ["--model_name_or_path", model / "best_model", "--do_predict",
                                                 "--predict_file", texts, "--eval_batch_size", "64", "--max_seq_len",
                                                 "32", "--num_workers", "2", "--output_dir", out], num_processes=2),
                tmp_path / "job.log")
    processes = []
    try:
        wait_for(lambda: (out / ".lock").exists(), job)  # the run's main() holds its directory
        kill_job(job, signal.SIGSTOP)
        processes = [job.pid, *descendants(job.pid)]
        seconds, ended = stop_job(job, processes, signal.SIGTERM, signal.SIGCONT)
    finally:
        end_all([job.pid, *processes])
    log = (tmp_path / "job.log").read_text()
    for rank in (0, 1):
        assert f"rank {rank}: stopped on SIGTERM outside the training steps" in log, log[-3000:]
    assert_job_left_in_grace(log, "train_bert_cls.py", ended)
    assert job.returncode != 0, job.returncode
    assert not (out / "predictions.jsonl").exists() and not (out / ".lock").exists()
    print(f"prediction run, SIGTERM to every process: launcher exit {job.returncode}, {seconds:.1f} s")
