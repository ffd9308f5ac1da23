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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
DEFAULT_DATA = REPO / "data"  # where docs/data.md (prepare_data.py) puts the real data in a clone
DATA_LAYOUT = "thucnews_titles/, cnews_sample/, bert-base-chinese/, imagenette_112/"

# Offline, and the fast tokenizer on one thread like everything else (it would otherwise batch-encode on all cores).
for _name, _value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)

if str(REPO) not in sys.path:  # the benchmarks import the training scripts and utils/ from the repo root
    sys.path.insert(0, str(REPO))

from utils.errors import UserError, run_cli  # noqa: E402,F401  (run_cli: every benchmark's entry point)
from utils.runtime import cpuinfo_field  # noqa: E402,F401  (the benchmarks' provenance and CPU flags)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the module docstring's layout and shows every default."""


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


def bert_script_args(data_root, train_file, config_overrides, **overrides):
    """train_bert_cls.py's own parsed arguments (all its defaults), for a randomly initialised model from
    data_root/bert-base-chinese: the benchmarks call the script's functions exactly as the script does, and a flag
    the script gains later comes with its default instead of breaking them."""
    import train_bert_cls
    args = train_bert_cls.parse_args([
        "--model_name_or_path", str(Path(data_root) / "bert-base-chinese"), "--from_scratch",
        "--config_overrides", config_overrides, "--do_train", "--train_file", str(train_file)])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def script_runtime_args():
    """The runtime flags the scripts get when none is given on the command line."""
    from utils.runtime import add_runtime_args
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    return parser.parse_args([])


def set_threads(threads):
    import torch
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (or parallel work already started)
        pass


class Cycle:
    """Endless batches from a loader; a new epoch (set_epoch on the loader or its batch sampler) when one runs out."""

    def __init__(self, loader):
        self.loader, self.epoch, self.iterator = loader, 0, None

    def __next__(self):
        while True:
            if self.iterator is None:
                owner = next((o for o in (self.loader, getattr(self.loader, "batch_sampler", None))
                              if hasattr(o, "set_epoch")), None)
                if owner is not None:
                    owner.set_epoch(self.epoch)
                self.iterator = iter(self.loader)
            try:
                return next(self.iterator)
            except StopIteration:
                self.iterator, self.epoch = None, self.epoch + 1


# ---- provenance: where and when a result was measured, saved with it

def load_average():
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def git_revision():
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        dirty = git("status", "--porcelain", "--", "train_bert_cls.py", "train_resnet.py", "utils")
        return git("rev-parse", "--short", "HEAD") + ("+uncommitted changes in scripts/utils" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def versions():
    out = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "accelerate", "transformers", "datasets", "tokenizers", "PIL", "numpy"):
        try:
            out[name] = getattr(__import__(name), "__version__", "?")
        except ImportError:
            pass
    return out


def provenance():
    import torch
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "nproc": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpuinfo_field("model name") or platform.processor() or "unknown",
        "load_average_at_start": load_average(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git_revision": git_revision(),
        "versions": versions(),
    }


# ---- interleaved timing and its summary

def interleaved_order(names, round_index):
    """A, B, C on even rounds and C, B, A on odd ones."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def run_rounds(arms, rounds, log=print):
    """Run each arm once per round, interleaved. `arms` maps name -> fn() returning (seconds, units, extra dict).

    Returns {name: [{"seconds", "units", "rate", **extra} per round]}.
    """
    samples = {name: [] for name in arms}
    for r in range(rounds):
        for name in interleaved_order(arms, r):
            seconds, units, extra = arms[name]()
            samples[name].append({"seconds": seconds, "units": units, "rate": units / seconds, **(extra or {})})
            log(f"  round {r + 1}/{rounds} {name:<44} {units / seconds:10.1f} /s  ({seconds:.2f} s)")
    return samples


def timed(step, steps, units_per_step):
    """An arm for run_rounds: `steps` calls of step(), timed in wall and process-CPU seconds."""
    def run():
        with Timer() as timer:
            for _ in range(steps):
                step()
        return timer.wall, steps * units_per_step, {"cpu_seconds": timer.cpu}
    return run


def compare_steps(name, steps_by_arm, rounds, steps, batch_size, warmup, baseline=None):
    """Warm each step function up, then time `steps` calls of each per round, interleaved, against `baseline`
    (default: the first arm). Returns (raw rounds, summary)."""
    print(f"\n== {name}")
    for step in steps_by_arm.values():
        for _ in range(warmup):
            step()
    samples = run_rounds({arm: timed(step, steps, batch_size) for arm, step in steps_by_arm.items()}, rounds)
    return samples, summarize(samples, baseline or next(iter(steps_by_arm)))


def cpu_share(rounds):
    """Median process-CPU seconds per wall second of an arm: below ~0.95 the process was waiting for a core."""
    shares = [r["cpu_seconds"] / r["seconds"] for r in rounds if "cpu_seconds" in r]
    return statistics.median(shares) if shares else None


def summarize(samples, baseline):
    """Per arm: median rate, spread, and the median over rounds of rate(arm) / rate(baseline) (each ratio compares
    two runs seconds apart)."""
    out = {}
    for name, rounds in samples.items():
        rates = [r["rate"] for r in rounds]
        ratios = [a["rate"] / b["rate"] for a, b in zip(rounds, samples[baseline])]
        out[name] = {"median_rate": statistics.median(rates), "min_rate": min(rates), "max_rate": max(rates),
                     "ratio_to_baseline": statistics.median(ratios), "ratio_min": min(ratios),
                     "ratio_max": max(ratios), "rounds": len(rates)}
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
    cells = [[str(h) for h in headers]] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def fmt(value):
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return "" if value is None else str(value)


def write_results(name, payload, output=None):
    path = Path(output) if output else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "load_average_at_end": load_average()}
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return path


class Timer:
    """Wall and process-CPU seconds of a block (CPU / wall < 1 means the process waited for a core or a peer)."""

    def __enter__(self):
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0
