"""`make gpu-bench`: the GPU figures in one command: one table, appended to benchmarks/RESULTS.md with the machine.

Parts, each a few rows of the table:
  - BERT b64 / b32, compile off / on: BERT-base (bert-base-chinese's config, random weights), THUCNews headlines
    padded to 128 tokens, bf16, global batch 64 (then 32), torch.compile off and on. train_bert_cls.py against
    transformers' Trainer, bench_vs_trainer.py's two whole commands on the same files with the same settings
    (tokenisation, batch, precision, compile, fused AdamW, linear schedule with warmup, clipping, steps, seed):
    training-step samples/s (the log windows after the first: no start-up, compilation or evaluation), the whole
    command's seconds and the validation accuracy after the same steps; beside them bench_gpu.py's bare model step on
    a synthetic batch of the same shape, timed in this process, and each arm's MFU (bench_gpu.py's definition).
  - ResNet-50 input: bench_gpu.py's input arms. ResNet-50 bf16 channels_last batch 256 compiled, bare on a synthetic
    batch against the same step fed by train_resnet.py's loader on ImageNet-sized JPEGs (the CPU loader's workers
    decode; --decode_on_device's workers read the bytes and the GPU decodes), and each loader alone.
  - steady steps without syncs: train_bert_cls.py, and train_resnet.py with either decode, 1 process each, under
    tools/step_probe (STEP_PROBE=count,sync_debug): torch.cuda.set_sync_debug_mode("error") over the steady steps, so
    any .item(), bool(tensor) or host copy there raises; the probe's counts say how many steps were steady.
  - 2 processes, one GPU: train_bert_cls.py on 2 processes sharing the GPU over gloo (NCCL refuses two ranks on one
    device; they are launched as two one-process machines on 127.0.0.1), steady ms/step with its cross-rank decisions
    on the host channel (utils/runtime.py HostChannel) and as before it (STEP_PROBE_DEVICE_AGREEMENT=1: an all-reduce
    on the device read back with .item()).

Time: the whole run keeps within --budget (360 s: about 6 minutes on one H200, plus start-up). Parts run round by
round, the arms of a round interleaved (harness.py: A B C, then C B A), in this order: the first tier (BERT b64 compile
off, BERT b64 compile on, ResNet-50 input, steady steps, 2 processes) for --rounds rounds, then the second tier (BERT
b32 compile off and on) likewise. A part's first round starts while any budget is left; a later round only if the
part's previous round fits in what is left. Each command has its own time limit (ARM_LIMIT_S) and is killed whole
past it or past the budget; the table names every arm that was cut, and why. When time runs short, what goes first
is the second tier, then the later rounds, then the first tier's last parts.

    make gpu-bench GPU_PYTHON=python3          # on the GPU machine (docs/gpu.md): data/ as docs/data.md says
    python benchmarks/gpu_bench.py --device cpu     # dry mode: tiny fixtures on the CPU, seconds; figures meaningless
    python benchmarks/gpu_bench.py --only "compile on"   # only the parts whose names contain the text

It needs, under --data_root: thucnews_titles/train.txt and val.txt, bert-base-chinese/config.json and vocab.txt;
the JPEGs are written here (utils/demo_data.py). The dry mode makes all of its data itself, runs one batch size and
one round, compiles with dynamo's "eager" backend, counts syncs without sync_debug (CUDA only), and writes its
Markdown to benchmarks/results/ instead of RESULTS.md.
"""
import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
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
BUDGET_S = 360
RESULTS_MD = REPO / "benchmarks" / "RESULTS.md"
RESULTS_SECTION = "## 13. GPU benchmark: `make gpu-bench`"
PROBE = REPO / "tools" / "step_probe" / "sitecustomize.py"
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
# Seconds one command may run on the GPU machine before it is killed: about three times what a compiled BERT-base
# command (start-up, inductor, 100 steps, evaluation, export) is expected to take there.
ARM_LIMIT_S = 240
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


GPU = Sizes(bert_batches=(64, 32), seq_len=128, bert_steps=100, logging_steps=10, learning_rate=1e-4,
            val_samples=1000, bare_steps=20, resnet_batch=256, image_size=224, jpegs=1024, jpeg_side=500,
            loader_workers=len(os.sched_getaffinity(0)) - 1, probe_bert_steps=60, probe_resnet_batch=64, rounds=2,
            compile_backend="inductor")
