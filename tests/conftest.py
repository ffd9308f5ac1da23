"""Shared test helpers: run the real launchers on tiny fixtures made here, offline, one thread per process."""
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tokenizers
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
# torch's switch for a new rendezvous store at each elastic restart: the restart tests show that none is needed
ENV.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
# The GPUs this machine shows, asked through NVML without initialising CUDA (cpu_in_this_process hides them here)
REAL_GPUS = torch.cuda.device_count()
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def pythonpath(*folders):
    """PYTHONPATH with these folders first, then the caller's: wheels installed with --target (make gpu-check) stay
    importable in a run that puts its own modules first."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [*map(str, folders), ENV.get("PYTHONPATH")]))}


# `launch` runs every job on a simulated 1-GPU machine where any CUDA use raises (tests/fake_gpu/sitecustomize.py):
# the suite's --cpu runs then prove that --cpu means CPU on a machine with a GPU, too.
FAKE_GPU = pythonpath(ROOT / "tests" / "fake_gpu")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


# --doc_stride needs every window of a long text: tokenizers 0.23.2 returns two at most, and the script refuses it
needs_whole_windows = pytest.mark.skipif(
    tokenizers.__version__ == "0.23.2", reason="tokenizers 0.23.2 cuts a long text into two windows at most, so "
    "--doc_stride refuses it (pip install 'tokenizers>=0.23.3'): the refusal is tested on any version")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# When this pytest process imported its helpers: every run its module fixtures launch started later, so a launched
# run's startup_seconds is below `time.time() - STARTED` (+1 s: psutil's process start times rest on the kernel's
# boot time, which comes in whole seconds), a bound no machine's speed moves.
STARTED = time.time()

# How long a test waits for a launched command, a job's event or a process's end before calling it a hang: sized for a
# hang only, never for a run's speed. The longest launched command, the GPU check's dry mode, takes 51-58 s of CPU
# (docs/results.md); a loaded 2-core machine stretches a command's wall time several times over its CPU time, and
# 600 s still leaves room for ten times that.
HANG_S = 600


def run(cmd, timeout=HANG_S, check=True, env=None):
    """Run a command from the repository root; on an unexpected exit code, show its output."""
    cmd = [sys.executable if c == "python" else str(c) for c in cmd]
    proc = subprocess.run(cmd, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def assert_one_line_error(proc, *fragments):
    """Bad input as the user sees it: exit status 2, no traceback, one `error:` line holding each fragment."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@contextlib.contextmanager
