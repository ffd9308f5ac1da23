"""train_bert_cls.py against transformers' Trainer (run_classification.py style), start to finish.

Both train the same randomly initialised BERT (bert-base-chinese's config and vocabulary, --config_overrides) on the
same files with the same settings (global batch, lr, linear schedule with warmup, weight decay, fused AdamW, gradient
clipping at 1.0, seed, one epoch, fp32, one process). Each arm is a whole command timed from outside, rounds
alternating; reported: wall time, time to first step, steady samples/s and validation accuracy (how each is measured:
benchmarks/README.md). A case may also set the device, bf16, torch.compile, a number of steps and padding to the
maximum length (CASE_DEFAULTS): benchmarks/gpu_bench.py runs this file's two commands on a GPU so. Cases: THUCNews
headlines at 64 tokens (the settings of RESULTS.md: 9,000 headlines, 4x256 BERT, global batch 64, lr 1e-3, 10% warmup,
weight decay 0.01, 2 threads) and cnews articles at 512 tokens (900 train / 100 validation of cnews_1000.txt). (Our
start-up's parts as a fraction of one epoch were measured once and removed: RESULTS.md section 8.)

    python benchmarks/bench_vs_trainer.py                  # --data_root (default data/), 2 rounds of both cases
    python benchmarks/bench_vs_trainer.py --quick          # generated headlines (utils/demo_data.py), 1 round
"""
import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (REPO, base_parser, format_table, interleaved_order, provenance, require_data,  # noqa: E402
                    run_cli, write_results)

HEADLINE_MODEL = "num_hidden_layers=4,hidden_size=256,num_attention_heads=4,intermediate_size=1024"
SEED = 42
OPTIMIZER = "adamw_torch_fused"  # the Trainer's name; train_bert_cls.py takes the same --optim
# What a case may set beyond its files, model, length, batch, lr and log interval; these defaults are the CPU cases'.
# compile: None, or the torch.compile backend ("inductor"); steps: None for one epoch, else the number of optimizer
# steps (the schedule's length too); pad_to_max_length: every batch padded to seq_len (one shape) rather than to its
# longest text.
CASE_DEFAULTS = {"device": "cpu", "precision": "no", "compile": None, "steps": None, "pad_to_max_length": False}


class CommandFailed(RuntimeError):
    """A timed command exited non-zero; the message ends with the tail of its stderr."""


def parse_args(argv=None):
    parser = base_parser(__doc__)
    parser.set_defaults(threads=2)
    parser.add_argument("--train_samples", type=int, default=9000, help="headlines from thucnews_titles/train.txt")
    parser.add_argument("--val_samples", type=int, default=1000, help="headlines from thucnews_titles/val.txt")
    parser.add_argument("--cnews_samples", type=int, default=1000,
                        help="articles from cnews_sample/cnews_1000.txt, 90%% train / 10%% validation")
    parser.add_argument("--batch_size", type=int, default=64, help="global batch, both arms")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--cases", default="headlines,cnews", help="comma-separated: headlines, cnews")
    parser.add_argument("--trainer_worker", type=Path, default=None, help=argparse.SUPPRESS)  # the Trainer arm
    return parser.parse_args(argv)


def prepare_cases(args, work):
    """{case: settings} with the files written under `work`; real data, or generated data with --quick."""
    if args.quick:
        from utils.demo_data import write_text_classification_data
        demo = write_text_classification_data(work / "demo", n_train=384, n_val=96, n_test=1)
        return {"headlines": dict(train=demo / "train.txt", val=demo / "val.txt", model=demo / "model", overrides="",
                                  seq_len=32, batch=32, lr=2e-3, logging_steps=3)}
    data = Path(args.data_root)
    require_data(data, "thucnews_titles/train.txt", "thucnews_titles/val.txt", "cnews_sample/cnews_1000.txt",
                 "bert-base-chinese/config.json")

    def case(name, splits, seq_len, logging_steps):
        for split, lines in splits.items():
            (work / f"{name}_{split}.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return dict(train=work / f"{name}_train.txt", val=work / f"{name}_val.txt", model=data / "bert-base-chinese",
                    overrides=HEADLINE_MODEL, seq_len=seq_len, batch=args.batch_size, lr=args.learning_rate,
                    logging_steps=logging_steps)

    def lines(*path):
        return data.joinpath(*path).read_text(encoding="utf-8").splitlines()
    cases = {}
    if "headlines" in args.cases:
        cases["headlines"] = case("titles", {"train": lines("thucnews_titles", "train.txt")[:args.train_samples],
                                             "val": lines("thucnews_titles", "val.txt")[:args.val_samples]},
                                  64, 10)
    if "cnews" in args.cases:
        articles = lines("cnews_sample", "cnews_1000.txt")
        random.Random(0).shuffle(articles)  # the file runs class by class: a shuffled 90/10 split
        articles = articles[:args.cnews_samples]
        n_train = len(articles) * 9 // 10
        cases["cnews"] = case("cnews", {"train": articles[:n_train], "val": articles[n_train:]}, 512, 2)
    return cases


