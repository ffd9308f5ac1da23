"""ResNet input pipeline: how fast the loader makes images vs how fast ResNet-18 trains on them.

Arms, interleaved round by round, on DATA_ROOT/imagenette_112/train (112x112 JPEGs, 242 of them grayscale):
  loader, project     train_resnet.py's loader: utils.image_data RGBImageFolder (torchvision.io.decode_image on the
                      file bytes, v2 RandomResizedCrop + flip + normalise on uint8 tensors, per-sample seeded
                      augmentation), batch 32, workers 0 / 1 / 2
  loader, main.py     imagenet/main.py's loader: ImageFolder + PIL + transforms.RandomResizedCrop, RandomHorizontalFlip,
                      ToTensor, Normalize, batch 32, workers 0
  model               ResNet-18 training steps (SGD momentum 0.9, batch 32) on synthetic input of the same size:
                      the rate the loader has to keep up with
1 torch thread in the main process (and in each worker, as DataLoader sets it).

    python benchmarks/bench_resnet_loader.py            # ~1.5 min
    python benchmarks/bench_resnet_loader.py --quick
(The PIL vs torchvision JPEG decoder arms were measured once and removed: RESULTS.md section 4.)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision import transforms  # noqa: E402

from utils.image_data import IMAGENET_MEAN, IMAGENET_STD, build_datasets  # noqa: E402

BATCH_SIZE = 32
SEED = 42


def loader_arm(dataset, workers, batches):
    """Images/s of a DataLoader after its start-up (fork, first prefetch), which a persistent epoch amortises."""
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(SEED))
    skip = 2 * workers + 1  # the batches workers prefetch at start (prefetch_factor 2) are not steady-state rate
    for _, _ in zip(range(skip), loader):  # warm-up: file cache and first-call costs stay out of round 1
        pass

    def run():
        iterator = iter(loader)
        for _ in range(skip):
            next(iterator)
        with common.Timer() as timer:
            for _ in range(batches):
                next(iterator)
        del iterator  # shuts the workers down before the next arm runs
        return timer.wall, batches * BATCH_SIZE, {"cpu_seconds": timer.cpu}
    return run


def model_arm(image_size, steps):
    torch.manual_seed(SEED)
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    inputs, targets = torch.randn(BATCH_SIZE, 3, image_size, image_size), torch.randint(0, 10, (BATCH_SIZE,))
    model.train()

    def step():
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up

    return common.timed(step, steps, BATCH_SIZE)


def main(argv=None):
    parser = common.base_parser(__doc__)
    parser.add_argument("--image_size", type=int, default=112, help="pixels: training crop and model input")
    args = parser.parse_args(argv)
    common.require_data(args.data_root, "imagenette_112/train")
    common.set_threads(args.threads)
    started = common.provenance()
    rounds = args.rounds or (1 if args.quick else 5)
    loader_batches = 3 if args.quick else 20
    model_steps = 1 if args.quick else 2

    root = args.data_root / "imagenette_112"
    project_train, _ = build_datasets(root, args.image_size, args.image_size, SEED)
    main_py_train = torchvision.datasets.ImageFolder(str(root / "train"), transforms.Compose([
        transforms.RandomResizedCrop(args.image_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]))

    arms = {
        "loader project, workers 0": loader_arm(project_train, 0, loader_batches),
        "loader project, workers 1": loader_arm(project_train, 1, loader_batches),
        "loader project, workers 2": loader_arm(project_train, 2, loader_batches),
        "loader main.py (PIL), workers 0": loader_arm(main_py_train, 0, loader_batches),
        f"model resnet18 training {args.image_size}px": model_arm(args.image_size, model_steps),
    }
    samples = common.run_rounds(arms, rounds)
    model_name = f"model resnet18 training {args.image_size}px"
    loaders = common.summarize(samples, model_name)
    # Per CPU-second only where all the work is in this process (workers 0, the model): worker CPU is not counted.
    rows = [[name, s["median_rate"], f"{s['min_rate']:.0f}-{s['max_rate']:.0f}", s["ratio_to_baseline"],
             s["median_cpu_rate"] if "workers 1" not in name and "workers 2" not in name else None,
             s["cpu_ratio_to_baseline"] if "workers 1" not in name and "workers 2" not in name else None,
             common.cpu_share(samples[name])] for name, s in loaders.items()]
    loader_table = common.format_table(["arm", "images/s (median)", "range", "x model consumption",
                                        "images per CPU-second", "x model, CPU time", "CPU share (main process)"],
                                       rows)
    print(f"\nLoader vs model at {args.image_size}px, batch {BATCH_SIZE}, 1 thread per process")
    print(loader_table)
    pair = {k: samples[k] for k in ("loader project, workers 0", "loader main.py (PIL), workers 0")}
    vs_main_py = common.summarize(pair, "loader main.py (PIL), workers 0")["loader project, workers 0"]
    print(f"project loader / main.py loader, both workers 0: {vs_main_py['ratio_to_baseline']:.2f}x wall-clock, "
          f"{vs_main_py['cpu_ratio_to_baseline']:.2f}x CPU time")

    model_rate = loaders[model_name]["median_rate"]
    w0 = loaders["loader project, workers 0"]["median_rate"]
    verdict = (f"one loader core makes {w0:,.0f} images/s, {w0 / model_rate:.1f}x what one core of ResNet-18 training "
               f"consumes ({model_rate:,.1f} images/s): the loader is "
               + ("not the bottleneck on CPU" if w0 > model_rate else "THE BOTTLENECK"))
    print(verdict)
    common.write_results("bench_resnet_loader", {
        "benchmark": "bench_resnet_loader", "provenance": started,
        "setup": {"image_size": args.image_size, "batch_size": BATCH_SIZE, "rounds": rounds,
                  "loader_batches_per_round": loader_batches, "model_steps_per_round": model_steps,
                  "train_images": len(project_train.samples)},
        "loaders": loaders, "project_vs_main_py_workers0": vs_main_py,
        "rounds_raw": samples, "loader_table": loader_table, "verdict": verdict},
        args.output)


if __name__ == "__main__":
    common.run_cli(main, sys.argv[1:])