def one_thread():
    """One torch thread, as the launched runs have (ENV: OMP_NUM_THREADS=1), for work in this process (run_here
    takes it itself): on a busy 2-core machine a second thread mostly spins (measured: 10 s of CPU instead of 0.8 s
    for a 20-step BERT run of tests/test_run_classification_flags.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_here(script, args, check=True):
    """`python SCRIPT args` as the script's `if __name__ == "__main__":` runs it (run_cli(main, parse_args())), but
    in this process: a 1-process run that stops at bad input (or trains a few steps) then costs no start-up, which
    (importing torch and transformers in a fresh interpreter) is most of such a run. Returns what `run` returns: the
    exit status and what went to stdout and stderr. Puts back what the run changes in this process: the SIGTERM
    and SIGINT handlers, accelerate's state, the environment (--cpu sets CUDA_VISIBLE_DEVICES), torch's choice of
    kernels (--use_deterministic_algorithms, cuDNN's autotuner), sys.argv and the directory; and ends W&B's service,
    as the process's exit would. The run has one torch thread (one_thread), as a
    launched process has."""
    import importlib
    import importlib.machinery
    import io
    import signal

    from accelerate.state import AcceleratorState, GradientState

    from utils.runtime import run_cli

    name = Path(script).stem
    found = importlib.machinery.PathFinder.find_spec(name)  # where `python SCRIPT` finds it now, sys.path first
    if name in sys.modules and found is not None and getattr(sys.modules[name], "__file__", None) != found.origin:
        del sys.modules[name]  # another test's script of the same name, imported from elsewhere
    module = importlib.import_module(name)
    argv = [str(a) for a in args]
    stdout, stderr = io.StringIO(), io.StringIO()
    sigterm, sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    environ, sys_argv = dict(os.environ), sys.argv
    deterministic, benchmark = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    returncode = 0
    try:
        sys.argv = [script, *argv]  # argparse's usage and error lines name the script, as on the command line
        with (one_thread(), contextlib.chdir(ROOT), contextlib.redirect_stdout(stdout),
              contextlib.redirect_stderr(stderr)):
            run_cli(module.main, module.parse_args(argv))
    except SystemExit as exit_:
        returncode = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    finally:
        sys.argv = sys_argv
        if "wandb" in sys.modules:  # what the script's exit does (utils/runtime.py runs the atexit functions, W&B's
            sys.modules["wandb"].teardown()  # among them): its service flushes each run's offline file, then ends
        signal.signal(signal.SIGTERM, sigterm)
        signal.signal(signal.SIGINT, sigint)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()  # the accumulation count and the active loaders: a new process starts without them
        os.environ.clear()
        os.environ.update(environ)
        torch.use_deterministic_algorithms(deterministic)
        torch.backends.cudnn.benchmark = benchmark
    proc = subprocess.CompletedProcess([script, *argv], returncode, stdout.getvalue(), stderr.getvalue())
    if check and returncode != 0:
        raise AssertionError(f"exit {returncode}: {script} {' '.join(argv)}\n--- stdout ---\n{proc.stdout[-6000:]}\n"
                             f"--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def run_on(num_processes, script, args):
    """A run on 1 or 2 processes whose point is the script, not the launcher: 1 process in this process (run_here,
    with the --cpu that `launch` adds), 2 through a real `accelerate launch` of gloo DDP. What a 1-process launch adds
    is an interpreter's start-up, seconds of CPU; a 1-process run's `startup_seconds` then counts from the pytest
    process's start, so tests of start-up read launched runs."""
    if num_processes == 1:
        return run_here(script, ["--cpu", *args])
    return launch(script, args, num_processes=num_processes)


def launch(script, args, num_processes=1, env=None, **kwargs):
    """`accelerate launch` with N CPU processes (N=2 is real gloo DDP: --multi_gpu + the script's --cpu),
    on a simulated 1-GPU machine (FAKE_GPU)."""
    return run(launch_cmd(script, args, num_processes), env={**FAKE_GPU, **(env or {})}, **kwargs)


def read_json(path):
    return json.loads(Path(path).read_text())


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


pytest_plugins = ["shared_image_runs"]


def pytest_configure(config):
    config.addinivalue_line("markers", "long: a learning check that needs many steps (an accuracy reached, a curve "
                                       "matched against a peer), an end-to-end run of a tool beside the scripts "
                                       "(the GPU tools' dry modes, the benchmarks' quick runs), or a run under "
                                       "inductor (its compiling alone costs a minute of CPU); `make test` leaves it "
                                       "out, `make test-long` runs it, .ci/run both")
    config.addinivalue_line("markers", "alone: launches 8 processes (about 1.3 GB each): `make test-long` runs these "
                                       "after the rest, one at a time, so that no other launch runs beside them")


# The files that take longest (`make test`'s durations; docs/results.md), longest first, handed out before the others;
# test_gpu_bench, test_gpu_check and test_compile hold the longest of `make test-long`, so they come next:
# pytest-xdist gives a worker a whole file at a time (--dist loadfile), in collection order, so a long file left near
# the end keeps one worker busy minutes after the other has run out of work. A file not named here runs after these,
# in name order. (test_onnx_export and test_image_predict read the shared digits_model, which test_resnet, first,
# builds and evaluates on 2 processes: not listed, they start long after and wait for no one's build of it.)
LONGEST_FIRST = ("test_bert_resume.py", "test_resnet.py", "test_gpu_bench.py", "test_gpu_check.py", "test_compile.py", "test_edges.py",
                 "test_faults.py", "test_stops.py", "test_selection.py", "test_launch_matrix.py",
                 "test_bert_cls.py", "test_sample_indices.py", "test_between_runs.py", "test_sync_free_step.py",
                 "test_metric_names.py", "test_data_cache.py", "test_docs.py")


def pytest_collection_modifyitems(config, items):
    """Run the files of LONGEST_FIRST first, each file's tests in their own order (its module fixtures then build
    once); every worker collects the same order, as pytest-xdist requires."""
    first = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # a stable sort: name order otherwise


@pytest.fixture(autouse=True)
def environment_as_found():
    """A run in this process changes the environment (--cpu sets CUDA_VISIBLE_DEVICES=""), which later launchers of
    this process would inherit (tests/test_accelerate_configs.py passes it on): put it back after every test, so
    that no test depends on which ran before it in the same process (with pytest-xdist the order varies)."""
    environ = dict(os.environ)
    yield
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)


