"""`make gpu-bench`: the GPU benchmark in one command. It prints one table and appends it to benchmarks/RESULTS.md with
the machine, the versions and the date.

Parts (each a few rows of the table), in the order they run:
  - BERT b64, compile off / on (and b32 in the second tier): BERT-base, bert-base-chinese's config with random
    weights, on THUCNews headlines padded to 128 tokens, bf16. train_bert_cls.py against transformers' Trainer: the two
    whole commands of bench_vs_trainer.py, on the same files with the same tokenisation, global batch, precision,
    compile, optimizer (fused AdamW), schedule (linear, 10% warmup), clipping, number of steps and seed. Reported:
    training-step samples/s (the log windows after the first, so no start-up, compilation or evaluation), the whole
    command's seconds, and the validation accuracy after the same steps. Beside them, bench_gpu.py's bare model step
    on a synthetic batch of the same shape, timed in this process, and every arm's MFU (bench_gpu.py's definition and
    datasheet peaks).
  - steady steps without syncs: train_bert_cls.py, and train_resnet.py with each kind of decoding, 1 process each,
    under tools/step_probe with STEP_PROBE=count,sync_debug. torch.cuda.set_sync_debug_mode("error") covers the
    steady steps, so any .item(), bool(tensor) or host copy there raises; the probe counts the steady steps.
  - 2 processes, one GPU: train_bert_cls.py on 2 processes that share the GPU over gloo (NCCL refuses two ranks on one
    device). They are launched as two one-process machines on 127.0.0.1. Reported: steady ms/step with the cross-rank
    decisions on the host channel (utils/runtime.py HostChannel), and with the device all-reduce read back by .item()
    that it replaced (STEP_PROBE_DEVICE_AGREEMENT=1).
  - ResNet-50 input: bench_gpu.py's input arms. The compiled ResNet-50 step (bf16, channels_last, batch 256), bare on
    a synthetic batch and fed by train_resnet.py's datasets and transforms on ImageNet-sized JPEGs (utils/demo_data.py),
    with the CPU loader (workers decode) and with --decode_on_device (workers read the bytes and the GPU decodes).
    Each loader alone is timed too. The last part of the first tier, so the first cut: bench_gpu.py has measured
    these arms before.

Time: the whole run keeps within --budget (360 s, about 6 minutes on one H200, plus start-up). The first tier (the
parts above) runs --rounds rounds (default 2), then the second tier (BERT b32, compile off and on) likewise. A round
runs every part in turn, and the arms of a part interleaved (harness.py: A B C, then C B A). A part's first round
starts while any budget is left; a later round starts only if the part's previous round fits in what is left. A
command is killed whole past its own limit (Sizes.command_limit) or past the budget. Work done in this process (the
bare steps, the loaders) cannot be stopped midway, so it only starts while some budget is left. What would run last
is cut first: the second tier, then the first tier's second round, last parts first. The table shows every arm that
was cut and why.

    make gpu-bench GPU_PYTHON=python3          # on the GPU machine (docs/gpu.md); data/ as docs/data.md says
    python benchmarks/gpu_bench.py --device cpu     # the dry mode, on tiny fixtures; the figures mean nothing
    python benchmarks/gpu_bench.py --only "compile on" ResNet   # only the parts whose names hold one of the texts

It reads, under --data_root: thucnews_titles/train.txt and val.txt, and bert-base-chinese/config.json and vocab.txt.
It writes the JPEGs itself. The dry mode makes all of its data itself and runs one batch size and one round. It
compiles with dynamo's "eager" backend, counts host reads without sync_debug (that needs CUDA), and writes its record
to benchmarks/results/, never to RESULTS.md.
"""
import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (first: offline settings, the repository on sys.path)

import torch  # noqa: E402

import bench_gpu  # noqa: E402
import bench_vs_trainer  # noqa: E402
from utils.demo_data import write_photo_imagefolder, write_text_classification_data  # noqa: E402

