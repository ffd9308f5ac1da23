"""Faults around a run: a dead rank, a diverging loss, a full disk, Ctrl-C, a taken port, legacy DataParallel, two
runs on one directory."""
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (ACCELERATE, FAKE_GPU, GRACE, HANG_S, ROOT, TORCHRUN, alive, descendants, free_port, launch,
                      launch_cmd, read_json, read_jsonl, run, run_here, start, wait_for, workers)
from safetensors.torch import load_file

from utils.checkpoint import latest_checkpoint
from utils.runtime import UserError, hold_output_dir, release_output_dirs

SCRIPT = "train_bert_cls.py"


def bert_args(data, out, *extra):
    return ["--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch", "--do_train",
            "--max_seq_len", "32", "--train_batch_size", "16", "--eval_batch_size", "16", "--output_dir", out, *extra]


def test_a_killed_rank_ends_the_whole_job_quickly(text_data, tmp_path):
    """The survivor does not wait out its collective (--ddp_timeout 30 s here; its line would say so): it sees its
    peer's connection close, or the launcher ends it on the dead rank's exit."""
    out = tmp_path / "out"
    job = start(launch_cmd(SCRIPT, bert_args(text_data, out, "--max_train_steps", "5000", "--checkpointing_steps",
                                             "10", "--ddp_timeout", "30"), num_processes=2), tmp_path / "job.log")
    wait_for(lambda: (out / "checkpoints" / "step_10" / "training_state.json").exists(), job)
    workers = [pid for pid in descendants(job.pid) if f"--output_dir {out}" in
               open(f"/proc/{pid}/cmdline").read().replace("\0", " ")]
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGKILL)
    job.wait(timeout=GRACE + HANG_S)
    assert job.returncode != 0
    log = (tmp_path / "job.log").read_text()
    assert "exitcode  : -9" in log and "SIGKILL" in log, log[-3000:]  # the failing rank is named
    assert "no reply within --ddp_timeout" not in log, log[-3000:]
    assert not alive(workers)


def test_nan_loss_stops_with_a_clear_message_and_a_good_checkpoint(text_data, tmp_path):
    out = tmp_path / "out"
    # Warmup makes step 1's learning rate 0 (a good checkpoint), then 1e9 blows the weights up.
    proc = run_here(SCRIPT, ["--cpu", *bert_args(text_data, out, "--learning_rate", "1e9", "--max_grad_norm",
                                                 "0", "--warmup_ratio", "0.5", "--max_train_steps", "20",
                                                 "--checkpointing_steps", "1", "--logging_steps", "1")],
                    check=False)
    assert proc.returncode == 2
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert error and "NaN/inf" in error[0] and "Last good checkpoint" in error[0], proc.stderr[-2000:]
    latest = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    assert str(latest) in error[0]
    assert all(torch.isfinite(w).all() for w in load_file(latest / "model.safetensors").values())


