"""A long run keeps memory flat: resident memory (RSS) after N steps within 10% of after N/10 steps.

Runs train_bert_cls.py and train_resnet.py on built-in data for --steps optimizer steps in a subprocess,
samples the training process's VmRSS from /proc as metrics.jsonl reaches each logged step, and reports
RSS at 10% of the run and at the end. Usage:
    python benchmarks/bench_memory.py            # 2,000 steps each
    python benchmarks/bench_memory.py --quick    # 200 steps each
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts the repo root on sys.path)
from harness import REPO as ROOT  # noqa: E402

from utils.demo_data import write_digits_imagefolder, write_text_classification_data  # noqa: E402


def rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def last_step(metrics_path):
    if not metrics_path.exists():
        return 0
    lines = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return max((e["step"] for e in lines if e.get("event") == "train"), default=0)


def measure(name, command, out, steps, threads):
    """RSS (MiB) of the training process at every logged step."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen([str(c) for c in command], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    samples, seen = {}, 0
    while proc.poll() is None:
        step = last_step(out / "metrics.jsonl")
        if step > seen:
            samples[step], seen = rss_mib(proc.pid), step
        time.sleep(0.02)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed with exit code {proc.returncode}: {' '.join(map(str, command))}")
    early = min((s for s in samples if s >= steps // 10), default=None)
    late = max(samples)
    return {"name": name, "steps": steps, "early_step": early, "early_rss_mib": samples[early],
            "late_step": late, "late_rss_mib": samples[late], "growth": samples[late] / samples[early] - 1,
            "samples": samples}


def main(argv=None):
    # Built-in data, one run per script: no --data_root, no --rounds.
    parser = harness.base_parser(__doc__, data=False, rounds=False)
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per script (--quick: 200)")
    args = parser.parse_args(argv)
    steps = 200 if args.quick else args.steps
    tmp = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    text, digits = write_text_classification_data(tmp / "text"), write_digits_imagefolder(tmp / "digits", size=16)
    bert_out, resnet_out = tmp / "bert", tmp / "resnet"
    runs = [
        measure("train_bert_cls.py", [sys.executable, "train_bert_cls.py", "--cpu", "--data_dir", text,
                                      "--model_name_or_path", text / "model", "--from_scratch", "--do_train",
                                      "--max_seq_len", "32", "--train_batch_size", "16", "--learning_rate", "1e-3",
                                      "--max_train_steps", steps, "--logging_steps", max(1, steps // 40),
                                      "--checkpointing_steps", max(1, steps // 4), "--output_dir", bert_out],
                bert_out, steps, args.threads),
        measure("train_resnet.py", [sys.executable, "train_resnet.py", "--cpu", digits, "--image_size", "16",
                                    "--val_resize", "16", "-b", "16", "--lr", "0.01", "-j", "0",
                                    "--epochs", -(-steps // (1348 // 16)), "-p", max(1, steps // 40),
                                    "--output_dir", resnet_out], resnet_out, steps, args.threads),
    ]
    print(harness.format_table(["script", "steps", "RSS at step (early)", "RSS at step (end)", "growth"], [
        [r["name"], r["steps"], f"{r['early_rss_mib']:.0f} MiB at {r['early_step']}",
         f"{r['late_rss_mib']:.0f} MiB at {r['late_step']}", f"{100 * r['growth']:+.1f}%"] for r in runs]))
    ok = all(abs(r["growth"]) <= 0.10 for r in runs)
    print(f"goal: within 10% -> {'met' if ok else 'NOT met'}")
    harness.write_results("bench_memory", {"provenance": harness.provenance(), "threads": args.threads, "runs": runs,
                                          "goal_met": ok}, args.output)


if __name__ == "__main__":
    harness.run_cli(main, sys.argv[1:])
