"""Shared test helpers: run the real launchers on tiny fixtures made here, offline, one thread per process."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from utils.demo_data import write_digits_imagefolder, write_text_classification_data  # noqa: E402

ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",  # two processes on two cores: one thread each, or they crawl
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "TQDM_DISABLE": "1",
}
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
# `launch` runs every job on a simulated 1-GPU machine where any CUDA use raises (tests/fake_gpu/sitecustomize.py):
# the suite's --cpu runs then prove that --cpu means CPU on a machine with a GPU, too.
# Prepended to PYTHONPATH, so wheels installed with --target (make gpu-check) stay importable.
FAKE_GPU = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests" / "fake_gpu"), os.environ.get("PYTHONPATH")]))}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, timeout=300, check=True, env=None):
    """Run a command from the repository root; on an unexpected exit code, show its output."""
    cmd = [sys.executable if c == "python" else str(c) for c in cmd]
    proc = subprocess.run(cmd, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def launch(script, args, num_processes=1, env=None, **kwargs):
    """`accelerate launch` with N CPU processes (N=2 is real gloo DDP: --multi_gpu + the script's --cpu),
    on a simulated 1-GPU machine (FAKE_GPU)."""
    return run(launch_cmd(script, args, num_processes), env={**FAKE_GPU, **(env or {})}, **kwargs)


def read_json(path):
    return json.loads(Path(path).read_text())


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def text_data(tmp_path_factory):
    """800 train / 99 val / 99 test headlines (odd-sized eval sets) and a small BERT config + vocab."""
    return write_text_classification_data(tmp_path_factory.mktemp("text"), n_train=800, n_val=99, n_test=99)


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory):
    return write_digits_imagefolder(tmp_path_factory.mktemp("digits"), size=16)


def launch_cmd(script, args, num_processes=1):
    """The command line `launch` runs, for tests that need to signal the running job."""
    if num_processes == 1:
        head = [*ACCELERATE, "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no"]
    else:
        head = [*ACCELERATE, "--multi_gpu", "--num_processes", num_processes, "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", free_port()]
    return [str(c) for c in [*head, script, "--cpu", *args]]


def start(cmd, log_path):
    """Start a job in its own process group (so the test can signal launcher and workers together)."""
    log = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate, proc, timeout=120):
    """Poll until predicate() holds; fail if the job exits first."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"job exited with {proc.returncode} before the condition held")
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def descendants(pid):
    """All processes below pid (the launcher's workers may sit in their own sessions)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_job(proc, sig):
    """Signal the launcher and every worker at once, as Slurm does to a job step (or the OOM killer to all)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def assert_same_weights(a, b):
    """Two state dicts, bitwise."""
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def assert_same_curve(reference, resumed, keys, stopped_at=None):
    """metrics.jsonl of a resumed run: the same events at the same steps (none repeated or skipped) with the same
    values of `keys` (timings aside). A run stopped between two log lines logs that window over fewer steps."""

    def curve(out):
        return [(e["event"], e["step"], *(e.get(k) for k in keys)) for e in read_jsonl(out / "metrics.jsonl")]

    expected, got = curve(reference), curve(resumed)
    assert [e[:2] for e in got] == [e[:2] for e in expected]
    if stopped_at is not None:
        window = next(i for i, e in enumerate(expected) if e[0] == "train" and e[1] > stopped_at)
        del expected[window], got[window]
    assert got == expected
