"""Data-parallel scaling on CPU: 2 processes x 1 thread (gloo DDP) vs 1 process x 1 thread, same GLOBAL batch.

Launch with 2 processes (the script refuses anything else):
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 benchmarks/bench_ddp_scaling.py --cpu
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 benchmarks/bench_ddp_scaling.py --cpu --quick
(or `torchrun --standalone --nproc_per_node 2 benchmarks/bench_ddp_scaling.py --cpu`).
At the README's real-data BERT settings (its model, bf16, fused AdamW at global batch 256; g64 for comparison):
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 benchmarks/bench_ddp_scaling.py --cpu \
        --config_overrides num_hidden_layers=6,hidden_size=256,num_attention_heads=4,intermediate_size=1024 \
        --mixed_precision bf16 --arms "1p g64,own full,g64 DDP defaults,g64 fused,no all-reduce,g256" --rounds 6

Model and data: the small BERT (2 layers, 128 wide, vocab 21,128: 3.2 M parameters, 2.7 M of them in the word
embedding, whose gradient is dense) on THUCNews headlines, AdamW, clipping at 1.0, the Accelerator of
utils.runtime.build_accelerator and the step of train_bert_cls.py (accelerate.accumulate, accelerator.backward,
clip_grad_norm_, prepared optimizer). Global batches are collated once (dynamic padding to a multiple of 8) and
split in two halves, as split_batches=True does; the 1-process arm trains on the whole global batch.

How the 1-process arms are measured: inside the same 2-process job, rank 0 trains an unwrapped copy of the model
while rank 1 waits in a barrier (its CPU use during that time is measured and reported, to show it leaves the
core free). So every arm runs in the same job, interleaved round by round with the others, on the same machine
state; no separate launches whose start-up and drift would dominate.

Efficiency of a 2-process arm = its samples/s / (2 x samples/s of the 1-process arm with the same global batch,
accumulation and optimizer), per round, median over rounds. On a machine shared with other jobs two processes may
not get two cores: the arm "2 procs, each its own full g64, no DDP" (two unconnected processes doing what the
1-process arm does) measures the parallel capacity the machine offered in that round, and
"efficiency / machine ceiling" divides by it, round by round.

Exactness is checked separately with dropout off: from the same weights and the same global batch, the gradient
each setting hands to the optimizer is compared with the 1-process gradient (relative L2 error); a setting that
only reorders float sums gives ~1e-7, compression gives much more.
"""
import contextlib
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
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs  # noqa: E402
from transformers import DataCollatorWithPadding  # noqa: E402

from bench_overhead import script_runtime_args  # noqa: E402
from train_bert_cls import build_model, optimizer_groups, tokenize  # noqa: E402
from utils.runtime import build_accelerator  # noqa: E402
from utils.text_data import build_label_list, read_examples  # noqa: E402

SMALL_BERT = "num_hidden_layers=2,hidden_size=128,num_attention_heads=2,intermediate_size=512"
SEED = 42
CEILING = "2 procs, each its own full g64, no DDP (machine ceiling)"
CEILING_BASE = "1p g64"
POWER_SGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}  # 2: the earliest DDP allows (error feedback)


def arm(name, procs, global_batch, accum=1, ddp=None, no_sync=False, check=True, fused=False, split=True):
    """procs=2 with ddp=None: each rank trains its own copy, no communication at all, on its half of the global
    batch (split=True) or on the whole of it (split=False: twice the work of 1 process, the machine's ceiling)."""
    return SimpleNamespace(name=name, procs=procs, global_batch=global_batch, accum=accum, ddp=ddp,
                           no_sync=no_sync, check=check and not (procs == 2 and ddp is None), fused=fused,
                           split=split)


