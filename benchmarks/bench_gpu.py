"""GPU throughput: ResNet-50 (bf16 autocast, channels_last) images/s and BERT-base (seq 128 and 512, bf16)
samples/s with model FLOPs utilisation and peak memory, torch.compile off vs on, interleaved round by round.

Synthetic inputs on the device, so these arms measure the model step alone. Beside them, ResNet-50's input on
ImageNet-sized JPEGs: train_resnet.py's CPU loader (decode and augment in --loader_workers workers) and its
--decode_on_device (the workers read the bytes; nvJPEG decodes the batch, crop/flip/normalise run on the GPU),
each alone and feeding the compiled ResNet-50 step, against that step's bare rate (the goal: 0.9x), and the
mean and largest difference between the two paths' images for the same crops.

MFU = 6 x parameters x tokens/s / peak FLOP/s: the usual training estimate (2 FLOPs per parameter per token
forward, 4 backward), counting the embedding parameters and leaving out attention's T^2 term, as the
brief for this benchmark asks. The dense bf16 peak comes from PEAK_BF16_TFLOPS for the GPUs listed there
(datasheet figures), or from --peak_tflops; for any other GPU MFU is not reported (no guessed hardware numbers).
Peak memory per arm: its own weights and optimizer state plus the largest transient allocation of its steps.

    python benchmarks/bench_gpu.py                      # A100 / H100 / H200 / L4 / RTX 4090: peak known
    python benchmarks/bench_gpu.py --peak_tflops <dense bf16 TFLOP/s of the GPU>
    python benchmarks/bench_gpu.py --quick --device cpu      # checks that it runs, on any machine (numbers meaningless)
"""
import argparse
import copy
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
from accelerate.utils import send_to_device  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler  # noqa: E402
from transformers import AutoConfig, BertConfig, BertForSequenceClassification  # noqa: E402

from train_resnet import train_transform  # noqa: E402
from utils.image_augment import add_augment_args, resolve_augment_args  # noqa: E402
from utils.demo_data import write_photo_imagefolder  # noqa: E402
from utils.image_device_decode import collate_for, decode_on_device, EncodedImageFolder  # noqa: E402
from utils.image_data import IMAGENET_STD, RGBImageFolder  # noqa: E402

SEED = 42
# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from NVIDIA's datasheets; matched against
# torch.cuda.get_device_name(), most specific first. A100: "A100 Tensor Core GPU" datasheet, BF16 312 (SXM and
# PCIe alike). H100: "H100 Tensor Core GPU" datasheet, BF16 1,979 (SXM) / 1,513 (PCIe) / 1,671 (NVL) *with
# sparsity*, so dense 989 / 756 / 835. H200: "H200 Tensor Core GPU" datasheet, 1,979 with sparsity (SXM) and
# 1,671 (NVL): dense 989 / 835. L4: datasheet BF16 242 with sparsity: dense 121. RTX 4090: Ada Lovelace
# architecture whitepaper, "Peak BF16 Tensor TFLOPS with FP32 Accumulate" 165.2 (330.4 with sparsity), as
# third-party copies of its table give it (they agree).
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
    ("H200 NVL", 835.0), ("H200", 989.0),
    ("A100", 312.0), ("L4", 121.0), ("RTX 4090", 165.2),
]


def datasheet_peak_tflops(device_name):
    """Dense bf16 peak TFLOP/s of a GPU named like torch.cuda.get_device_name(), or None if not in the table."""
    # whole words: "L4" must not match an L40S
    return next((peak for key, peak in PEAK_BF16_TFLOPS if re.search(rf"\b{re.escape(key)}\b", device_name)), None)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mfu(parameters, samples_per_second, tokens_per_sample, peak_tflops):
    """Model FLOPs utilisation as the module docstring defines it; None without a known peak."""
    if not peak_tflops:
        return None
    return 6 * parameters * samples_per_second * tokens_per_sample / (peak_tflops * 1e12)


