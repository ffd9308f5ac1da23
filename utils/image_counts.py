"""What the ResNet script counts of its training images between two log lines: top-1/top-5 hits over the readable
ones, and the unreadable ones (utils/image_data.py marks them with a target `-1 - index`).

The counts stay on the device (no `.item()` per step, which is a device sync) until a log line reads them; an
unreadable image stops the run with one line naming the file, or, with --skip_bad_images, is reported once and
counted. Reading and checking are collectives: every rank calls them at the same points.
"""
import torch

from .errors import UserError
from .image_data import describe_bad_image


def bad_image_error(dataset, target):
    """The one-line error for the unreadable image whose placeholder target is `target` (< 0)."""
    path = dataset.bad_image_path(target)
    return UserError(f"{path}: unreadable image ({describe_bad_image(path)}); "
                     "replace or remove it, or pass --skip_bad_images")


class ImageCounts:
    def __init__(self, accelerator, dataset, skip_bad_images):
        self.accelerator, self.dataset, self.skip_bad_images = accelerator, dataset, skip_bad_images
        self.window = torch.zeros(4, dtype=torch.long, device=accelerator.device)  # readable, top-1, top-5, skipped
        self.lowest_target = torch.zeros((), dtype=torch.long, device=accelerator.device)  # < 0: an unreadable one
        self.reported, self.skipped_total = set(), 0

    def add(self, logits, targets):
        """Count one batch, logits (B, C) and targets (B,); returns how many of its images were readable."""
        readable = targets >= 0
        hits = logits.detach().topk(min(5, logits.shape[1]), dim=1).indices.eq(targets[:, None])  # (B, 5)
        self.window += torch.stack([readable.sum(), hits[:, 0].sum(), hits.any(dim=1).sum(), (~readable).sum()])
        self.lowest_target = torch.minimum(self.lowest_target, targets.min())
        return readable.sum()

    def read(self):
        """Top-1/top-5 accuracy (%) over the window's readable images on all ranks, and the images skipped; then
        start a new window. A collective."""
        readable, top1, top5, skipped = self.accelerator.reduce(self.window, reduction="sum").tolist()
        self.window.zero_()
        self.skipped_total += skipped
        n = max(1, readable)
        return {"acc1": 100.0 * top1 / n, "acc5": 100.0 * top5 / n, "skipped_images": skipped}

    def check_unreadable(self):
        """Stop on the first unreadable image any rank has seen, or without stopping report each one once. A
        collective."""
        lowest = self.accelerator.gather(self.lowest_target.view(1)).min().item()
        if lowest < 0 and not self.skip_bad_images:
            raise bad_image_error(self.dataset, lowest)
        if lowest < 0 and lowest not in self.reported:
            self.reported.add(lowest)
            self.accelerator.print(f"warning: skipping unreadable image {self.dataset.bad_image_path(lowest)}")
