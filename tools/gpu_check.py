"""`make gpu-check`: every GPU path of both scripts on tiny fixtures made here, then bench_gpu.py, in one command.

Checks (each with its own time limit; the whole run is planned to fit 8 minutes on one H100):
  - both scripts end to end on 1 GPU in fp32, fp16 and bf16, torch.compile off and on (ResNet also without
    channels_last); each export loads into plain transformers / torchvision and predicts what the run reported;
    fp16 runs report the loss scaler's final scale and the steps it skipped;
  - exact resume: a run SIGKILLed mid-epoch and resumed with `latest` against the uninterrupted run, both under
    --use_deterministic_algorithms, bitwise;
  - --data_parallel over every visible GPU; --sync_bn with 2-process NCCL (skipped below 2 GPUs);
  - bench_gpu.py: ResNet-50 and BERT-base throughput, MFU and peak memory; ResNet-50's input on JPEGs, the CPU loader
    against --decode_on_device, alone and feeding the compiled step, and how far apart their images are.
It writes benchmarks/results/gpu_check_<time>.md and prints a one-screen summary. Nothing comes from the network.

    make gpu-check                                     # on the GPU machine (see docs/gpu.md)
    python tools/gpu_check.py --device cpu        # dry mode: the same harness on CPU, smallest matrix
    python tools/gpu_check.py --only resume       # only the checks whose names contain "resume"
Without a visible GPU (and without --device cpu) it says so and exits 0.
"""
import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from utils.demo_data import write_digits_imagefolder, write_text_classification_data  # noqa: E402

BUDGET_S = 8 * 60  # the whole run on one H100
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
FP16_INITIAL_SCALE = 2.0 ** 16  # torch.amp.GradScaler's default init_scale; halved once per skipped step
RESNET = ["--arch", "resnet18", "--image_size", "16", "--val_resize", "16", "-b", "64", "--lr", "0.02",
          "--momentum", "0", "-p", "5"]
# Dry mode proves the harness, not the hardware: 399 of the digits (300 to train: 4 steps of 64 an epoch, 99 to
# validate), a checkpoint every 2 steps and the kill after step 2, so that each ResNet run is a few seconds of training.
DRY_DIGITS, DRY_CHECKPOINT_STEPS = 399, 2
PRECISION_NAMES = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}  # accelerate's "no" is fp32
RESUME_EPOCHS = 6  # 126 steps: long enough that the kill lands mid-run even on a fast GPU
# --decode_on_device's images against the CPU loader's: the bound torchvision's own nvJPEG test puts on the mean
# difference from libjpeg (test/test_image.py test_decode_jpeg_cuda: "Some difference expected between jpeg
# implementations", mean < 2)
DECODE_MEAN_LEVELS = 2.0


@dataclass
class Check:
    name: str
    status: str = "failed"  # passed / failed / skipped
    detail: str = ""
    figures: dict = field(default_factory=dict)  # name -> (value, unit)
    seconds: float = 0.0