def test_a_full_disk_stops_every_rank_with_one_line_and_the_previous_checkpoint_stays_latest(text_data, tmp_path,
                                                                                              small_disk):
    """2 processes writing to a 3 MiB disk: step_1 (about 1.8 MiB) fits, step_2 does not. Every rank stops (none
    waits in a collective), with one line naming the directory and its free space; the unfinished step_2 is removed and
    the run resumes from step_1."""
    out = small_disk("3M") / "out"
    # no validation file: the checkpoints are what fills the disk
    args = ["--train_file", text_data / "train.txt", "--model_name_or_path", text_data / "model", "--from_scratch",
            "--do_train", "--max_seq_len", "32", "--train_batch_size", "16", "--max_train_steps", "3",
            "--checkpointing_steps", "1", "--logging_steps", "1"]
    proc = launch(SCRIPT, [*args, "--output_dir", out], num_processes=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {out / 'checkpoints'}: cannot write (") and " free there: checkpoint step_2 " \
        "not saved; the latest complete checkpoint is still" in errors[0], errors[0]
    assert f'{SCRIPT}", line' not in proc.stderr, proc.stderr[-3000:]  # no worker's traceback (the launcher has its own)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    assert not (out / ".lock").exists()  # released on the full disk too
    copy = shutil.copytree(out, tmp_path / "copy")  # on a disk with room: the latest checkpoint resumes
    run_here(SCRIPT, ["--cpu", *args, "--output_dir", copy, "--resume_from_checkpoint", "latest"])
    assert [e["step"] for e in read_jsonl(copy / "metrics.jsonl") if e["event"] == "train"] == [1, 2, 3]


def test_ctrl_c_is_one_line_per_process_and_the_last_checkpoint_resumes(text_data, tmp_path):
    """A terminal's Ctrl-C: SIGINT to the launcher's process group; the launcher passes it on to the ranks (in
    sessions of their own) one after another, and on a busy machine a rank can have left before the next one's
    arrives. Here in the order that is hardest for the ranks: rank 0 alone has it and leaves, so rank 1 learns of it
    only as its collective broken by rank 0's leaving, and still prints its own Ctrl-C line; then the terminal's
    Ctrl-C reaches the launcher, which passes it on to whatever is left: at the end of a run it changes nothing."""
    out = tmp_path / "out"
    args = bert_args(text_data, out, "--max_train_steps", "5000", "--checkpointing_steps", "10")
    job = start(launch_cmd(SCRIPT, args, num_processes=2), tmp_path / "job.log")
    wait_for(lambda: (out / "checkpoints" / "step_10" / "training_state.json").exists(), job)
    first = next(pid for pid in workers(job, out) if "RANK=0\0" in Path(f"/proc/{pid}/environ").read_text())
    os.kill(first, signal.SIGINT)  # as the launcher passing it on to rank 0 first
    wait_for(lambda: "rank 1: interrupted (Ctrl-C)" in (tmp_path / "job.log").read_text(), job)
    with contextlib.suppress(ProcessLookupError):  # the launcher may have ended already, with both ranks
        os.killpg(job.pid, signal.SIGINT)  # the launcher's process group only, as a terminal does: not kill_job
    job.wait(timeout=GRACE + HANG_S)
    log = (tmp_path / "job.log").read_text()
    last = latest_checkpoint(out / "checkpoints")
    for rank in (0, 1):
        lines = [line for line in log.splitlines() if line.startswith(f"rank {rank}: interrupted (Ctrl-C)")]
        assert len(lines) == 1 and lines[0].endswith(f"the last checkpoint, {last}, is complete: continue with "
                                                     "--resume_from_checkpoint latest"), log[-3000:]
    # no worker prints a traceback (the launcher prints its own SignalException: its business)
    assert "KeyboardInterrupt" not in log and f'{SCRIPT}", line' not in log, log[-3000:]
    assert not (out / ".lock").exists()  # the interrupted run let go of its output directory
    step = int(last.name.split("_")[1])
    run_here(SCRIPT, ["--cpu", *bert_args(text_data, out, "--max_train_steps", str(step + 1),
                                          "--checkpointing_steps", "10", "--resume_from_checkpoint", "latest")])
    assert read_json(out / "all_results.json")["train_steps"] == step + 1


def test_the_ranks_of_each_launch_attempt_agree_on_keys_no_earlier_attempt_used(monkeypatch):
    """agree_on_attempt as torch's elastic agent's restarts meet it: one store for every attempt, in which the failed
    attempt's hellos are still there when the next attempt's rank 0 arrives before the others (it answers them, then
    the new ones). The start-up line says so only under a launch that restarts."""
    import datetime
    import threading

    import utils.runtime
    from utils.runtime import agree_on_attempt, elastic_restart_note

    timeout = datetime.timedelta(seconds=HANG_S)
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)

    def ranks(*ranks):
        numbers = {}

        def join(rank):
            client = torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
            numbers[rank] = agree_on_attempt(client, rank, 3, timeout)
        threads = [threading.Thread(target=join, args=(rank,)) for rank in ranks]
        for thread in threads:
            thread.start()
        return numbers, threads

    def finish(numbers, threads):
        for thread in threads:
            thread.join(HANG_S)
        assert not any(thread.is_alive() for thread in threads)
        return numbers

    first = finish(*ranks(2, 1, 0))
    assert first == {0: "1", 1: "1", 2: "1"}
    dead = [server.get(f"attempts/hello/{rank}").decode() for rank in (1, 2)]  # the failed attempt's tokens
    leader = ranks(0)
    deadline = time.monotonic() + HANG_S
    while not server.check([f"attempts/welcome/{token}" for token in dead]):  # rank 0 answered the dead ranks
        assert leader[1][0].is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    second = finish(*ranks(1, 2)) | finish(*leader)
    assert second == {0: "2", 1: "2", 2: "2"}

    monkeypatch.setattr(utils.runtime, "_attempt", "2")
    assert "attempt/2/" in elastic_restart_note({"TORCHELASTIC_MAX_RESTARTS": "2"})
    assert elastic_restart_note({"TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    monkeypatch.setattr(utils.runtime, "_attempt", None)  # a launch of one process: no process group
    assert elastic_restart_note({"TORCHELASTIC_MAX_RESTARTS": "2"}) is None


def test_a_taken_port_and_a_forced_gloo_backend(text_data, tmp_path):
    """One machine: accelerate moves to a free port and says so; that run also forces --dist_backend gloo (what
    machines without NCCL, and Windows, use) on the simulated 1-GPU machine. Several machines: a clear error on rank 0.
    (One 2-process run for both checks: each used to start its own.)"""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", port, SCRIPT, "--cpu",
                    *bert_args(text_data, tmp_path / "one", "--dist_backend", "gloo", "--max_train_steps", "2")],
                   env=FAKE_GPU)
        assert f"Port `{port}` is already in use" in proc.stderr
        results = read_json(tmp_path / "one" / "all_results.json")
        assert results["num_processes"] == 2 and results["distributed_type"] == "MULTI_CPU"
        proc = run([*ACCELERATE, "--multi_gpu", "--num_machines", "2", "--machine_rank", "0", "--num_processes", "2",
                    "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--same_network", SCRIPT, "--cpu",
                    *bert_args(text_data, tmp_path / "two", "--max_train_steps", "2")], check=False)
    assert proc.returncode != 0
    assert f"port `{port}`, but another process is utilizing it" in proc.stderr
    assert not (tmp_path / "two").exists()


def test_legacy_data_parallel_trains_and_exports_plain_keys(text_data, tmp_path):
    """1 process, in this process: the warning is Python's (on stderr outside pytest, which records warnings)."""
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="DDP is several times faster"):
        run_here(SCRIPT, ["--cpu", *bert_args(text_data, out, "--data_parallel", "--max_train_steps", "4")])
    assert not any(k.startswith("module.") for k in load_file(out / "best_model" / "model.safetensors"))
    assert read_json(out / "all_results.json")["train_steps"] == 4