def build_arms(quick, powersgd):
    hooks = DDPCommunicationHookType
    arms = [
        arm("1p g64", 1, 64),
        arm(CEILING, 2, 64, split=False),
        arm("2p g64 halves, no DDP (no communication; optimizer on both)", 2, 64),
        arm("2p g64 DDP defaults (bucket 25 MB)", 2, 64, ddp={}),
        arm("2p g64 no all-reduce (no_sync; WRONG results, diagnostic)", 2, 64, ddp={}, no_sync=True, check=False),
        arm("2p g64 fp16 compression hook", 2, 64, ddp={"comm_hook": hooks.FP16}),
        arm("2p g64 bf16 compression hook", 2, 64, ddp={"comm_hook": hooks.BF16}),
        arm("2p g64 PowerSGD rank 1", 2, 64, ddp={"comm_hook": hooks.POWER_SGD, "comm_state_option": POWER_SGD}),
        arm("2p g64 bucket_cap_mb 1", 2, 64, ddp={"bucket_cap_mb": 1}),
        arm("2p g64 bucket_cap_mb 100", 2, 64, ddp={"bucket_cap_mb": 100}),
        arm("1p g64 fused AdamW", 1, 64, fused=True),
        arm("2p g64 fused AdamW", 2, 64, ddp={}, fused=True),
        arm("2p g64 fused AdamW, no all-reduce (no_sync; WRONG results, diagnostic)", 2, 64, ddp={}, fused=True,
            no_sync=True, check=False),
        arm("1p g64 x accum 4", 1, 64, accum=4),
        arm("2p g64 x accum 4 (no_sync on 3 of 4)", 2, 64, accum=4, ddp={}),
        arm("1p g128", 1, 128),
        arm("2p g128", 2, 128, ddp={}),
        arm("1p g256", 1, 256),
        arm("2p g256", 2, 256, ddp={}),
        arm("1p g256 fused AdamW", 1, 256, fused=True),
        arm("2p g256 fused AdamW", 2, 256, ddp={}, fused=True),
    ]
    if not powersgd:  # see --powersgd: it can abort the whole job on gloo
        arms = [a for a in arms if "PowerSGD" not in a.name]
    if quick:
        keep = {"1p g64", "2p g64 DDP defaults (bucket 25 MB)", "2p g64 fp16 compression hook",
                "2p g64 bf16 compression hook", "2p g64 PowerSGD rank 1", "1p g64 x accum 4", "2p g64 x accum 4 (no_sync on 3 of 4)"}
        arms = [a for a in arms if a.name in keep]
    return arms


def baseline_of(a, arms):
    """The 1-process arm an arm's efficiency is measured against."""
    for b in arms:
        if b.procs == 1 and (b.global_batch, b.accum, b.fused) == (a.global_batch, a.accum, a.fused):
            return b
    return None


def ddp_wrap(accelerator, model, ddp_kwargs):
    """accelerator.prepare_model with these DistributedDataParallelKwargs, as if given to Accelerator(kwargs_handlers=
    ...): prepare reads ddp_handler. Without the autocast prepare would wrap into forward under --mixed_precision:
    the timed steps apply accelerator.autocast() themselves, on 1 and 2 processes alike, and the gradient checks
    stay fp32."""
    accelerator.ddp_handler = DistributedDataParallelKwargs(**ddp_kwargs)
    native_amp, accelerator.native_amp = accelerator.native_amp, False
    try:
        return accelerator.prepare_model(model)
    finally:
        accelerator.ddp_handler, accelerator.native_amp = None, native_amp