def shared_dir(tmp_path_factory, name, build):
    """A directory every test of the session reads, made once by `build(directory)` for the whole `pytest -n N` run
    (its workers share the base temporary directory, and a file lock makes the others wait for the first): the
    fixtures' data and the trained runs that several test files only read. A test that changes such a run works on
    its own copy (shutil.copytree). A build that failed is tried again by the next test that asks."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # popen-gwN's parent: the same for every worker of this run
    directory, done = root / "shared" / name, root / "shared" / f"{name}.done"
    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "shared" / f"{name}.lock")):
        if not done.exists():
            if directory.exists():
                import shutil
                shutil.rmtree(directory)  # what a failed build left
            directory.mkdir()
            build(directory)
            done.touch()
    return directory


@pytest.fixture(scope="session", autouse=True)
def cpu_in_this_process():
    """What runs in a pytest process (the unit tests, run_here's 1-process runs) runs on CPU on any machine, as a
    launched --cpu run does: where a GPU is visible, it is hidden from the process that runs the tests before anything
    initialises CUDA (an in-process --cpu run could not hide it afterwards; a leftover accelerate state would put the
    next in-process run on the GPU). A fixture, not an import-time setting: pytest-xdist's workers inherit their
    controller's environment, and launched runs see the machine as it is (ENV was copied at import)."""
    if REAL_GPUS:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if torch.cuda.is_available():
            raise RuntimeError("CUDA was initialised in the pytest process before the tests ran, so it cannot hide "
                               "the GPU: ask torch.cuda.device_count() (NVML), not is_available(), at import time")


@pytest.fixture(scope="session")
def text_data(tmp_path_factory):
    """800 train / 99 val / 99 test headlines (odd-sized eval sets) and a small BERT config + vocab."""
    return shared_dir(tmp_path_factory, "text", lambda d: write_text_classification_data(d, n_train=800, n_val=99,
                                                                                         n_test=99))


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory):
    """All 1,797 digits: 1,348 train / 449 val, for the learning checks (`make test-long`)."""
    return shared_dir(tmp_path_factory, "digits", lambda d: write_digits_imagefolder(d, size=16))


# 447 of the digits: 336 train (5 steps of 64 an epoch, 16 images left over, so drop_last drops some) and 111 val
# (odd, so that padding the last batch on 2 processes would show in the counts). Enough for every property that does
# not depend on how far a run learns: counts, exports, exact resumes, equal weights on 1 and 2 processes.
FEW_DIGITS = 447
FEW_DIGITS_TRAIN, FEW_DIGITS_VAL = 336, 111


@pytest.fixture(scope="session")
def few_digits(tmp_path_factory):
    return shared_dir(tmp_path_factory, "few_digits", lambda d: write_digits_imagefolder(d, size=16, limit=FEW_DIGITS))


def launch_cmd(script, args, num_processes=1):
    """The command line `launch` runs, for tests that need to signal the running job."""
    if num_processes == 1:
        head = [*ACCELERATE, "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no"]
    else:
        head = [*ACCELERATE, "--multi_gpu", "--num_processes", num_processes, "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", free_port()]
    return [str(c) for c in [*head, script, "--cpu", *args]]


# The grace torch's elastic agent (accelerate launch, torchrun) gives the ranks between passing a stop on and its
# SIGKILL: 30 s by default, GRACE for the jobs the tests signal (TORCH_ELASTIC_SHUTDOWN_TIMEOUT). Whether the ranks
# left by themselves is then read from the launcher's log (LAUNCHER_SIGKILL), not from a clock that a loaded machine
# can push past 30 s: a stop that saves takes a few seconds of CPU here (the tests print how many).
GRACE = 300
LAUNCHER_SIGKILL = "forcefully exiting via"  # torch's words when the grace ended with ranks still running