def run_command(cmd, threads, env=None, timeout=None):
    """Wall seconds of `cmd` run from the repository root; CommandFailed on a non-zero exit. Past `timeout` seconds
    the command is killed with every process it started (inductor's compile workers, a loader's) and
    subprocess.TimeoutExpired raised."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env or {})}
    start = time.perf_counter()
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise CommandFailed(f"{' '.join(map(str, cmd[:6]))} ... exited with {proc.returncode}:\n{stderr[-3000:]}")
    return wall


def steady_rate(window_rates):
    """Steady samples/s: the median of the log windows' rates after the first (which holds the first steps' warm-up
    and compilation), or of the only one."""
    return statistics.median(window_rates[1:] or window_rates)


def compile_env(case):
    """torch.compile on or off for either arm: what `accelerate launch --dynamo_backend B` tells the script it starts
    (accelerate's TorchDynamoPlugin reads it); the Trainer's torch_compile sets the same itself, and its off must not
    inherit an on from the environment."""
    return {"ACCELERATE_DYNAMO_BACKEND": (case["compile"] or "no").upper()}


def ours_command(case, out):
    """train_bert_cls.py on one process, started as the Trainer's command is (python, no launcher), with the case's
    settings."""
    return [sys.executable, "train_bert_cls.py", *(["--cpu"] if case["device"] == "cpu" else []),
            "--mixed_precision", case["precision"], "--train_file", case["train"], "--validation_file", case["val"],
            "--model_name_or_path", case["model"], "--from_scratch",
            *(["--config_overrides", case["overrides"]] if case["overrides"] else []),
            "--max_seq_len", case["seq_len"], *(["--pad_to_max_length"] if case["pad_to_max_length"] else []),
            "--train_batch_size", case["batch"], "--eval_batch_size", case["batch"], "--optim", OPTIMIZER,
            "--learning_rate", case["lr"], "--warmup_ratio", "0.1", "--weight_decay", "0.01", "--max_grad_norm", "1.0",
            "--seed", SEED, "--num_train_epochs", "1", *(["--max_train_steps", case["steps"]] if case["steps"] else []),
            "--logging_steps", case["logging_steps"], "--do_train", "--do_eval",
            "--output_dir", out, "--overwrite_output_dir"]


def run_ours(case, out, threads, env=None, timeout=None):
    case = {**CASE_DEFAULTS, **case}
    wall = run_command(ours_command(case, out), threads, {**(env or {}), **compile_env(case)}, timeout)
    results = json.loads((out / "all_results.json").read_text())
    windows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [w["samples_per_second"] for w in windows if w["event"] == "train"]
    return {"wall_seconds": wall, "startup_seconds": results["startup_seconds"],
            "steady_samples_per_second": steady_rate(rates), "train_steps": results["train_steps"],
            "epoch_seconds": results["train_runtime"], "val_accuracy": results["eval_accuracy"]}


def run_trainer(case, out, threads, env=None, timeout=None):
    case = {**CASE_DEFAULTS, **case}
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "case.json"
    spec.write_text(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in case.items()}))
    wall = run_command([sys.executable, Path(__file__).resolve(), "--trainer_worker", spec], threads,
                       {**(env or {}), **compile_env(case)}, timeout)
    return {"wall_seconds": wall, **json.loads((out / "trainer_result.json").read_text())}


def trainer_worker(spec_path):
    """run_classification.py's path for this data: read, tokenise with map, DataCollatorWithPadding, Trainer."""
    from utils.loop import seconds_since_process_start  # first, so nothing below is missed
    import numpy as np
    import torch
    from datasets import load_dataset
    from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                              Trainer, TrainerCallback, TrainingArguments, set_seed)

    case = json.loads(Path(spec_path).read_text())
    out = Path(spec_path).parent
    set_seed(SEED)  # before the model's random initialisation, as run_classification.py does
    # cnews lines: label TAB text; QUOTE_NONE (3) because headlines hold quote characters
    raw = load_dataset("csv", data_files={"train": case["train"], "validation": case["val"]}, delimiter="\t",
                       column_names=["label", "text"], quoting=3)
    labels = sorted(set(raw["train"]["label"]))
    label2id = {name: i for i, name in enumerate(labels)}
    tokenizer = AutoTokenizer.from_pretrained(case["model"])
    config = AutoConfig.from_pretrained(case["model"], num_labels=len(labels), label2id=label2id,
                                        id2label=dict(enumerate(labels)))
    if case["overrides"]:
        config.update_from_string(case["overrides"])
    model = AutoModelForSequenceClassification.from_config(config)

    def preprocess(batch):
        encoded = tokenizer(batch["text"], truncation=True, max_length=case["seq_len"],
                            padding="max_length" if case["pad_to_max_length"] else False)
        encoded["labels"] = [label2id[name] for name in batch["label"]]
        return encoded

    data = raw.map(preprocess, batched=True, remove_columns=["text", "label"])
    # (a new "label" column would keep the old one's string type in datasets 5.2: the ids go to "labels")
    n = case["logging_steps"]
    window_ends, first_step = [], []  # perf_counter() at the start and every n-th step's end; process seconds

    class StepTimes(TrainerCallback):
        """Log windows timed as ours are: from the start of training, then at the end of every n-th step, after the
        device finished it (the Trainer's own logging reads the loss back right after this callback, so the wait
        moves; it is not added)."""
        def on_train_begin(self, args, state, control, **kwargs):
            window_ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            if not first_step:
                first_step.append(seconds_since_process_start())
            if state.global_step % n == 0:
                if torch.cuda.is_available() and not args.use_cpu:
                    torch.cuda.synchronize()
                window_ends.append(time.perf_counter())

    # ours: ceil(--warmup_ratio x its steps); given as a whole number, which every transformers 5 takes
    steps = case["steps"] or math.ceil(len(data["train"]) / case["batch"])
    training_args = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=case["batch"],
        per_device_eval_batch_size=case["batch"], learning_rate=case["lr"], weight_decay=0.01,
        warmup_steps=math.ceil(0.1 * steps),
        lr_scheduler_type="linear", optim=OPTIMIZER, max_grad_norm=1.0, num_train_epochs=1,
        max_steps=case["steps"] or -1, eval_strategy="no", save_strategy="no", logging_steps=n, report_to="none",
        use_cpu=case["device"] == "cpu", bf16=case["precision"] == "bf16", torch_compile=bool(case["compile"]),
        torch_compile_backend=case["compile"], disable_tqdm=True, seed=SEED)

    def accuracy(prediction):
        return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}

    trainer = Trainer(model=model, args=training_args, train_dataset=data["train"], eval_dataset=data["validation"],
                      data_collator=DataCollatorWithPadding(tokenizer), callbacks=[StepTimes()],
                      compute_metrics=accuracy)
    trainer.train()
    trainer.save_model()  # as run_classification.py does after training (ours writes best_model/)
    metrics = trainer.evaluate()  # run_classification.py --do_eval: once, after training
    rates = [n * case["batch"] / (end - start) for start, end in zip(window_ends, window_ends[1:])]
    result = {"startup_seconds": first_step[0], "steady_samples_per_second": steady_rate(rates),
              "train_steps": trainer.state.global_step, "epoch_seconds": window_ends[-1] - window_ends[0],
              "val_accuracy": metrics["eval_accuracy"]}
    (out / "trainer_result.json").write_text(json.dumps(result))


