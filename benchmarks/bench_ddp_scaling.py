"""Data-parallel scaling on CPU: 2 processes x 1 thread (gloo DDP) vs 1 process x 1 thread, same GLOBAL batch.

Launch with 2 processes (the script refuses anything else):
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 benchmarks/bench_ddp_scaling.py --cpu
At the README's real-data BERT settings (its model, bf16, fused AdamW at global batch 256; g64 for comparison):
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 benchmarks/bench_ddp_scaling.py --cpu \
        --config_overrides num_hidden_layers=6,hidden_size=256,num_attention_heads=4,intermediate_size=1024 \
        --mixed_precision bf16 --arms "1p g64,own full,g64 DDP defaults,g64 fused,g256" --rounds 6

The step is train_bert_cls.py's (accumulate, backward, clip_grad_norm_, prepared AdamW) on its Accelerator; global
batches of THUCNews headlines are collated once and split in halves, as split_batches=True does. Efficiency =
samples/s / (2 x the 1-process arm with the same global batch and optimizer), median over rounds. How the arms share
one job, the machine ceiling and the gradient check: benchmarks/README.md. The diagnostic arms (compression hooks,
PowerSGD, bucket sizes, no all-reduce, g128, gradient accumulation) and the per-phase timings were measured once and
removed (RESULTS.md section 3).
"""
import copy
import itertools
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from utils.text_model import optimizer_groups  # noqa: E402

SMALL_BERT = "num_hidden_layers=2,hidden_size=128,num_attention_heads=2,intermediate_size=512"
CEILING = "2 procs, each its own full g64, no DDP (machine ceiling)"
ARMS = [  # (name, processes, global batch, fused AdamW); --quick: the first and third
    ("1p g64", 1, 64, False), (CEILING, 2, 64, False), ("2p g64 DDP defaults (bucket 25 MB)", 2, 64, False),
    ("1p g64 fused AdamW", 1, 64, True), ("2p g64 fused AdamW", 2, 64, True),
    ("1p g256", 1, 256, False), ("2p g256", 2, 256, False),
    ("1p g256 fused AdamW", 1, 256, True), ("2p g256 fused AdamW", 2, 256, True)]


def ddp_wrap(accelerator, model):
    """accelerator.prepare_model without the autocast it would wrap into forward under --mixed_precision: the
    timed steps apply accelerator.autocast() themselves, on 1 and 2 processes alike, and the gradient checks stay
    fp32."""
    native_amp, accelerator.native_amp = accelerator.native_amp, False
    try:
        return accelerator.prepare_model(model)
    finally:
        accelerator.native_amp = native_amp


def arm_step(spec, accelerator, base_model, batches):
    """One optimizer step of an arm on this rank, the way train_bert_cls.train does it; None where the rank idles."""
    if spec.procs == 1 and accelerator.process_index != 0:
        return None
    model = copy.deepcopy(base_model)
    # fused=True: one vectorised kernel over all parameters (on CPU since torch 2.4); the default on CPU is a
    # per-parameter Python loop. Same update up to float rounding.
    optimizer = torch.optim.AdamW(optimizer_groups(model, 0.01), lr=3e-5, fused=spec.fused or None)
    optimizer = accelerator.prepare_optimizer(optimizer)
    model = (ddp_wrap(accelerator, model) if spec.ddp else model).train()
    cursor = itertools.count()

    def step():
        batch = batches[spec.batch][next(cursor) % len(batches[spec.batch])]
        if spec.ddp:  # split_batches: rank r gets the r-th half; otherwise the whole batch (1p, the ceiling)
            batch = halve(batch, accelerator.process_index)
        with accelerator.accumulate(model):
            with accelerator.autocast():  # --mixed_precision bf16: the same autocast on 1 and 2 processes
                loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return step


def halve(batch, rank):
    half = len(batch["labels"]) // 2
    return {k: v[rank * half:(rank + 1) * half] for k, v in batch.items()}


