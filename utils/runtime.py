"""How a run is launched and executed, the same in both scripts: the Accelerator (`build_accelerator`) and the
launches it refuses, how GPU kernels are chosen (`choose_kernels`), the runtime flags and the parser's number types,
DataLoader settings, user-facing errors and how a run ends (`UserError`, `run_cli`), a problem on one rank stopping
every rank (`stop_together`, `writing`), stops that reach every process (`HostChannel`, `RollCall`, the loader
workers' and the launcher's signals), each elastic attempt's own keys, and one run per output directory
(`hold_output_dir`). Why each is as it is: docs/code.md#runtimepy-and-flagspy; what a user sees of it:
docs/faults_and_resume.md, docs/launching.md.

Neighbours: utils/flags.py (the parser), utils/loop.py (PreemptionGuard acts on the stops), utils/checkpoint.py,
utils/export.py, utils/outputs.py.
"""
import argparse
import atexit
import copy
import ctypes
import datetime
import importlib.util
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

try:
    import resource  # not on Windows
except ImportError:
    resource = None

import accelerate
import numpy as np
import torch
from accelerate import PartialState
from accelerate.tracking import get_available_trackers
from accelerate.utils import (DataLoaderConfiguration, DistributedType,
                              InitProcessGroupKwargs, ProjectConfiguration, broadcast_object_list, gather_object,
                              is_comet_ml_available, is_mlflow_available, is_tensorboard_available, is_wandb_available,
                              parse_flag_from_env)
from safetensors import SafetensorError
from tqdm.auto import tqdm


class UserError(Exception):
    """A problem with the user's input or command line, or with the machine (a full disk), not a bug in this code."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with where the run stood (utils/loop.py PreemptionGuard)."""


class Stopped(BaseException):
    """SIGTERM outside the training steps: the run stops at once, what it was writing simply absent; inside them,
    utils/loop.py PreemptionGuard saves a checkpoint instead
    (docs/faults_and_resume.md#stops-how-each-one-is-delivered-and-what-it-saves)."""


STOPPED_LINE = ("stopped on SIGTERM outside the training steps: the files this run had not finished are not written "
                "(those it finished are complete); run it again to finish them")


_stop_signalled = False  # this process received the SIGTERM that stops the training steps (PreemptionGuard)


def note_stop_signal():
    global _stop_signalled
    _stop_signalled = True


def stop_signalled():
    """Whether this process received the stopping SIGTERM (other processes of the job, W&B's service, may be gone)."""
    return _stop_signalled


def stop_at_once(signum, frame):
    """The SIGTERM handler of a run outside its training steps (run_cli installs it)."""
    forget_a_dead_launcher()
    raise Stopped(STOPPED_LINE)


_outside_training = stop_at_once  # SIGTERM's handler outside the training steps: run_cli chooses it


def stop_outside_training():
    """Give SIGTERM back the handler run_cli chose for outside the training steps (utils/loop.py PreemptionGuard)."""
    signal.signal(signal.SIGTERM, _outside_training)


_where_on_ctrl_c = None  # what this run says on Ctrl-C: where it stands (utils/loop.py PreemptionGuard.where)


def on_ctrl_c(where):
    """Register `where()`, the line this process prints on Ctrl-C, its own or a peer's that broke a collective."""
    global _where_on_ctrl_c
    _where_on_ctrl_c = where


def _ctrl_c_line():
    return _where_on_ctrl_c() if _where_on_ctrl_c else "interrupted (Ctrl-C)"


def _after_the_end(signum, frame):
    """SIGINT's handler once the run is over (run_cli): a Ctrl-C that arrives now changes nothing."""


def say(line):
    """`line` on stderr in one write (the processes share one log), on its own line even under a progress bar."""
    tqdm.write(f"{line}\n", file=sys.stderr, end="")


def run_cli(main, args):
    """Return `main(args)`, or end the run in one line and an exit status: a UserError 2, a lost peer 1, Ctrl-C 130,
    SIGTERM outside the training steps 143; the output directory's lock released however it ends
    (docs/code.md#how-a-run-ends-run_cli, docs/launching.md#4-errors-and-exit-statuses-under-a-launcher)."""
    global _outside_training
    code, result = 0, None
    on_ctrl_c(None)  # a run before this one in the same process (tests) said where it stood, not this one
    entry, interrupt = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    _outside_training = signal.SIG_IGN if entry == signal.SIG_IGN else stop_at_once
    stop_outside_training()
    try:
        result = main(args)
    except UserError as err:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving on an error: first, before anything can wait
        line = f"error: {err}"
        if RollCall.first_to_fail():
            say(line)
        record_for_launcher(line)
        code = 2
    except RuntimeError as err:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving, as after a UserError
        signal.signal(signal.SIGINT, _after_the_end)  # first: the launcher's Ctrl-C may still be on its way here
        op = nondeterministic_op(err) if getattr(args, "use_deterministic_algorithms", False) else None
        if op is None and not is_lost_peer(err):
            signal.signal(signal.SIGINT, signal.SIG_DFL if interrupt is None else interrupt)
            raise
        stopped_on_ctrl_c = op is None and RollCall.left_on_ctrl_c()
        if op is not None:  # printed once, as a UserError is: every rank meets the op at the same step
            line, code = f"error: {nondeterministic_op_line(op)}", 2
            if RollCall.first_to_fail():
                say(line)
        else:
            if stopped_on_ctrl_c:
                line, code = _ranked(_ctrl_c_line()), 130
            else:
                line, code = lost_peer_line(err, getattr(args, "ddp_timeout", None)), 1
            say(line)
        record_for_launcher(line)
        if stopped_on_ctrl_c:
            RollCall.leave_on_ctrl_c()
    except KeyboardInterrupt as err:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving, as after a UserError
        signal.signal(signal.SIGINT, _after_the_end)  # the launcher passes Ctrl-C on too: one line, not two
        line = _ranked(str(err) if isinstance(err, Interrupted) else "interrupted (Ctrl-C)")
        say(line)
        record_for_launcher(line)
        RollCall.leave_on_ctrl_c()
        code = 130
    except Stopped as err:
        signal.signal(signal.SIGTERM,
                      signal.SIG_IGN)  # a second SIGTERM (the launcher passes its own on) changes nothing
        line = _ranked(str(err))
        say(line)
        record_for_launcher(line)
        code = 143
    finally:
        # the run is over: a late SIGTERM (the launcher passing its own on) must not cut the lock's release short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        release_output_dirs()
    if launched_world_size() > 1:
        leave_process(code)
    signal.signal(signal.SIGTERM, signal.SIG_DFL if entry is None else entry)  # the caller's again
    signal.signal(signal.SIGINT, signal.SIG_DFL if interrupt is None else interrupt)
    if code:
        sys.exit(code)
    return result


