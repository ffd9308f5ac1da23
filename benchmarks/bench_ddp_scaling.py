"""Data-parallel scaling on CPU: 2 processes x 1 thread (gloo DDP) vs 1 process x 1 thread, same GLOBAL batch.

Launch with 2 processes (the script refuses anything else):
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 benchmarks/bench_ddp_scaling.py --cpu
At the README's real-data BERT settings (its model, bf16, fused AdamW at global batch 256; g64 for comparison):
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 benchmarks/bench_ddp_scaling.py --cpu \
        --config_overrides num_hidden_layers=6,hidden_size=256,num_attention_heads=4,intermediate_size=1024 \
        --mixed_precision bf16 --arms "1p g64,own full,g64 DDP defaults,g64 fused,g256" --rounds 6

The step is train_bert_cls.py's (accumulate, backward, clip_grad_norm_, prepared AdamW) on the Accelerator of
utils.runtime.build_accelerator; global batches of THUCNews headlines are collated once and split in halves, as
split_batches=True does. The 1-process arms run on rank 0 while rank 1 waits in a barrier, so all arms share one
job, interleaved round by round. Efficiency = samples/s / (2 x the 1-process arm with the same global batch,
accumulation and optimizer), per round, median over rounds; "efficiency / machine ceiling" divides by what two
unconnected processes reached in the same round. The gradient check (dropout off, same weights and global batch)
gives the relative L2 error of the gradient DDP hands the optimizer vs the 1-process one: ~1e-7 is float
summation order. More in benchmarks/README.md; the compression-hook, PowerSGD, bucket-size and no-all-reduce arms
and the fused-vs-loop AdamW update check were measured once and removed (RESULTS.md section 3).
"""
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import DataCollatorWithPadding  # noqa: E402

from train_bert_cls import build_model, optimizer_groups, tokenize  # noqa: E402
from utils.runtime import build_accelerator  # noqa: E402
from utils.text_data import build_label_list, read_examples  # noqa: E402

SMALL_BERT = "num_hidden_layers=2,hidden_size=128,num_attention_heads=2,intermediate_size=512"
SEED = 42
CEILING = "2 procs, each its own full g64, no DDP (machine ceiling)"
CEILING_BASE = "1p g64"


def arm(name, procs, global_batch, accum=1, fused=False):
    return SimpleNamespace(name=name, procs=procs, global_batch=global_batch, accum=accum, fused=fused,
                           ddp=procs == 2 and name != CEILING)


def build_arms(quick):
    arms = [arm("1p g64", 1, 64), arm(CEILING, 2, 64), arm("2p g64 DDP defaults (bucket 25 MB)", 2, 64),
            arm("1p g64 fused AdamW", 1, 64, fused=True), arm("2p g64 fused AdamW", 2, 64, fused=True),
            arm("1p g64 x accum 4", 1, 64, accum=4), arm("2p g64 x accum 4 (no_sync on 3 of 4)", 2, 64, accum=4)]
    for g in (128, 256):
        arms += [arm(f"1p g{g}", 1, g), arm(f"2p g{g}", 2, g)]
    arms += [arm("1p g256 fused AdamW", 1, 256, fused=True), arm("2p g256 fused AdamW", 2, 256, fused=True)]
    if quick:
        arms = [a for a in arms if a.global_batch == 64 and not a.fused and a.name != CEILING]
    return arms


def baseline_of(a, arms):
    """The 1-process arm an arm's efficiency is measured against."""
    return next((b for b in arms if b.procs == 1 and (b.global_batch, b.accum, b.fused) == (a.global_batch, a.accum, a.fused)), None)


def ddp_wrap(accelerator, model):
    """accelerator.prepare_model without the autocast it would wrap into forward under --mixed_precision: the
    timed steps apply accelerator.autocast() themselves, on 1 and 2 processes alike, and the gradient checks stay
    fp32."""
    native_amp, accelerator.native_amp = accelerator.native_amp, False
    try:
        return accelerator.prepare_model(model)
    finally:
        accelerator.native_amp = native_amp