# One batch size and one round: the second tier is the first's code at another batch, and rounds are the scheduler's
# (tests/test_gpu_bench.py tests both with stand-in arms).
DRY = Sizes(bert_batches=(4,), seq_len=32, bert_steps=12, logging_steps=3, learning_rate=2e-3, val_samples=32,
            bare_steps=2, resnet_batch=2, image_size=32, jpegs=24, jpeg_side=48, loader_workers=0,
            probe_bert_steps=12, probe_resnet_batch=2, rounds=1, compile_backend="eager")


# ---- the plan: arms, parts, tiers, the budget --------------------------------------------------------------------

class Cut(Exception):
    """An arm that did not finish in its time: not a failure of what it measures."""


@dataclass
class Arm:
    """One row of the table. `measure(limit, round_index)` runs it once within `limit` seconds and returns its
    figures, a dict with "rate" (its unit is the part's); `limited`: whether that limit holds (a command, killed at it)
    or cannot (work in this process, which only starts while the budget lasts)."""
    name: str
    measure: Callable
    limit: float = ARM_LIMIT_S
    limited: bool = True
    rounds: list = field(default_factory=list)  # per round: its figures, or None where it did not run
    seconds: list = field(default_factory=list)  # per round: the wall seconds it took
    problem: str = ""  # why it has no figure, or what went wrong in a round


@dataclass
class Part:
    """Arms measured together, round after round, in interleaved order (`concurrent`: all at once, for checks that
    time nothing). `rounds`: at most this many (None: the run's)."""
    name: str
    arms: list
    unit: str
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
    limit = min(arm.limit, budget.left()) if arm.limited else budget.left()
    start = budget.clock()
    try:
        figures = arm.measure(limit, round_index)
    except (Cut, subprocess.TimeoutExpired):
        figures = None
        arm.problem = (f"cut: past its {arm.limit:.0f} s limit" if limit < budget.left() - 1
                       else f"cut: the {budget.seconds:.0f} s budget ran out while it ran")
    except Exception as err:  # noqa: BLE001 - one failed arm is reported; the others still run
        figures = None
        arm.problem = f"failed: {type(err).__name__}: {err}".replace("\n", " ")[:600]
    arm.rounds.append(figures)
    arm.seconds.append(budget.clock() - start)
    rate = f"{figures['rate']:,.1f}" if figures and figures.get("rate") is not None else arm.problem
    log(f"  round {round_index + 1} {arm.name:<42} {rate}  ({arm.seconds[-1]:.0f} s)")


def run_part_round(part, round_index, budget, log):
    """One round of `part`, if the budget allows it; False if it was cut."""
    if budget.left() <= 0 or (part.durations and part.durations[-1] > budget.left()):
        part.cut = (f"rounds from {round_index + 1} on cut: {budget.left():.0f} s of the budget left, the last round "
                    f"took {part.durations[-1]:.0f} s" if part.durations else "cut: no budget left")
        return False
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
    return True


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


# ---- what is measured ---------------------------------------------------------------------------------------------

class Bench:
    """The run's device, sizes, working folder and shared fixtures (the JPEGs, the bare steps), made when first asked
    for."""

    def __init__(self, args, sizes, work):
        self.args, self.sizes, self.work = args, sizes, work
        self.device = torch.device(args.device)
        self.dry = args.device == "cpu"
        self.threads = 1 if self.dry else len(os.sched_getaffinity(0))
        self.bert_model, self.train_files, self.val_file = self.headline_files()
        self.config = bench_gpu.bert_config(self.bert_model)
        with torch.device("meta"):  # the count without the weights
            self.bert_parameters = sum(p.numel() for p in bench_gpu.BertForSequenceClassification(self.config)
                                       .parameters())
        self.bare_berts, self.jpeg_root = {}, None
        self.peak_tflops = (None if self.dry else
                            args.peak_tflops or bench_gpu.datasheet_peak_tflops(torch.cuda.get_device_name()))

    def headline_files(self):
        """(model folder, {batch: training file of exactly bert_steps batches}, validation file): the real headlines,
        or the dry mode's generated ones."""
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
        """The ImageFolder of ImageNet-sized JPEGs (train/ and val/) the ResNet arms read."""
        if self.jpeg_root is None:
            s = self.sizes
            self.jpeg_root = write_photo_imagefolder(self.work / "jpegs", s.jpegs, max(2, s.jpegs // 16),
                                                     longer_side=s.jpeg_side)
        return self.jpeg_root

    def launch_env(self, probe=None):
        """A launched command's environment: offline, and with tools/step_probe first on PYTHONPATH where asked."""
        env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1",
               "PYTHONUNBUFFERED": "1"}
        if probe is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROBE.parent), os.environ.get("PYTHONPATH")]))
            env.update(probe)
        return env