# torch's words for an op without a deterministic kernel under torch.use_deterministic_algorithms(True), raised at the
# op's first use (in a DataLoader worker or a compiled graph, inside the message of the error that carries it on)
NONDETERMINISTIC_OP = re.compile(r"(\S+) does not have a deterministic implementation, but you set "
                                 r"'torch\.use_deterministic_algorithms\(True\)'")


def nondeterministic_op(err):
    """The op torch names in `err` when it has no deterministic kernel for it, else None."""
    found = NONDETERMINISTIC_OP.search(str(err))
    return found.group(1) if found else None


def nondeterministic_op_line(op):
    """The one line of a run that met an op without a deterministic kernel under --use_deterministic_algorithms."""
    return (f"{op}: torch {torch.__version__} has no deterministic kernel for this op, and "
            f"--use_deterministic_algorithms (--full_determinism) allows deterministic kernels only: drop the flag "
            f"(the run is then not bitwise reproducible on a GPU: docs/gpu.md#reproducibility), or change the model or "
            f"loss (the script's adaptation section) to do without the op")


def _ranked(line):
    """`line` with this process's rank in front under a multi-process launch."""
    return f"rank {os.environ.get('RANK', '?')}: {line}" if launched_world_size() > 1 else line


TIMEOUT_MARK = "Timed out waiting"  # gloo's words for a collective that waited --ddp_timeout
LOST_PEER_MARKS = (TIMEOUT_MARK, "Connection closed by peer", "onnection reset by peer")


def is_lost_peer(err):
    """Whether `err` is a collective another rank of a multi-process launch never answered (gloo's timeout or a
    closed connection)."""
    return launched_world_size() > 1 and any(mark in str(err) for mark in LOST_PEER_MARKS)


def lost_peer_line(err, ddp_timeout):
    """`rank R: rank S ...`: a survivor's line naming the ranks that missed the roll call and what their process on
    this host does (a frozen one is ended here: RollCall.end)."""
    absent = RollCall.absent()
    fates = {rank: RollCall.fate(rank) for rank in absent or []}
    waited = (f"no reply within --ddp_timeout {ddp_timeout:g} s" if TIMEOUT_MARK in str(err) and ddp_timeout
              else "its connection closed")
    said = {
        "frozen": "stopped answering: frozen (a stopped process on this machine), ended here",
        "exited": "exited",
        "stuck": "is stuck in the kernel on this machine (a disk or network filesystem that does not answer)",
        "running": (f"did not answer the roll call within {RollCall.ANSWER_SECONDS:g} s but runs on this machine "
                    f"(busy, or waiting in a collective of its own): left to the launcher"),
        "elsewhere": "stopped answering (on another machine: a frozen or dead process, a stuck disk or network)"}
    parts = []
    for fate, words in said.items():
        ranks = [rank for rank in absent or [] if fates[rank] == fate]
        if fate == "frozen":
            ranks = [rank for rank in ranks if RollCall.end(rank)]
        if ranks:
            parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {words}")
    who = "; ".join(parts) or "another rank stopped answering"
    store = ("; the launcher's store cannot be reached either: the machine that holds it (rank 0's) is gone or its "
             "launcher ended") if absent is None else ""
    return (f"rank {os.environ.get('RANK', '?')}: {who} ({waited}){store}; the job ends here: continue from its latest "
            f"checkpoint")


class StoreGone(Exception):
    """The launcher's store cannot be reached (none under this launch, or its server is gone)."""


@contextmanager
def _stderr_quiet():
    """Nothing written to file descriptor 2 inside (torch's store client prints C++ stack frames before it raises)."""
    sys.stderr.flush()
    saved, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(quiet)


ATTEMPT_SCHEME = "elastic-attempt"  # build_accelerator's init_method under torch's elastic agent: attempt_rendezvous
_attempt = None  # the number the ranks of this launch attempt agreed on (agree_on_attempt), once they have
_attempt_handler = None  # attempt_rendezvous, once registered with torch


def elastic_launch():
    """Whether torch's elastic agent (torchrun, accelerate launch) started this process as one of several."""
    return "TORCHELASTIC_RUN_ID" in os.environ and launched_world_size() > 1


def attempt_init_method():
    """The init_method that puts this attempt's process groups under keys of their own (attempt_rendezvous)."""
    global _attempt_handler
    if _attempt_handler is None:
        torch.distributed.register_rendezvous_handler(ATTEMPT_SCHEME, attempt_rendezvous)
        _attempt_handler = attempt_rendezvous
    return f"{ATTEMPT_SCHEME}://"


def attempt_rendezvous(url, timeout=datetime.timedelta(minutes=30), **kwargs):
    """torch's env:// rendezvous with every key of the process groups under `attempt/N/` (agree_on_attempt); yields
    (store, rank, world size) (docs/code.md#elastic-attempts-keys-of-their-own)."""
    global _attempt
    query = url.split("?", 1)[1] if "?" in url else ""  # the rank and world size init_process_group was given
    store, rank, world_size = next(torch.distributed.rendezvous(f"env://?{query}" if query else "env://",
                                                                timeout=timeout))
    _attempt = agree_on_attempt(store, rank, world_size, timeout)
    yield torch.distributed.PrefixStore(f"attempt/{_attempt}", store), rank, world_size


ATTEMPT_POLL_SECONDS = 0.05


def agree_on_attempt(store, rank, world_size, timeout):
    """A number every rank of this launch attempt agrees on and no earlier attempt in `store` used; a collective
    through the store (why and how: docs/code.md#elastic-attempts-keys-of-their-own)."""
    keys = torch.distributed.PrefixStore("attempts", store)
    if rank != 0:
        token = secrets.token_hex(8)
        keys.set(f"hello/{rank}", token)
        number = keys.get(f"welcome/{token}").decode()  # waits up to the store's timeout
        keys.add(f"{number}/joined", 1)
        return number
    number = str(keys.add("count", 1))
    hellos, answered = [f"hello/{r}" for r in range(1, world_size)], set()
    deadline = time.monotonic() + timeout.total_seconds()
    while keys.add(f"{number}/joined", 0) < world_size - 1:
        tokens = set(keys.multi_get(hellos)) - answered  # waits until each rank has said hello, in any attempt
        if tokens:
            keys.multi_set([f"welcome/{token.decode()}" for token in tokens], [number] * len(tokens))
            answered |= tokens
        if time.monotonic() > deadline:
            raise RuntimeError(f"{TIMEOUT_MARK} {timeout.total_seconds():g} s for every rank to join this launch "
                               f"attempt's process group")
        time.sleep(ATTEMPT_POLL_SECONDS)
    return number