REPO = harness.REPO
RESULTS_MD = REPO / "benchmarks" / "RESULTS.md"
RESULTS_SECTION = "## 13. GPU benchmark: `make gpu-bench`"
PROBE = REPO / "tools" / "step_probe" / "sitecustomize.py"
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
CPU_FIGURES_WARNING = "DRY RUN ON THE CPU: tiny models and data; THESE FIGURES MEAN NOTHING about any GPU"


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the GPU run's sizes, or the dry run's (tiny, on a CPU)."""
    bert_batches: tuple  # global batches: the first in the first tier, the others in the second
    seq_len: int  # tokens: every batch padded to this length
    bert_steps: int  # optimizer steps of each BERT command (its training file holds exactly these batches)
    logging_steps: int  # steps per log window; the first window (warm-up, compilation) is not counted
    learning_rate: float  # peak, linear warmup over 10% of the steps, then linear decay
    val_samples: int  # headlines of the validation accuracy
    bare_steps: int  # timed steps of a bare-step arm per round
    resnet_batch: int
    image_size: int  # pixels: RandomResizedCrop's output
    jpegs: int  # training JPEGs (and a sixteenth of that to validate the script runs)
    jpeg_side: int  # pixels: the JPEGs' longer side
    loader_workers: int  # DataLoader workers of the ResNet input arms
    probe_bert_steps: int  # steps of the sync check's and the 2-process runs' BERT
    probe_resnet_batch: int  # the sync check's ResNet batch (one epoch over the JPEGs)
    rounds: int
    compile_backend: str  # torch.compile's backend for "compile on"
    budget: float  # seconds for the whole run (--budget)
    command_limit: float  # seconds one command may run before it is killed whole


GPU = Sizes(bert_batches=(64, 32), seq_len=128, bert_steps=100, logging_steps=10, learning_rate=1e-4,
            val_samples=1000, bare_steps=20, resnet_batch=256, image_size=224, jpegs=1024, jpeg_side=500,
            loader_workers=len(os.sched_getaffinity(0)) - 1, probe_bert_steps=60, probe_resnet_batch=64, rounds=2,
            compile_backend="inductor", budget=360,
            # about three times what a compiled BERT-base command (start-up, inductor, 100 steps, evaluation, export)
            # is expected to take on one H200
            command_limit=240)
# One batch size and one round: the second tier is the first's code at another batch size, and rounds are the
# scheduler's (tests/test_gpu_bench.py tests both with stand-in arms). The whole dry run takes minutes on a loaded
# 2-core machine: its budget and limits are an hour, so that no run of the test suite is cut by the clock.
DRY = Sizes(bert_batches=(4,), seq_len=32, bert_steps=12, logging_steps=3, learning_rate=2e-3, val_samples=32,
            bare_steps=2, resnet_batch=2, image_size=32, jpegs=24, jpeg_side=48, loader_workers=0,
            probe_bert_steps=12, probe_resnet_batch=2, rounds=1, compile_backend="eager", budget=3600,
            command_limit=3600)


# ---- the plan: arms, parts, tiers, the budget --------------------------------------------------------------------

class Cut(Exception):
    """An arm that did not finish in its time: not a failure of what it measures."""


@dataclass
class Arm:
    """One row of the table. `measure(limit, round_index)` runs it once within `limit` seconds and returns its
    figures, a dict with "rate" (in the part's unit; None for a check). `limit`: the seconds a command may run, or None
    for work in this process, which cannot be stopped midway: it only starts while some budget is left."""
    name: str
    measure: Callable
    limit: float | None = None
    rounds: list = field(default_factory=list)  # per round: its figures, or None where it did not run
    seconds: list = field(default_factory=list)  # per round: the wall seconds it took
    problem: str = ""  # why it has no figure, or what went wrong in a round


@dataclass
class Part:
    """Arms measured together, round after round, in interleaved order (`concurrent`: all at once, for checks that
    time nothing). `cells(arm)`: the arm's row in the table ({"figure", "ratios", "mfu", "wall", "accuracy"}, any
    left out stays empty). `rounds`: at most this many (None: the run's)."""
    name: str
    arms: list
    cells: Callable
    concurrent: bool = False
    rounds: int | None = None
    durations: list = field(default_factory=list)  # seconds each round took
    cut: str = ""  # why it stopped before its rounds were done


class Budget:
    """Seconds left of the run; `clock` injectable so the scheduler is tested without waiting."""

    def __init__(self, seconds, clock=time.monotonic):
        self.seconds, self.clock = seconds, clock
        self.deadline = clock() + seconds

    def left(self):
        return max(0.0, self.deadline - self.clock())


def run_arm(arm, round_index, budget, log):
    """One round of `arm`, within its own limit or what is left of the budget, whichever is less. Its figures are
    appended, or None with `arm.problem` saying why (cut by which clock, or how it failed)."""
    own_limit = arm.limit is not None and arm.limit < budget.left()
    limit = arm.limit if own_limit else budget.left()
    start = budget.clock()
    try:
        figures = arm.measure(limit, round_index)
    except (Cut, subprocess.TimeoutExpired):
        figures = None
        arm.problem = (f"cut: past its {arm.limit:.0f} s limit" if own_limit
                       else f"cut: the {budget.seconds:.0f} s budget ran out while it ran")
    except Exception as err:  # noqa: BLE001 - one failed arm is reported; the others still run
        figures = None
        arm.problem = f"failed: {type(err).__name__}: {err}".replace("\n", " ")[:600]
    arm.rounds.append(figures)
    arm.seconds.append(budget.clock() - start)
    rate = f"{figures['rate']:,.1f}" if figures and figures.get("rate") is not None else arm.problem or "done"
    log(f"  round {round_index + 1} {arm.name:<42} {rate}  ({arm.seconds[-1]:.0f} s)")


def run_part_round(part, round_index, budget, log):
    """One round of `part` if the budget allows it; otherwise `part.cut` says why not, and no later round runs."""
    if budget.left() <= 0 or (part.durations and part.durations[-1] > budget.left()):
        part.cut = (f"rounds from {round_index + 1} on cut: {budget.left():.0f} s of the budget left, the last round "
                    f"took {part.durations[-1]:.0f} s" if part.durations else "cut: no budget left")
        return
    log(f"{part.name}, round {round_index + 1}")
    start = budget.clock()
    arms = harness.interleaved_order(part.arms, round_index)
    if part.concurrent:
        with concurrent.futures.ThreadPoolExecutor(len(arms)) as pool:
            list(pool.map(lambda arm: run_arm(arm, round_index, budget, log), arms))
    else:
        for arm in arms:
            run_arm(arm, round_index, budget, log)
    part.durations.append(budget.clock() - start)


def run_plan(tiers, rounds, budget, log=print):
    """Every tier in order; in a tier, round 1 of each part, then round 2 of each, and so on."""
    for tier in tiers:
        for round_index in range(rounds):
            for part in tier:
                if round_index < (part.rounds or rounds) and not part.cut:
                    run_part_round(part, round_index, budget, log)
    for part in (p for tier in tiers for p in tier):
        for arm in part.arms:
            if not any(arm.rounds) and not arm.problem:
                arm.problem = part.cut or "cut: not reached"


# ---- the figures of a round: medians and ratios -------------------------------------------------------------------

def done(arm):
    """The arm's figures of the rounds it finished."""
    return [figures for figures in arm.rounds if figures is not None]


def median_of(arm, key):
    values = [figures[key] for figures in done(arm) if figures.get(key) is not None]
    return statistics.median(values) if values else None


def ratio(arm, baseline):
    """The median over rounds of arm's rate / baseline's rate, each ratio within one round; None without one."""
    pairs = [(a["rate"], b["rate"]) for a, b in zip(arm.rounds, baseline.rounds) if a and b and a["rate"] and b["rate"]]
    return statistics.median(a / b for a, b in pairs) if pairs else None


def times(value):
    return f"{value:.2f}x" if value is not None else "?"


def number(value):
    """A rate as the table shows it: whole numbers from 100 on, three significant digits below (dry-mode sizes)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


# ---- what is measured ---------------------------------------------------------------------------------------------

class Bench:
    """The run's device, sizes, working folder and shared fixtures: the headline files, the JPEGs and the bare BERT
    steps (the last two made when first asked for)."""

    def __init__(self, args, sizes, work):
        self.args, self.sizes, self.work = args, sizes, work
        self.device = torch.device(args.device)
        self.dry = args.device == "cpu"
        # the commands' torch threads: all the cores here, as either arm would take by default; one on the 2-core
        # machines the dry mode runs on
        self.threads = 1 if self.dry else len(os.sched_getaffinity(0))
        self.bert_model, self.train_files, self.val_file = self.headline_files()
        self.config = bench_gpu.bert_config(self.bert_model)
        with torch.device("meta"):  # counted without making the weights
            model = bench_gpu.BertForSequenceClassification(self.config)
        self.bert_parameters = sum(p.numel() for p in model.parameters())
        self.bare_berts, self.jpeg_root = {}, None
        self.jpeg_lock = threading.Lock()  # the sync checks' two ResNet runs ask for the JPEGs at once
        self.peak_tflops = (None if self.dry else
                            args.peak_tflops or bench_gpu.datasheet_peak_tflops(torch.cuda.get_device_name()))

    def headline_files(self):
        """(model folder, {batch: training file of exactly bert_steps batches}, validation file): the real headlines
        (thucnews_titles is shuffled: its first lines hold every class), or the dry mode's generated ones."""
        s = self.sizes
        if self.dry:
            data = write_text_classification_data(self.work / "text", n_train=max(s.bert_batches) * s.bert_steps,
                                                   n_val=s.val_samples, n_test=1)
            model, train, val = data / "model", data / "train.txt", data / "val.txt"
        else:
            root = self.args.data_root
            harness.require_data(root, "thucnews_titles/train.txt", "thucnews_titles/val.txt",
                                 "bert-base-chinese/config.json", "bert-base-chinese/vocab.txt")
            model, train, val = (root / "bert-base-chinese", root / "thucnews_titles" / "train.txt",
                                 root / "thucnews_titles" / "val.txt")
        lines = train.read_text(encoding="utf-8").splitlines()
        files = {}
        for batch in s.bert_batches:
            files[batch] = self.work / f"headlines_train_b{batch}.txt"
            files[batch].write_text("".join(f"{line}\n" for line in lines[:batch * s.bert_steps]), encoding="utf-8")
        val_file = self.work / "headlines_val.txt"
        val_lines = val.read_text(encoding="utf-8").splitlines()[:s.val_samples]
        val_file.write_text("".join(f"{line}\n" for line in val_lines), encoding="utf-8")
        return model, files, val_file

    def bare_bert(self, batch, mode):
        """bench_gpu.py's bare BERT step at this batch, warmed up (compiled) the first time it is asked for."""
        if (batch, mode) not in self.bare_berts:
            by_mode, _ = bench_gpu.bert_workloads(self.config, self.device, batch, self.sizes.seq_len, [mode],
                                                  self.sizes.compile_backend)
            by_mode[mode].warm_up(2 if self.dry else 5)
            self.bare_berts[batch, mode] = by_mode[mode]
        return self.bare_berts[batch, mode]

    def jpegs(self):
        """The ImageFolder of ImageNet-sized JPEGs (train/, and val/ for the script runs) the ResNet arms read."""
        with self.jpeg_lock:
            if self.jpeg_root is None:
                s = self.sizes
                self.jpeg_root = write_photo_imagefolder(self.work / "jpegs", s.jpegs, max(2, s.jpegs // 16),
                                                         longer_side=s.jpeg_side)
        return self.jpeg_root

    def probe_env(self, out, device_agreement=False):
        """A launched run's environment under tools/step_probe (first on PYTHONPATH, before .gpu-site's wheels):
        its counts into `out`, sync_debug on a GPU, and the device agreement where asked."""
        pythonpath = os.pathsep.join(filter(None, [str(PROBE.parent), os.environ.get("PYTHONPATH")]))
        return {"PYTHONPATH": pythonpath, "STEP_PROBE": "count" if self.dry else "count,sync_debug",
                "STEP_PROBE_OUT": str(out), **({"STEP_PROBE_DEVICE_AGREEMENT": "1"} if device_agreement else {})}


def bert_part(bench, batch, mode):
    """train_bert_cls.py and the Trainer (bench_vs_trainer.py's commands) beside the bare model step, at one batch
    and compile mode: training-step samples/s."""
    s = bench.sizes
    case = {"train": bench.train_files[batch], "val": bench.val_file, "model": bench.bert_model, "overrides": "",
            "seq_len": s.seq_len, "batch": batch, "lr": s.learning_rate, "logging_steps": s.logging_steps,
            "device": bench.device.type, "precision": "bf16", "compile": s.compile_backend if mode == "on" else None,
            "steps": s.bert_steps, "pad_to_max_length": True}
    name = f"BERT b{batch}, compile {mode}"

    def bare(limit, round_index):
        workload = bench.bare_bert(batch, mode)
        seconds, samples, _ = bench_gpu.timed(bench.device, s.bare_steps, batch, workload.step)()
        return {"rate": samples / seconds, "warm_up_seconds": workload.compile_seconds}

    def command(runner, label):
        def measure(limit, round_index):
            out = bench.work / f"bert_b{batch}_compile_{mode}_{label}_{round_index}"
            result = runner(case, out, bench.threads, timeout=limit)
            shutil.rmtree(out, ignore_errors=True)  # its exported model: 400 MB for BERT-base
            return {"rate": result["steady_samples_per_second"], **result}
        return measure

    ours, trainer, step = (Arm("train_bert_cls.py", command(bench_vs_trainer.run_ours, "ours"), s.command_limit),
                           Arm("Trainer", command(bench_vs_trainer.run_trainer, "trainer"), s.command_limit),
                           Arm("bare model step", bare))

    def cells(arm):
        rate, utilisation = median_of(arm, "rate"), None
        if rate is not None:
            utilisation = bench_gpu.mfu(bench.bert_parameters, rate, s.seq_len, bench.peak_tflops)
        wall, accuracy = median_of(arm, "wall_seconds"), median_of(arm, "val_accuracy")
        ratios = {ours.name: f"{times(ratio(ours, trainer))} Trainer, {times(ratio(ours, step))} bare step",
                  trainer.name: f"{times(ratio(trainer, step))} bare step"}
        return {"figure": f"{number(rate)} samples/s" if rate is not None else "", "ratios": ratios.get(arm.name, ""),
                "mfu": f"{utilisation:.1%}" if utilisation is not None else "",
                "wall": f"{wall:.1f}" if wall is not None else "",
                "accuracy": f"{accuracy:.3f}" if accuracy is not None else ""}

    return Part(name, [step, ours, trainer], cells)


def resnet_part(bench):
    """bench_gpu.py's ResNet-50 input arms: the compiled step bare and fed by each loader, and each loader alone."""
    s = bench.sizes
    state = {}

    def prepare():
        """The compiled step and the loaders (their workers start here), once, for every arm of every round."""
        if "error" in state:
            raise RuntimeError(f"the ResNet arms' setup failed: {state['error']}")
        if "inputs" not in state:
            try:
                workload = bench_gpu.resnet50_workloads(bench.device, s.resnet_batch, s.image_size, ["on"],
                                                        s.compile_backend)["on"]
                workload.warm_up(2 if bench.dry else 5)
                inputs, agreement = bench_gpu.input_arms(bench.device, workload, bench.jpegs() / "train",
                                                         s.image_size, s.resnet_batch, s.loader_workers, bench.dry)
            except Exception as err:
                state["error"] = f"{type(err).__name__}: {err}"
                raise
            state.update(workload=workload, inputs=inputs, agreement=agreement)
        return state

    def bare(limit, round_index):
        workload = prepare()["workload"]
        seconds, images, _ = bench_gpu.timed(bench.device, s.bare_steps, s.resnet_batch, workload.step)()
        return {"rate": images / seconds, "warm_up_seconds": workload.compile_seconds}

    def loader(name):
        def measure(limit, round_index):
            seconds, images, _ = prepare()["inputs"][name]()
            return {"rate": images / seconds, "agreement": state["agreement"]}
        return measure

    step = Arm("bare compiled step", bare)
    arms = [step, *(Arm(name, loader(name)) for name in bench_gpu.input_arm_names(s.loader_workers))]

    def cells(arm):
        rate = median_of(arm, "rate")
        return {"figure": f"{number(rate)} images/s" if rate is not None else "",
                "ratios": f"{times(ratio(arm, step))} bare compiled step" if arm is not step else ""}

    return Part("ResNet-50 input", arms, cells)


def probe_report(out_dir, rank=0):
    """tools/step_probe's counts of one rank: its steps, which were steady, and what they did."""
    path = Path(out_dir) / f"rank{rank}.json"
    if not path.is_file():
        raise RuntimeError(f"{path}: the step probe wrote no counts (is {PROBE} there and first on PYTHONPATH?)")
    return json.loads(path.read_text())


def run_launched(commands, env, limit, logs):
    """Start the commands together, each in a session of its own, and wait for all of them within `limit` seconds
    (past it every session is killed whole, the launcher with its processes: Cut). RuntimeError naming the first that
    failed, with the end of its log."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", **env}
    procs = []
    for cmd, log in zip(commands, logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + limit
    try:
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise Cut() from None
    for proc, log in zip(procs, logs):
        if proc.returncode:
            tail = " | ".join(Path(log).read_text(errors="replace").strip().splitlines()[-4:])
            raise RuntimeError(f"exit {proc.returncode}: {tail[-500:]}")


def sync_check_part(bench):
    """Each script on 1 process under the step probe: sync_debug "error" over its steady steps (on a GPU), and the
    probe's count of them and of the host reads it saw there. The three runs time nothing: they run at once."""
    s = bench.sizes
    batch, cpu = s.bert_batches[0], ["--cpu"] if bench.dry else []
    # bf16 as on the GPU; fp32 in the dry mode, where ResNet in CPU bf16 autocast can turn NaN at random (a known
    # kernel behaviour: tools/gpu_check.py's dry mode avoids it too) and the run's health check would stop it
    launch = [*ACCELERATE, "--num_processes", "1", "--num_machines", "1", "--mixed_precision",
              "no" if bench.dry else "bf16", "--dynamo_backend", "no"]

    def bert():
        return ["train_bert_cls.py", *cpu, "--train_file", bench.train_files[batch], "--validation_file",
                bench.val_file, "--model_name_or_path", bench.bert_model, "--from_scratch", "--max_seq_len", s.seq_len,
                "--pad_to_max_length", "--train_batch_size", batch, "--max_train_steps", s.probe_bert_steps,
                "--logging_steps", s.logging_steps, "--do_train", "--do_eval"]

    def resnet(*decode):
        # one epoch over the JPEGs; up to 8 loader workers: enough to feed a 64-image step, and three runs share
        # the machine's cores
        return ["train_resnet.py", *cpu, bench.jpegs(), "--arch", "resnet50", "-b", s.probe_resnet_batch,
                "--image_size", s.image_size, "--val_resize", s.image_size, "--channels_last",
                "-j", min(8, s.loader_workers), "--epochs", "1", "-p", s.logging_steps, *decode]

    def check(label, script_args):
        def measure(limit, round_index):
            out, probe_out = bench.work / f"sync_{label}", bench.work / f"sync_{label}_probe"
            run_launched([[*launch, *script_args(), "--output_dir", out, "--overwrite_output_dir"]],
                         bench.probe_env(probe_out), limit, [out.with_suffix(".log")])
            steps = probe_report(probe_out)["steps"]
            steady = [step for step in steps if step["steady"]]
            if not steady:
                raise RuntimeError("no steady step: nothing was checked (more steps, fewer log lines)")
            return {"rate": None, "steady_steps": len(steady), "steps": len(steps), "sync_debug": not bench.dry,
                    "host_reads": sum(sum(step["syncs"].values()) for step in steady)}
        return measure

    def cells(arm):
        if not done(arm):
            return {}
        f = done(arm)[-1]
        under = "under sync_debug, nothing raised" if f["sync_debug"] else "(no sync_debug on a CPU)"
        return {"figure": f"{f['steady_steps']} steady steps of {f['steps']} {under}; {f['host_reads']} host reads "
                          "counted in them"}

    return Part("steady steps without syncs", [
        Arm("train_bert_cls.py", check("bert", bert), s.command_limit),
        Arm("train_resnet.py", check("resnet", resnet), s.command_limit),
        Arm("train_resnet.py --decode_on_device", check("resnet_device_decode", lambda: resnet("--decode_on_device")),
            s.command_limit)], cells, concurrent=True, rounds=1)


def two_process_part(bench):
    """train_bert_cls.py on 2 processes sharing the one GPU over gloo, launched as two one-process machines on
    127.0.0.1 (a launch of 2 processes on a 1-GPU machine is refused: each would need a GPU of its own): steady
    ms/step with the host channel, and with the device agreement it replaced."""
    s = bench.sizes
    batch = s.bert_batches[0]

    def launch(rank, port, out):
        return [*ACCELERATE, "--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--machine_rank", rank,
                "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--same_network",
                "--mixed_precision", "bf16", "--dynamo_backend", "no", "train_bert_cls.py",
                *(["--cpu"] if bench.dry else []), "--dist_backend", "gloo", "--train_file", bench.train_files[batch],
                "--model_name_or_path", bench.bert_model, "--from_scratch", "--max_seq_len", s.seq_len,
                "--pad_to_max_length", "--train_batch_size", batch, "--max_train_steps", s.probe_bert_steps,
                "--logging_steps", s.logging_steps, "--do_train", "--output_dir", out, "--overwrite_output_dir"]

    def arm(device_agreement):
        def measure(limit, round_index):
            name = f"two_processes_{'device' if device_agreement else 'host'}_{round_index}"
            out, probe_out, port = bench.work / name, bench.work / f"{name}_probe", harness.free_port()
            env = bench.probe_env(probe_out, device_agreement)
            env["STEP_PROBE"] = "count"  # sync_debug would raise at DDP's gloo all-reduce, a host copy by design
            run_launched([launch(rank, port, out) for rank in (0, 1)], env, limit,
                         [bench.work / f"{name}_machine{rank}.log" for rank in (0, 1)])
            windows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            ms = bench_vs_trainer.steady_rate([w["ms_per_step"] for w in windows if w["event"] == "train"])
            report = probe_report(probe_out)
            if report["world_size"] != 2 or report["device_agreement"] != device_agreement:
                raise RuntimeError(f"the probe saw world size {report['world_size']} and device agreement "
                                   f"{report['device_agreement']}: not the run this arm is")
            steady = [step for step in report["steps"] if step["steady"]]
            per_step = {group: sum(sum(step["collectives"][group].values()) for step in steady) / max(1, len(steady))
                        for group in ("training", "host")}
            shutil.rmtree(out, ignore_errors=True)
            in_run = sum(sum(step["collectives"]["host"].values()) for step in report["steps"])
            return {"rate": 1000 * batch / ms, "ms_per_step": ms, "steady_steps": len(steady),
                    "collectives_per_steady_step": per_step, "host_collectives_in_run": in_run}
        return measure

    host, device = (Arm("host channel", arm(False), s.command_limit),
                    Arm("device agreement (before)", arm(True), s.command_limit))

    def cells(arm):
        if not done(arm):
            return {}
        collectives = done(arm)[-1]["collectives_per_steady_step"]
        return {"figure": f"{median_of(arm, 'ms_per_step'):.1f} ms/step ({number(median_of(arm, 'rate'))} samples/s);"
                          f" per steady step {collectives['host']:g} host-channel, {collectives['training']:g} "
                          "training-group collectives",
                "ratios": f"{times(ratio(host, device))} the device agreement's rate" if arm is host else ""}

    return Part("2 processes, one GPU (gloo)", [host, device], cells)


def plan(bench):
    """The tiers of parts, in the order they run (the module docstring says why in this order)."""
    first, *others = bench.sizes.bert_batches
    probed = [sync_check_part(bench), two_process_part(bench)]
    tiers = [[bert_part(bench, first, "off"), bert_part(bench, first, "on"), *probed, resnet_part(bench)],
             [bert_part(bench, batch, mode) for batch in others for mode in ("off", "on")]]
    if not PROBE.is_file():  # a tool of its own: without it, the parts that need it say so and do not run
        for part in probed:
            part.cut = f"not run: {PROBE.relative_to(REPO)} is missing"
    only = bench.args.only
    return [[part for part in tier if only is None or any(text in part.name for text in only)] for tier in tiers]


# ---- the table and the record -------------------------------------------------------------------------------------

TABLE_HEADERS = ["part", "arm", "figure", "ratios (median of each round's)", "MFU", "command s", "val accuracy",
                 "rounds"]


def table(tiers):
    """One row per arm; an arm without a figure shows why it has none."""
    rows = []
    for part in (p for tier in tiers for p in tier):
        for arm in part.arms:
            cells = part.cells(arm)
            rows.append([part.name, arm.name, cells.get("figure") or arm.problem or "no figure",
                         *(cells.get(key, "") for key in ("ratios", "mfu", "wall", "accuracy")), len(done(arm))])
    return harness.format_table(TABLE_HEADERS, rows)


def driver_version():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def device_name(bench):
    return f"CPU {harness.cpuinfo_field('model name') or 'unknown'}" if bench.dry else torch.cuda.get_device_name(0)


def machine_line(bench, provenance):
    """The device, its memory and driver, the CUDA and library versions, the cores."""
    versions = provenance["versions"]
    software = ", ".join(f"{name} {versions[name]}" for name in ("torch", "transformers", "accelerate", "python")
                         if name in versions)
    cores = len(os.sched_getaffinity(0))
    if bench.dry:
        return f"{device_name(bench)} ({cores} cores), no GPU; {software}"
    memory = torch.cuda.get_device_properties(0).total_memory // 2**20
    return (f"{device_name(bench)} ({memory:,} MiB), driver {driver_version()}, CUDA {torch.version.cuda}, "
            f"{cores} CPU cores; {software}")


def markdown(tiers, bench, provenance, started, seconds):
    """The run's record: heading, machine, command, settings, the table, and what was cut or failed."""
    s = bench.sizes
    lines = [f"### {started:%Y-%m-%d %H:%M} UTC, {device_name(bench)}", ""]
    if bench.dry:
        lines += [f"**{CPU_FIGURES_WARNING}.**", ""]
    revision = provenance["git_revision"] or "an unknown revision (no git repository here)"
    peak = f"{bench.peak_tflops:g} TFLOP/s dense bf16" if bench.peak_tflops else "no known peak (no MFU)"
    lines += [
        f"Machine: {machine_line(bench, provenance)}. Command: `{shlex.join(['python', *sys.argv])}` at {revision}; "
        f"budget {bench.args.budget:.0f} s, took {seconds:.0f} s.", "",
        f"BERT: {bench.bert_parameters:,} parameters, {s.bert_steps} steps of headlines padded to {s.seq_len} tokens, "
        f"bf16, lr {s.learning_rate:g}, log windows of {s.logging_steps} steps (the first not counted); the bare step "
        f"{s.bare_steps} steps a round. MFU = 6 x parameters x tokens/s / {peak}. ResNet-50: batch "
        f"{s.resnet_batch}, {s.image_size} px, {s.jpegs} JPEGs of {s.jpeg_side} px, {s.loader_workers} loader "
        f"workers. torch.compile's backend: {s.compile_backend}.", "", table(tiers), ""]
    parts = [part for tier in tiers for part in tier]
    notes = [f"- {part.name}: {part.cut}" for part in parts if part.cut]
    notes += [f"- {part.name} / {arm.name}: {arm.problem}" for part in parts for arm in part.arms
              if arm.problem and arm.problem != part.cut]
    agreement = next((f["agreement"] for part in parts for arm in part.arms for f in done(arm) if "agreement" in f),
                     None)
    if agreement:
        notes.append(f"- device decode against the CPU loader, the same crops: mean |difference| "
                     f"{agreement['mean_abs_levels']:.2f}, max {agreement['max_abs_levels']:.0f} levels of 255 over "
                     f"{agreement['images']} images")
    return "\n".join(lines + notes) + "\n"


def append_to_results(path, block):
    """Append a run's record to RESULTS.md, at the end of its section (made at the end of the file if missing)."""
    text = Path(path).read_text(encoding="utf-8")
    if RESULTS_SECTION not in text:
        text = (text.rstrip("\n") + f"\n\n{RESULTS_SECTION}\n\nEach run of `make gpu-bench` (benchmarks/gpu_bench.py) "
                "appends its record here: the machine, the command and its table.\n")
    start = text.index(RESULTS_SECTION) + len(RESULTS_SECTION)
    following = text.find("\n## ", start)
    end = len(text) if following < 0 else following + 1
    text = text[:end].rstrip("\n") + "\n\n" + block + ("\n" + text[end:] if end < len(text) else "")
    Path(path).write_text(text, encoding="utf-8")


def summary(tiers):
    """The results JSON's view of every arm: its figures per round, its seconds, its problem."""
    return {part.name: {"durations": part.durations, "cut": part.cut,
                        "arms": {arm.name: {"rounds": arm.rounds, "seconds": arm.seconds, "problem": arm.problem}
                                 for arm in part.arms}}
            for tier in tiers for part in tier}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=harness.HelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the dry mode (tiny fixtures it makes itself; minutes on 2 cores; no RESULTS.md)")
    parser.add_argument("--data_root", type=Path, default=None,
                        help=f"folder with {harness.DATA_LAYOUT} (default {harness.DEFAULT_DATA}); not in dry mode")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole run (default {GPU.budget:.0f}; dry mode {DRY.budget:.0f})")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds per part (default {GPU.rounds}; dry mode {DRY.rounds})")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="only the parts whose names contain one of these (e.g. --only 'compile on' ResNet)")
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="dense bf16 peak of the GPU for MFU (default: bench_gpu.py's datasheet table)")
    parser.add_argument("--output", type=Path, default=None,
                        help="results JSON (default benchmarks/results/gpu_bench.json; dry mode gpu_bench_dry.json)")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="the run's record (default benchmarks/results/gpu_bench.md; dry mode gpu_bench_dry.md); "
                             "a GPU run also appends it to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    dry = args.device == "cpu"
    if dry and args.data_root is not None:
        parser.error("--data_root: the dry mode (--device cpu) makes its own tiny data and reads none")
    if dry and args.peak_tflops is not None:
        parser.error("--peak_tflops: the dry mode computes no MFU (a CPU's figures mean nothing)")
    args.data_root = args.data_root or harness.DEFAULT_DATA
    args.budget = args.budget or (DRY if dry else GPU).budget
    return args


