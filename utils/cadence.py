"""When a training run logs, validates and saves a resumable checkpoint, counted in optimizer steps.

Both scripts keep the same cadence; after each optimizer step the loop asks `cadence.after_step(...)` and acts:
- a log line every `log_every` steps and at each epoch's end, so that no log window spans two epochs;
- validation every `eval_every` steps, or, without it, at each epoch's end; always after the run's last step;
- a resumable checkpoint every `checkpoint_every` steps, or, without it, at each epoch's end but the run's last
  (a finished run needs none: its results and exports are written).
An epoch ends at its last batch, or at the run's last step (--max_train_steps may stop inside an epoch).
"""
import math
from dataclasses import dataclass
from typing import NamedTuple


class Due(NamedTuple):
    """What the loop does after one optimizer step."""
    log: bool
    evaluate: bool
    checkpoint: bool
    finished: bool  # the run's last step: nothing follows


@dataclass(frozen=True)
class Cadence:
    total_steps: int  # optimizer steps of the whole run
    steps_per_epoch: int  # optimizer steps per epoch (the last one's accumulation window may be short)
    batches_per_epoch: int  # loader batches per epoch
    log_every: int  # optimizer steps between log lines
    eval_every: int | None = None  # optimizer steps between validations; None: at each epoch's end
    checkpoint_every: int | None = None  # optimizer steps between checkpoints; None: at each epoch's end

    @property
    def epochs(self):
        """Epochs the loop starts, the last one perhaps cut short by total_steps."""
        return math.ceil(self.total_steps / self.steps_per_epoch)

    def finished(self, completed_steps):
        return completed_steps >= self.total_steps

    def after_step(self, completed_steps, batches_in_epoch):
        """What is due once optimizer step `completed_steps` (1-based, counted from the run's start) has been taken
        on the epoch's batch `batches_in_epoch` (1-based)."""
        finished = self.finished(completed_steps)
        epoch_end = batches_in_epoch == self.batches_per_epoch or finished
        return Due(log=completed_steps % self.log_every == 0 or epoch_end,
                   evaluate=finished or (completed_steps % self.eval_every == 0 if self.eval_every else epoch_end),
                   checkpoint=(completed_steps % self.checkpoint_every == 0 if self.checkpoint_every
                               else epoch_end and not finished),
                   finished=finished)