def elastic_restart_note(environ=os.environ):
    """The start-up line of a launch with elastic restarts, once the ranks agreed on their attempt; else None."""
    restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if not restarts or _attempt is None:
        return None
    return (f"elastic restarts (up to {restarts}): this attempt's process groups keep their keys under "
            f"attempt/{_attempt}/ in the launcher's store, apart from a failed attempt's, so a restarted group never "
            f"reads a dead worker's address; TORCH_DISABLE_SHARE_RDZV_TCP_STORE is not needed")


class RollCall:
    """Who is still there, asked through the launcher's store, which a frozen rank does not hold up: who entered
    (`enter`), who answers after a failed collective (`absent`), who left on Ctrl-C, who failed first
    (docs/code.md#stops-that-reach-every-process)."""
    ANSWER_SECONDS = 5.0  # how long survivors wait for each other's answers: their collectives time out together
    _store = None
    _gone = False  # the store failed once: it is not asked again

    @classmethod
    def store(cls):
        """This launch attempt's keys in the launcher's store (agree_on_attempt's number, else this machine's
        restart count), or None where there is none to reach."""
        if cls._store is None and not cls._gone and "MASTER_ADDR" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
            attempt = (f"attempt_{_attempt}" if _attempt is not None
                       else f"restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}")
            attempt = f"roll_call/{os.environ['TORCHELASTIC_RUN_ID']}/{attempt}/"
            try:
                with _stderr_quiet():
                    client = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                        is_master=False, timeout=datetime.timedelta(seconds=5))
            except (RuntimeError, OSError):
                cls._gone = True
                return None
            cls._store = torch.distributed.PrefixStore(attempt, client)
        return cls._store

    @classmethod
    def _ask(cls, method, *args, shared=False):
        """store.method(*args); StoreGone where there is no store (`shared`: nor several processes) or it fails."""
        store = cls.store() if not shared or launched_world_size() > 1 else None
        if store is None:
            raise StoreGone
        try:
            with _stderr_quiet():
                return getattr(store, method)(*args)
        except (RuntimeError, OSError):
            cls._store, cls._gone = None, True
            raise StoreGone from None

    @classmethod
    def enter(cls):
        """Record this rank's host, PID and start time (at start-up, on every rank of a multi-process launch)."""
        try:
            cls._ask("set", f"process/{os.environ['RANK']}", json.dumps(
                {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid())}))
        except StoreGone:
            pass  # a lost rank is then not named

    @classmethod
    def leave_on_ctrl_c(cls):
        """Record in the store that this rank stops on Ctrl-C (under a multi-process launch), before it leaves."""
        try:
            cls._ask("add", "ctrl_c", 1, shared=True)
        except StoreGone:
            pass  # a peer then names this rank as one that stopped answering

    @classmethod
    def left_on_ctrl_c(cls):
        """Whether a rank of this launch stopped on Ctrl-C (leave_on_ctrl_c); False where no store can be reached."""
        try:
            return cls._ask("add", "ctrl_c", 0, shared=True) > 0
        except StoreGone:
            return False

    @classmethod
    def first_to_fail(cls):
        """Whether this rank is the first of its launch to stop on a UserError, which it then prints (without a
        store: the first process of each machine)."""
        try:
            return cls._ask("add", "user_error", 1, shared=True) == 1
        except StoreGone:
            return os.environ.get("LOCAL_RANK", "0") == "0"

    @classmethod
    def absent(cls):
        """The ranks that do not answer within ANSWER_SECONDS; None where the store cannot be reached."""
        try:
            cls._ask("set", f"here/{os.environ['RANK']}", "1")
            answered, everyone = cls._ask("add", "here", 1), launched_world_size()
            deadline = time.monotonic() + cls.ANSWER_SECONDS
            while answered < everyone and time.monotonic() < deadline:  # one request a poll, whatever the count
                time.sleep(0.2)
                answered = cls._ask("add", "here", 0)
            return [] if answered >= everyone else cls._missing(list(range(everyone)))
        except StoreGone:
            return None

    @classmethod
    def _missing(cls, ranks):
        """The ranks of `ranks` that did not answer, halving the list: a few requests per missing rank."""
        if cls._ask("check", [f"here/{rank}" for rank in ranks]):
            return []
        if len(ranks) == 1:
            return ranks
        return cls._missing(ranks[:len(ranks) // 2]) + cls._missing(ranks[len(ranks) // 2:])

    @classmethod
    def _entry(cls, rank):
        """What `rank` entered at start-up (host, PID, start time); None where the store does not say."""
        try:
            return json.loads(cls._ask("get", f"process/{rank}"))
        except (StoreGone, ValueError):
            return None

    @classmethod
    def fate(cls, rank):
        """What a silent rank's process does: "elsewhere" (not this host), "exited", "frozen", "stuck" or "running"."""
        entry = cls._entry(rank)
        if entry is None or entry.get("host") != socket.gethostname():
            return "elsewhere"
        started = _process_start(entry["pid"])
        if started == "ended" or started != entry.get("pid_start"):
            return "exited"
        return {"T": "frozen", "t": "frozen", "D": "stuck"}.get(_process_state(entry["pid"]), "running")

    @classmethod
    def end(cls, rank):
        """SIGKILL `rank`'s process on this host (a stopped one ignores SIGTERM); whether it did."""
        entry = cls._entry(rank)
        if entry is None or _process_start(entry["pid"]) != entry.get("pid_start"):
            return False
        try:
            os.kill(entry["pid"], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def leave_process(code):
    """Exit with `code` after the atexit handlers, without the interpreter's finalization, where gloo's threads can
    abort a finished run (docs/launching.md#4-errors-and-exit-statuses-under-a-launcher)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_together(accelerator, problem):
    """Raise UserError with the lowest rank's problem on every rank if any rank has one. A collective (an all-reduce
    of a flag; the lines gathered only then): every rank calls it at the same point."""
    if accelerator.num_processes == 1:
        problems = [problem]
    else:
        flag = torch.tensor(float(problem is not None), device=accelerator.device)
        if accelerator.reduce(flag, reduction="sum").item() == 0:
            return
        problems = gather_object([problem])
    first = next((p for p in problems if p), None)
    if first:
        raise UserError(first)


def write_failure(err, directory):
    """The one line for `err` if it is a failure to write into `directory` (a full disk, a quota, a read-only mount:
    OSError, torch.save's zip writer, safetensors), naming the file where `err` does and the free space; else None."""
    if isinstance(err, OSError):
        reason = f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
    elif isinstance(err, SafetensorError) or (isinstance(err, RuntimeError) and any(
            mark in str(err) for mark in ("inline_container", "PytorchStreamWriter", "file write failed"))):
        reason = str(err).strip().splitlines()[0]
    else:
        return None
    try:
        free = f"{human_bytes(shutil.disk_usage(directory).free)} free there"
    except OSError as usage_err:
        free = f"its free space unknown ({usage_err.strerror})"
    return f"{directory}: cannot write ({reason}); {free}"


def human_bytes(count):
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024


@contextmanager
def writing(accelerator, directory, unfinished=None, writer=None):
    """A block that writes into `directory`: a failure to write, or a UserError, on any rank stops every rank, after
    the main process (or `writer`) removed `unfinished`. A collective at the block's end (a barrier): every rank
    enters it."""
    problem = None
    try:
        yield
    except UserError as err:
        problem = str(err)
    except Exception as err:
        problem = write_failure(err, directory)
        if problem is None:
            raise
    try:
        stop_together(accelerator, problem)
    except UserError:
        if unfinished is not None and (accelerator.is_main_process if writer is None else writer):
            if Path(unfinished).is_dir():
                shutil.rmtree(unfinished, ignore_errors=True)
            else:
                Path(unfinished).unlink(missing_ok=True)
        raise


def record_for_launcher(line):
    """Write `line` where torch's elastic agent reads a failed worker's error (its summary prints it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary then says less; the line is on stderr already


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help with the module docstring as written, every default (a None default's help says what it will be), and
    each flag's role (`role_help`, from utils/checkpoint.py FlagRoles) in brackets."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)

    def _format_action(self, action):
        role = getattr(action, "role_help", None)
        if role and action.help is not argparse.SUPPRESS:
            action = copy.copy(action)  # the parser's own action keeps its help
            # the default's placeholder is in the text now, so it is not added twice
            action.help = f"{self._get_help_string(action) or ''} [{role}]".lstrip()
        return super()._format_action(action)


def _number(text, kind, accept, what):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not accept(value):
        raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}")  # argparse prefixes the flag
    return value


def positive_int(text):
    """argparse type of counts, intervals and sizes: an integer >= 1."""
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def nonnegative_int(text):
    """argparse type of counts where 0 means none (or all, as --save_total_limit says): an integer >= 0."""
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text):
    """argparse type of learning rates and timeouts: a finite number > 0."""
    return _number(text, float, lambda v: v > 0, "a number > 0")


def nonnegative_float(text):
    """argparse type of weight decays, norms and alphas where 0 switches the thing off: a finite number >= 0."""
    return _number(text, float, lambda v: v >= 0, "a number >= 0")


def hf_bool(value):
    """argparse type of a boolean as HfArgumentParser takes it (`--flag True`, `--flag no`): nargs="?", const=True."""
    if value.lower() in ("true", "yes", "1"):
        return True
    if value.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r}: expected true or false")

DATA_PARALLEL_WARNING = (
    "--data_parallel uses legacy single-process nn.DataParallel; multi-process DDP is several times faster "
    "(docs/launching.md): prefer `accelerate launch --config_file accelerate_configs/4gpu.yaml ...`"
)

CPU_BF16_WITHOUT_AMX = (
    "note: this CPU has no AMX (no amx_bf16 flag in /proc/cpuinfo), and bf16 autocast without it is usually slower "
    "than fp32 (docs/gpu.md#precision-defaults); drop --mixed_precision bf16 here for speed"
)


def add_runtime_args(parser):
    """Flags both scripts share for how the run is executed (not what it trains)."""
    group = parser.add_argument_group("runtime")
    group.add_argument("--cpu", "--no-accel", action="store_true",
                       help="CPU only, whatever the machine holds (GPUs are hidden from the process); needed for "
                       "multi-process CPU (gloo) DDP (main.py's --no-accel)")
    group.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                       help="default: whatever the launcher / accelerate config says")
    group.add_argument("--fp16", "--amp", dest="mixed_precision", action="store_const", const="fp16",
                       help="the same as --mixed_precision fp16 (the Trainer's and accelerate's examples' --fp16, "
                       "torchvision's and timm's --amp)")
    group.add_argument("--bf16", dest="mixed_precision", action="store_const", const="bf16",
                       help="the same as --mixed_precision bf16 (the Trainer's --bf16)")
    group.add_argument("--dist_backend", choices=["nccl", "gloo"], default=None,
                       help="process-group backend; default nccl on GPU, gloo on CPU and on Windows")
    group.add_argument("--ddp_timeout", type=positive_float, default=300.0,
                       help="seconds a collective waits for a missing rank before the job fails")
    group.add_argument("--data_parallel", action="store_true",
                       help="legacy single-process nn.DataParallel over all visible GPUs (slower than DDP)")
    group.add_argument("--use_deterministic_algorithms", "--use-deterministic-algorithms", "--full_determinism",
                       action="store_true",
                       help="bitwise-reproducible runs on a GPU, usually slower: deterministic kernels only, cuDNN's "
                       f"autotuner off, CUBLAS_WORKSPACE_CONFIG={DETERMINISTIC_CUBLAS[0]} (torchvision's flag, the "
                       f"Trainer's --full_determinism); an op without a deterministic kernel stops the run in one line "
                       f"naming it (docs/gpu.md#reproducibility)")
    group.add_argument("--report_to", nargs="+", choices=REPORT_TO, default=None, metavar="TRACKER",
                       help=f"experiment trackers, one or more of {', '.join(REPORT_TO)} (Trainer's names; 'all': "
                       "every one accelerate finds installed); default: none")
    group.add_argument("--with_tracking", action="store_true", help="the same as --report_to tensorboard")
    memory = parser.add_argument_group("memory (what is trained stays the same with or without these)")
    memory.add_argument("--gradient_checkpointing", "--grad_checkpointing", "--grad-checkpointing", action="store_true",
                        help="keep fewer activations and recompute them in the backward pass: less device memory, "
                        "about one more forward pass of compute (the Trainer's and timm's flag)")
    memory.add_argument("--auto_find_batch_size", action="store_true",
                        help="on an out-of-memory error, train again with half the per-device micro-batch and twice "
                        "the accumulation: the same global batch, samples and steps (utils/loop.py)")
    return group


REPORT_TO = ("tensorboard", "wandb", "mlflow", "comet_ml", "all", "none")
# the package each tracker needs, and accelerate's check for it
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", is_tensorboard_available), "wandb": ("wandb", is_wandb_available),
                    "mlflow": ("mlflow", is_mlflow_available), "comet_ml": ("comet_ml", is_comet_ml_available)}


def resolve_trackers(args):
    """The trackers accelerate logs to, from --report_to and --with_tracking; one whose package is missing: refused."""
    names = list(args.report_to or []) + (["tensorboard"] if args.with_tracking else [])
    if "none" in names:
        if len(set(names)) > 1:
            raise UserError(f"--report_to none cannot be combined with {', '.join(n for n in names if n != 'none')}"
                            + (" (--with_tracking is --report_to tensorboard)" if args.with_tracking else ""))
        return []
    if "all" in names:
        names += [str(tracker) for tracker in get_available_trackers()]
    trackers = list(dict.fromkeys(name for name in names if name != "all"))
    for name in trackers:
        package, available = TRACKER_PACKAGES.get(name, (name, lambda: True))
        if not available():
            raise UserError(f"--report_to {name}: the {package} package is not installed (pip install {package})")
    if "mlflow" in trackers and not os.environ.get("MLFLOW_TRACKING_URI"):
        missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
        if missing:
            raise UserError(f"--report_to mlflow: its local store (output_dir/mlflow.db) needs {' and '.join(missing)} "
                            f"(pip install {' '.join(missing)}; the full mlflow package has them), or set "
                            f"MLFLOW_TRACKING_URI to a tracking server")
    return trackers


def launched_world_size():
    """Processes the launcher started (torchrun / accelerate launch set WORLD_SIZE), before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_launch(args):
    """Refuse the launches that would silently train the wrong thing."""
    world_size = launched_world_size()
    if world_size > 1 and not args.cpu and not torch.cuda.is_available():
        raise UserError(
            f"{world_size} processes were launched on a machine without a GPU but without --cpu: each would train on "
            f"its own (duplicate, independent runs). Add --cpu to the script's arguments for gloo DDP on CPU."
        )
    if args.data_parallel and world_size > 1:
        raise UserError(
            f"--data_parallel (single-process nn.DataParallel) cannot be combined with a multi-process launch "
            f"({world_size} processes): drop --data_parallel, the launch already does DDP."
        )
    here, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    if here > gpus > 0 and not args.cpu:
        raise UserError(
            f"{here} processes were launched on this machine, which has {gpus} GPU{'s' * (gpus > 1)} visible: each "
            f"process trains on a GPU of its own. Launch at most {gpus} per machine (--num_processes, or num_processes "
            f"in the config file), or add --cpu for gloo DDP on CPU."
        )


# Open files a rank needs besides those it holds when it starts (docs/launching.md#3-at-scale)
FILES_PER_GLOO_GROUP = 4  # + one per process: a full mesh
FILES_PER_LOADER_WORKER = 8  # pipes and shared-memory handles of the batches in flight
FILES_FOR_NCCL = 128  # ring and tree neighbours only: a budget, not measured
FILES_MARGIN = 64  # the files a run reads and writes at a time


def open_files_needed(world_size, gpu, loader_workers, open_now):
    """How many files a rank may hold open at once: its process groups, its loaders' workers, a margin."""
    if world_size == 1:
        groups = 0
    else:
        training = FILES_FOR_NCCL if gpu else world_size + FILES_PER_GLOO_GROUP
        groups = training + world_size + FILES_PER_GLOO_GROUP  # + the host channel
    return open_now + groups + loader_workers * FILES_PER_LOADER_WORKER + FILES_MARGIN


def check_open_file_limit(needed, say=print):
    """Raise the soft limit on open files (ulimit -n) for `needed`, in one line; a UserError past the hard limit."""
    if resource is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    launch = f"this {launched_world_size():,}-process launch" if launched_world_size() > 1 else "this launch"
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise UserError(f"open files: each rank of {launch} may hold about {needed:,} at once "
                        f"(docs/launching.md#3-at-scale), and the limit here is {soft:,} (hard limit {hard:,}): raise "
                        f"it before launching, e.g. `ulimit -n {needed}` (under Slurm: on the nodes)")
    raised = needed * 2 if hard == resource.RLIM_INFINITY else min(hard, needed * 2)  # room for what is not counted
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if os.environ.get("LOCAL_RANK", "0") == "0":
        say(f"open files: raised the soft limit (ulimit -n) from {soft:,} to {raised:,} (hard limit {hard:,}): each "
            f"rank of {launch} may hold about {needed:,} at once")


def hide_gpus_under_cpu(args):
    """`--cpu` (or ACCELERATE_USE_CPU) means CPU on any machine: hide every GPU before anything asks CUDA
    (docs/gpu.md#--cpu-means-cpu-on-any-machine)."""
    if not (args.cpu or parse_flag_from_env("ACCELERATE_USE_CPU")):
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    still_visible = torch.cuda.is_available()
    if still_visible and (launched_world_size() > 1 or args.data_parallel):
        raise RuntimeError("--cpu could not hide the GPUs: CUDA was queried before build_accelerator ran, and a "
                           "multi-process or --data_parallel CPU run would then use them; call build_accelerator first")
    if args.data_parallel:
        # nn.DataParallel over no GPU is a pass-through: the run stays one CPU replica
        print("--data_parallel under --cpu: no GPU is used, nn.DataParallel runs the model as one CPU replica",
              file=sys.stderr, flush=True)


class HostChannel:
    """A gloo group beside the training group on which the ranks agree, in host memory, on a stop or an out-of-memory
    error: `start` does not wait, `any` does; none on one process (docs/code.md#stops-that-reach-every-process)."""

    _run = None  # the channel build_accelerator opened

    def __init__(self, group=None):
        self.group = group  # the gloo group; None on one process

    @classmethod
    def open(cls, accelerator, timeout):
        """The run's channel; a collective, once per run. A group that cannot connect is one line naming
        GLOO_SOCKET_IFNAME."""
        if accelerator.num_processes == 1:
            cls._run = cls()
            return cls._run
        try:
            cls._run = cls(torch.distributed.new_group(backend="gloo", timeout=timeout))
        except RuntimeError as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(f"the processes could not open the small gloo group they agree on stops in ({reason}): set "
                            f"GLOO_SOCKET_IFNAME to the network interface the machines share, as NCCL_SOCKET_IFNAME "
                            f"(docs/launching.md)") from None
        return cls._run

    @classmethod
    def of(cls, accelerator):
        """The channel build_accelerator opened for the run; on one process, one without collectives."""
        if accelerator.num_processes == 1:
            return cls()
        if cls._run is None:
            raise RuntimeError("no host channel: build_accelerator opens it on every rank")
        return cls._run

    def any(self, flag):
        """True on every rank if any rank passed True, waiting for every rank; a collective."""
        return bool(self.start([flag]).result()[0])

    def start(self, values):
        """Start taking the largest of each of `values` over the ranks, without waiting (`.result()`); a collective."""
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)  # its own: several may be in flight
        if self.group is None:
            return Agreement(None, tensor)
        work = torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=self.group, async_op=True)
        return Agreement(work, tensor)


class Agreement(NamedTuple):
    """Values being all-reduced on the host channel (HostChannel.start)."""
    work: object  # the all-reduce's handle; None on one process
    tensor: torch.Tensor  # (values,) float64 in host memory

    def result(self):
        """The largest of each value over the ranks, once the all-reduce is done (host memory only)."""
        if self.work is not None:
            self.work.wait()
        return self.tensor.tolist()


# the CUBLAS_WORKSPACE_CONFIG values torch counts as deterministic, the first the default (docs/gpu.md#reproducibility)
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
NONDETERMINISTIC_GPU = ("GPU kernels as fast as they come (cuDNN's autotuner, sums in the order threads finish): this "
                        "run and its resumes are not bitwise reproducible; --use_deterministic_algorithms makes them "
                        "so (docs/gpu.md#reproducibility)")


def choose_kernels(args):
    """Set how this process picks its GPU kernels, before anything touches CUDA (docs/gpu.md#reproducibility); the
    start-up line that says so, or None. A CUBLAS_WORKSPACE_CONFIG torch would refuse is a UserError here."""
    deterministic = args.use_deterministic_algorithms
    torch.backends.cudnn.benchmark = not deterministic
    if not deterministic:
        return NONDETERMINISTIC_GPU if torch.cuda.is_available() and not getattr(args, "cpu", False) else None
    workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS[0])
    if workspace not in DETERMINISTIC_CUBLAS:
        raise UserError(f"--use_deterministic_algorithms: CUBLAS_WORKSPACE_CONFIG={workspace} is not deterministic "
                        f"(torch accepts {' or '.join(DETERMINISTIC_CUBLAS)}): unset it, or set one of those")
    # implies cuDNN's deterministic convolutions, and Inductor's deterministic mode under torch.compile
    torch.use_deterministic_algorithms(True)
    return (f"deterministic kernels (--use_deterministic_algorithms): torch.use_deterministic_algorithms(True), cuDNN "
            f"autotuner off, CUBLAS_WORKSPACE_CONFIG={workspace}; an op without a deterministic kernel stops the run")