class Runner:
    """One arm's model copy, optimizer and batch cursor on this rank."""

    def __init__(self, spec, accelerator, base_model, batches):
        self.spec, self.accelerator, self.batches, self.cursor = spec, accelerator, batches, 0
        self.rank = accelerator.process_index
        self.active = spec.procs == 2 or self.rank == 0
        if not self.active:
            return
        model = copy.deepcopy(base_model)
        # fused=True: one vectorised kernel over all parameters (on CPU since torch 2.4); the default on CPU is a
        # per-parameter Python loop. Same update up to float rounding.
        optimizer = torch.optim.AdamW(optimizer_groups(model, 0.01), lr=3e-5, fused=spec.fused or None)
        self.model = ddp_wrap(accelerator, model) if spec.ddp else model
        self.optimizer = accelerator.prepare_optimizer(optimizer)
        self.model.train()
        self.phase = {"forward_backward": 0.0, "clip": 0.0, "optimizer": 0.0}

    def micro_batch(self):
        batch = self.batches[self.spec.global_batch][self.cursor % len(self.batches[self.spec.global_batch])]
        self.cursor += 1
        if not self.spec.ddp:  # 1 process, or the ceiling: each of the 2 processes trains the whole global batch
            return batch
        half = self.spec.global_batch // 2  # split_batches: rank r gets the r-th half of the global batch
        return {k: v[self.rank * half:(self.rank + 1) * half] for k, v in batch.items()}

    def optimizer_step(self):
        """One optimizer step (accum micro-batches), the way train_bert_cls.train does it; phases timed."""
        acc, model = self.accelerator, self.model
        for _ in range(self.spec.accum):
            batch = self.micro_batch()
            t0 = time.perf_counter()
            with acc.accumulate(model):
                with acc.autocast():  # --mixed_precision bf16: the same autocast on 1 and 2 processes
                    loss = model(**batch).loss
                acc.backward(loss)
                t1 = time.perf_counter()
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                t2 = time.perf_counter()
                self.optimizer.step()  # prepared: a no-op on the accumulation micro-steps
                self.optimizer.zero_grad(set_to_none=True)
                t3 = time.perf_counter()
            self.phase["forward_backward"] += t1 - t0
            self.phase["clip"] += t2 - t1
            self.phase["optimizer"] += t3 - t2

    def prepare_round(self):
        self.accelerator.gradient_accumulation_steps = self.spec.accum
        self.accelerator.step = 0  # accumulate() counts micro-steps on the Accelerator; each arm starts a cycle


