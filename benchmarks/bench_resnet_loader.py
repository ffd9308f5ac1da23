"""ResNet input pipeline: how fast the loader makes images vs how fast ResNet-18 trains on them.

Arms, interleaved round by round, on DATA_ROOT/imagenette_112/train (112x112 JPEGs, 242 of them grayscale):
  loader, project     train_resnet.py's loader: utils.image_data RGBImageFolder (torchvision.io.decode_image on the
                      file bytes, v2 RandomResizedCrop + flip + normalise on uint8 tensors, per-sample seeded
                      augmentation), batch 32, workers 0
  loader, main.py     imagenet/main.py's loader: ImageFolder + PIL + transforms.RandomResizedCrop, RandomHorizontalFlip,
                      ToTensor, Normalize, batch 32, workers 0
  model               ResNet-18 training steps (SGD momentum 0.9, batch 32) on synthetic input of the same size:
                      the rate the loader has to keep up with
1 torch thread. Workers 0, so each rate is one core's (the worker-count and JPEG-decoder arms were measured once and
removed: RESULTS.md section 4).

    python benchmarks/bench_resnet_loader.py            # ~1 min
    python benchmarks/bench_resnet_loader.py --quick
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
import torchvision  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision import transforms  # noqa: E402

from utils.image_data import IMAGENET_MEAN, IMAGENET_STD, build_datasets  # noqa: E402

BATCH_SIZE = 32
PROJECT, MAIN_PY = "loader project, workers 0", "loader main.py (PIL), workers 0"


def loader_arm(dataset, batches):
    loader = common.forever(DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True,
                                     generator=torch.Generator().manual_seed(common.SEED)))
    next(loader)  # warm-up: file cache and first-call costs stay out of round 1
    return common.timed(lambda: len(next(loader)[1]), batches)


def model_arm(image_size, steps):
    torch.manual_seed(common.SEED)
    model = torchvision.models.resnet18(num_classes=10).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    batch = torch.randn(BATCH_SIZE, 3, image_size, image_size), torch.randint(0, 10, (BATCH_SIZE,))
    common.train_step(model, optimizer, batch)  # warm-up
    return common.timed(lambda: common.train_step(model, optimizer, batch), steps)


def main(argv=None):
    parser = common.base_parser(__doc__)
    parser.add_argument("--image_size", type=int, default=112, help="pixels: training crop and model input")
    args = parser.parse_args(argv)
    common.require_data(args.data_root, "imagenette_112/train")
    common.set_threads(args.threads)
    started = common.provenance()
    rounds = args.rounds or (1 if args.quick else 5)
    loader_batches, model_steps = (3, 1) if args.quick else (20, 2)

    root = args.data_root / "imagenette_112"
    project_train, _ = build_datasets(root, args.image_size, args.image_size, common.SEED)
    main_py_train = torchvision.datasets.ImageFolder(str(root / "train"), transforms.Compose([
        transforms.RandomResizedCrop(args.image_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]))
    model_name = f"model resnet18 training {args.image_size}px"
    arms = {PROJECT: loader_arm(project_train, loader_batches), MAIN_PY: loader_arm(main_py_train, loader_batches),
            model_name: model_arm(args.image_size, model_steps)}
    samples = common.run_rounds(arms, rounds)
    loaders = common.summarize(samples, model_name)
    rows = [[name, s["median_rate"], f"{s['min_rate']:.0f}-{s['max_rate']:.0f}", s["ratio_to_baseline"],
             s["median_cpu_rate"], s["cpu_ratio_to_baseline"], s["cpu_share"]] for name, s in loaders.items()]
    loader_table = common.format_table(["arm", "images/s (median)", "range", "x model consumption",
                                        "images per CPU-second", "x model, CPU time", "CPU share"], rows)
    print(f"\nLoader vs model at {args.image_size}px, batch {BATCH_SIZE}, 1 thread")
    print(loader_table)
    vs_main_py = common.summarize({k: samples[k] for k in (PROJECT, MAIN_PY)}, MAIN_PY)[PROJECT]
    print(f"project loader / main.py loader: {vs_main_py['ratio_to_baseline']:.2f}x wall-clock, "
          f"{vs_main_py['cpu_ratio_to_baseline']:.2f}x CPU time")
    model_rate, project_rate = loaders[model_name]["median_rate"], loaders[PROJECT]["median_rate"]
    verdict = (f"one loader core makes {project_rate:,.0f} images/s, {project_rate / model_rate:.1f}x what one core of "
               f"ResNet-18 training consumes ({model_rate:,.1f} images/s): the loader is "
               + ("not the bottleneck on CPU" if project_rate > model_rate else "THE BOTTLENECK"))
    print(verdict)
    setup = {"image_size": args.image_size, "batch_size": BATCH_SIZE, "rounds": rounds,
             "train_images": len(project_train.samples), "loader_batches_per_round": loader_batches,
             "model_steps_per_round": model_steps}
    common.write_results("bench_resnet_loader", {
        "provenance": started, "setup": setup, "loaders": loaders, "project_vs_main_py_workers0": vs_main_py,
        "rounds_raw": samples, "loader_table": loader_table, "verdict": verdict}, args.output)


if __name__ == "__main__":
    common.run_cli(main, sys.argv[1:])