def bert_part(bench, batch, mode):
    """train_bert_cls.py and the Trainer (bench_vs_trainer.py) beside the bare model step, at one batch and compile
    mode; the rate is training-step samples/s."""
    s = bench.sizes
    case = {"train": bench.train_files[batch], "val": bench.val_file, "model": bench.bert_model, "overrides": "",
            "seq_len": s.seq_len, "batch": batch, "lr": s.learning_rate, "logging_steps": s.logging_steps,
            "device": bench.device.type, "precision": "bf16", "compile": s.compile_backend if mode == "on" else None,
            "steps": s.bert_steps, "pad_to_max_length": True}
    part = f"BERT b{batch}, compile {mode}"

    def bare(limit, round_index):
        workload = bench.bare_bert(batch, mode)
        seconds, samples, _ = bench_gpu.timed(bench.device, s.bare_steps, batch, workload.step)()
        return {"rate": samples / seconds, "warm_up_seconds": workload.compile_seconds}

    def command(runner, label):
        def measure(limit, round_index):
            out = bench.work / f"{part}_{label}_{round_index}".replace(" ", "_").replace(",", "")
            result = runner(case, out, bench.threads, bench.launch_env(), timeout=limit)
            shutil.rmtree(out, ignore_errors=True)  # the exported BERT-bases: 400 MB each
            return {"rate": result["steady_samples_per_second"], **result}
        return measure

    return Part(part, [Arm("bare model step", bare, limited=False),
                       Arm("train_bert_cls.py", command(bench_vs_trainer.run_ours, "ours")),
                       Arm("Trainer", command(bench_vs_trainer.run_trainer, "trainer"))], "samples/s")


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

    def loader_arm(name):
        def measure(limit, round_index):
            seconds, images, _ = prepare()["inputs"][name]()
            return {"rate": images / seconds, **({} if round_index else {"agreement": state["agreement"]})}
        return measure

    arms = [Arm("bare compiled step", bare, limited=False)]
    arms += [Arm(name, loader_arm(name), limited=False) for name in bench_gpu.input_arm_names(s.loader_workers)]
    return Part("ResNet-50 input", arms, "images/s")


def probe_report(out_dir, rank=0):
    """tools/step_probe's count for one rank: its steps, the steady ones, and what they did."""
    path = Path(out_dir) / f"rank{rank}.json"
    if not path.is_file():
        raise RuntimeError(f"{path}: the step probe wrote no counts (is {PROBE} there and first on PYTHONPATH?)")
    return json.loads(path.read_text())