class Workload:
    """One model + optimizer, eager or compiled, stepping on a fixed synthetic batch under bf16 autocast."""

    def __init__(self, model, optimizer, batch, loss_fn, compiled, batch_size, backend="inductor"):
        self.model, self.optimizer, self.batch, self.loss_fn = model, optimizer, batch, loss_fn
        # dynamic=False: each workload keeps the static shapes it was built for. Without it, a second workload of the
        # same model class with another shape (batch 32 after 64, seq 512 after 128) makes dynamo recompile the
        # shared forward with dynamic shapes, and that arm would time other kernels than a lone run of it.
        self.forward = torch.compile(model, backend=backend, dynamic=False) if compiled else model
        self.device, self.batch_size, self.compile_seconds = next(model.parameters()).device, batch_size, None

    def step(self, batch=None):
        """One training step on the synthetic batch, or on `batch` (a loader's) when given."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.loss_fn(self.forward, self.batch if batch is None else batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def warm_up(self, steps):
        """First steps: compilation (if any) and allocator warm-up; their time is reported, not counted."""
        self.compile_seconds = timed(self.device, steps, 0, self.step)()[0]

    def resident_bytes(self):
        """Weights and optimizer state: what this arm holds between steps."""
        tensors = [*self.model.parameters(), *self.model.buffers(),
                   *(t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t))]
        return sum(t.numel() * t.element_size() for t in tensors if t.device == self.device)


def timed(device, steps, units, step, before=lambda: None, memory_of=None):
    """An arm for harness.run_rounds: before(), then `steps` calls of step() timed between device syncs. With
    `memory_of` (a Workload) on CUDA, also its peak memory: its resident bytes plus the largest allocation the steps
    added (the other arms' weights stay resident: only what this arm adds counts)."""
    def run():
        before()
        synchronize(device)
        memory = memory_of is not None and device.type == "cuda"
        if memory:
            allocated_before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        seconds, extra = time.perf_counter() - start, {}
        if memory:
            transient = torch.cuda.max_memory_allocated(device) - allocated_before
            extra["peak_memory_gib"] = (memory_of.resident_bytes() + transient) / 2**30
        return seconds, steps * units, extra
    return run


def resnet50_workloads(device, batch, image_size, modes, backend="inductor"):
    """{compile mode: ResNet-50 Workload} on one synthetic channels_last batch; the same initial weights in each."""
    torch.manual_seed(SEED)
    base = torchvision.models.resnet50().to(memory_format=torch.channels_last)
    images = torch.randn(batch, 3, image_size, image_size, device=device).contiguous(memory_format=torch.channels_last)
    data = images, torch.randint(0, 1000, (batch,), device=device)

    def workload(compiled):
        model = copy.deepcopy(base).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        return Workload(model, optimizer, data, lambda forward, d: F.cross_entropy(forward(d[0]), d[1]), compiled,
                        batch, backend)
    return {mode: workload(mode == "on") for mode in modes}


def bert_config(config_dir, labels=10):
    """The BERT shape: config_dir's config.json (bert-base-chinese's), or transformers' default BertConfig without
    one."""
    config_dir = Path(config_dir)
    if (config_dir / "config.json").is_file():
        return AutoConfig.from_pretrained(config_dir, num_labels=labels)
    return BertConfig(num_labels=labels)


def bert_workloads(config, device, batch, seq, modes, backend="inductor"):
    """({compile mode: BERT Workload}, parameters): a randomly initialised classifier of `config` on one synthetic
    batch of `batch` x `seq` tokens, none of them padding; the same initial weights in each."""
    torch.manual_seed(SEED)
    base = BertForSequenceClassification(config)
    # token ids from 1000 on: bert-base-chinese's first thousand are special and unused tokens (a tiny test vocabulary
    # has fewer: its upper half)
    first_id = min(1000, config.vocab_size // 2)
    data = {"input_ids": torch.randint(first_id, config.vocab_size, (batch, seq), device=device),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device),
            "labels": torch.randint(0, config.num_labels, (batch,), device=device)}

    def workload(compiled):
        model = copy.deepcopy(base).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5, fused=device.type in ("cuda", "cpu"))
        return Workload(model, optimizer, data, lambda forward, d: forward(**d).loss, compiled, batch, backend)
    return {mode: workload(mode == "on") for mode in modes}, sum(p.numel() for p in base.parameters())