def test_data_parallel_with_a_multi_process_launch_is_an_error(text_data, tmp_path):
    proc = launch(SCRIPT, bert_args(text_data, tmp_path / "out", "--data_parallel", "--max_train_steps", "2"),
                  num_processes=2, check=False)
    assert proc.returncode != 0
    assert "--data_parallel (single-process nn.DataParallel) cannot be combined" in proc.stderr


# ---- one run per output directory (utils/runtime.py hold_output_dir) ----

ONE_PROCESS = SimpleNamespace(num_processes=1, is_main_process=True, is_local_main_process=True)


def test_output_dir_lock_refuses_a_live_holder_and_takes_over_a_gone_one(tmp_path, capsys, monkeypatch):
    out = tmp_path / "new" / "out"
    monkeypatch.setattr(sys, "argv", ["train_bert_cls.py", "--token", "hf_SECRET", "--output_dir", str(out)])
    hold_output_dir(ONE_PROCESS, out)
    holder = json.loads((out / ".lock").read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    assert holder["command"] == f"train_bert_cls.py --token *** --output_dir {out}"  # never the token
    with pytest.raises(UserError, match=rf"{out}: another run is using this directory \(host \S+, PID {os.getpid()}, "):
        hold_output_dir(ONE_PROCESS, out)  # this process still runs: a live holder
    release_output_dirs()
    assert not (tmp_path / "new").exists()  # created only to hold the lock, and nothing else was written

    out.mkdir(parents=True)
    (out / ".lock").write_text(json.dumps({"host": "gpu-node-7", "pid": 4242, "started": "2026-01-01 00:00:00",
                                           "command": "train_resnet.py /data/imagenet"}))
    with pytest.raises(UserError, match=rf"locked by a run on another machine \(host gpu-node-7, PID 4242, .*\), "
                                        rf"which cannot be checked from here; .*remove {out / '.lock'}"):
        hold_output_dir(ONE_PROCESS, out)
    assert (out / ".lock").is_file() and out.is_dir()  # the refused run removed nothing

    # this host, but the PID now runs another program (another start time): the holder is gone
    holder = {**holder, "pid_start": -1, "token": "gone"}
    (out / ".lock").write_text(json.dumps(holder))
    hold_output_dir(ONE_PROCESS, out)
    assert f"{out / '.lock'}: taking over the lock of a run that is no longer running" in capsys.readouterr().out
    assert json.loads((out / ".lock").read_text())["token"] != "gone"
    release_output_dirs()
    assert not (out / ".lock").exists() and out.is_dir()  # it existed before: kept


def test_output_dir_lock_of_an_earlier_attempt_of_a_requeued_slurm_job_is_taken_over(tmp_path, monkeypatch):
    """A job Slurm requeued (the same SLURM_JOB_ID, a higher SLURM_RESTART_COUNT) after its node went down left a lock
    from another host: taken over. Another step of this attempt, or another job, keeps its lock."""
    monkeypatch.setenv("SLURM_JOB_ID", "7741")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    out = tmp_path / "out"
    out.mkdir()
    for holder, taken_over in (({"slurm_job_id": "7741", "slurm_restart_count": 1}, False),  # this attempt's
                               ({"slurm_job_id": "7740", "slurm_restart_count": 0}, False),  # another job
                               ({"slurm_job_id": "7741", "slurm_restart_count": 0}, True)):  # the earlier attempt
        (out / ".lock").write_text(json.dumps({"host": "gpu-node-7", "pid": 4242, **holder}))
        if taken_over:
            hold_output_dir(ONE_PROCESS, out)
            assert json.loads((out / ".lock").read_text())["slurm_restart_count"] == 1
            release_output_dirs()
        else:
            with pytest.raises(UserError, match="locked by a run on another machine"):
                hold_output_dir(ONE_PROCESS, out)


def test_a_stop_inside_the_lock_release_leaves_no_lock(tmp_path, monkeypatch):
    """A SIGTERM that stops the run while its end releases the lock (Stopped raised in the middle of the release) leaves
    the lock to run_cli's own release, which finishes it; a stop before the release does the same."""
    from utils import runtime

    for cut in ("before the file goes", "after the file went"):
        out = tmp_path / cut.replace(" ", "_") / "out"
        hold_output_dir(ONE_PROCESS, out)
        target = runtime._read_lock if cut.startswith("before") else runtime._remove_empty
        calls = []

        def stopped_once(*args, target=target, calls=calls, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise runtime.Stopped(runtime.STOPPED_LINE)
            return target(*args, **kwargs)

        monkeypatch.setattr(runtime, target.__name__, stopped_once)

        def main(args):
            release_output_dirs()  # the end of the run (RunLog.end), where the stop arrives

        handler = signal.getsignal(signal.SIGTERM)
        try:
            with pytest.raises(SystemExit) as exit_:
                runtime.run_cli(main, None)
        finally:
            monkeypatch.undo()
        assert exit_.value.code == 143 and len(calls) == 2, cut
        assert signal.getsignal(signal.SIGTERM) == handler  # run_cli gives its caller's handler back
        assert not (out / ".lock").exists() and not out.parent.exists(), cut  # lock and its new directories gone


SIGNAL_ONCE = """
import ctypes, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from utils import runtime

received = []

def on_sigterm(signum, frame):  # what both of the scripts' SIGTERM handlers do first
    runtime.forget_a_dead_launcher()
    received.append(signum)
    print("sigterm", flush=True)

libc, asked = ctypes.CDLL(None), ctypes.c_int()
signal.signal(signal.SIGTERM, on_sigterm)
runtime.stop_with_launcher()
libc.prctl(2, ctypes.byref(asked))  # PR_GET_PDEATHSIG
print(f"asked {asked.value} parent {os.getppid()}", flush=True)
for _ in range(12000):  # 600 s at most (a hang): the launcher's death, then the signal
    if received:
        break
    time.sleep(0.05)
libc.prctl(2, ctypes.byref(asked))
print(f"asked {asked.value} parent {os.getppid()}", flush=True)
"""

LAUNCHER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, *sys.argv[1:]], start_new_session=True)
time.sleep(3600)  # until the test kills it
"""


def test_an_orphan_is_signalled_once_at_its_launchers_death(tmp_path):
    """A process of an elastic launch asks for SIGTERM at its launcher's death; once that came, it withdraws the
    request, which the kernel would otherwise repeat each time a thread of the init process it was handed to ends."""
    (tmp_path / "rank.py").write_text(SIGNAL_ONCE)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    log = tmp_path / "rank.log"
    launcher = start([sys.executable, tmp_path / "launcher.py", tmp_path / "rank.py", ROOT], log,
                     env={"TORCHELASTIC_RUN_ID": "none"})
    wait_for(lambda: "asked" in log.read_text(), launcher)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + HANG_S
    while log.read_text().count("asked") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = log.read_text().splitlines()
    assert lines[0] == f"asked {int(signal.SIGTERM)} parent {launcher.pid}", lines
    assert lines[1] == "sigterm" and lines[2].startswith("asked 0 parent ") and lines[2] != lines[0], lines


LOCK_CHECK = """
import json, os, sys
from pathlib import Path
from pathlib import Path
from types import SimpleNamespace

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU (gloo) on any machine, as --cpu makes a run
sys.path.insert(0, sys.argv[1])
from accelerate import PartialState
from accelerate.utils import gather_object