def random_states():
    """Every random generator a training step may draw from (dropout, drop path, augmentation in this process)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_random_states(states):
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state_all(states["cuda"])


def _tensors(output):
    """The tensors of a model's output: a tensor, or a tuple, list or dict (transformers' ModelOutput) of them."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []


def settle_gradient_buckets(ddp, model):
    """Precede the first training forward of `model` (`ddp` inside it) with a forward and backward pass whose only
    effect is DDP's bucket rebuild, so every step of every launch sums in the same buckets
    (docs/faults_and_resume.md#bitwise-at-any-process-count, docs/code.md#the-accelerator-build_accelerator)."""

    def rebuild_first(module, args, kwargs):
        if not (torch.is_grad_enabled() and ddp.module.training):
            return  # an evaluation: the first training forward is still to come
        handle.remove()
        states, buffers = random_states(), [b.detach().clone() for b in ddp.module.buffers()]
        sync, ddp.require_backward_grad_sync = ddp.require_backward_grad_sync, True  # also inside no_sync()
        try:
            outputs = [t for t in _tensors(module(*args, **kwargs)) if t.requires_grad]
            torch.autograd.backward([t.float().sum() for t in outputs])
        finally:
            ddp.require_backward_grad_sync = sync
            for parameter in ddp.module.parameters():
                parameter.grad = None
            with torch.no_grad():
                for buffer, saved in zip(ddp.module.buffers(), buffers):
                    buffer.copy_(saved)
            set_random_states(states)

    handle = model.register_forward_pre_hook(rebuild_first, with_kwargs=True)