def timed_round(step, optimizer_steps):
    """Run one arm for `optimizer_steps` on the ranks it uses; wall and CPU seconds per rank."""
    dist.barrier()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(optimizer_steps if step else 0):
        step()
    dist.barrier()
    gathered = [None, None]
    dist.all_gather_object(gathered, {"wall": time.perf_counter() - t0, "cpu": time.process_time() - cpu0})
    return gathered


def gradient_errors(arms, accelerator, base_model, batches):
    """Relative L2 error of the gradient each DDP arm gives the optimizer vs the exact 1-process gradient (fp32,
    dropout off); a fused arm hands the optimizer the same gradient as its unfused twin."""
    model = copy.deepcopy(base_model)
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    errors = {}
    for g in sorted({a.batch for a in arms if a.ddp}):
        exact_model, ddp_model = copy.deepcopy(model), ddp_wrap(accelerator, copy.deepcopy(model))
        exact_model(**batches[g][0]).loss.backward()
        exact = torch.cat([p.grad.flatten() for p in exact_model.parameters()])
        with accelerator.accumulate(ddp_model):
            accelerator.backward(ddp_model(**halve(batches[g][0], accelerator.process_index)).loss)
        grad = torch.cat([p.grad.flatten() for p in ddp_model.module.parameters()])
        errors[g] = float((grad - exact).norm() / exact.norm())
        accelerator.print(f"  gradient check g{g}: relative error {errors[g]}")
    return errors


