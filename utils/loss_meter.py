"""Training loss as a mean over samples, read (and synchronised) only when logging; and the check that stops a run
whose loss became NaN/inf before anything is saved from it.

Keeps per-rank sums as tensors so the hot loop never calls `.item()` (a device sync).
"""
import torch

from .checkpoint import resolve_resume
from .errors import UserError


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


class HealthCheck:
    """Stops the run with one line, on every rank, once the loss became NaN/inf; before a save (`weights=True`)
    the weights are checked too, since the logged loss lags them by a step. `also`: further checks of the same
    kind (the ResNet script's unreadable images). Collectives: every rank calls `check` at the same points."""

    def __init__(self, accelerator, meter, model, checkpoint_dir, lr_flag, also=()):
        self.accelerator, self.meter, self.model = accelerator, meter, model
        self.checkpoint_dir, self.lr_flag, self.also = checkpoint_dir, lr_flag, also

    def check(self, completed_steps, weights=False):
        if self.meter.diverged(self.accelerator) or (weights and not parameters_finite(self.accelerator, self.model)):
            raise UserError(f"loss became NaN/inf by step {completed_steps}; stopped before saving anything from it. "
                            f"Last good checkpoint: {resolve_resume('latest', self.checkpoint_dir)}. Try a lower "
                            f"{self.lr_flag} or bf16 instead of fp16.")
        for check in self.also:
            check()
