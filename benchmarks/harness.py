"""What every benchmark shares: alternating A/B timing, provenance, a printed table and a results JSON.

Shared machines drift (other jobs, frequency scaling), so absolute times are unreliable but ratios
measured close together in time hold. Every benchmark therefore runs its arms in ONE process,
interleaved: round 1 runs A, B, C; round 2 runs C, B, A; and so on (the order flips each round so a
steady drift favours no arm), and reports the median rate per arm and the median of the per-round ratios.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "data"  # where docs/data.md (prepare_data.py) puts the real data in a clone
DATA_LAYOUT = "thucnews_titles/, cnews_sample/, bert-base-chinese/, imagenette_112/"
SEED = 42
# What a measurement depends on in this repository: a change here, uncommitted, is named in the record's revision
# (tools/step_probe: what gpu_bench.py's probed runs load before the script).
MEASURED_CODE = ("train_bert_cls.py", "train_resnet.py", "utils", "benchmarks", "accelerate_configs",
                 "tools/step_probe")

# Offline, and the fast tokenizer on one thread like everything else (it would otherwise batch-encode on all cores).
for _name, _value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)

if str(REPO) not in sys.path:  # the benchmarks import the training scripts and utils/ from the repo root
    sys.path.insert(0, str(REPO))

from utils.runtime import HelpFormatter  # noqa: E402
from utils.runtime import run_cli, UserError  # noqa: E402,F401  (run_cli: every benchmark's entry point)
from utils.runtime import cpuinfo_field  # noqa: E402,F401  (the benchmarks' provenance and CPU flags)


def base_parser(description, data=True, rounds=True):
    """The flags every benchmark takes; --data_root and --rounds only where the benchmark has data or rounds."""
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seconds: only checks that the benchmark works")
    if rounds:
        parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (None: depends on --quick)")
    if data:
        parser.add_argument("--data_root", type=Path, default=DEFAULT_DATA,
                            help=f"folder with {DATA_LAYOUT} (docs/data.md says how to get them)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    parser.add_argument("--output", type=Path, default=None, help="results JSON (None: benchmarks/results/<name>.json)")
    return parser


def require_data(data_root, *relative_paths):
    """Refuse to start, in one line, when the real data is not where --data_root says."""
    missing = [str(Path(data_root) / p) for p in relative_paths if not (Path(data_root) / p).exists()]
    if missing:
        raise UserError(f"{', '.join(missing)}: not found; pass --data_root DIR (the folder holding {DATA_LAYOUT}) "
                        "or put the data there as docs/data.md says (python prepare_data.py ...)")


def free_port():
    """A TCP port free on 127.0.0.1 now, for a launch's rendezvous."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_threads(threads):
    import torch
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (or parallel work already started)
        pass


# ---- what the benchmarks train: the scripts' own functions, and one plain torch step

def bert_script_args(data_root, train_file, config_overrides, **overrides):
    """train_bert_cls.py's own parsed arguments (all its defaults), for a randomly initialised model from
    data_root/bert-base-chinese: a flag the script gains later comes with its default instead of breaking them."""
    import train_bert_cls
    args = train_bert_cls.parse_args([
        "--model_name_or_path", str(Path(data_root) / "bert-base-chinese"), "--from_scratch",
        "--config_overrides", config_overrides, "--do_train", "--train_file", str(train_file)])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def bert_model(script_args, labels):
    """(tokenizer, model) as train_bert_cls.py builds them (its build_model). With bert_train_loader, the only place
    the benchmarks reach into the script, beside its parse_args."""
    from train_bert_cls import build_model
    return build_model(script_args, labels)


def bert_train_loader(script_args, tokenizer, labels, examples):
    """The unprepared training loader train_bert_cls.py builds (its build_dataloaders): tokenised once, padded per
    batch."""
    from train_bert_cls import build_dataloaders
    from utils.text_data import label_targets, tokenize_examples
    targets = label_targets(examples, labels, script_args.multi_label, script_args.do_regression)
    dataset = tokenize_examples(tokenizer, examples, targets, script_args.max_seq_len)
    return build_dataloaders(script_args, tokenizer, {"train": dataset}, None)["train"]


def script_accelerator(**flags):
    """The scripts' Accelerator (utils.runtime.build_accelerator) with their default runtime flags, `flags` set."""
    import tempfile
    from utils.runtime import add_runtime_args, build_accelerator
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    runtime = parser.parse_args([])
    vars(runtime).update(flags)
    with tempfile.TemporaryDirectory() as project_dir:  # nothing is saved: the project directory stays empty
        return build_accelerator(runtime, Path(project_dir), 1)


def headline_model(data_root, config_overrides, samples, max_seq_len):
    """(model, tokenised dataset, collator): a randomly initialised BERT (train_bert_cls.build_model, seeded) and the
    first `samples` THUCNews headlines, collated padded to a multiple of 8."""
    import torch
    from transformers import DataCollatorWithPadding
    from utils.text_data import build_label_list, read_examples, tokenize
    train_file = Path(data_root) / "thucnews_titles" / "train.txt"
    examples = read_examples(train_file)[:samples]
    labels = build_label_list(examples, None)
    label2id = {label: i for i, label in enumerate(labels)}
    torch.manual_seed(SEED)  # the same weights on every rank
    tokenizer, model = bert_model(bert_script_args(data_root, train_file, config_overrides), labels)
    dataset = tokenize(tokenizer, [e.text for e in examples], [label2id[e.label] for e in examples], max_seq_len)
    return model, dataset, DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)


