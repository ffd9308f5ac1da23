"""Framework overhead: a training step the way the scripts do it on Accelerate vs a minimal torch loop.

Arms, for the small BERT on THUCNews headlines (batch 32, AdamW):
  accelerate  utils.runtime.build_accelerator with the scripts' default flags (split_batches, seedable sampler,
              bounded collectives), accelerator.prepare(model, optimizer, loader, scheduler), and the script's loop:
              `with accelerator.accumulate(model)`, accelerator.backward, accelerator.clip_grad_norm_, prepared
              optimizer and scheduler steps, plus its per-step bookkeeping (LossMeter), without .item() as in the script
  plain       the same model, data, optimizer and scheduler: loss.backward(), clip_grad_norm_, step, zero_grad
One process, 1 thread. Goal: accelerate >= 0.97 x plain. (The ResNet-18 arms, the same Accelerate calls around
train_resnet.py's step, were measured and removed: RESULTS.md section 2.)

    python benchmarks/bench_overhead.py            # ~1 min
    python benchmarks/bench_overhead.py --quick
"""
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import get_linear_schedule_with_warmup  # noqa: E402

from utils.text_model import optimizer_groups  # noqa: E402
from utils.loop import LossMeter  # noqa: E402
from utils.text_data import build_label_list, read_examples  # noqa: E402

SMALL_BERT = "num_hidden_layers=2,hidden_size=128,num_attention_heads=2,intermediate_size=512"
TOTAL_STEPS = 100_000  # scheduler length: far beyond the benchmark, so the learning rate stays warm-up-sized
ACCELERATE, PLAIN = "bert accelerate (train_bert_cls step)", "bert plain torch loop"


def bert_arms(accelerator, args):
    train_file = args.data_root / "thucnews_titles" / "train.txt"
    examples = read_examples(train_file)[:args.samples]
    labels = build_label_list(examples, None)
    torch.manual_seed(harness.SEED)
    script_args = harness.bert_script_args(args.data_root, train_file, SMALL_BERT, train_batch_size=32, num_workers=0,
                                          seed=harness.SEED)
    tokenizer, model = harness.bert_model(script_args, labels)
    loader = harness.bert_train_loader(script_args, tokenizer, labels, examples)

    def optimizer_and_schedule(m):
        optimizer = torch.optim.AdamW(optimizer_groups(m, 0.01), lr=3e-5)
        return optimizer, get_linear_schedule_with_warmup(optimizer, TOTAL_STEPS // 10, TOTAL_STEPS)

    # accelerate: train_bert_cls.train's step
    acc_model = copy.deepcopy(model)
    optimizer, scheduler = optimizer_and_schedule(acc_model)
    acc_model, optimizer, acc_loader, scheduler = accelerator.prepare(acc_model, optimizer, loader, scheduler)
    acc_batches, meter = harness.forever(acc_loader), LossMeter(accelerator.device)
    acc_model.train()

    def accelerate_step():
        batch = next(acc_batches)
        with accelerator.accumulate(acc_model):
            loss = acc_model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(acc_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        meter.update(loss, batch["labels"].shape[0])
        return batch["labels"].shape[0]

    # plain: the same model, optimizer and schedule by hand, an ordinary DataLoader over the same dataset
    plain_model = copy.deepcopy(model).to(accelerator.device).train()
    plain_optimizer, plain_scheduler = optimizer_and_schedule(plain_model)
    plain_batches = harness.forever(DataLoader(loader.dataset, batch_size=32, shuffle=True, collate_fn=loader.collate_fn,
                                              generator=torch.Generator().manual_seed(harness.SEED)))

    def plain_step():
        batch = {k: v.to(accelerator.device) for k, v in next(plain_batches).items()}
        samples = harness.train_step(plain_model, plain_optimizer, batch, clip=1.0)
        plain_scheduler.step()
        return samples

    return {ACCELERATE: accelerate_step, PLAIN: plain_step}


def main(argv=None):
    parser = harness.base_parser(__doc__)
    parser.add_argument("--samples", type=int, default=6000, help="headlines tokenised for the BERT arms")
    args = parser.parse_args(argv)
    harness.require_data(args.data_root, "thucnews_titles/train.txt", "bert-base-chinese")
    harness.set_threads(args.threads)
    # Many short rounds: on a shared machine a burst of other work lands in one round, and the median drops it.
    rounds = args.rounds or (2 if args.quick else 40)
    if args.quick:
        args.samples = 400
    accelerator = harness.script_accelerator()
    samples, summary = harness.compare_steps("small BERT (2x128) on THUCNews headlines, batch 32, AdamW",
                                            bert_arms(accelerator, args), rounds, 3 if args.quick else 4, warmup=3,
                                            baseline=PLAIN)
    rows = [[arm, s["median_rate"], 1000 * 32 / s["median_rate"], s["ratio_to_baseline"],
             f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}", s["median_cpu_rate"], s["cpu_ratio_to_baseline"],
             f"{s['cpu_ratio_min']:.2f}-{s['cpu_ratio_max']:.2f}", s["cpu_share"]] for arm, s in summary.items()]
    table = harness.format_table(["arm", "samples/s (median)", "ms/step", "vs plain, wall (median of rounds)",
                                 "per-round range", "samples per CPU-second", "vs plain, CPU time",
                                 "per-round range", "CPU share"], rows)
    print(table)
    ratio, cpu_ratio = summary[ACCELERATE]["ratio_to_baseline"], summary[ACCELERATE]["cpu_ratio_to_baseline"]
    verdict = ("met" if min(ratio, cpu_ratio) >= 0.97 else "NOT met" if max(ratio, cpu_ratio) < 0.97
               else "met on one measure only")
    print(f"accelerate / plain = {ratio:.3f} wall-clock, {cpu_ratio:.3f} CPU time (goal >= 0.97: {verdict})")
    harness.write_results("bench_overhead", {
        "provenance": harness.provenance(), "accelerator": {"device": str(accelerator.device),
                                                           "mixed_precision": accelerator.mixed_precision},
        "bert": {"arms": summary, "rounds_raw": samples, "table": table, "ratio_wall": ratio, "ratio_cpu": cpu_ratio,
                 "goal_met_wall": ratio >= 0.97, "goal_met_cpu": cpu_ratio >= 0.97}}, args.output)


if __name__ == "__main__":
    harness.run_cli(main, sys.argv[1:])