def measure(args, rounds, work):
    """Every case's alternating rounds of both arms, run in `work`."""
    cases = prepare_cases(args, work)
    arms = {"train_bert_cls.py": run_ours, "Trainer": run_trainer}
    samples, payload = {}, {"provenance": provenance(), "rounds": rounds, "threads": args.threads, "cases": {}}
    for name, case in cases.items():
        print(f"{name}: {case['seq_len']} tokens, batch {case['batch']}, lr {case['lr']}")
        samples[name] = {arm: [] for arm in arms}
        for r in range(rounds):
            for arm in interleaved_order(arms, r):
                result = arms[arm](case, work / f"{name}_{arm}_{r}", args.threads)
                samples[name][arm].append(result)
                print(f"  round {r + 1}/{rounds} {arm:<18} wall {result['wall_seconds']:6.1f} s | first step "
                      f"{result['startup_seconds']:5.1f} s | {result['steady_samples_per_second']:6.1f} samples/s "
                      f"| val accuracy {result['val_accuracy']:.3f}", flush=True)
        payload["cases"][name] = {"settings": {k: str(v) for k, v in case.items()}, "rounds": samples[name]}
    return samples, payload


def main(args):
    import torch
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (1 if args.quick else 2)
    with tempfile.TemporaryDirectory(prefix="bench_vs_trainer_") as work:  # checkpoints of every run: removed
        try:
            samples, payload = measure(args, rounds, Path(work))
        except CommandFailed as err:
            sys.exit(f"error: {err}")
    rows = []
    for name, by_arm in samples.items():
        for arm, results in by_arm.items():
            med = {key: statistics.median(r[key] for r in results)
                   for key in ("wall_seconds", "startup_seconds", "steady_samples_per_second", "val_accuracy")}
            ours = by_arm["train_bert_cls.py"]
            speedup = statistics.median(t["wall_seconds"] / o["wall_seconds"] for o, t in zip(ours, by_arm["Trainer"]))
            rows.append([name, arm, med["wall_seconds"], med["startup_seconds"], med["steady_samples_per_second"],
                         med["val_accuracy"], speedup if arm == "train_bert_cls.py" else None])
    print(format_table(["case", "arm", "wall s", "first step s", "steady samples/s", "val accuracy",
                        "Trainer wall / ours"], rows))
    write_results("bench_vs_trainer", payload, args.output)


if __name__ == "__main__":
    cli = parse_args()
    if cli.trainer_worker:
        trainer_worker(cli.trainer_worker)
    else:
        run_cli(main, cli)