def fixed_batches(dataset, collator, batch_size, count, seed=SEED):
    """`count` collated batches in a fixed shuffled order (identical on every rank), wrapping around the dataset."""
    import torch
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    return [dict(collator([dataset[order[(i * batch_size + j) % len(order)]] for j in range(batch_size)]))
            for i in range(count)]


def train_step(model, optimizer, batch, clip=None, bf16=False):
    """One plain torch step: a transformers batch (dict with labels) or (inputs, targets) for cross-entropy, bf16
    CPU autocast around the forward if asked (what --mixed_precision bf16 does on a CPU). Returns the samples."""
    import torch
    import torch.nn.functional as F
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if isinstance(batch, Mapping):  # a dict, or transformers' BatchEncoding
            loss, samples = model(**batch).loss, len(batch["labels"])
        else:
            loss, samples = F.cross_entropy(model(batch[0]), batch[1]), len(batch[1])
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return samples


def forever(loader):
    """Endless batches: the loader's epochs one after the other (a prepared loader advances its own epoch)."""
    while True:
        yield from loader


# ---- provenance: where and when a result was measured, saved with it

def load_average():
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]] if Path("/proc/loadavg").exists() else None


def provenance():
    import torch

    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        dirty = git("status", "--porcelain", "--", *MEASURED_CODE)
        revision = git("rev-parse", "--short", "HEAD") + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        revision = None
    versions = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "accelerate", "transformers", "datasets", "tokenizers", "PIL", "numpy"):
        try:
            versions[name] = getattr(__import__(name), "__version__", "?")
        except ImportError:  # not installed here
            pass
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "nproc": os.cpu_count(),
            "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "cpu_model": cpuinfo_field("model name") or platform.processor() or "unknown",
            "load_average_at_start": load_average(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "git_revision": revision, "versions": versions}


# ---- interleaved timing and its summary

def interleaved_order(names, round_index):
    """A, B, C on even rounds and C, B, A on odd ones."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def run_rounds(arms, rounds, log=print):
    """Run each arm once per round, interleaved. `arms` maps name -> fn() returning (seconds, units, extra dict).
    Returns {name: [{"seconds", "units", "rate", **extra} per round]}."""
    samples = {name: [] for name in arms}
    for r in range(rounds):
        for name in interleaved_order(arms, r):
            seconds, units, extra = arms[name]()
            samples[name].append({"seconds": seconds, "units": units, "rate": units / seconds, **(extra or {})})
            log(f"  round {r + 1}/{rounds} {name:<44} {units / seconds:10.1f} /s  ({seconds:.2f} s)")
    return samples


def timed(step, steps):
    """An arm for run_rounds: `steps` calls of step() (each returns the samples it did), in wall and process-CPU
    seconds (CPU / wall < 1: the process waited for a core)."""
    def run():
        wall, cpu = time.perf_counter(), time.process_time()
        units = sum(step() for _ in range(steps))
        return time.perf_counter() - wall, units, {"cpu_seconds": time.process_time() - cpu}
    return run


def compare_steps(name, steps_by_arm, rounds, steps, warmup, baseline=None):
    """Warm each step function up, then time `steps` calls of each per round, interleaved, against `baseline`
    (default: the first arm). Returns (raw rounds, summary)."""
    print(f"\n== {name}")
    for step in steps_by_arm.values():
        for _ in range(warmup):
            step()
    samples = run_rounds({arm: timed(step, steps) for arm, step in steps_by_arm.items()}, rounds)
    return samples, summarize(samples, baseline or next(iter(steps_by_arm)))


def summarize(samples, baseline):
    """Per arm: median rate, spread, and the median over rounds of rate(arm) / rate(baseline) (each ratio compares
    two runs seconds apart); CPU share = process-CPU seconds per wall second (below ~0.95: it waited for a core)."""
    out = {}
    for name, rounds in samples.items():
        rates = [r["rate"] for r in rounds]
        ratios = [a["rate"] / b["rate"] for a, b in zip(rounds, samples[baseline])]
        shares = [r["cpu_seconds"] / r["seconds"] for r in rounds if "cpu_seconds" in r]
        out[name] = {"median_rate": statistics.median(rates), "min_rate": min(rates), "max_rate": max(rates),
                     "ratio_to_baseline": statistics.median(ratios), "ratio_min": min(ratios),
                     "ratio_max": max(ratios), "rounds": len(rates),
                     "cpu_share": statistics.median(shares) if shares else None}
        if all("cpu_seconds" in r for r in rounds + samples[baseline]):
            # Units per CPU-second of this process: on a shared machine, time spent waiting for a core is not
            # counted, so this ratio stays put when other jobs come and go (single-process, single-thread arms only).
            cpu_ratios = [(a["units"] / a["cpu_seconds"]) / (b["units"] / b["cpu_seconds"])
                          for a, b in zip(rounds, samples[baseline])]
            out[name].update(median_cpu_rate=statistics.median(r["units"] / r["cpu_seconds"] for r in rounds),
                             cpu_ratio_to_baseline=statistics.median(cpu_ratios),
                             cpu_ratio_min=min(cpu_ratios), cpu_ratio_max=max(cpu_ratios))
    return out


def format_table(headers, rows):
    """A Markdown table, so the printed output can be pasted into RESULTS.md as is."""
    def fmt(value):
        if isinstance(value, float):
            return (f"{value:,.0f}" if value == 0 or abs(value) >= 100 else
                    f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}")
        return f"{value:,}" if isinstance(value, int) else "" if value is None else str(value)
    cells = [[str(h) for h in headers]] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_results(name, payload, output=None):
    """The results JSON (default benchmarks/results/<name>.json, git-ignored), provenance and raw rounds included."""
    path = Path(output) if output else REPO / "benchmarks" / "results" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, **payload, "load_average_at_end": load_average()}
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return path