def global_batches(dataset, collator, global_batch, count, seed):
    """`count` collated global batches of a fixed shuffled order (identical on every rank)."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    batches = []
    for i in range(count):
        idx = [order[(i * global_batch + j) % len(order)] for j in range(global_batch)]
        batches.append(dict(collator([dataset[k] for k in idx])))
    return batches


def timed_round(runner, optimizer_steps):
    """Run one arm for `optimizer_steps` on the ranks it uses; wall and CPU seconds per rank."""
    dist.barrier()
    cpu0, t0 = time.process_time(), time.perf_counter()
    if runner.active:
        runner.prepare_round()
        for _ in range(optimizer_steps):
            runner.optimizer_step()
    dist.barrier()
    gathered = [None, None]
    dist.all_gather_object(gathered, {"wall": time.perf_counter() - t0, "cpu": time.process_time() - cpu0})
    return gathered


def check_gradients(spec, accelerator, base_model, batches, reference):
    """Relative L2 error of the gradient DDP gives the optimizer vs the exact 1-process gradient."""
    rank, half = accelerator.process_index, spec.global_batch // 2
    model = ddp_wrap(accelerator, copy.deepcopy(base_model))  # fp32: no autocast here
    accelerator.gradient_accumulation_steps, accelerator.step = spec.accum, 0
    for m in range(spec.accum):
        with accelerator.accumulate(model):
            loss = model(**{k: v[rank * half:(rank + 1) * half] for k, v in batches[spec.global_batch][m].items()}).loss
            accelerator.backward(loss)
    grad = torch.cat([p.grad.flatten() for p in model.module.parameters()])
    exact = reference[(spec.global_batch, spec.accum)]
    return float((grad - exact).norm() / exact.norm())


def reference_gradient(base_model, batches, global_batch, accum):
    model = copy.deepcopy(base_model)
    for m in range(accum):
        (model(**batches[global_batch][m]).loss / accum).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def main(argv=None):
    parser = common.base_parser(__doc__)
    parser.add_argument("--cpu", action="store_true", help="required on a machine without GPUs (gloo DDP)")
    parser.add_argument("--samples_per_round", type=int, default=None,
                        help="samples each arm trains per round (None: 512, --quick 128)")
    parser.add_argument("--train_samples", type=int, default=8192, help="headlines tokenised")
    parser.add_argument("--arms", default=None, help="comma-separated substrings: run only the arms they match")
    parser.add_argument("--config_overrides", default=SMALL_BERT,
                        help="the model, as train_bert_cls.py's --config_overrides (default: the 2-layer 128-wide probe)")
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], default="no",
                        help="autocast of the timed steps (bf16 runs on CPUs with AVX512-BF16/AMX); the gradient "
                             "checks stay in fp32, where exactness is defined")
    args = parser.parse_args(argv)
    train_file = args.data_root / "thucnews_titles" / "train.txt"
    common.require_data(args.data_root, "thucnews_titles/train.txt", "bert-base-chinese")
    common.set_threads(args.threads)
    rounds = args.rounds or (1 if args.quick else 4)
    samples_per_round = args.samples_per_round or (128 if args.quick else 512)
    runtime = common.script_runtime_args()
    runtime.cpu, runtime.mixed_precision = args.cpu, args.mixed_precision
    with tempfile.TemporaryDirectory() as tmp:
        accelerator = build_accelerator(runtime, Path(tmp), 1)
    if accelerator.num_processes != 2:
        raise common.UserError("run with 2 processes: accelerate launch --multi_gpu --num_processes 2 "
                               "benchmarks/bench_ddp_scaling.py --cpu")
    started = common.provenance()
    say = accelerator.print

    examples = read_examples(train_file)[:args.train_samples]
    labels = build_label_list(examples, None)
    label2id = {label: i for i, label in enumerate(labels)}
    torch.manual_seed(SEED)  # the same weights on both ranks
    tokenizer, base_model = build_model(common.bert_script_args(args.data_root, train_file, args.config_overrides), labels)
    dataset = tokenize(tokenizer, [e.text for e in examples], [label2id[e.label] for e in examples], 512)
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    arms = build_arms(args.quick and not args.arms)
    if args.arms:
        arms = [a for a in arms if any(part in a.name for part in args.arms.split(","))]
    batches = {g: global_batches(dataset, collator, g, max(8, samples_per_round // g * 4), SEED + g)
               for g in sorted({a.global_batch for a in arms})}
    parameters = sum(p.numel() for p in base_model.parameters())
    say(f"BERT {args.config_overrides}, {args.mixed_precision=}: {parameters:,} parameters ({4 * parameters / 2**20:.1f} MiB of fp32 gradient per step)")

    # 1) Exactness, dropout off, before any timing.
    exact_model = copy.deepcopy(base_model)
    exact_model.config.hidden_dropout_prob = exact_model.config.attention_probs_dropout_prob = 0.0
    for module in exact_model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    reference = {(a.global_batch, a.accum): reference_gradient(exact_model, batches, a.global_batch, a.accum)
                 for a in arms if a.procs == 1}
    exactness = {}
    for a in arms:
        if a.ddp and not a.fused and (a.global_batch, a.accum) in reference:
            exactness[a.name] = check_gradients(a, accelerator, exact_model, batches, reference)
            say(f"  gradient check {a.name:<48} relative error {exactness[a.name]}")

    # 2) Throughput, interleaved.
    runners = [Runner(a, accelerator, base_model, batches) for a in arms]
    for runner in runners:  # warm-up: one optimizer step each
        timed_round(runner, 1)
    raw = {a.name: [] for a in arms}
    for r in range(rounds):
        for runner in common.interleaved_order(runners, r):
            a = runner.spec
            steps = max(1, samples_per_round // (a.global_batch * a.accum))
            per_rank = timed_round(runner, steps)
            wall = per_rank[0]["wall"]
            samples = steps * a.global_batch * a.accum * (2 if a.name == CEILING else 1)
            raw[a.name].append({"seconds": wall, "units": samples, "rate": samples / wall,
                                "cpu_share": [p["cpu"] / p["wall"] for p in per_rank]})
            say(f"  round {r + 1}/{rounds} {a.name:<58} {samples / wall:8.1f} samples/s  CPU share per rank "
                + " ".join(f"{p['cpu'] / p['wall']:.2f}" for p in per_rank))

    # 3) Summary on rank 0.
    phases = [None, None]
    dist.all_gather_object(phases, {r.spec.name: r.phase for r in runners if r.active})
    rows, summary = [], {}
    for a in arms:
        base = baseline_of(a, arms)
        rate = statistics.median(x["rate"] for x in raw[a.name])
        efficiency = of_ceiling = None
        if a.procs == 2 and base is not None:
            efficiency = statistics.median(x["rate"] / (2 * y["rate"]) for x, y in zip(raw[a.name], raw[base.name]))
            if raw.get(CEILING) and raw.get(CEILING_BASE) and a.name != CEILING:
                # the same round's independent-processes rate: what the cores allowed at that moment
                of_ceiling = statistics.median(x["rate"] / (2 * y["rate"]) / (c["rate"] / (2 * z["rate"]))
                                               for x, y, c, z in zip(raw[a.name], raw[base.name], raw[CEILING],
                                                                     raw[CEILING_BASE]))
        opt_steps = sum(x["units"] for x in raw[a.name]) / (a.global_batch * a.accum * (2 if a.name == CEILING else 1)) + 1
        ms = {k: 1000 * v / opt_steps for k, v in phases[0][a.name].items()}
        idle_cpu = statistics.median(x["cpu_share"][1] for x in raw[a.name]) if a.procs == 1 else None
        # a fused arm hands the optimizer the same gradient as its unfused twin; only the optimizer differs
        twin = next((b.name for b in arms if b.ddp and not b.fused and (b.global_batch, b.accum) == (a.global_batch, a.accum)), None)
        err = 0.0 if a.procs == 1 else exactness.get(twin if a.fused else a.name)
        note = (f"rank 1 idle meanwhile: {idle_cpu:.2f} CPU" if a.procs == 1 else
                "no communication: two separate models, twice the samples" if a.name == CEILING else "")
        summary[a.name] = {"procs": a.procs, "global_batch": a.global_batch, "accum": a.accum,
                           "median_samples_per_second": rate, "efficiency": efficiency,
                           "fraction_of_ceiling": of_ceiling,
                           "ms_per_optimizer_step_rank0": ms, "gradient_relative_error": err,
                           "rank1_cpu_share_while_idle": idle_cpu, "note": note,
                           "cpu_share_median": [statistics.median(x["cpu_share"][i] for x in raw[a.name]) for i in (0, 1)]}
        rows.append([a.name, rate, efficiency, of_ceiling, ms["forward_backward"], ms["clip"], ms["optimizer"],
                     "/".join(f"{s:.2f}" for s in summary[a.name]["cpu_share_median"]),
                     f"{err:.1e}" if err is not None else "n/a", note])
    table = common.format_table(["arm", "samples/s (median)", "efficiency", "efficiency / machine ceiling", "fwd+bwd ms/step (rank 0)",
                                 "clip ms", "optimizer ms", "CPU share rank0/rank1",
                                 "gradient rel. error vs 1p", "note"], rows)
    say(table)
    if accelerator.is_main_process:
        # Only real data-parallel training counts, not the machine-ceiling arm.
        trained = [a.name for a in arms if a.ddp and summary[a.name]["efficiency"] is not None]
        best_name = max(trained, key=lambda n: summary[n]["efficiency"], default=None)
        best = summary[best_name]["efficiency"] if best_name else None
        if best is not None:
            say(f"best efficiency {best:.3f} ({best_name}; goal >= 0.85: {'met' if best >= 0.85 else 'NOT met'})")
        common.write_results("bench_ddp_scaling", {
            "benchmark": "bench_ddp_scaling", "provenance": started,
            "setup": {"model": args.config_overrides, "mixed_precision": args.mixed_precision, "parameters": parameters, "threads_per_process": args.threads,
                      "rounds": rounds, "samples_per_round": samples_per_round, "backend": dist.get_backend()},
            "arms": summary, "rounds_raw": raw, "table": table,
            "best_efficiency": best, "best_arm": best_name}, args.output)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    common.run_cli(main, sys.argv[1:])