def time_arms(arms, steps, rounds, samples_per_round, say):
    """One warm-up optimizer step per arm, then `rounds` rounds of `samples_per_round` samples each, the arms
    interleaved: {arm: [per round: seconds, samples, samples/s, each rank's CPU share]}."""
    for a in arms:
        timed_round(steps[a.name], 1)
    raw = {a.name: [] for a in arms}
    for r in range(rounds):
        for a in harness.interleaved_order(arms, r):
            optimizer_steps = max(1, samples_per_round // a.batch)
            per_rank = timed_round(steps[a.name], optimizer_steps)
            samples, wall = optimizer_steps * a.batch * (2 if a.name == CEILING else 1), per_rank[0]["wall"]
            raw[a.name].append({"seconds": wall, "units": samples, "rate": samples / wall,
                                "cpu_share": [p["cpu"] / p["wall"] for p in per_rank]})
            say(f"  round {r + 1}/{rounds} {a.name:<58} {samples / wall:8.1f} samples/s  CPU share per rank "
                + " ".join(f"{p['cpu'] / p['wall']:.2f}" for p in per_rank))
    return raw


def main(argv=None):
    parser = harness.base_parser(__doc__)
    parser.add_argument("--cpu", action="store_true", help="required on a machine without GPUs (gloo DDP)")
    parser.add_argument("--samples_per_round", type=int, default=None,
                        help="samples each arm trains per round (None: 512, --quick 128)")
    parser.add_argument("--train_samples", type=int, default=8192, help="headlines tokenised")
    parser.add_argument("--arms", default=None, help="comma-separated substrings: run only the arms they match")
    parser.add_argument("--config_overrides", default=SMALL_BERT,
                        help="the model, as train_bert_cls.py's --config_overrides (default: a 2-layer 128-wide BERT)")
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], default="no",
                        help="autocast of the timed steps (bf16 runs on CPUs with AVX512-BF16/AMX); the gradient "
                             "checks stay in fp32, where exactness is defined")
    args = parser.parse_args(argv)
    harness.require_data(args.data_root, "thucnews_titles/train.txt", "bert-base-chinese")
    harness.set_threads(args.threads)
    rounds = args.rounds or (1 if args.quick else 4)
    samples_per_round = args.samples_per_round or (128 if args.quick else 512)
    accelerator = harness.script_accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    if accelerator.num_processes != 2:
        raise harness.UserError("run with 2 processes: accelerate launch --multi_gpu --num_processes 2 "
                               "benchmarks/bench_ddp_scaling.py --cpu")
    started, say = harness.provenance(), accelerator.print

    arms = [SimpleNamespace(name=n, procs=p, batch=g, fused=f, ddp=p == 2 and n != CEILING) for n, p, g, f in ARMS]
    if args.arms:
        arms = [a for a in arms if any(part in a.name for part in args.arms.split(","))]
    elif args.quick:
        arms = [arms[0], arms[2]]
    base_model, dataset, collate = harness.headline_model(args.data_root, args.config_overrides, args.train_samples, 512)
    batches = {g: harness.fixed_batches(dataset, collate, g, max(8, samples_per_round // g * 4), harness.SEED + g)
               for g in sorted({a.batch for a in arms})}
    parameters = sum(p.numel() for p in base_model.parameters())
    say(f"BERT {args.config_overrides}, {args.mixed_precision=}: {parameters:,} parameters "
        f"({4 * parameters / 2**20:.1f} MiB of fp32 gradient per step)")
    errors = gradient_errors(arms, accelerator, base_model, batches)  # before any timing

    steps = {a.name: arm_step(a, accelerator, base_model, batches) for a in arms}
    raw = time_arms(arms, steps, rounds, samples_per_round, say)

    def efficiency(a):
        """Per round: samples/s / (2 x the same round's 1-process arm with the same global batch and optimizer)."""
        base = next((b.name for b in arms if b.procs == 1 and (b.batch, b.fused) == (a.batch, a.fused)), None)
        return [x["rate"] / (2 * y["rate"]) for x, y in zip(raw[a.name], raw[base])] if a.procs == 2 and base else None
    ceiling = next((efficiency(a) for a in arms if a.name == CEILING), None)  # what the two cores allowed, per round

    rows, summary = [], {}
    for a in arms:
        per_round = efficiency(a)
        of_ceiling = (statistics.median(e / c for e, c in zip(per_round, ceiling))
                      if per_round and ceiling and a.name != CEILING else None)
        err = 0.0 if a.procs == 1 else errors.get(a.batch) if a.ddp else None
        shares = [statistics.median(x["cpu_share"][i] for x in raw[a.name]) for i in (0, 1)]
        summary[a.name] = {"procs": a.procs, "global_batch": a.batch, "fused_adamw": a.fused,
                           "median_samples_per_second": statistics.median(x["rate"] for x in raw[a.name]),
                           "efficiency": statistics.median(per_round) if per_round else None,
                           "fraction_of_ceiling": of_ceiling, "gradient_relative_error": err,
                           "cpu_share_median": shares}
        rows.append([a.name, summary[a.name]["median_samples_per_second"], summary[a.name]["efficiency"], of_ceiling,
                     "/".join(f"{s:.2f}" for s in shares), f"{err:.1e}" if err is not None else "n/a"])
    table = harness.format_table(["arm", "samples/s (median)", "efficiency", "efficiency / machine ceiling",
                                 "CPU share rank0/rank1", "gradient rel. error vs 1p"], rows)
    say(table)
    if accelerator.is_main_process:
        trained = [a.name for a in arms if a.ddp and summary[a.name]["efficiency"] is not None]  # not the ceiling
        best_name = max(trained, key=lambda n: summary[n]["efficiency"], default=None)
        best = summary[best_name]["efficiency"] if best_name else None
        if best is not None:
            say(f"best efficiency {best:.3f} ({best_name}; goal >= 0.85: {'met' if best >= 0.85 else 'NOT met'})")
        harness.write_results("bench_ddp_scaling", {
            "provenance": started, "setup": {
                "model": args.config_overrides, "mixed_precision": args.mixed_precision, "parameters": parameters,
                "threads_per_process": args.threads, "rounds": rounds, "samples_per_round": samples_per_round,
                "backend": dist.get_backend()},
            "arms": summary, "rounds_raw": raw, "table": table, "best_efficiency": best, "best_arm": best_name},
            args.output)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    harness.run_cli(main, sys.argv[1:])
