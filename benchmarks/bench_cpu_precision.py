"""CPU training precision: fp32 vs bf16 autocast (and channels_last for ResNet), interleaved, same model and data.

What `--mixed_precision bf16` does on a CPU run: Accelerate wraps the forward pass in
torch.autocast("cpu", dtype=torch.bfloat16); weights, gradients and the optimizer stay fp32. On CPUs with
AVX512-BF16 or AMX (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later) oneDNN runs the matmuls and
convolutions in bf16; elsewhere bf16 can be slower than fp32. This benchmark says which case a machine is.

Arms (plain torch steps: bench_overhead.py shows the scripts' Accelerate step costs the same as a plain loop):
  BERT   the README's real-data model (--bert_config) on THUCNews headlines, AdamW (fused), batch --bert_batch:
         fp32 vs bf16 autocast
  ResNet resnet18, --image_size px, batch --resnet_batch, SGD momentum, synthetic images:
         fp32 NCHW vs bf16 NCHW vs bf16 channels_last (the fp32 channels_last arm was measured and removed:
         RESULTS.md section 6)

    python benchmarks/bench_cpu_precision.py --threads 2     # ~3 min
    python benchmarks/bench_cpu_precision.py --quick
"""
import copy
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
import torchvision  # noqa: E402

from utils.text_model import optimizer_groups  # noqa: E402

README_BERT = "num_hidden_layers=6,hidden_size=256,num_attention_heads=4,intermediate_size=1024"


def bert_arms(args):
    model, dataset, collator = harness.headline_model(args.data_root, args.bert_config, args.samples, 64)
    batches = harness.fixed_batches(dataset, collator, args.bert_batch, len(dataset) // args.bert_batch)

    def arm(bf16):
        m = copy.deepcopy(model).train()
        optimizer, cursor = torch.optim.AdamW(optimizer_groups(m, 0.01), lr=5e-4, fused=True), itertools.count()
        return lambda: harness.train_step(m, optimizer, batches[next(cursor) % len(batches)], clip=1.0, bf16=bf16)

    return {"bert fp32": arm(False), "bert bf16 autocast": arm(True)}


def resnet_arms(args):
    torch.manual_seed(harness.SEED)
    model = torchvision.models.resnet18(num_classes=10)
    generator = torch.Generator().manual_seed(harness.SEED)
    images = torch.randn(4, args.resnet_batch, 3, args.image_size, args.image_size, generator=generator)
    targets = torch.randint(0, 10, (4, args.resnet_batch), generator=generator)

    def arm(bf16, channels_last):
        m = copy.deepcopy(model).train()
        layout = torch.channels_last if channels_last else torch.contiguous_format
        m = m.to(memory_format=layout)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        cursor = itertools.count()

        def step():
            i = next(cursor) % len(images)
            return harness.train_step(m, optimizer, (images[i].contiguous(memory_format=layout), targets[i]), bf16=bf16)
        return step

    return {"resnet18 fp32": arm(False, False), "resnet18 bf16 autocast": arm(True, False),
            "resnet18 bf16 autocast channels_last": arm(True, True)}


def compare(name, steps_by_arm, rounds, steps):
    samples, summary = harness.compare_steps(name, steps_by_arm, rounds, steps, warmup=2)
    rows = [[arm, s["median_rate"], s["ratio_to_baseline"], f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}",
             s["cpu_share"]] for arm, s in summary.items()]
    table = harness.format_table(["arm", "samples/s (median)", f"vs {next(iter(summary))} (median of rounds)",
                                 "per-round range", "CPU share (threads busy)"], rows)
    print(table)
    return {"arms": summary, "rounds_raw": samples, "table": table}


def main(argv=None):
    parser = harness.base_parser(__doc__)
    parser.add_argument("--bert_config", default=README_BERT, help="train_bert_cls.py --config_overrides")
    parser.add_argument("--bert_batch", type=int, default=256, help="samples per BERT step")
    parser.add_argument("--samples", type=int, default=4096, help="headlines tokenised for the BERT arms")
    parser.add_argument("--resnet_batch", type=int, default=128, help="images per ResNet step")
    parser.add_argument("--image_size", type=int, default=80, help="pixels, ResNet input")
    args = parser.parse_args(argv)
    harness.require_data(args.data_root, "thucnews_titles/train.txt", "bert-base-chinese")
    harness.set_threads(args.threads)
    rounds = args.rounds or (1 if args.quick else 6)
    if args.quick:
        args.samples, args.bert_batch, args.resnet_batch, args.image_size = 256, 32, 16, 32
    flags = sorted(set((harness.cpuinfo_field("flags") or "").split())
                   & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512f"})
    print(f"CPU flags: {' '.join(flags) or 'none of avx512f/avx512_bf16/amx_bf16'}; {args.threads} thread(s)")
    results = {"provenance": harness.provenance(), "cpu_flags": flags,
               "setup": {"bert_config": args.bert_config, "bert_batch": args.bert_batch,
                         "resnet_batch": args.resnet_batch, "image_size": args.image_size}}
    results["bert"] = compare(f"BERT ({args.bert_config}) on THUCNews headlines, batch {args.bert_batch}, AdamW",
                              bert_arms(args), rounds, 1 if args.quick else 4)
    results["resnet18"] = compare(f"ResNet-18, {args.image_size}px synthetic, batch {args.resnet_batch}, SGD",
                                  resnet_arms(args), rounds, 1 if args.quick else 3)
    harness.write_results("bench_cpu_precision", results, args.output)


if __name__ == "__main__":
    harness.run_cli(main, sys.argv[1:])
