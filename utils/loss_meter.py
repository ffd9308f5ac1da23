"""Training loss as a mean over samples, read (and synchronised) only when logging.

Keeps per-rank sums as tensors so the hot loop never calls `.item()` (a device sync).
"""
import torch


class LossMeter:
    def __init__(self, device):
        self.device = device
        self.nonfinite = torch.zeros((), device=device)  # non-finite losses since the start, never reset
        self.reset()

    def reset(self):
        self.loss_sum = torch.zeros((), device=self.device)
        self.samples = torch.zeros((), device=self.device)

    def update(self, loss, num_samples):
        """`loss` is the mean over `num_samples` local samples."""
        loss = loss.detach().float()
        self.loss_sum += loss * num_samples
        self.samples += num_samples
        self.nonfinite += (~torch.isfinite(loss)).float()

    def mean(self, accelerator):
        """Mean loss per sample over all ranks since the last call; a collective, so call it on every rank."""
        totals = accelerator.reduce(torch.stack([self.loss_sum, self.samples]), reduction="sum")
        self.reset()
        return (totals[0] / totals[1].clamp(min=1)).item()

    def diverged(self, accelerator):
        """True on every rank if any rank has seen a NaN/inf loss; a collective."""
        return accelerator.reduce(self.nonfinite.clone(), reduction="sum").item() > 0


def parameters_finite(accelerator, model):
    """True on every rank if every weight is finite; checked before a checkpoint is written. A collective."""
    bad = sum(int(not torch.isfinite(p).all()) for p in model.parameters())
    return accelerator.reduce(torch.tensor(float(bad), device=accelerator.device), reduction="sum").item() == 0