def start(cmd, log_path, env=None):
    """Start a job in its own process group (so the test can signal launcher and workers together)."""
    log = open(log_path, "w")
    return subprocess.Popen([str(c) for c in cmd], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**ENV, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(GRACE), **(env or {})},
                            start_new_session=True)


def wait_for(predicate, proc, timeout=HANG_S):
    """Poll until predicate() holds; fail if the job exits first (the timeout is for a job that hangs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
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


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a directory on a tmpfs of that size, a disk that fills up for real; unmounted after the test.
    Skips the test where no tmpfs can be mounted (it needs root)."""
    mounted = []

    def mount(size):
        disk = tmp_path / f"disk{len(mounted)}"
        disk.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True,
                              text=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(disk)
        return disk
    yield mount
    for disk in mounted:
        subprocess.run(["umount", "-l", str(disk)])


def workers(job, out):
    """The training processes of a launched job writing to `out` (the launcher's own process excluded)."""
    found = []
    for pid in descendants(job.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        if f"--output_dir {out}" in cmdline and "accelerate.commands.launch" not in cmdline \
                and "torch.distributed.run" not in cmdline:
            found.append(pid)
    return found


def assert_group_restarted(log):
    """The elastic agent saw a worker of the group fail and started the group again, which resumed. The worker it names
    is the one whose failure it recorded first: the SIGKILLed one (exitcode -9) or its peer, which may see the broken
    connection and exit on its own first."""
    assert re.search(r"failed \(exitcode: -?\d+\) local_rank: \d", log) and "Resumed from" in log, log[-3000:]


def assert_attempts_kept_apart(log):
    """The restarted group's process groups under keys of their own in the launcher's store (the start-up line of
    each attempt), and no restart on the way that failed to connect (a later restart's success would hide one)."""
    for attempt in (1, 2):
        assert f"this attempt's process groups keep their keys under attempt/{attempt}/" in log, log[-3000:]
    assert "connectFullMesh" not in log and "Connection refused" not in log, log[-3000:]


def kill_job(proc, sig):
    """Signal the launcher and every worker at once, as Slurm does to a job step (or the OOM killer to all). After a
    SIGKILL, wait until each of them has ended (gone or a zombie), as the next command after a `kill -9` finds them:
    a process that is still tearing down its memory still holds its output directory's lock."""
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    if sig == signal.SIGKILL:
        gone_within(pids, HANG_S)


def stop_job(job, processes, *signals):
    """Send each of `signals` to every process of the job (kill_job), then wait for the launcher (its GRACE and more).
    Returns the seconds from the first signal until the launcher exited (printed by the tests, not compared), and
    whether every process of `processes` (the job's, listed before the signals) ended after it (a DataLoader worker
    notices its parent's exit within torch's 5-second watchdog interval; the wait is for a hang)."""
    signaled = time.monotonic()
    for sig in signals:
        kill_job(job, sig)
    job.wait(timeout=GRACE + HANG_S)
    return time.monotonic() - signaled, gone_within(processes, HANG_S)


def end_all(pids):
    """SIGKILL whatever a test started and left running (a failing test must not leave orphans training on)."""
    for pid in alive(pids):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def rank_tracebacks(log, script):
    """Lines of a training process's traceback (the launcher's own traceback is its business)."""
    return [line for line in log.splitlines() if f'{script}", line' in line or "killed by signal" in line]


def assert_job_left_in_grace(log, script, ended):
    """What a stop of every process must leave: no training process's traceback, the ranks gone by themselves (the
    launcher did not need its SIGKILL), no process of the job left (stop_job's `ended`)."""
    assert not rank_tracebacks(log, script), log[-3000:]
    assert LAUNCHER_SIGKILL not in log, log[-3000:]
    assert ended, "a process of the job outlived it"


def alive(pids):
    """The processes of `pids` still running (a zombie has ended)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.append(pid)
    return running


def gone_within(pids, seconds):
    """Whether every process of `pids` ended within `seconds`: returns as soon as they have."""
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not alive(pids)


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