class Harness:
    """Runs the checks against one device (cuda, or cpu in dry mode) under a global deadline."""

    def __init__(self, args, work):
        self.args, self.work, self.cpu = args, work, args.device == "cpu"
        self.deadline = time.monotonic() + args.budget
        self.gpus = 0 if self.cpu else torch.cuda.device_count()
        self.resnet = [*RESNET, "-j", "0" if self.cpu else "2",  # loader workers: none on the 2-core test machine
                       "--checkpointing_steps", str(DRY_CHECKPOINT_STEPS if self.cpu else 10)]
        self.text = write_text_classification_data(work / "text", n_train=400, n_val=99, n_test=99)
        self.bert = ["--data_dir", self.text, "--model_name_or_path", self.text / "model", "--from_scratch",
                     "--do_train"]
        self.digits = write_digits_imagefolder(work / "digits", size=16, limit=DRY_DIGITS if self.cpu else None)

    def remaining(self, limit):
        """Seconds a check (or one launch of it) may still run: its own `limit`, cut by the run's budget. The limits
        fit the GPU run into its budget; dry mode proves the harness, not how fast a CPU trains, and has the run's
        budget alone (a launch of a few seconds of CPU took 17 times that in wall time on a busy 2-core machine)."""
        limit = math.inf if self.cpu else limit
        return max(0.0, min(limit, self.deadline - time.monotonic()))

    def launch(self, script, args, out, limit, precision="no", compile_=False, processes=1, wait=True):
        """`accelerate launch` of a script in a session of its own; returns the ended Popen (the running one when
        wait=False). Past its time limit the whole session is killed, the script with its launcher."""
        head = [*ACCELERATE, "--num_machines", "1", "--mixed_precision", precision,
                "--dynamo_backend", "inductor" if compile_ else "no"]
        head += ["--multi_gpu", "--num_processes", str(processes)] if processes > 1 else ["--num_processes", "1"]
        cmd = [str(c) for c in [*head, script, *(["--cpu"] if self.cpu else []), *args, "--output_dir", out]]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
        # several jobs share the machine's cores (16 on the H100 box): a few threads each, not 16 each
        env["OMP_NUM_THREADS"] = "1" if self.cpu else "2"
        with open(Path(out).with_suffix(".log"), "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        if not wait:
            return proc
        try:
            proc.wait(timeout=self.remaining(limit))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the script it started, not the launcher alone
            proc.wait()
            raise
        if proc.returncode:
            tail = Path(out).with_suffix(".log").read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"exit {proc.returncode}: {' | '.join(tail)[-400:]}")
        return proc

    # ---- the checks ------------------------------------------------------------------------------------------

    def bert_run(self, precision, compile_, limit=240):
        out = self.work / f"bert_{precision}_compile_{'on' if compile_ else 'off'}"
        self.launch("train_bert_cls.py", [
            *self.bert, "--do_eval", "--do_test", "--max_seq_len", "64", "--train_batch_size", "16",
            "--eval_batch_size", "32", "--learning_rate", "2e-3", "--num_train_epochs", "4", "--logging_steps", "10",
            "--checkpointing_steps", "20", *(["--max_train_steps", "5"] if self.cpu else [])],
            out, limit, precision, compile_)
        results = json.loads((out / "all_results.json").read_text())
        figures = {"test accuracy": (results["test_accuracy"], ""), **self.scaler_figures(out, precision)}
        return "passed", (f"{self.bert_export_agrees(out, results)}; {results['mixed_precision']} on "
                          f"{results['device']}"), figures

    def bert_export_agrees(self, out, results):
        """best_model in plain transformers (fp32, no project code) scores the test set as the run reported."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        model = AutoModelForSequenceClassification.from_pretrained(out / "best_model").to(self.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(out / "best_model")
        rows = [line.split("\t", 1) for line in (self.text / "test.txt").read_text().splitlines() if line.strip()]
        correct = 0
        with torch.no_grad():
            for start in range(0, len(rows), 64):
                chunk = rows[start:start + 64]
                batch = tokenizer([text for _, text in chunk], truncation=True, max_length=64, padding=True,
                                  return_tensors="pt").to(self.device)
                predicted = model(**batch).logits.argmax(-1).tolist()
                correct += sum(model.config.id2label[p] == label for p, (label, _) in zip(predicted, chunk))
        return self.agreement("test accuracy", correct, len(rows), results["test_accuracy"])

    def resnet_run(self, precision, compile_, channels_last=True, limit=240):
        out = self.work / f"resnet_{precision}_compile_{'on' if compile_ else 'off'}{'' if channels_last else '_nchw'}"
        self.launch("train_resnet.py", self.resnet_args(1 if self.cpu else 3, channels_last), out, limit,
                    precision, compile_)
        results = json.loads((out / "all_results.json").read_text())
        figures = {"val acc@1": (results["best_acc1"], "%"), **self.scaler_figures(out, precision)}
        return "passed", self.resnet_export_agrees(out), figures

    def resnet_export_agrees(self, out):
        """model_best.pth in plain torchvision (PIL + torchvision transforms) scores val as the run reported."""
        import torchvision
        from PIL import Image
        best = torch.load(out / "model_best.pth", map_location="cpu", weights_only=True)
        model = torchvision.models.resnet18(num_classes=len(best["class_to_idx"]))
        model.load_state_dict(best["state_dict"])  # strict: no `module.` / `_orig_mod.` prefix, nothing missing
        model = model.to(self.device).eval()
        t = torchvision.transforms
        transform = t.Compose([t.Resize(16), t.CenterCrop(16), t.ToTensor(),
                               t.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        paths = sorted((self.digits / "val").rglob("*.png"))
        images = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths]).to(self.device)
        targets = torch.tensor([best["class_to_idx"][p.parent.name] for p in paths], device=self.device)
        with torch.no_grad():
            correct = (model(images).argmax(1) == targets).sum().item()
        return self.agreement("val acc@1", correct, len(paths), best["best_acc1"] / 100)

    @staticmethod
    def agreement(what, correct, total, reported):
        """The plain model's score against the run's. The run evaluated under autocast (bf16/fp16) and the
        plain model runs in fp32, so a sample whose top two logits nearly tie may flip: one sample is allowed."""
        differ = abs(correct - round(reported * total))
        if differ > 1:
            raise AssertionError(f"exported model: {what} {correct}/{total} in plain fp32, run reported "
                                 f"{reported:.4f} ({differ} samples apart; 1 allowed for autocast rounding)")
        return f"export reloads: {what} {correct}/{total} (run: {reported:.4f})"

    def scaler_figures(self, out, precision):
        """fp16: the loss scaler's state in the last checkpoint. It starts at 2^16 and halves on every skipped
        step (it would double after 2000 clean steps, more than these runs take), so skipped = log2(2^16 / scale)."""
        if precision != "fp16" or self.cpu:
            return {}
        checkpoints = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        scaler = checkpoints[-1] / "scaler.pt" if checkpoints else None
        if scaler is None or not scaler.exists():
            raise AssertionError(f"fp16 run saved no loss-scaler state under {out / 'checkpoints'}: scaler not engaged")
        scale = torch.load(scaler, weights_only=True)["scale"]
        return {"fp16 loss scale at the end": (float(scale), ""),
                "fp16 skipped steps": (max(0, round(math.log2(FP16_INITIAL_SCALE / float(scale)))), "steps")}

    def resnet_args(self, epochs, channels_last=True):
        return [self.digits, *self.resnet, "--epochs", str(epochs), *(["--channels_last"] if channels_last else [])]

    def resume(self, limit=240):
        """SIGKILL a run mid-epoch, resume with `latest`, compare the final weights with an uninterrupted run: all of
        them under --use_deterministic_algorithms, without which two uninterrupted GPU runs already differ (cuDNN's
        autotuner, atomics: docs/gpu.md#reproducibility), so the resumed run must be bitwise the uninterrupted one.
        Where it is not, a second uninterrupted run tells a resume that is not exact from kernels that are not
        deterministic; either fails."""
        precision, epochs, kill_after = ("no", 1, DRY_CHECKPOINT_STEPS) if self.cpu else ("no", RESUME_EPOCHS, 20)
        args = [*self.resnet_args(epochs), "--use_deterministic_algorithms"]
        reference, killed = self.work / "resume_reference", self.work / "resume_killed"
        self.launch("train_resnet.py", args, reference, limit, precision)
        job = self.launch("train_resnet.py", args, killed, limit, precision, wait=False)
        deadline = time.monotonic() + self.remaining(limit)
        while not (killed / "checkpoints" / f"step_{kill_after}" / "training_state.json").exists():
            if job.poll() is not None or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):  # an ended launcher may have left none of its session
                    os.killpg(job.pid, signal.SIGKILL)
                job.wait()
                raise RuntimeError(f"the run to interrupt ended or stalled before step {kill_after} "
                                   f"(exit {job.poll()})")
            time.sleep(0.02)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        if (killed / "checkpoint.pth").exists():
            return "failed", "the run finished before the kill landed: nothing was interrupted", {}
        stopped = max(int(p.name.split("_")[1]) for p in (killed / "checkpoints").glob("step_*"))
        self.launch("train_resnet.py", [*args, "--resume", "latest"], killed, limit, precision)
        diff = self.max_weight_difference(reference, killed)
        figures = {"killed after step": (stopped, "steps"), "max |weight difference| vs uninterrupted": (diff, "")}
        if diff == 0:
            return "passed", (f"bitwise identical to the uninterrupted run (killed after step {stopped}; "
                              "--use_deterministic_algorithms)"), figures
        repeat = self.work / "resume_reference_again"
        self.launch("train_resnet.py", args, repeat, limit, precision)
        noise = self.max_weight_difference(reference, repeat)
        figures["max |weight difference| between two uninterrupted runs"] = (noise, "")
        if noise > 0:
            return "failed", (f"two uninterrupted runs under --use_deterministic_algorithms differ by {noise:.2e}: a "
                              f"kernel is not deterministic here (the resumed run differs by {diff:.2e})"), figures
        return "failed", (f"resumed run differs by {diff:.2e} from the uninterrupted run, which a second run repeats "
                          "bitwise: the resume is not exact"), figures

    @staticmethod
    def max_weight_difference(a, b):
        wa = torch.load(a / "checkpoint.pth", map_location="cpu", weights_only=True)["state_dict"]
        wb = torch.load(b / "checkpoint.pth", map_location="cpu", weights_only=True)["state_dict"]
        assert wa.keys() == wb.keys()
        return max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa if wa[k].is_floating_point())

    def data_parallel(self, limit=180):
        """Both scripts wrapped in nn.DataParallel; exports without the `module.` prefix. Dry mode runs ResNet
        only: --cpu --data_parallel of BERT is in the test suite already (tests/test_faults.py)."""
        out = self.work / "resnet_data_parallel"
        self.launch("train_resnet.py", [*self.resnet_args(1), "--data_parallel"], out, limit)
        agree = self.resnet_export_agrees(out)
        where = "one CPU replica (--cpu)" if self.cpu else f"{self.gpus} GPU(s)"
        if self.cpu:
            return "passed", f"ResNet over {where}; {agree}", {}
        bert = self.work / "bert_data_parallel"
        self.launch("train_bert_cls.py", [*self.bert, "--max_seq_len", "32", "--train_batch_size", "16",
                                          "--max_train_steps", "10", "--data_parallel"], bert, limit)
        from safetensors.torch import load_file
        keys = load_file(bert / "best_model" / "model.safetensors").keys()
        if any(k.startswith(("module.", "_orig_mod.")) for k in keys):
            raise AssertionError("BERT export under --data_parallel keeps a wrapper prefix")
        return "passed", f"both scripts over {where}; ResNet {agree}", {"GPUs used": (self.gpus, "")}

    def sync_bn_nccl(self, limit=180):
        if self.gpus < 2:
            return "skipped", f"needs at least 2 GPUs ({self.gpus} visible)", {}
        out = self.work / "resnet_sync_bn_nccl"
        self.launch("train_resnet.py", [*self.resnet_args(1), "--sync_bn"], out, limit, precision="bf16",
                    processes=2)
        results = json.loads((out / "all_results.json").read_text())
        if results["num_processes"] != 2 or results["distributed_type"] != "MULTI_GPU":
            raise AssertionError(f"launched {results['num_processes']} x {results['distributed_type']}")
        return "passed", "2 processes, NCCL, SyncBatchNorm", {"val acc@1": (results["best_acc1"], "%")}

    def bench(self, limit=240):
        """bench_gpu.py at 2 rounds x 10 steps per arm (its own default is 5 x 20): 6 arms, 3 of them compiled,
        must leave the 8-minute budget room for the rest; run `bench_gpu.py` alone for steadier figures."""
        out = self.work / "bench_gpu.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--output", str(out)]
        cmd += (["--quick", "--device", "cpu", "--torch_compile", "off", "--resnet_image_size", "32",
                 "--bert_seq_len", "16"] if self.cpu else ["--rounds", "2", "--steps", "10"])
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=self.remaining(limit))
        if proc.returncode:
            raise RuntimeError(f"bench_gpu.py exit {proc.returncode}: {proc.stderr.strip()[-400:]}")
        result = json.loads(out.read_text())
        figures = {}
        for arm, s in result["arms"].items():
            unit = "images/s" if arm.startswith("resnet") else "samples/s"
            figures[arm] = (s["median_rate"], unit)
            if s.get("mfu") is not None:
                figures[f"{arm} MFU"] = (100 * s["mfu"], "%")
            if s.get("peak_memory_gib"):
                figures[f"{arm} peak memory"] = (s["peak_memory_gib"], "GiB")
        for arm in result["input_arms"]:  # the goal: the fed step at 0.9x the bare compiled step or better
            figures[f"{arm} vs {result['model_step_arm']}"] = (result["arms"][arm]["ratio_to_baseline"], "x")
        agreement = result["input_agreement"]
        for stat in ("mean", "max"):
            figures[f"device decode vs CPU loader, {stat} abs difference"] = (agreement[f"{stat}_abs_levels"], "levels")
        if (mean := agreement["mean_abs_levels"]) >= DECODE_MEAN_LEVELS:
            return "failed", (f"--decode_on_device images differ from the CPU loader's by {mean:.2f} levels of 255 on "
                              f"average (bound {DECODE_MEAN_LEVELS})"), figures
        peak = result["setup"]["peak_tflops"]
        return "passed", f"{result['device_name']}; MFU against {peak or 'no known'} TFLOP/s dense bf16", figures

    @property
    def device(self):
        return torch.device("cpu" if self.cpu else "cuda")

    def plan(self):
        """(name, function) in running order; the training matrix runs a few jobs at a time on a GPU."""
        if self.cpu:  # dry mode: one run per script, every other check once. ResNet in fp32: bf16 with
            # channels_last on CPU (torch 2.14.1) sometimes yields non-finite weights by step 10 (see docs/gpu.md)
            matrix = [("BERT bf16, compile off", lambda: self.bert_run("bf16", False)),
                      ("ResNet fp32 channels_last, compile off", lambda: self.resnet_run("no", False))]
        else:
            arms = [(p, c, f"{PRECISION_NAMES[p]}{{}}, compile {'on' if c else 'off'}")
                    for p in ("no", "fp16", "bf16") for c in (False, True)]
            matrix = [("BERT " + name.format(""), lambda p=p, c=c: self.bert_run(p, c)) for p, c, name in arms]
            matrix += [("ResNet " + name.format(" channels_last"), lambda p=p, c=c: self.resnet_run(p, c))
                       for p, c, name in arms]
            matrix += [("ResNet bf16 NCHW (no channels_last), compile off",
                        lambda: self.resnet_run("bf16", False, channels_last=False))]
        single = [("exact resume after SIGKILL mid-epoch (latest)", self.resume),
                  ("--data_parallel over every visible GPU", self.data_parallel),
                  ("--sync_bn + 2-process NCCL", self.sync_bn_nccl)]
        return [("bench_gpu.py (quiet GPU first)", self.bench)], matrix, single


def run_check(name, fn, harness):
    check, start = Check(name), time.monotonic()
    if harness.remaining(1) <= 0:
        check.status, check.detail = "skipped", f"out of the {harness.args.budget:.0f} s budget"
        return check
    try:
        check.status, check.detail, check.figures = fn()
    except subprocess.TimeoutExpired:
        if harness.remaining(1) <= 0:  # cut by the run's budget, not by the check's own limit: nothing failed
            check.status, check.detail = "skipped", f"out of the {harness.args.budget:.0f} s budget before it ended"
        else:
            check.detail = "time limit reached"
    except Exception as err:  # noqa: BLE001 - a failed check is reported, and the others still run
        check.detail = f"{type(err).__name__}: {err}".replace("\n", " ")[:500]
    check.seconds = time.monotonic() - start
    return check


def fmt(value):
    return f"{value:,.4g}" if isinstance(value, float) else str(value)


def report(checks, args, started, path):
    versions = {name: __import__(name).__version__ for name in ("torch", "torchvision", "transformers", "accelerate")}
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry mode: no GPU figures)"
    lines = [f"# GPU check, {started:%Y-%m-%d %H:%M} UTC", "",
             f"Device: {device}; GPUs visible: {torch.cuda.device_count() if args.device == 'cuda' else 0}; "
             + ", ".join(f"{k} {v}" for k, v in versions.items()) + f"; python {sys.version.split()[0]}", "",
             "| check | result | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {c.status} | {c.seconds:.0f} | {c.detail.replace('|', '/')} |" for c in checks]
    lines += ["", "| check | figure | value | unit |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {k} | {fmt(v)} | {u} |" for c in checks for k, (v, u) in c.figures.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def summary(checks, path):
    print("\n===== gpu check =====")
    for c in checks:
        print(f"{c.status.upper():7} {c.name} ({c.seconds:.0f} s): {c.detail}")
        for k, (v, u) in c.figures.items():
            print(f"          {k}: {fmt(v)} {u}".rstrip())
    counts = {s: sum(c.status == s for c in checks) for s in ("passed", "failed", "skipped")}
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; report: {path}")
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: dry mode, the same harness with --cpu on the smallest matrix")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--parallel", type=int, default=6,
                        help="training-matrix jobs at a time on the GPU (tiny models: they share it and 16 cores)")
    parser.add_argument("--report", type=Path, default=None, help="Markdown report (default benchmarks/results/)")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="run only the checks whose names contain one of these (e.g. --only resume 'compile on'), "
                             "to finish a run that ran out of its budget")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu check: no GPU visible here, nothing to check (run it on a GPU machine, or --device cpu for the "
              "dry mode)")
        return 0
    started = datetime.now(timezone.utc)
    path = args.report or ROOT / "benchmarks" / "results" / f"gpu_check_{started:%Y%m%d_%H%M%S}.md"
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        harness = Harness(args, Path(tmp))
        first, matrix, single = (
            [(name, fn) for name, fn in part if args.only is None or any(text in name for text in args.only)]
            for part in harness.plan())
        checks = [run_check(name, fn, harness) for name, fn in first]
        if matrix:
            # The matrix's threads load exports with transformers, whose lazy names are not safe to resolve from
            # several threads at once (all but the first get "cannot import name AutoModelForSequenceClassification"):
            # resolved here, once, before the threads start.
            from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: F401
        workers = 1 if harness.cpu else args.parallel
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            checks += list(pool.map(lambda item: run_check(*item, harness), matrix))
        checks += [run_check(name, fn, harness) for name, fn in single]
        report(checks, args, started, path)
    counts = summary(checks, path)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