class Runner:
    """One arm's model copy, optimizer and batch cursor on this rank."""

    def __init__(self, spec, accelerator, base_model, batches):
        self.spec, self.accelerator, self.batches, self.cursor = spec, accelerator, batches, 0
        self.rank = accelerator.process_index
        self.active = spec.procs == 2 or self.rank == 0
        self.error = None
        if not self.active:
            return
        model = copy.deepcopy(base_model)
        # fused=True: one vectorised kernel over all parameters (on CPU since torch 2.4); the default on CPU is a
        # per-parameter Python loop. Same update up to float rounding.
        optimizer = torch.optim.AdamW(optimizer_groups(model, 0.01), lr=3e-5, fused=spec.fused or None)
        if spec.ddp is not None:
            model = ddp_wrap(accelerator, model, spec.ddp)
        self.model, self.optimizer = model, accelerator.prepare_optimizer(optimizer)
        self.model.train()
        self.phase = {"forward_backward": 0.0, "clip": 0.0, "optimizer": 0.0}

    def micro_batch(self):
        batch = self.batches[self.spec.global_batch][self.cursor % len(self.batches[self.spec.global_batch])]
        self.cursor += 1
        if self.spec.procs == 1 or not self.spec.split:
            return batch
        half = self.spec.global_batch // 2  # split_batches: rank r gets the r-th half of the global batch
        return {k: v[self.rank * half:(self.rank + 1) * half] for k, v in batch.items()}

    def optimizer_step(self):
        """One optimizer step (accum micro-batches), the way train_bert_cls.train does it; phases timed."""
        acc, model = self.accelerator, self.model
        for _ in range(self.spec.accum):
            batch = self.micro_batch()
            t0 = time.perf_counter()
            sync_context = model.no_sync() if self.spec.no_sync else contextlib.nullcontext()
            with sync_context, acc.accumulate(model):
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
    """Run one arm for `optimizer_steps` on the ranks it uses; wall, CPU per rank, samples."""
    dist.barrier()
    cpu0, t0 = time.process_time(), time.perf_counter()
    error = None
    if runner.active and runner.error is None:
        runner.prepare_round()
        try:
            for _ in range(optimizer_steps):
                runner.optimizer_step()
        except RuntimeError as err:  # e.g. a dtype gloo cannot all-reduce
            error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    dist.barrier()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    gathered = [None, None]
    dist.all_gather_object(gathered, {"wall": wall, "cpu": cpu, "error": error})
    return gathered


def check_gradients(spec, accelerator, base_model, batches, reference, iterations=3):
    """Relative L2 error of the gradient this setting gives the optimizer vs the exact 1-process gradient."""
    rank = accelerator.process_index
    if spec.procs == 1 or spec.ddp is None:
        return 0.0
    model = ddp_wrap(accelerator, copy.deepcopy(base_model), spec.ddp)  # fp32: no autocast here
    accelerator.gradient_accumulation_steps, accelerator.step = spec.accum, 0
    half = spec.global_batch // 2
    try:
        for it in range(iterations):  # PowerSGD compresses from its 2nd iteration on; the weights never change
            model.zero_grad(set_to_none=True)
            for m in range(spec.accum):
                batch = batches[spec.global_batch][m]
                with accelerator.accumulate(model):
                    loss = model(**{k: v[rank * half:(rank + 1) * half] for k, v in batch.items()}).loss
                    accelerator.backward(loss)
    except RuntimeError as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    grad = torch.cat([p.grad.flatten() for p in model.module.parameters()])
    return float((grad - reference[(spec.global_batch, spec.accum)]).norm() / reference[(spec.global_batch, spec.accum)].norm())


@torch.no_grad()
def fused_adamw_difference(base_model):
    """max |w_fused - w_loop| / max |update| after one AdamW step from the same weights and gradients."""
    models = [copy.deepcopy(base_model) for _ in range(2)]
    generator = torch.Generator().manual_seed(SEED)
    grads = [torch.randn(p.shape, generator=generator) for p in models[0].parameters()]
    for model, fused in zip(models, (None, True)):
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        with torch.enable_grad():
            torch.optim.AdamW(optimizer_groups(model, 0.01), lr=3e-5, fused=fused).step()
    before = list(base_model.parameters())
    diff = max(float((a - b).abs().max()) for a, b in zip(models[0].parameters(), models[1].parameters()))
    update = max(float((a - b).abs().max()) for a, b in zip(models[0].parameters(), before))
    return diff / update