from utils.runtime import UserError, hold_output_dir, leave_process, release_output_dirs

state = PartialState(cpu=True)
rank = state.process_index
node = SimpleNamespace(num_processes=2, is_main_process=rank == 0, is_local_main_process=True)  # 2 machines
base = Path(sys.argv[2])
pids = gather_object([os.getpid()])

own = base / f"node{rank}"  # each node's own disk: each node's process holds its own lock
hold_output_dir(node, own)
assert json.loads((own / ".lock").read_text())["pid"] == os.getpid()
release_output_dirs()
assert not own.exists()

shared = base / "shared"  # one disk seen by both: the main process's lock only, left alone by node 1
hold_output_dir(node, shared)
assert json.loads((shared / ".lock").read_text())["pid"] == pids[0]
state.wait_for_everyone()
release_output_dirs()
state.wait_for_everyone()
assert not (shared / ".lock").exists()

busy = base / ("free" if rank == 0 else "busy")  # node 1's disk holds another live run's lock: every rank stops
try:
    hold_output_dir(node, busy)
    raise AssertionError("not refused")
except UserError as err:
    assert "busy: another run is using this directory" in str(err) and "(node " in str(err), err
release_output_dirs()
assert rank == 1 or not (base / "free").exists()  # the main process's own lock went with the refusal
print(f"rank {rank} ok", flush=True)
leave_process(0)  # as run_cli leaves a launched process: no interpreter finalization for gloo's threads to abort
"""


def test_output_dir_lock_on_node_local_and_shared_disks(tmp_path):
    """Two "machines" of one process each (torchrun, gloo): on node-local disks every node locks its own copy; on a
    shared one only the main process locks; a node whose disk holds another run's lock stops the whole job."""
    busy = tmp_path / "busy"
    hold_output_dir(ONE_PROCESS, busy)  # another live run (this test process) holds node 1's directory
    script = tmp_path / "lock_check.py"
    script.write_text(LOCK_CHECK)
    try:
        proc = run([*TORCHRUN, "--nproc_per_node", "2", "--master_port", free_port(), script, ROOT, tmp_path])
    finally:
        release_output_dirs()
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout


LEAVE_CHECK = """
import atexit, os, sys
sys.path.insert(0, sys.argv[1])
from accelerate import PartialState
from accelerate.utils import broadcast_object_list

from utils.runtime import UserError, run_cli


class Finalized:
    def __del__(self, write=os.write, line=f"rank {os.environ['RANK']} finalized\\n".encode()):
        write(1, line)  # in the interpreter's finalization, where a gloo worker's late bid for the GIL aborts


kept = Finalized()


def main(mode):
    state = PartialState(cpu=True)
    atexit.register(print, f"rank {state.process_index} atexit", flush=True)
    broadcast_object_list([1])  # a gloo collective whose work object holds Python tensors
    print(f"rank {state.process_index} done")  # left in the buffer: leaving must flush it
    if mode == "error":
        raise UserError("bad input")


run_cli(main, sys.argv[2])
"""


@pytest.mark.parametrize("mode, code", [("ok", 0), ("error", 2)])
def test_a_launched_process_leaves_without_the_interpreters_finalization(tmp_path, mode, code):
    """Each process of a multi-process launch runs its atexit handlers, flushes its output and exits with the run's
    status, but skips the interpreter's finalization, where a gloo worker thread dropping its last collective aborted
    finished runs (SIGABRT)."""
    script = tmp_path / "leave_check.py"
    script.write_text(LEAVE_CHECK)
    proc = run([*TORCHRUN, "--nproc_per_node", "2", "--master_port", free_port(), script, ROOT, mode], check=False)
    assert proc.returncode == (0 if code == 0 else 1), proc.stderr[-3000:]  # torchrun: 1 when a worker failed
    for rank in (0, 1):
        assert f"rank {rank} done" in proc.stdout and f"rank {rank} atexit" in proc.stdout
        assert f"rank {rank} finalized" not in proc.stdout
    if code:
        assert "error: bad input" in proc.stderr and f"(exitcode: {code})" in proc.stderr
