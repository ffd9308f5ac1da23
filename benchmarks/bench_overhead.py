"""Framework overhead: a training step the way the scripts do it on Accelerate vs a minimal torch loop.

Arms, for the small BERT on THUCNews headlines (batch 32, AdamW) and for ResNet-18 (64x64, batch 32, SGD momentum):
  accelerate  utils.runtime.build_accelerator with the scripts' default flags (split_batches, seedable sampler,
              bounded collectives), accelerator.prepare(model, optimizer, loader, scheduler), and the scripts' loop:
              `with accelerator.accumulate(model)`, accelerator.backward, accelerator.clip_grad_norm_ (BERT), prepared
              optimizer and scheduler steps, plus the scripts' per-step bookkeeping (LossMeter; ResNet's top-1/top-5
              window), all without .item() as in the scripts
  plain       the same model, data, optimizer and scheduler: loss.backward(), clip_grad_norm_ (BERT), step, zero_grad
One process, 1 thread. Goal: accelerate >= 0.97 x plain.

    python benchmarks/bench_overhead.py            # ~2 min
    python benchmarks/bench_overhead.py --quick
"""
import copy
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from transformers import get_linear_schedule_with_warmup  # noqa: E402

from train_bert_cls import build_dataloaders, build_model, optimizer_groups  # noqa: E402
from train_resnet import classification_loss  # noqa: E402
from utils.image_counts import ImageCounts  # noqa: E402
from utils.loss_meter import LossMeter  # noqa: E402
from utils.runtime import build_accelerator  # noqa: E402
from utils.text_data import build_label_list, read_examples  # noqa: E402

SMALL_BERT = "num_hidden_layers=2,hidden_size=128,num_attention_heads=2,intermediate_size=512"
SEED = 42
TOTAL_STEPS = 100_000  # scheduler length: far beyond the benchmark, so the learning rate stays warm-up-sized