def main(args):
    dry = args.device == "cpu"
    if not dry and not torch.cuda.is_available():
        print("gpu bench: no GPU visible here, nothing to measure (--device cpu runs the dry mode)")
        return 0
    sizes = DRY if dry else GPU
    rounds = args.rounds or sizes.rounds
    name = "gpu_bench_dry" if dry else "gpu_bench"
    warning = f"\n{'!' * 100}\n{CPU_FIGURES_WARNING}\n{'!' * 100}\n" if dry else ""
    print(warning, end="")
    if dry:
        harness.set_threads(1)
    else:
        torch.backends.cudnn.benchmark = True
    provenance, started, start = harness.provenance(), datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_bench_") as work:
        bench = Bench(args, sizes, Path(work))
        tiers = plan(bench)
        run_plan(tiers, rounds, Budget(args.budget))
        record = markdown(tiers, bench, provenance, started, time.monotonic() - start)
    print("\n" + record + warning, end="")
    path = args.markdown or REPO / "benchmarks" / "results" / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record, encoding="utf-8")
    print(f"wrote {path}")
    if not dry:
        append_to_results(RESULTS_MD, record)
        print(f"appended the record to {RESULTS_MD}")
    harness.write_results(name, {"provenance": provenance, "dry": dry, "sizes": dataclasses.asdict(sizes),
                                 "rounds": rounds, "budget_seconds": args.budget,
                                 "machine": machine_line(bench, provenance), "parts": summary(tiers),
                                 "markdown": record}, args.output)
    failed = [arm for tier in tiers for part in tier for arm in part.arms if arm.problem.startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(harness.run_cli(main, parse_args()))