def input_arm_names(workers):
    """The input arms' names, in input_arms' order: each loader alone, then feeding the step."""
    loaders = (f"CPU loader ({workers} workers)", "device decode")
    return [arm for name in loaders for arm in (f"resnet50 input alone: {name}", f"resnet50 step fed by {name}")]


def input_arms(device, workload, root, image_size, batch_size, workers, quick=False):
    """ResNet-50's input on the JPEGs of the ImageFolder `root` (utils/demo_data.py write_photo_imagefolder): the CPU
    loader (decode and augment in `workers` workers) and --decode_on_device (the workers read the bytes; decode and
    augment on `device`), each alone (images/s delivered on the device) and feeding `workload`'s steps; and how far
    apart the two paths' images are for the same crops (levels of 255, over the first 64 images)."""
    augment = argparse.ArgumentParser()
    add_augment_args(augment)
    augment = augment.parse_args(["--image_size", str(image_size)])
    resolve_augment_args(augment)  # train_resnet.py's defaults: RandomResizedCrop, flip, normalise
    cpu, encoded = (folder(root, train_transform(augment), image_size, SEED)
                    for folder in (RGBImageFolder, EncodedImageFolder))
    first = range(min(64, len(cpu)))
    expected = torch.stack([cpu[i][0] for i in first])
    got = encoded.collate([encoded[i] for i in first]).decode(device)[0].cpu()
    levels = (got - expected).abs() * torch.tensor(IMAGENET_STD)[:, None, None] * 255  # undo the normalisation
    agreement = {"images": len(first), "mean_abs_levels": levels.mean().item(), "max_abs_levels": levels.max().item()}
    # 2 rounds of batches per worker: after the drain every worker starts a batch at once, so whole rounds time them
    steps = 1 if quick else 2 * max(1, workers)
    arms, names = {}, iter(input_arm_names(workers))
    for dataset in (cpu, encoded):
        loader = DataLoader(dataset, batch_size, collate_fn=collate_for(dataset), num_workers=workers,
                            pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                            sampler=RandomSampler(dataset, num_samples=1 << 30))  # one endless epoch
        # as accelerate moves them, then as the training loop takes them (decode_on_device)
        batches = decode_on_device((send_to_device(batch, device, non_blocking=True) for batch in loader), device)
        for arm, consume in ((next(names), lambda batch: None),
                             (next(names), lambda batch: workload.step((batch[0].contiguous(
                                 memory_format=torch.channels_last), batch[1])))):
            arms[arm] = timed(device, steps, batch_size, lambda c=consume, b=batches: c(next(b)),
                              # prefetched while other arms ran (prefetch_factor 2 per worker): not a rate
                              before=lambda b=batches: [next(b) for _ in range(2 * workers)])
    return arms, agreement


