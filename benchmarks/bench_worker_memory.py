"""How much a DataLoader worker grows over one epoch from reading the image sample list: torchvision's ImageFolder
(a list of (path, class) tuples) beside ours (utils/image_data.py RGBImageFolder: numpy arrays).

A forked worker shares the main process's pages until it writes one; reading a Python object writes its reference
count, so a worker that reads every tuple of the list copies the pages they sit on. The dataset here reads each
sample's entry (path and class) and returns its class, without opening the file: what is measured is the list's
cost alone, not decoding's. The worker's USS and PSS (/proc/<pid>/smaps_rollup) are read after its first batch and
after the epoch; the growth is their difference. Images: imagenette_112/train hard-linked --copies times. Usage:
    python benchmarks/bench_worker_memory.py --data_root ../shared/data --copies 10     # 94,690 files
    python benchmarks/bench_worker_memory.py --data_root ../shared/data --quick          # 1 copy
"""
import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402,F401  (puts the repo root on sys.path)
from bench_startup import hard_linked_copies  # noqa: E402

from utils.image_data import RGBImageFolder  # noqa: E402

BATCH = 256


class EntryOnly(torch.utils.data.Dataset):
    """Reads sample `index`'s (path, class) from `folder.samples` and returns the class."""

    def __init__(self, folder):
        self.samples = folder.samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, target = self.samples[index]
        return target + 0 * len(path)


def uss_pss_kib(pid):
    """(USS, PSS) of process `pid` in KiB: its private pages, and its proportional share of all its pages."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":")
        fields[name] = int(value.split()[0])
    return fields["Private_Clean"] + fields["Private_Dirty"], fields["Pss"]


def worker_growth(folder):
    """(USS, PSS) growth in KiB of the one worker over an epoch of `folder`'s sample list."""
    loader = DataLoader(EntryOnly(folder), batch_size=BATCH, num_workers=1, persistent_workers=True)
    batches = iter(loader)
    next(batches)
    [worker] = batches._workers
    before = uss_pss_kib(worker.pid)
    for _ in batches:
        pass
    after = uss_pss_kib(worker.pid)
    return after[0] - before[0], after[1] - before[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_root", type=Path, default=Path("../shared/data"))
    parser.add_argument("--copies", type=int, default=10, help="hard links per imagenette_112/train image")
    parser.add_argument("--quick", action="store_true", help="1 copy")
    args = parser.parse_args(argv)
    copies = 1 if args.quick else args.copies
    with tempfile.TemporaryDirectory() as work:
        root = hard_linked_copies(args.data_root / "imagenette_112" / "train", copies, Path(work) / "train")
        arms = {"torchvision ImageFolder": ImageFolder(str(root)), "ours (RGBImageFolder)": RGBImageFolder(root, None, 8)}
        print("| sample list | images | worker USS growth | PSS growth | per image (USS) |")
        print("|---|---|---|---|---|")
        for name, folder in arms.items():
            uss, pss = worker_growth(folder)
            print(f"| {name} | {len(folder):,} | {uss / 1024:.1f} MiB | {pss / 1024:.1f} MiB | "
                  f"{uss * 1024 / len(folder):.0f} B |")


if __name__ == "__main__":
    main()