def reference_gradient(base_model, batches, global_batch, accum):
    model = copy.deepcopy(base_model)
    for m in range(accum):
        (model(**batches[global_batch][m]).loss / accum).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def main():
    parser = common.base_parser(__doc__)
    parser.add_argument("--cpu", action="store_true", help="required on a machine without GPUs (gloo DDP)")
    parser.add_argument("--samples_per_round", type=int, default=None,
                        help="samples each arm trains per round (default 512, --quick 128)")
    parser.add_argument("--train_samples", type=int, default=8192, help="headlines tokenised")
    parser.add_argument("--powersgd", action="store_true",
                        help="add the PowerSGD arm. Off by default: on gloo, PowerSGD's all-reduces are issued from "
                             "completion callbacks of several buckets and can reach the ranks in different orders; "
                             "the job then aborts with gloo's 'Received data size doesn't match expected size'")
    parser.add_argument("--arms", default=None, help="comma-separated substrings: run only the arms they match")
    parser.add_argument("--config_overrides", default=SMALL_BERT,
                        help="the model, as train_bert_cls.py's --config_overrides (default: the 2-layer 128-wide probe)")
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], default="no",
                        help="autocast of the timed steps (bf16 runs on CPUs with AVX512-BF16/AMX); the gradient "
                             "checks stay in fp32, where exactness is defined")
    args = parser.parse_args()
    common.set_threads(args.threads)
    rounds = args.rounds or (1 if args.quick else 4)
    samples_per_round = args.samples_per_round or (128 if args.quick else 512)
    runtime = script_runtime_args()
    runtime.cpu, runtime.mixed_precision = args.cpu, args.mixed_precision
    with tempfile.TemporaryDirectory() as tmp:
        accelerator = build_accelerator(runtime, Path(tmp), 1)
    if accelerator.num_processes != 2:
        raise SystemExit("run with 2 processes: accelerate launch --multi_gpu --num_processes 2 "
                         "benchmarks/bench_ddp_scaling.py --cpu")
    main_process = accelerator.is_main_process
    started = common.provenance()
    say = accelerator.print

    examples = read_examples(args.data_root / "thucnews_titles" / "train.txt")[:args.train_samples]
    labels = build_label_list(examples, None)
    label2id = {label: i for i, label in enumerate(labels)}
    model_args = common.bert_script_args(args.data_root, args.data_root / "thucnews_titles" / "train.txt",
                                         args.config_overrides)
    torch.manual_seed(SEED)
    tokenizer, base_model = build_model(model_args, labels)  # the same weights on both ranks (same seed)
    dataset = tokenize(tokenizer, [e.text for e in examples], [label2id[e.label] for e in examples], 512)
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    arms = build_arms(args.quick and not args.arms, args.powersgd)
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
        if a.check and a.procs == 2 and not a.fused:
            exactness[a.name] = check_gradients(a, accelerator, exact_model, batches, reference)
            say(f"  gradient check {a.name:<48} relative error {exactness[a.name]}")

    fused_difference = fused_adamw_difference(exact_model)
    say(f"  fused vs default AdamW, one step on the same gradients: max |dw| / max |update| = {fused_difference:.1e}")

    # 2) Throughput, interleaved.
    runners = [Runner(a, accelerator, base_model, batches) for a in arms]
    for runner in runners:  # warm-up: one optimizer step each (PowerSGD leaves its vanilla first iteration here)
        timed_round(runner, 2 if runner.spec.ddp and "comm_hook" in runner.spec.ddp else 1)
    raw = {a.name: [] for a in arms}
    errors = {}
    for r in range(rounds):
        for runner in common.interleaved_order(runners, r):
            a = runner.spec
            steps = max(1, samples_per_round // (a.global_batch * a.accum))
            per_rank = timed_round(runner, steps)
            if any(p["error"] for p in per_rank):
                errors[a.name] = next(p["error"] for p in per_rank if p["error"])
                runner.error = errors[a.name]
                say(f"  {a.name}: {errors[a.name]}")
                continue
            wall = per_rank[0]["wall"]
            samples = steps * a.global_batch * a.accum * (1 if a.split else 2)
            raw[a.name].append({"seconds": wall, "units": samples, "rate": samples / wall,
                                "cpu_share": [p["cpu"] / p["wall"] for p in per_rank]})
            say(f"  round {r + 1}/{rounds} {a.name:<58} {samples / wall:8.1f} samples/s  CPU share per rank "
                + " ".join(f"{p['cpu'] / p['wall']:.2f}" for p in per_rank))

    # 3) Summary on rank 0.
    phases = [None, None]
    dist.all_gather_object(phases, {r.spec.name: r.phase for r in runners if r.active})
    rows, summary = [], {}
    for a, runner in zip(arms, runners):
        if not raw[a.name]:
            rows.append([a.name, None, None, None, None, None, None, None, None, errors.get(a.name, "not run")])
            continue
        base = baseline_of(a, arms)
        rate = statistics.median(x["rate"] for x in raw[a.name])
        efficiency = of_ceiling = None
        if a.procs == 2 and base is not None and raw[base.name]:
            efficiency = statistics.median(x["rate"] / (2 * y["rate"]) for x, y in zip(raw[a.name], raw[base.name]))
            if raw.get(CEILING) and a.name != CEILING:
                # the same round's independent-processes rate: what the cores allowed at that moment
                of_ceiling = statistics.median(x["rate"] / (2 * y["rate"]) / (c["rate"] / (2 * z["rate"]))
                                               for x, y, c, z in zip(raw[a.name], raw[base.name], raw[CEILING],
                                                                     raw[CEILING_BASE]))
        ph = phases[0].get(a.name)
        opt_steps = (sum(x["units"] for x in raw[a.name]) / (a.global_batch * a.accum * (1 if a.split else 2))
                     + (2 if a.ddp and "comm_hook" in a.ddp else 1))
        ms = {k: 1000 * v / opt_steps for k, v in ph.items()} if ph else {}
        idle_cpu = (statistics.median(x["cpu_share"][1] for x in raw[a.name]) if a.procs == 1 else None)
        err = exactness.get(a.name, 0.0 if a.procs == 1 else None)
        if a.fused and a.procs == 2 and a.check:  # the same gradient as the checked arm without fused; only the optimizer differs
            err = next((exactness.get(b.name) for b in arms if b.procs == 2 and b.ddp == {} and not b.fused
                        and (b.global_batch, b.accum) == (a.global_batch, a.accum)), None)
        if a.procs == 1:
            note = f"rank 1 idle meanwhile: {idle_cpu:.2f} CPU"
        elif a.ddp is None:
            note = "no communication: two separate models" + ("" if a.split else ", twice the samples")
        elif a.no_sync:
            note = "no all-reduce: the ranks' models diverge"
        else:
            note = ""
        if a.fused:
            note = (note + "; " if note else "") + f"fused AdamW update differs by {fused_difference:.0e} of a step"
        summary[a.name] = {"procs": a.procs, "global_batch": a.global_batch, "accum": a.accum,
                           "ddp_kwargs": {k: str(v) for k, v in (a.ddp or {}).items()},
                           "median_samples_per_second": rate, "efficiency": efficiency,
                           "fraction_of_ceiling": of_ceiling,
                           "ms_per_optimizer_step_rank0": ms, "gradient_relative_error": err,
                           "rank1_cpu_share_while_idle": idle_cpu, "note": note,
                           "cpu_share_median": [statistics.median(x["cpu_share"][i] for x in raw[a.name]) for i in (0, 1)]}
        rows.append([a.name, rate, efficiency, of_ceiling, ms.get("forward_backward"), ms.get("clip"), ms.get("optimizer"),
                     "/".join(f"{s:.2f}" for s in summary[a.name]["cpu_share_median"]),
                     err if isinstance(err, str) else (f"{err:.1e}" if err is not None else "n/a"),
                     note])
    table = common.format_table(["arm", "samples/s (median)", "efficiency", "efficiency / machine ceiling", "fwd+bwd ms/step (rank 0)",
                                 "clip ms", "optimizer ms", "CPU share rank0/rank1",
                                 "gradient rel. error vs 1p", "note"], rows)
    say(table)
    if main_process:
        # Only real data-parallel training counts: not the no-DDP or no-all-reduce diagnostics.
        trained = {a.name for a in arms if a.ddp is not None and not a.no_sync}
        best_name = max((n for n in trained if summary.get(n, {}).get("efficiency") is not None),
                        key=lambda n: summary[n]["efficiency"], default=None)
        best = summary[best_name]["efficiency"] if best_name else None
        if best is not None:
            say(f"best efficiency {best:.3f} ({best_name}; goal >= 0.85: {'met' if best >= 0.85 else 'NOT met'})")
        common.write_results("bench_ddp_scaling", {
            "benchmark": "bench_ddp_scaling", "provenance": started,
            "setup": {"model": args.config_overrides, "mixed_precision": args.mixed_precision, "parameters": parameters, "threads_per_process": args.threads,
                      "rounds": rounds, "samples_per_round": samples_per_round, "backend": dist.get_backend()},
            "fused_adamw_relative_difference": fused_difference, "arms": summary, "errors": errors, "rounds_raw": raw, "table": table,
            "best_efficiency": best, "best_arm": best_name}, args.output)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