def run_launched(commands, env, limit, logs):
    """Start the commands together, each in a session of its own, and wait for all of them within `limit` seconds
    (past it every session is killed whole, the launcher with its processes: Cut). RuntimeError naming the first that
    failed, with the end of its log."""
    procs = []
    for cmd, log in zip(commands, logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen([str(c) for c in cmd], cwd=REPO, env={**os.environ, **env}, stdout=out,
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


def launch_head(bench, precision="bf16"):
    """`accelerate launch` of one process, eager, as the scripts' docs start them."""
    return [*ACCELERATE, "--num_processes", "1", "--num_machines", "1", "--mixed_precision", precision,
            "--dynamo_backend", "no"]


def sync_check_part(bench):
    """Each script on 1 process under the step probe: sync_debug "error" over its steady steps (on a GPU), and the
    probe's count of them and of the host reads it saw there."""
    s = bench.sizes
    modes = "count" if bench.dry else "count,sync_debug"  # set_sync_debug_mode is CUDA's
    cpu = ["--cpu"] if bench.dry else []

    def bert():
        batch = s.bert_batches[0]
        return ["train_bert_cls.py", *cpu, "--train_file", bench.train_files[batch], "--validation_file",
                bench.val_file, "--model_name_or_path", bench.bert_model, "--from_scratch", "--max_seq_len", s.seq_len,
                "--pad_to_max_length", "--train_batch_size", batch, "--max_train_steps", s.probe_bert_steps,
                "--logging_steps", s.logging_steps, "--do_train", "--do_eval"]

    def resnet(*decode):
        return ["train_resnet.py", *cpu, bench.jpegs(), "--arch", "resnet50", "-b", s.probe_resnet_batch,
                "--image_size", s.image_size, "--val_resize", s.image_size, "--channels_last",
                "-j", min(8, s.loader_workers), "--epochs", "1", "-p", s.logging_steps, *decode]

    def check(label, script_args):
        def measure(limit, round_index):
            out, probe_out = bench.work / f"sync_{label}", bench.work / f"sync_{label}_probe"
            run_launched([[*launch_head(bench), *script_args(), "--output_dir", out, "--overwrite_output_dir"]],
                         bench.launch_env({"STEP_PROBE": modes, "STEP_PROBE_OUT": str(probe_out)}), limit,
                         [out.with_suffix(".log")])
            steps = probe_report(probe_out)["steps"]
            steady = [step for step in steps if step["steady"]]
            if not steady:
                raise RuntimeError("no steady step: nothing was checked (more steps, fewer log lines)")
            return {"rate": None, "steady_steps": len(steady), "steps": len(steps),
                    "host_reads": sum(sum(step["syncs"].values()) for step in steady),
                    "sync_debug": "sync_debug" in modes}
        return measure

    return Part("steady steps without syncs", [
        Arm("train_bert_cls.py", check("bert", bert)),
        Arm("train_resnet.py", check("resnet", resnet)),
        Arm("train_resnet.py --decode_on_device", check("resnet_device_decode", lambda: resnet("--decode_on_device")))],
        "", concurrent=True, rounds=1)


def two_process_part(bench):
    """train_bert_cls.py on 2 processes sharing the one GPU over gloo, launched as two one-process machines on
    127.0.0.1 (a launch of 2 processes on a 1-GPU machine is refused: each would need its own GPU): steady ms/step with
    the host channel, and with the device agreement it replaced."""
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
            probe = {"STEP_PROBE": "count", "STEP_PROBE_OUT": str(probe_out),
                     **({"STEP_PROBE_DEVICE_AGREEMENT": "1"} if device_agreement else {})}
            run_launched([launch(rank, port, out) for rank in (0, 1)], bench.launch_env(probe), limit,
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
            return {"rate": 1000 * batch / ms, "ms_per_step": ms, "steady_steps": len(steady),
                    "collectives_per_steady_step": per_step}
        return measure

    return Part("2 processes, one GPU (gloo)", [Arm("host channel", arm(False)),
                                                Arm("device agreement (before)", arm(True))], "samples/s")


def plan(bench):
    """The tiers of parts, in the order they run (the module docstring says why this order)."""
    s = bench.sizes
    first, *others = s.bert_batches
    tiers = [[bert_part(bench, first, "off"), bert_part(bench, first, "on"), resnet_part(bench),
              sync_check_part(bench), two_process_part(bench)],
             [bert_part(bench, batch, mode) for batch in others for mode in ("off", "on")]]
    if not PROBE.is_file():  # the probe is a separate tool: without it, these two parts say so and are not run
        for part in tiers[0][3:]:
            part.cut = f"not run: {PROBE.relative_to(REPO)} is missing"
    only = bench.args.only
    return [[part for part in tier if only is None or any(text in part.name for text in only)] for tier in tiers]


# ---- the table ----------------------------------------------------------------------------------------------------

def done(arm):
    return [figures for figures in arm.rounds if figures is not None]


def median_of(arm, key):
    values = [figures[key] for figures in done(arm) if figures.get(key) is not None]
    return statistics.median(values) if values else None


def ratio(arm, baseline):
    """The median over rounds of arm's rate / baseline's rate, each ratio from the same round; None without one."""
    pairs = [(a["rate"], b["rate"]) for a, b in zip(arm.rounds, baseline.rounds) if a and b and a["rate"] and b["rate"]]
    return statistics.median(a / b for a, b in pairs) if pairs else None


def times(value):
    return f"{value:.2f}x" if value is not None else "?"


def number(value):
    """A rate as the table shows it: whole numbers from 100 on, three significant digits below (dry-mode sizes)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def row_cells(part, arm, bench):
    """[figure, ratios, MFU, command s, accuracy] of one arm; the figure is empty where the arm has none."""
    arms = {a.name: a for a in part.arms}
    rate = median_of(arm, "rate")
    cells = {"figure": "", "ratios": "", "mfu": "", "wall": "", "accuracy": ""}
    if part.name.startswith("BERT"):
        if rate is not None:
            cells["figure"] = f"{number(rate)} samples/s"
            utilisation = bench_gpu.mfu(bench.bert_parameters, rate, bench.sizes.seq_len, bench.peak_tflops)
            cells["mfu"] = f"{utilisation:.1%}" if utilisation is not None else ""
        if arm.name == "train_bert_cls.py":
            cells["ratios"] = (f"{times(ratio(arm, arms['Trainer']))} Trainer, "
                               f"{times(ratio(arm, arms['bare model step']))} bare step")
        elif arm.name == "Trainer":
            cells["ratios"] = f"{times(ratio(arm, arms['bare model step']))} bare step"
        wall, accuracy = median_of(arm, "wall_seconds"), median_of(arm, "val_accuracy")
        cells["wall"] = f"{wall:.1f}" if wall is not None else ""
        cells["accuracy"] = f"{accuracy:.3f}" if accuracy is not None else ""
    elif part.name.startswith("ResNet"):
        if rate is not None:
            cells["figure"] = f"{number(rate)} images/s"
        if arm.name != "bare compiled step":
            cells["ratios"] = f"{times(ratio(arm, arms['bare compiled step']))} bare compiled step"
    elif part.name.startswith("steady"):
        figures = done(arm)
        if figures:
            f = figures[-1]
            under = "under sync_debug, nothing raised" if f["sync_debug"] else "(no sync_debug on a CPU)"
            cells["figure"] = (f"{f['steady_steps']} steady steps of {f['steps']} {under}; "
                               f"{f['host_reads']} host reads counted in them")
    else:  # 2 processes
        if rate is not None:
            collectives = done(arm)[-1]["collectives_per_steady_step"]
            cells["figure"] = (f"{median_of(arm, 'ms_per_step'):.1f} ms/step ({number(rate)} samples/s); per steady step "
                               f"{collectives['host']:g} host-channel, {collectives['training']:g} training-group "
                               "collectives")
        if arm.name == "host channel":
            cells["ratios"] = f"{times(ratio(arm, arms['device agreement (before)']))} the device agreement's rate"
    if not cells["figure"]:
        cells["figure"] = arm.problem or "no figure"
    return cells


TABLE_HEADERS = ["part", "arm", "figure", "ratios (median of each round's)", "MFU", "command s", "val accuracy",
                 "rounds"]


def table(tiers, bench):
    rows = []
    for part in (p for tier in tiers for p in tier):
        for arm in part.arms:
            c = row_cells(part, arm, bench)
            rows.append([part.name, arm.name, c["figure"], c["ratios"], c["mfu"], c["wall"], c["accuracy"],
                         len(done(arm))])
    return harness.format_table(TABLE_HEADERS, rows)


# ---- the record ---------------------------------------------------------------------------------------------------

def driver_version():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def machine_line(bench):
    versions = harness.provenance()["versions"]
    software = ", ".join(f"{name} {versions[name]}" for name in ("torch", "transformers", "accelerate", "python")
                         if name in versions)
    cores = len(os.sched_getaffinity(0))
    if bench.dry:
        return f"CPU {harness.cpuinfo_field('model name') or 'unknown'} ({cores} cores), no GPU; {software}"
    props = torch.cuda.get_device_properties(0)
    return (f"{torch.cuda.get_device_name(0)} ({props.total_memory // 2**20:,} MiB), driver {driver_version()}, "
            f"CUDA {torch.version.cuda}, {cores} CPU cores; {software}")


def markdown(tiers, bench, started, seconds):
    """The run's record: heading, machine, command, settings, the table, and what was cut or failed."""
    s = bench.sizes
    lines = [f"### {started:%Y-%m-%d %H:%M} UTC, {machine_line(bench).split(' (')[0]}", ""]
    if bench.dry:
        lines += [f"**{CPU_FIGURES_WARNING}.**", ""]
    provenance = harness.provenance()
    lines += [f"Machine: {machine_line(bench)}. Command: `{provenance['command']}` at {provenance['git_revision']}; "
              f"budget {bench.args.budget:.0f} s, took {seconds:.0f} s. MFU = 6 x {bench.bert_parameters:,} "
              f"parameters x tokens/s / {bench.peak_tflops or 'no known'} TFLOP/s dense bf16 (bench_gpu.py).", "",
              f"BERT: {s.bert_steps} steps of headlines padded to {s.seq_len} tokens, bf16, lr {s.learning_rate:g}; "
              f"training samples/s over the log windows of {s.logging_steps} steps after the first; the bare step "
              f"{s.bare_steps} steps a round on a synthetic batch. ResNet-50: batch {s.resnet_batch}, {s.image_size} px, "
              f"{s.jpegs} JPEGs of {s.jpeg_side} px, {s.loader_workers} loader workers. Compile: torch.compile "
              f"{s.compile_backend}.", "", table(tiers, bench), ""]
    notes = [f"- {part.name}: {part.cut}" for tier in tiers for part in tier if part.cut]
    notes += [f"- {part.name} / {arm.name}: {arm.problem}" for tier in tiers for part in tier for arm in part.arms
              if arm.problem and arm.problem != part.cut]
    for part in (p for tier in tiers for p in tier if p.name.startswith("ResNet")):
        agreement = next((f["agreement"] for arm in part.arms for f in done(arm) if "agreement" in f), None)
        if agreement:
            notes.append(f"- device decode against the CPU loader, the same crops: mean |difference| "
                         f"{agreement['mean_abs_levels']:.2f}, max {agreement['max_abs_levels']:.0f} levels of 255 "
                         f"over {agreement['images']} images")
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
    return {part.name: {"unit": part.unit, "durations": part.durations, "cut": part.cut,
                        "arms": {arm.name: {"rounds": arm.rounds, "seconds": arm.seconds, "problem": arm.problem}
                                 for arm in part.arms}}
            for tier in tiers for part in tier}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=harness.HelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the dry mode (tiny fixtures it makes itself; seconds; no RESULTS.md)")
    parser.add_argument("--data_root", type=Path, default=None,
                        help=f"folder with {harness.DATA_LAYOUT} (default {harness.DEFAULT_DATA}); not in dry mode")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole run (default {BUDGET_S}; dry mode 3600)")
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds per part (default {GPU.rounds}; dry 1)")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="only the parts whose names contain one of these (e.g. --only 'compile on' ResNet)")
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="dense bf16 peak of the GPU for MFU (default: bench_gpu.py's datasheet table)")
    parser.add_argument("--output", type=Path, default=None,
                        help="results JSON (default benchmarks/results/gpu_bench.json; dry gpu_bench_dry.json)")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="the run's record as Markdown (default benchmarks/results/gpu_bench.md; dry "
                             "gpu_bench_dry.md); a GPU run also appends it to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    dry = args.device == "cpu"
    if dry and args.data_root is not None:
        parser.error("--data_root: the dry mode (--device cpu) makes its own tiny data and reads none")
    if dry and args.peak_tflops is not None:
        parser.error("--peak_tflops: the dry mode computes no MFU (a CPU's figures mean nothing)")
    args.data_root = args.data_root or harness.DEFAULT_DATA
    args.budget = args.budget or (3600.0 if dry else float(BUDGET_S))
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
    started, clock = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_bench_") as work:
        bench = Bench(args, sizes, Path(work))
        tiers = plan(bench)
        run_plan(tiers, rounds, Budget(args.budget))
        record = markdown(tiers, bench, started, time.monotonic() - clock)
    print("\n" + record + warning, end="")
    md = args.markdown or REPO / "benchmarks" / "results" / f"{name}.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(record, encoding="utf-8")
    print(f"wrote {md}")
    if not dry:
        append_to_results(RESULTS_MD, record)
        print(f"appended to {RESULTS_MD}")
    harness.write_results(name, {"provenance": harness.provenance(), "dry": dry, "sizes": dataclasses.asdict(sizes),
                                 "rounds": rounds, "budget_seconds": args.budget, "machine": machine_line(bench),
                                 "parts": summary(tiers), "markdown": record}, args.output)
    failed = [arm for tier in tiers for part in tier for arm in part.arms if arm.problem.startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(harness.run_cli(main, parse_args()) or 0)