class Accelerator(accelerate.Accelerator):
    """accelerate's, whose DDP model sums in the same buckets every step (settle_gradient_buckets) and copies rank 0's
    buffers before each forward pass only with `sync_buffers`."""

    def __init__(self, *args, sync_buffers=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.sync_buffers = sync_buffers

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        ddp = getattr(prepared, "_orig_mod", prepared)  # under torch.compile, DDP is inside
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            ddp.broadcast_buffers = self.sync_buffers  # torch's own setting, set after construction: no warning
            settle_gradient_buckets(ddp, prepared)
        return prepared


def build_accelerator(args, output_dir, gradient_accumulation_steps=1, broadcast_buffers=True, loader_workers=0):
    """The one Accelerator both scripts use, and the run's HostChannel (docs/code.md#the-accelerator-build_accelerator).
    `broadcast_buffers`: for a model whose buffers training changes (BatchNorm); `loader_workers`: the DataLoader
    workers a rank may run at once (their open files are counted)."""
    hide_gpus_under_cpu(args)
    determinism = choose_kernels(args)
    check_launch(args)
    open_now = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    gpu = torch.cuda.is_available() and not args.cpu
    check_open_file_limit(open_files_needed(launched_world_size(), gpu, loader_workers, open_now))
    stop_with_launcher()
    backend = args.dist_backend or ("gloo" if sys.platform == "win32" else None)
    timeout = datetime.timedelta(seconds=args.ddp_timeout)
    # backend=None lets accelerate choose (nccl on GPU, gloo on CPU); under torch's elastic agent, this attempt's keys
    # of its own in the launcher's store (attempt_rendezvous)
    init_method = attempt_init_method() if elastic_launch() else None
    group = (InitProcessGroupKwargs(backend=backend, init_method=init_method, timeout=timeout) if backend
             else InitProcessGroupKwargs(init_method=init_method, timeout=timeout))
    dataloader_config = DataLoaderConfiguration(
        split_batches=True,  # the loader's batch size is the GLOBAL batch, divided among processes
        use_seedable_sampler=True,  # shuffling order depends only on seed+epoch: exact mid-epoch resume
        non_blocking=True,  # host-to-GPU copies overlap compute; needs pinned memory (loader_settings)
    )
    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
        dataloader_config=dataloader_config,
        kwargs_handlers=[group],
        log_with=resolve_trackers(args) or None,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=os.path.join(output_dir, "runs")),
        sync_buffers=broadcast_buffers,
    )
    check_sharding_applies(accelerator)
    if accelerator.num_processes > 1:
        RollCall.enter()
    HostChannel.open(accelerator, timeout)
    if effective_precision(accelerator) != accelerator.mixed_precision:
        accelerator.print("warning: fp16 mixed precision is not applied on CPU; this run trains in fp32 (use bf16 for "
                          "CPU autocast)")
    for note in (determinism, cpu_bf16_note(accelerator.device, effective_precision(accelerator)),
                 elastic_restart_note()):
        if note:
            accelerator.print(note)
    return accelerator