def bert_arms(accelerator, args):
    examples = read_examples(args.data_root / "thucnews_titles" / "train.txt")[:args.samples]
    labels = build_label_list(examples, None)
    torch.manual_seed(SEED)
    script_args = common.bert_script_args(args.data_root, args.data_root / "thucnews_titles" / "train.txt", SMALL_BERT,
                                          train_batch_size=32, num_workers=0, seed=SEED)
    tokenizer, model = build_model(script_args, labels)
    loader = build_dataloaders(script_args, tokenizer, labels, {"train": examples}, None)[0]["train"]

    # accelerate: train_bert_cls.train's step
    acc_model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(optimizer_groups(acc_model, 0.01), lr=3e-5)
    scheduler = get_linear_schedule_with_warmup(optimizer, TOTAL_STEPS // 10, TOTAL_STEPS)
    acc_model, optimizer, acc_loader, scheduler = accelerator.prepare(acc_model, optimizer, loader, scheduler)
    acc_batches, meter = common.Cycle(acc_loader), LossMeter(accelerator.device)
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

    # plain: the same model, optimizer and schedule by hand, an ordinary DataLoader over the same dataset
    plain_model = copy.deepcopy(model).to(accelerator.device)
    plain_optimizer = torch.optim.AdamW(optimizer_groups(plain_model, 0.01), lr=3e-5)
    plain_scheduler = get_linear_schedule_with_warmup(plain_optimizer, TOTAL_STEPS // 10, TOTAL_STEPS)
    plain_batches = common.Cycle(DataLoader(loader.dataset, batch_size=32, shuffle=True, collate_fn=loader.collate_fn,
                                            generator=torch.Generator().manual_seed(SEED)))
    plain_model.train()

    def plain_step():
        batch = {k: v.to(accelerator.device) for k, v in next(plain_batches).items()}
        loss = plain_model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 1.0)
        plain_optimizer.step()
        plain_scheduler.step()
        plain_optimizer.zero_grad(set_to_none=True)

    return {"bert accelerate (train_bert_cls step)": accelerate_step, "bert plain torch loop": plain_step}


def resnet_arms(accelerator, args):
    torch.manual_seed(SEED)
    model = torchvision.models.resnet18(num_classes=10)
    images = torch.randn(args.resnet_images, 3, 64, 64)
    targets = torch.randint(0, 10, (args.resnet_images,))
    dataset = TensorDataset(images, targets)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)

    acc_model = copy.deepcopy(model)
    optimizer = sgd(acc_model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = DataLoader(dataset, batch_size=32, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(SEED))
    acc_model, optimizer, acc_loader, scheduler = accelerator.prepare(acc_model, optimizer, loader, scheduler)
    acc_batches, meter = common.Cycle(acc_loader), LossMeter(accelerator.device)
    counts = ImageCounts(accelerator, dataset, skip_bad_images=False)
    acc_model.train()

    def accelerate_step():  # train_resnet.train's step, bookkeeping included
        inputs, targets = next(acc_batches)
        with accelerator.accumulate(acc_model):
            logits = acc_model(inputs)
            loss = classification_loss(logits, targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        meter.update(loss, counts.add(logits, targets))

    plain_model = copy.deepcopy(model).to(accelerator.device)
    plain_optimizer = sgd(plain_model.parameters())
    plain_scheduler = torch.optim.lr_scheduler.LambdaLR(plain_optimizer, lambda step: 1.0)
    plain_batches = common.Cycle(DataLoader(dataset, batch_size=32, shuffle=True, drop_last=True,
                                            generator=torch.Generator().manual_seed(SEED)))
    plain_model.train()

    def plain_step():
        inputs, targets = next(plain_batches)
        loss = F.cross_entropy(plain_model(inputs.to(accelerator.device)), targets.to(accelerator.device))
        loss.backward()
        plain_optimizer.step()
        plain_scheduler.step()
        plain_optimizer.zero_grad(set_to_none=True)

    return {"resnet18 accelerate (train_resnet step)": accelerate_step, "resnet18 plain torch loop": plain_step}


def compare(name, arms, rounds, steps, warmup, batch_size):
    accelerate_arm, plain_arm = list(arms)
    samples, summary = common.compare_steps(name, arms, rounds, steps, batch_size, warmup, baseline=plain_arm)
    rows = [[arm, s["median_rate"], 1000 * batch_size / s["median_rate"], s["ratio_to_baseline"],
             f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}", s["median_cpu_rate"], s["cpu_ratio_to_baseline"],
             f"{s['cpu_ratio_min']:.2f}-{s['cpu_ratio_max']:.2f}", common.cpu_share(samples[arm])]
            for arm, s in summary.items()]
    table = common.format_table(["arm", "samples/s (median)", "ms/step", "vs plain, wall (median of rounds)",
                                 "per-round range", "samples per CPU-second", "vs plain, CPU time",
                                 "per-round range", "CPU share"], rows)
    print(table)
    ratio, cpu_ratio = summary[accelerate_arm]["ratio_to_baseline"], summary[accelerate_arm]["cpu_ratio_to_baseline"]
    verdict = "met" if min(ratio, cpu_ratio) >= 0.97 else "NOT met" if max(ratio, cpu_ratio) < 0.97 else "met on one measure only"
    print(f"accelerate / plain = {ratio:.3f} wall-clock, {cpu_ratio:.3f} CPU time (goal >= 0.97: {verdict})")
    return {"arms": summary, "rounds_raw": samples, "table": table, "ratio_wall": ratio, "ratio_cpu": cpu_ratio,
            "goal_met_wall": ratio >= 0.97, "goal_met_cpu": cpu_ratio >= 0.97}


def main(argv=None):
    parser = common.base_parser(__doc__)
    parser.add_argument("--samples", type=int, default=6000, help="headlines tokenised for the BERT arms")
    parser.add_argument("--resnet_images", type=int, default=320, help="synthetic 64x64 images for the ResNet arms")
    args = parser.parse_args(argv)
    common.require_data(args.data_root, "thucnews_titles/train.txt", "bert-base-chinese")
    common.set_threads(args.threads)
    # Many short rounds: on a shared machine a burst of other work lands in one round, and the median drops it.
    rounds = args.rounds or (2 if args.quick else 40)
    if args.quick:
        args.samples = 400
    with tempfile.TemporaryDirectory() as output_dir:
        accelerator = build_accelerator(common.script_runtime_args(), Path(output_dir), 1)
        results = {"benchmark": "bench_overhead", "provenance": common.provenance(),
                   "accelerator": {"device": str(accelerator.device), "num_processes": accelerator.num_processes,
                                   "mixed_precision": accelerator.mixed_precision}}
        results["bert"] = compare("small BERT (2x128) on THUCNews headlines, batch 32, AdamW", bert_arms(accelerator, args),
                                  rounds, 3 if args.quick else 4, 3, 32)
        results["resnet18"] = compare("ResNet-18, 64x64 synthetic images, batch 32, SGD momentum 0.9",
                                      resnet_arms(accelerator, args), rounds if args.quick else max(1, rounds * 3 // 4),
                                      1, 2, 32)
    common.write_results("bench_overhead", results, args.output)


if __name__ == "__main__":
    common.run_cli(main, sys.argv[1:])