def main():
    parser = harness.base_parser(__doc__)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a syntax check")
    parser.add_argument("--torch_compile", choices=["off", "on", "both"], default="both")
    parser.add_argument("--peak_tflops", type=float, default=None, help="dense bf16 peak of the device, for MFU")
    parser.add_argument("--resnet_batch", type=int, default=256)
    parser.add_argument("--resnet_image_size", type=int, default=224)
    parser.add_argument("--bert_batch", type=int, default=64)
    parser.add_argument("--bert_seq_len", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per model arm per round (default 20, quick 1); input arms: 2 per worker")
    parser.add_argument("--input_images", type=int, default=1024, help="JPEGs in the input arms' fixture (quick 8)")
    parser.add_argument("--loader_workers", type=int, default=len(os.sched_getaffinity(0)) - 1,
                        help="DataLoader workers of the input arms (default: every core but the training process's)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --device cpu --quick to check the script")
    if device.type == "cpu":
        harness.set_threads(args.threads)
    if args.quick:
        args.resnet_batch, args.resnet_image_size = min(args.resnet_batch, 2), min(args.resnet_image_size, 64)
        args.bert_batch, args.bert_seq_len = min(args.bert_batch, 2), [min(seq, 32) for seq in args.bert_seq_len[:1]]
        args.input_images, args.loader_workers = min(args.input_images, 8), 0
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        args.peak_tflops = args.peak_tflops or datasheet_peak_tflops(torch.cuda.get_device_name(device))
    started = harness.provenance()
    rounds = args.rounds or (1 if args.quick else 5)
    steps = args.steps or (1 if args.quick else 20)
    modes = ["off", "on"] if args.torch_compile == "both" else [args.torch_compile]

    resnet = {f"resnet50 bf16 channels_last, compile {mode}": w
              for mode, w in resnet50_workloads(device, args.resnet_batch, args.resnet_image_size, modes).items()}
    config = bert_config(args.data_root / "bert-base-chinese")
    if args.quick and device.type == "cpu":
        config.update({"num_hidden_layers": 2})  # a syntax check, not a measurement
    bert_layers, berts = config.num_hidden_layers, {}
    for seq in args.bert_seq_len:
        by_mode, bert_parameters = bert_workloads(config, device, args.bert_batch, seq, modes)
        berts[seq] = {f"bert-base seq{seq} bf16, compile {mode}": w for mode, w in by_mode.items()}
    workloads = {**resnet, **{name: w for group in berts.values() for name, w in group.items()}}
    for name, workload in workloads.items():
        workload.warm_up(2 if args.quick else 5)
        print(f"  warm-up {name}: {workload.compile_seconds:.1f} s")
    model_step = list(resnet)[-1]  # compiled where it is: the step the input has to keep up with (goal: 0.9x)
    fixture = tempfile.TemporaryDirectory(prefix="bench_gpu_jpegs_")
    jpegs = write_photo_imagefolder(fixture.name, args.input_images, longer_side=64 if args.quick else 500) / "train"
    inputs, agreement = input_arms(device, resnet[model_step], jpegs, args.resnet_image_size, args.resnet_batch,
                                   args.loader_workers, args.quick)
    samples = harness.run_rounds({**{name: timed(device, steps, w.batch_size, w.step, memory_of=w)
                                    for name, w in workloads.items()}, **inputs}, rounds)

    rows, summary = [], {}
    groups = [(resnet, None), *((group, seq) for seq, group in berts.items())]
    for group, tokens_per_sample in groups:
        stats = harness.summarize({name: samples[name] for name in group}, next(iter(group)))
        for name, s in stats.items():
            utilisation = (mfu(bert_parameters, s["median_rate"], tokens_per_sample, args.peak_tflops)
                           if tokens_per_sample else None)
            peak = max((r.get("peak_memory_gib", 0) for r in samples[name]), default=0) or None
            s.update(mfu=utilisation, warm_up_seconds=workloads[name].compile_seconds, peak_memory_gib=peak)
            summary[name] = s
            rows.append([name, s["median_rate"], s["ratio_to_baseline"],
                         f"{utilisation:.1%}" if utilisation is not None else "",
                         peak, workloads[name].compile_seconds])
    table = harness.format_table(["arm", "images or samples/s (median)", "vs compile off", "MFU",
                                 "peak memory GiB", "warm-up s (incl. compile)"], rows)
    input_stats = harness.summarize({model_step: samples[model_step], **{n: samples[n] for n in inputs}}, model_step)
    summary.update({name: input_stats[name] for name in inputs})
    table += "\n\n" + harness.format_table(
        ["input arm (ImageNet-sized JPEGs)", "images/s (median)", f"vs {model_step}"],
        [[name, input_stats[name]["median_rate"], input_stats[name]["ratio_to_baseline"]] for name in inputs])
    table += (f"\ndevice decode vs CPU loader, same crops: mean |difference| {agreement['mean_abs_levels']:.3f}, "
              f"max {agreement['max_abs_levels']:.0f} levels of 255 over {agreement['images']} images")
    print(table)
    if args.peak_tflops is None:
        print("MFU not computed: no dense bf16 peak known for this device (PEAK_BF16_TFLOPS); pass --peak_tflops")
    harness.write_results("bench_gpu", {
        "provenance": started, "device": str(device),
        "setup": {**vars(args), "steps": steps, "rounds": rounds, "bert_layers": bert_layers,
                  "bert_parameters": bert_parameters},
        "model_step_arm": model_step, "input_arms": list(inputs), "input_agreement": agreement,
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else harness.cpuinfo_field("model name")),
        "arms": summary, "rounds_raw": samples, "table": table}, args.output)


if __name__ == "__main__":
    main()