def cpuinfo_field(name, cpuinfo="/proc/cpuinfo"):
    """The first `name : value` of the Linux cpuinfo file, or None where there is none."""
    try:
        return next((line.split(":", 1)[1].strip() for line in Path(cpuinfo).read_text().splitlines()
                     if line.startswith(name)), None)
    except OSError:
        return None


def cpu_has_amx(cpuinfo="/proc/cpuinfo"):
    """Whether the CPU has AMX bf16 tiles, from the Linux cpuinfo flags; None where they cannot be read."""
    flags = cpuinfo_field("flags", cpuinfo)
    return None if flags is None else "amx_bf16" in flags.split()


def cpu_bf16_note(device, precision, cpuinfo="/proc/cpuinfo"):
    """The one line a bf16 run on a CPU without AMX prints, else None."""
    if torch.device(device).type == "cpu" and precision == "bf16" and cpu_has_amx(cpuinfo) is False:
        return CPU_BF16_WITHOUT_AMX
    return None


def maybe_data_parallel(model, args):
    """Wrap in nn.DataParallel before `prepare` when asked for (legacy single-process multi-GPU)."""
    if not args.data_parallel:
        return model
    warnings.warn(DATA_PARALLEL_WARNING, stacklevel=2)
    return torch.nn.DataParallel(model)


