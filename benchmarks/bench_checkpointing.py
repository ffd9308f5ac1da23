"""--gradient_checkpointing: the memory one training step needs, and its time, with and without it.

BERT-base's encoder (12 x 768, from scratch) at a long sequence and ResNet-50 at 224 px, each built by its script's
own functions from the parsed flags (train_bert_cls.build_model; train_resnet.build_model and place_model), trained
with a plain torch step (forward, loss, backward, optimizer step; AdamW for BERT, SGD with momentum for ResNet).
Peak memory of a step: the most memory its tensors held at once above what was held before it (weights, optimizer
state), so activations and gradients. On CUDA that is the caching allocator's peak (torch.cuda.max_memory_allocated);
on the CPU it is read from the allocations torch.profiler records (profile_memory, its memory timeline):
tracemalloc does not see torch's allocations, and the process's peak RSS counts memory the C allocator keeps after a
free, so neither measures a step. Step time: interleaved rounds in one process (benchmarks/harness.py). The arms
start from the same weights and see the same batches. Usage:
    python benchmarks/bench_checkpointing.py            # BERT 512 tokens x 4, ResNet-50 224 px x 8
    python benchmarks/bench_checkpointing.py --quick    # tiny models, seconds: checks that it works
"""
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

# the profiler's kineto logs "gpuGetDeviceCount failed" as an ERROR on a machine without a GPU: not one here
os.environ.setdefault("KINETO_LOG_LEVEL", "5")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts the repo root on sys.path)

from utils.demo_data import write_small_bert  # noqa: E402

BERT_BASE = "num_hidden_layers=12,hidden_size=768,num_attention_heads=12,intermediate_size=3072"
BERT_TINY = "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,intermediate_size=64"


def peak_step_bytes(step, device):
    """Bytes above those held before the step, at the step's peak (see the module docstring)."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        # deprecated in favour of CUDA's memory snapshots, which do not see the CPU; the quick test runs it
        warnings.simplefilter("ignore", FutureWarning)
        path = os.path.join(folder, "memory_timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        _, sizes = json.loads(Path(path).read_text())  # [times, bytes per category at each time]
    held = np.asarray(sizes).sum(axis=1)
    return int(held.max() - held[0])


def bert_arm(model_dir, overrides, seq_len, batch_size, checkpointing, device):
    """A step function of train_bert_cls.py's model on one fixed batch of `seq_len` real tokens per text."""
    import torch

    import train_bert_cls
    args = train_bert_cls.parse_args(["--model_name_or_path", str(model_dir), "--from_scratch", "--do_train",
                                      "--config_overrides", overrides, "--train_file", "unused.txt",
                                      *(["--gradient_checkpointing"] if checkpointing else [])])
    torch.manual_seed(harness.SEED)  # the same weights in both arms
    _, model = train_bert_cls.build_model(args, [str(i) for i in range(10)])
    model.to(device).train()
    generator = torch.Generator().manual_seed(harness.SEED)
    batch = {"input_ids": torch.randint(5, model.config.vocab_size, (batch_size, seq_len), generator=generator),
             "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
             "labels": torch.randint(0, 10, (batch_size,), generator=generator)}
    batch = {k: v.to(device) for k, v in batch.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return synchronized(lambda: harness.train_step(model, optimizer, batch), device)


def resnet_arm(arch, image_size, batch_size, checkpointing, device):
    """A step function of train_resnet.py's model (build_model, place_model) on one fixed batch of images."""
    import torch

    import train_resnet
    args = train_resnet.parse_args(["--dummy", "-a", arch, *(["--gradient_checkpointing"] if checkpointing else [])])
    torch.manual_seed(harness.SEED)
    model = train_resnet.place_model(train_resnet.build_model(args, 1000), args).to(device).train()
    generator = torch.Generator().manual_seed(harness.SEED)
    batch = (torch.randn(batch_size, 3, image_size, image_size, generator=generator).to(device),
             torch.randint(0, 1000, (batch_size,), generator=generator).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return synchronized(lambda: harness.train_step(model, optimizer, batch), device)


def synchronized(step, device):
    """`step`, timed to its end on a GPU too (kernels run asynchronously)."""
    import torch

    def run():
        samples = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return samples
    return run


def main(argv=None):
    parser = harness.base_parser(__doc__, data=False)
    parser.add_argument("--seq_len", type=int, default=512, help="BERT tokens per text (--quick: 64)")
    parser.add_argument("--bert_batch", type=int, default=4, help="BERT texts per step (--quick: 2)")
    parser.add_argument("--resnet_batch", type=int, default=8, help="ResNet-50 images per step (--quick: 2)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per arm and round (--quick: 1)")
    args = parser.parse_args(argv)
    import torch
    harness.set_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rounds = args.rounds or (1 if args.quick else 3)
    steps = 1 if args.quick else args.steps
    model_dir = write_small_bert(Path(tempfile.mkdtemp(prefix="bench_checkpointing_")) / "bert")
    seq_len, bert_batch = (64, 2) if args.quick else (args.seq_len, args.bert_batch)
    resnet, image_size, resnet_batch = ("resnet18", 64, 2) if args.quick else ("resnet50", 224, args.resnet_batch)
    workloads = {  # name -> (arm for checkpointing off/on, samples per step)
        f"BERT {'2x32' if args.quick else '12x768'}, {seq_len} tokens x {bert_batch}": (lambda checkpointing: bert_arm(
            model_dir, BERT_TINY if args.quick else BERT_BASE, seq_len, bert_batch, checkpointing, device), bert_batch),
        f"{resnet}, {image_size} px x {resnet_batch}": (lambda checkpointing: resnet_arm(
            resnet, image_size, resnet_batch, checkpointing, device), resnet_batch),
    }
    results, rows = {}, []
    for name, (build, batch_size) in workloads.items():
        arms = {"plain": build(False), "--gradient_checkpointing": build(True)}
        peaks = {}
        for arm, step in arms.items():
            step()  # the first step allocates the optimizer state: measure a later one
            peaks[arm] = peak_step_bytes(step, device)
        raw, summary = harness.compare_steps(name, arms, rounds, steps, warmup=0)
        results[name] = {"peak_step_bytes": peaks, "summary": summary, "rounds": raw}
        ms_per_step = {arm: 1000 * batch_size / summary[arm]["median_rate"] for arm in arms}
        checkpointed = summary["--gradient_checkpointing"]
        rows.append([name, f"{peaks['plain'] / 2**20:,.0f} MiB",
                     f"{peaks['--gradient_checkpointing'] / 2**20:,.0f} MiB",
                     f"{peaks['--gradient_checkpointing'] / peaks['plain']:.2f}", ms_per_step["plain"],
                     ms_per_step["--gradient_checkpointing"], f"{1 / checkpointed['ratio_to_baseline']:.2f}",
                     f"{1 / checkpointed['cpu_ratio_to_baseline']:.2f}"])
    # CPU time per step: on a shared machine the wall time also counts the waits for a core (harness.summarize)
    print(harness.format_table(["workload", "peak of a step, plain", "with checkpointing", "memory ratio",
                                "ms/step plain", "ms/step checkpointing", "time ratio", "CPU-time ratio"], rows))
    harness.write_results("bench_checkpointing", {"provenance": harness.provenance(), "device": str(device),
                                                  "threads": args.threads, "rounds": rounds, "steps": steps,
                                                  "workloads": results}, args.output)


if __name__ == "__main__":
    harness.run_cli(main, sys.argv[1:])