def loader_generator(seed):
    """A training DataLoader's own generator, so that creating an iterator leaves dropout's RNG alone (exact resume)."""
    return torch.Generator().manual_seed(seed)


def effective_precision(accelerator):
    """What the run really computes in: Accelerate trains fp16 requests on CPU in fp32 (no autocast, no scaler)."""
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        return "no"
    return accelerator.mixed_precision


def run_info(accelerator, global_batch_size):
    """How this run was launched, recorded with the results so a launch mistake is visible there."""
    return {
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "mixed_precision": effective_precision(accelerator),
        "mixed_precision_requested": accelerator.mixed_precision,
        "device": str(accelerator.device),
        "global_batch_size": global_batch_size,
        "per_device_batch_size": global_batch_size // accelerator.num_processes,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),  # --use_deterministic_algorithms
    }


def print_run_summary(accelerator, title, rows):
    """The resolved run, printed once at start-up."""
    width = max(len(key) for key in rows)
    lines = [f"***** {title} *****"] + [f"  {key:<{width}} : {value}" for key, value in rows.items()]
    accelerator.print("\n".join(lines), flush=True)


def loader_settings(num_workers):
    """DataLoader keyword arguments for `num_workers` workers on this run's device (docs/code.md#dataloaders)."""
    return {"num_workers": num_workers, "pin_memory": PartialState().device.type == "cuda",
            "persistent_workers": num_workers > 0, "worker_init_fn": ignore_stop_signals if num_workers else None}


def ignore_stop_signals(worker_id):
    """A DataLoader worker's start: it ignores Ctrl-C and every SIGTERM but its parent's, leaving the stop to the
    parent (docs/code.md#dataloaders)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # pending until _leave_on_parents_sigterm takes it
    threading.Thread(target=_leave_on_parents_sigterm, args=(os.getppid(),), daemon=True).start()


def _leave_on_parents_sigterm(parent):
    """Take every SIGTERM sent to this process (blocked in all its threads); leave at once on the parent's."""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_launcher():
    """Under torch's elastic agent on Linux, get SIGTERM when the agent dies, to save and leave rather than train on as
    an orphan (docs/code.md#stops-that-reach-every-process)."""
    global _launcher
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getppid()
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        return  # the kernel refused: the job then ends as it did without it
    _launcher = parent
    if os.getppid() != parent:  # the launcher died while the request was being made
        os.kill(os.getpid(), signal.SIGTERM)


_launcher = None  # the agent whose death sends this process SIGTERM (stop_with_launcher), while it is alive


def forget_a_dead_launcher():
    """On every SIGTERM acted on: once the launcher is gone, withdraw the request for a signal at its death (the
    kernel would repeat it)."""
    global _launcher
    if _launcher is not None and os.getppid() != _launcher:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0)
        _launcher = None


def check_sharding_applies(accelerator):
    """Refuse a config asking for FSDP or DeepSpeed that accelerate did not apply (cpu=True): it would be plain DDP."""
    for variable, wanted in (("ACCELERATE_USE_FSDP", DistributedType.FSDP),
                             ("ACCELERATE_USE_DEEPSPEED", DistributedType.DEEPSPEED)):
        if os.environ.get(variable, "false").lower() == "true" and accelerator.distributed_type != wanted:
            got = str(accelerator.distributed_type).split(".")[-1]
            raise UserError(f"the accelerate config asks for {wanted.value} (distributed_type: {wanted.value}), which "
                            f"does not run {'on CPU (--cpu)' if accelerator.device.type == 'cpu' else 'here'}: this "
                            f"run would be plain {got}. Use accelerate_configs/cpu_ddp.yaml on CPU, or GPUs")


SECRET_ARGS = ("token",)  # arguments whose values are never written or printed (--token)
MASK = "***"


def public_command(argv):
    """The command line with the SECRET_ARGS values masked, as run_config.json and the lock record it."""
    return " ".join(public_argv(argv))


def public_argv(argv):
    """The command line's words with the values of the SECRET_ARGS flags masked."""
    flags = {f"--{name}" for name in SECRET_ARGS}
    words = list(argv)
    for i, word in enumerate(words):
        if word in flags and i + 1 < len(words):
            words[i + 1] = MASK
        elif word.split("=", 1)[0] in flags and "=" in word:
            words[i] = f"{word.split('=', 1)[0]}={MASK}"
    return words


LOCK_NAME = ".lock"
_held_locks = []  # [(lock path, token, directories created to hold it)] of this process, released at the end


def hold_output_dir(accelerator, output_dir):
    """Take OUTPUT_DIR/.lock for this run, or stop every rank with one line; a collective
    (docs/code.md#one-run-per-output-directory-the-lock)."""
    decision = [None]  # ("ok", this job's token) or ("error", the refusal)
    if accelerator.is_main_process:
        decision = [_claim_or_refusal(Path(output_dir), secrets.token_hex(8))]
    if accelerator.num_processes > 1:
        broadcast_object_list(decision)
    kind, token = decision[0]
    if kind == "error":
        raise UserError(token)
    if accelerator.num_processes == 1:
        return
    problem = None
    if accelerator.is_local_main_process and not accelerator.is_main_process:
        # finds the main process's lock on a shared disk (the same token); takes this node's on a disk of its own
        kind, refusal = _claim_or_refusal(Path(output_dir), token)
        problem = f"{refusal} (node {socket.gethostname()})" if kind == "error" else None
    problems = [p for p in gather_object([problem]) if p]
    if problems:
        raise UserError(problems[0])


def _claim_or_refusal(output_dir, token):
    try:
        _claim(output_dir, token)
        return "ok", token
    except UserError as err:
        return "error", str(err)


def release_output_dirs():
    """Remove this process's locks and the directories created only to hold them; safe to repeat (a release cut
    short is finished by the next)."""
    while _held_locks:
        path, token, created = _held_locks[-1]
        if _read_lock(path, wait=0).get("token") == token:
            path.unlink(missing_ok=True)
        _remove_empty(created)
        _held_locks.pop()


def _remove_empty(directories):
    """Remove `directories` (outermost first in the list), innermost first, as long as they are empty."""
    for directory in reversed(directories):
        try:
            directory.rmdir()
        except OSError:
            break


def _claim(output_dir, token):
    """Create output_dir/.lock for this job (`token`), taking over a stale one, leaving this job's; a UserError names
    a live holder."""
    path = output_dir / LOCK_NAME
    created = [d for d in (output_dir, *output_dir.parents) if not d.exists()][::-1]
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file of that name, no permission
        raise UserError(f"{output_dir}: cannot create the output directory ({err.strerror or err})") from None
    if path.is_symlink():  # O_EXCL refuses to create through it, and reading it finds no holder
        _remove_empty(created)
        raise UserError(f"{path}: a symbolic link to {os.readlink(path)}, not a lock a run writes (one is a file); "
                        f"remove it, then start the run again")
    for _ in range(5):  # each round: create, or judge the holder (and take a stale lock over)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder.get("token") == token:
                return
            if not _is_stale(holder):
                _remove_empty(created)
                raise UserError(_refusal(output_dir, path, holder))
            print(f"{path}: taking over the lock of a run that is no longer running ({_describe_holder(holder)})",
                  flush=True)
            _remove_stale(path, holder)
            continue
        except OSError as err:  # a directory that is not writable
            raise UserError(f"{path}: cannot create the run's lock ({err.strerror or err})") from None
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": public_command(sys.argv),
                       "token": token, **_slurm_attempt()}, f)
            f.flush()
            os.fsync(f.fileno())
        _held_locks.append((path, token, created))
        return
    raise UserError(f"{path}: could not take the lock (other runs keep taking it over); try again")


def _read_lock(path, wait=2.0):
    """A lock's contents; a lock being written (empty for an instant) is read again until `wait` seconds passed."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return json.loads(Path(path).read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return {"unreadable": True}
            time.sleep(0.1)


def _process_start(pid):
    """The process's start time in clock ticks after boot (tells a reused PID), "ended" for a zombie, else None."""
    try:
        state, *fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return "ended" if state == "Z" else int(fields[18])
    except (OSError, ValueError, IndexError):
        return None


def _process_state(pid):
    """The process's /proc state letter (R running, S sleeping, D in the kernel, T stopped, Z ended), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _slurm_attempt():
    """The Slurm job and its attempt (SLURM_RESTART_COUNT grows with each requeue), where Slurm started this run."""
    job = os.environ.get("SLURM_JOB_ID")
    return {"slurm_job_id": job, "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0"))} if job else {}


def _is_stale(holder):
    """Whether a lock's holder is certainly gone: an earlier attempt of this Slurm job, or a dead PID on this host."""
    ours = _slurm_attempt()
    if ours and holder.get("slurm_job_id") == ours["slurm_job_id"]:
        return holder.get("slurm_restart_count", 0) < ours["slurm_restart_count"]
    if holder.get("unreadable") or holder.get("host") != socket.gethostname():
        return False  # another host's processes cannot be checked from here
    pid = holder.get("pid")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it runs, under another user
    except (TypeError, OverflowError):
        return False
    now = _process_start(pid)
    return now == "ended" or (now is not None and holder.get("pid_start") not in (None, now))


def _remove_stale(path, holder):
    """Move the stale lock aside and delete it, unless another run replaced it in the meantime (then put that back)."""
    aside = path.with_name(f"{path.name}.stale-{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another run took it over first
    if _read_lock(aside, wait=0) == holder:
        aside.unlink()
        return
    try:
        os.link(aside, path)  # the new holder's lock goes back where it was
    except FileExistsError:
        pass
    aside.unlink()


def _describe_holder(holder):
    if holder.get("unreadable"):
        return "unreadable lock file"
    return (f"host {holder.get('host')}, PID {holder.get('pid')}, started {holder.get('started')}: "
            f"{holder.get('command')}")


def _refusal(output_dir, path, holder):
    if not holder.get("unreadable") and holder.get("host") == socket.gethostname():
        return (f"{output_dir}: another run is using this directory ({_describe_holder(holder)}); wait for it to end, "
                f"or pass another --output_dir")
    return (f"{output_dir}: locked by a run on another machine ({_describe_holder(holder)}), which cannot be checked "
            f"from here; pass another --output_dir, or, if that run is over, remove {path}")
