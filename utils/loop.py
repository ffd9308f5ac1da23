"""The training loop's bookkeeping, shared by both scripts: what one optimizer step does besides forward, backward
and `optimizer.step()`.

One optimizer step, as both scripts' `train()` take it:
1. `epoch_batches` gives the epoch's batches (after a resume, those after the checkpoint's position), and
   `Throughput.epoch` iterates them, timing the wait for each batch.
2. Inside `accelerator.accumulate(model)`: for each micro-batch of this process's share (`Attempt.micro_batches`:
   the whole share, unless --auto_find_batch_size split it), forward, the per-sample losses (each times its class's
   weight with --class_weights: `ClassWeights`), and `LossScale` turns them into the loss to backward, so that the
   step's gradient is the mean over exactly the real samples it saw (an epoch's last, short batch and accumulation
   window included), on any number of processes. Then clipping when the gradients are synchronised,
   `optimizer.step()`, `scheduler.step()`, `zero_grad`.
3. `LossMeter.update` adds the batch's loss to per-rank sums on the device (no `.item()`, which is a device sync).
4. Once the gradients were synchronised (the last micro-batch of the window), the step counts: `Throughput.step`
   and `Cadence.after_step` say what is due: a log line (`LossMeter.mean` and `Throughput.read`, after
   `HealthCheck.check` stopped a run whose loss became NaN/inf), a validation, a checkpoint.
5. `PreemptionGuard.should_stop`: a SIGTERM on any rank (Slurm, a cloud preemption) becomes a checkpoint at this step
   on every rank, then a clean stop; Ctrl-C stops at once, with one line per process naming the last checkpoint.
Outside the steps that log, validate or save, a step never waits for the device: no `.item()` or other read of a
device tensor, and no collective of ours on the training group. The decisions every rank must share (the stop above,
the out-of-memory agreement below) travel on utils/runtime.py HostChannel, a gloo group beside the training group
whose all-reduce of a flag stays in host memory; what remains on the training group is DDP's own: its gradient
all-reduce and, for a model whose buffers training changes (ResNet's BatchNorm), its broadcast of rank 0's buffers
in each step's forward pass (utils/runtime.py build_accelerator). tests/test_sync_free_step.py counts what a step does.
After each validation, `Selection` (transformers Trainer's metric_for_best_model, greater_is_better and
EarlyStoppingCallback, with their flags: add_selection_args) says whether the model is the best so far and whether
the run stops early; its counters live in the loop's `state`, which every checkpoint keeps. The metric it may name
is any number the script's `evaluate` returns: `validation_names` learns them before training from one evaluation of
one validation batch (`OneBatch`), which `resolve_selection` checks the flag against.
Every method that reduces over ranks is a collective: every rank calls it at the same points.

Out of device memory (--auto_find_batch_size, `OutOfMemoryRetry`): the run is not over. Every process drops what the
failed attempt built, puts the model, random generators and loss scaler back as they were when training started, and
trains again from the newest checkpoint the failed attempt saved (else from where the launch started), with each
process's share of a batch cut into micro-batches of half the size: twice the accumulation. The loader's batches, the
accumulation windows, the loss of each sample, the schedule and the checkpoints' positions are those of the command
line, so the run trains the same samples in the same steps as with a smaller -b and more accumulation.

Neighbours: utils/checkpoint.py (what a step's checkpoint writes), utils/outputs.py (the log line),
utils/runtime.py (the Accelerator).
"""
import contextlib
import json
import math
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import psutil
import torch
from accelerate.utils import DistributedType, find_batch_size, send_to_device, slice_tensors
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from . import checkpoint, outputs, runtime


class Due(NamedTuple):
    """What the loop does after one optimizer step."""
    log: bool
    evaluate: bool
    checkpoint: bool
    finished: bool  # the run's last step: nothing follows


@dataclass(frozen=True)
class Cadence:
    """When a run logs, validates and saves a resumable checkpoint, counted in optimizer steps; a pure value.

    - a log line every `log_every` steps and at each epoch's end, so that no log window spans two epochs;
    - validation every `eval_every` steps, or, without it, at each epoch's end; always after the run's last step;
    - a resumable checkpoint every `checkpoint_every` steps, or, without it, at each epoch's end but the run's last
      (a finished run needs none: its results and exports are written).
    An epoch ends at its last batch, or at the run's last step (--max_train_steps may stop inside an epoch).
    """
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


class LossScale:
    """A training loss that is the mean over exactly the real samples of each optimizer step, on any number of
    processes.

    Two things accelerate does would otherwise make N processes train differently from 1:
    - an epoch's last, short GLOBAL batch is completed with samples from the epoch's start (`even_batches`), so
      that every process gets a share: on 2 processes 200 samples at a batch of 16 train 208;
    - `backward` divides every micro-batch's loss by the full accumulation count, also in an epoch's last, shorter
      window: a window of 1 batch out of 4 would take a quarter-strength step.
    Here each real sample weighs 1 / (real samples in its optimizer step) and a padded one 0, so the step's
    gradient is the mean over the samples it really saw, as on 1 process. (`even_batches=False` instead would leave
    a process without a last batch: the others would wait for its gradients in the all-reduce.)
    """

    def __init__(self, accelerator, dataset_size, global_batch_size, accumulation_steps, drop_last=False):
        self.accelerator = accelerator
        self.global_batch = global_batch_size
        self.accumulation = accumulation_steps
        full, rest = divmod(dataset_size, global_batch_size)
        self.batches_per_epoch = full if drop_last or rest == 0 else full + 1
        self.last_batch_real = global_batch_size if drop_last or rest == 0 else rest

    def real_in_batch(self, index):
        """Real samples in the epoch's batch `index` (0-based), over all processes."""
        return self.last_batch_real if index == self.batches_per_epoch - 1 else self.global_batch

    def window_real(self, index):
        """Real samples in the optimizer step that batch `index` belongs to (windows restart every epoch)."""
        start = index - index % self.accumulation
        end = min(start + self.accumulation, self.batches_per_epoch)
        return sum(self.real_in_batch(i) for i in range(start, end))

    def local_real(self, index, local_batch_size, offset=0):
        """How many of `local_batch_size` samples from position `offset` of this process's share of batch `index` are
        real: its share is the global positions [rank * b, rank * b + b) and the padding comes after the real
        samples."""
        share = self.global_batch // self.accelerator.num_processes
        first = self.accelerator.process_index * share + offset
        return max(0, min(local_batch_size, self.real_in_batch(index) - first))

    def loss(self, per_sample_losses, index, offset=0):
        """(loss to backward, mean over this process's real samples, their count) for batch `index`, or for its
        micro-batch starting at position `offset` of this process's share.

        DDP averages the gradient over the P processes and accelerate divides by the accumulation count N, so
        the sum of the real losses is scaled by P * N / (real samples in the step)."""
        real = self.local_real(index, per_sample_losses.shape[0], offset)
        mask = torch.arange(per_sample_losses.shape[0], device=per_sample_losses.device) < real
        total = (per_sample_losses * mask).sum()
        scale = self.accelerator.num_processes * self.accumulation / self.window_real(index)
        return total * scale, total.detach() / max(real, 1), real

    def window_batches(self, index):
        """Loader batches in the optimizer step that batch `index` belongs to: N, or fewer at an epoch's end."""
        start = index - index % self.accumulation
        return min(start + self.accumulation, self.batches_per_epoch) - start

    def window_scale(self, index):
        """For a loss that is already a mean over full batches (drop_last): N / (batches in this window)."""
        return self.accumulation / self.window_batches(index)


CLASS_WEIGHTS_HELP = ("single-label cross-entropy weighted per class: 'balanced' (n_samples / (n_classes * count) of "
                      "the training labels, scikit-learn's) or a JSON file {label: weight}")


@dataclass(frozen=True)
class ClassWeights:
    """--class_weights: one weight per class, multiplying the cross-entropy of the samples of that class. The loss
    of a step stays the mean over its samples (LossScale), so a step's loss is sum(w_i * l_i) / N: no collective, the
    same on any number of processes."""
    by_label: dict  # {label: weight}, in class-id order
    source: str  # "balanced" or the JSON file

    def tensor(self, device):
        return torch.tensor(list(self.by_label.values()), dtype=torch.float32, device=device)  # (C,)

    def line(self):
        """What the run prints once at start."""
        return f"--class_weights {self.source}: " + ", ".join(f"{k} {v:.4g}" for k, v in self.by_label.items())


def load_class_weights(spec, labels, train_targets):
    """None without --class_weights. `balanced`: scikit-learn's compute_class_weight("balanced") over the classes
    the training targets (class ids) hold; a class no training sample has gets 0, which changes nothing (no
    sample's loss is multiplied by it) but label smoothing's share. Otherwise a JSON file mapping every label to a
    weight >= 0."""
    if spec is None:
        return None
    if spec == "balanced" and train_targets is None:
        raise runtime.UserError("--class_weights balanced counts the training labels, and this data has none "
                                "(--dummy): pass a JSON file {label: weight}")
    if spec == "balanced":
        from sklearn.utils.class_weight import compute_class_weight

        targets = np.asarray(train_targets)
        present = np.unique(targets)
        weights = np.zeros(len(labels))
        weights[present] = compute_class_weight("balanced", classes=present, y=targets)
        return ClassWeights(dict(zip(labels, weights.tolist())), "balanced")
    return ClassWeights(read_class_weights_file(spec, labels), str(spec))


def read_class_weights_file(path, labels):
    """{label: weight} in the order of `labels` from a JSON object naming each label once."""
    path = Path(path)
    if not path.is_file():
        raise runtime.UserError(f"--class_weights {path}: no such file (or pass 'balanced')")
    try:
        weights = json.loads(path.read_text(encoding="utf-8-sig"))  # with or without a BOM, as every input
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise runtime.UserError(f"{path}: not a JSON file ({err})") from None
    if not isinstance(weights, dict):
        raise runtime.UserError(f"{path}: expected a JSON object {{label: weight}}")
    problems = []
    unknown = [str(label) for label in weights if label not in labels]
    missing = [label for label in labels if label not in weights]
    if unknown:
        problems.append(f"unknown label(s) {', '.join(unknown[:5])}")
    if missing:
        problems.append(f"no weight for {', '.join(missing[:5])}")
    if problems:
        shown = ", ".join(labels[:10]) + (", ..." if len(labels) > 10 else "")
        raise runtime.UserError(f"{path}: {'; '.join(problems)} (the labels: {shown})")
    for label, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise runtime.UserError(f"{path}: the weight of {label} is {weight!r}; weights are numbers >= 0")
    if not any(weights.values()):
        raise runtime.UserError(f"{path}: every weight is 0")
    return {label: float(weights[label]) for label in labels}


class LossMeter:
    """Training loss as a mean over samples, kept as per-rank sums on the device so the hot loop never calls
    `.item()` (a device sync), read (and synchronised over ranks) only when logging."""

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
    """Stops the run with one line, on every rank, once the loss became NaN/inf, before anything is saved from it;
    before a save (`parameters=True`) the parameters are checked too, since the logged loss lags them by a step.
    `last_good()`: the checkpoint the message points to. `also`: further checks of the same kind (the ResNet script's
    unreadable images). Collectives: every rank calls `check` at the same points."""

    def __init__(self, accelerator, meter, model, last_good, lr_flag, also=()):
        self.accelerator, self.meter, self.model = accelerator, meter, model
        self.last_good, self.lr_flag, self.also = last_good, lr_flag, also

    def check(self, completed_steps, parameters=False):
        if (self.meter.diverged(self.accelerator)
            or (parameters and not parameters_finite(self.accelerator, self.model))):
            raise runtime.UserError(f"loss became NaN/inf by step {completed_steps}; stopped before saving anything "
                                    f"from it. Last good checkpoint: {self.last_good()}. Try a lower {self.lr_flag} or "
                                    f"bf16 instead of fp16.")
        for check in self.also:
            check()


_END = object()  # an exhausted iterator (a batch may be anything, None included)


def seconds_since_process_start():
    """Wall seconds since this process was started (the interpreter itself, imports and all)."""
    return time.time() - psutil.Process().create_time()


class Pause:
    """How long one excluded block took (`seconds`, set when it ends)."""
    seconds = 0.0


class Throughput:
    """Steps and samples between two log lines, and the time they took without the pauses: where a run's wall time
    goes (start-up until the first step, training steps, and the pauses between them).

    The samples/s of a log line is the speed of training alone: time spent evaluating or checkpointing, and the wait
    for an epoch's first batch (DataLoader workers starting and filling their queues), is kept out of it and reported
    on its own (`eval_seconds`, `epoch_start_seconds`, ...). Counted in, an evaluation made the window around it look
    several times slower than the steps in it were.

    `clock` is injectable so the bookkeeping can be tested without sleeping. With `data_wait`, read() also gives
    `data_ms_per_step`: the wait for the batches after an epoch's first (main.py's "Data" time), a part of the
    training time.
    """

    def __init__(self, clock=time.perf_counter, process_clock=seconds_since_process_start, data_wait=False):
        self.clock, self.process_clock, self.data_wait = clock, process_clock, data_wait
        self.startup_seconds = None  # process start to the end of the first training step of this process
        self.first_step_in_window = False
        self.reset()

    def reset(self):
        self.start, self.steps, self.samples, self.paused, self.waited = self.clock(), 0, 0, {}, 0.0

    def step(self, samples):
        """One optimizer step of `samples` samples (over all processes) has been taken."""
        if self.startup_seconds is None:
            self.startup_seconds = self.process_clock()
            self.first_step_in_window = True
        self.steps += 1
        self.samples += samples

    @contextmanager
    def pause(self, name):
        """Time spent inside is not training time; it is reported as `{name}_seconds` with the next read()."""
        pause, start = Pause(), self.clock()
        try:
            yield pause
        finally:
            pause.seconds = self.clock() - start
            self.paused[name] = self.paused.get(name, 0.0) + pause.seconds

    def epoch(self, batches):
        """Iterate `batches`; the wait for the first one (worker start-up, first fetch) is an `epoch_start` pause,
        the wait for each later one is data time."""
        with self.pause("epoch_start"):
            iterator = iter(batches)
            batch = next(iterator, _END)
        while batch is not _END:
            yield batch
            start = self.clock()
            batch = next(iterator, _END)
            self.waited += self.clock() - start

    def read(self):
        """ms/step and samples/s of the window's training time, the pauses apart; then start a new window."""
        elapsed = self.clock() - self.start
        training = max(elapsed - sum(self.paused.values()), 1e-9)
        values = {"ms_per_step": 1000 * training / max(1, self.steps), "samples_per_second": self.samples / training,
                  **({"data_ms_per_step": 1000 * self.waited / max(1, self.steps)} if self.data_wait else {}),
                  **{f"{name}_seconds": seconds for name, seconds in self.paused.items()}}
        if self.first_step_in_window:
            values["startup_seconds"] = self.startup_seconds
            self.first_step_in_window = False
        self.reset()
        return values


class EvaluationAbandoned(Exception):
    """Every rank agreed to stop during an evaluation (PreemptionGuard.batches): the loop saves its position, with the
    validation still due (the resumed run validates first)."""


class AccumulationWindow(NamedTuple):
    """The start of an accumulation window (PreemptionGuard.start_window)."""
    first_batch: int  # its first batch's index in the epoch
    micro_step: int  # accelerator.step before its first batch: accelerate's count of batches into the window, saved
    rng: dict  # random_states() before its first batch
    buffers: list  # copies of the model's buffers before its first batch


AGREEMENT_SECONDS = 1.0  # how often the ranks agree on a stop: a signal is acted on within about twice that
MAX_CHECKS_PER_AGREEMENT = 100  # however fast the steps: a slow phase after fast steps holds a stop 100 checks at most


class PreemptionGuard:
    """SIGTERM (what Slurm and cloud preemption send, and what a rank gets when its launcher dies:
    utils/runtime.py stop_with_launcher) becomes "checkpoint at a step boundary, then exit"; Ctrl-C (SIGINT) stops at
    once, with one line per process saying where: `Interrupted` (utils/runtime.py run_cli).

    The SIGTERM may reach only some ranks; the checks (`should_stop` after each optimizer step, `stops_inside_window`
    after each batch of an accumulation window, `batches` before each evaluation batch) turn it into a decision all
    ranks share, so every rank saves the same checkpoint at the same step. The ranks agree about every
    AGREEMENT_SECONDS, whatever the step time and the number of processes: one agreement at a time is in flight on the
    host channel (utils/runtime.py HostChannel.start), started at a check and read `every` checks later, where every
    rank reads the same `every` from the agreement before (the slowest rank's seconds per check). A step never waits
    for it unless its all-reduce took longer than that; a signal is acted on within about two agreements
    (docs/launching.md#3-at-scale; at the next check on one process). Ctrl-C saves nothing: the line names the
    last complete checkpoint (`last_checkpoint()`) and how to continue (`resume`). `close` ends the training steps:
    SIGTERM then stops the rest of the run at once (utils/runtime.py Stopped).
    """

    def __init__(self, accelerator, last_checkpoint=lambda: None, resume="--resume latest"):
        self.accelerator, self.last_checkpoint, self.resume = accelerator, last_checkpoint, resume
        self.channel = runtime.HostChannel.of(accelerator)
        self.received = None
        self.step = None  # the last optimizer step taken, as of the last check
        self.pending = None  # the agreement in flight
        self.every = 1  # checks from one agreement's start to its reading: the same on every rank
        self.checks = 0  # checks since the agreement in flight started
        self.started = None  # time.perf_counter() when it started
        self.agreed = False  # the ranks agreed to stop: every later check says so without a collective
        signal.signal(signal.SIGTERM, self._handler)
        signal.signal(signal.SIGINT, self._interrupt)
        runtime.on_ctrl_c(self.where)  # a peer's Ctrl-C that reaches this process as a broken collective says where

    def close(self, preempted):
        """The training steps are over (every rank, at the same point): the agreement in flight is finished, and SIGTERM
        stops the rest of the run at once again (utils/runtime.py stop_outside_training, as run_cli chose). A SIGTERM
        that was not acted on (`preempted` False) is delivered again now, so that it stops what follows."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        runtime.stop_outside_training()
        if self.received and not preempted:
            os.kill(os.getpid(), signal.SIGTERM)

    def _handler(self, signum, frame):
        runtime.forget_a_dead_launcher()
        runtime.note_stop_signal()
        self.received = signal.Signals(signum).name

    def _interrupt(self, signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher passes the terminal's Ctrl-C on: one is enough
        raise runtime.Interrupted(self.where())

    def where(self):
        """`interrupted (Ctrl-C) after step N; ...`: the line an interrupted process prints."""
        last = self.last_checkpoint()
        after = f" after step {self.step}" if self.step is not None else ""
        if last is None:
            return f"interrupted (Ctrl-C){after}; no checkpoint was saved yet"
        return (f"interrupted (Ctrl-C){after}; the last checkpoint, {last}, is complete: continue with {self.resume}")

    def should_stop(self, completed_steps=None):
        """True on every rank, at the same check, once a rank had received the signal by the check before (one
        process: by this one). A collective: call it on all ranks at the same points."""
        self.step = completed_steps
        if self.agreed:
            return True
        if self.channel.group is None:  # one process: nothing to agree on, nothing to wait for
            self.agreed = self.received is not None
            return self.agreed
        self.checks += 1
        if self.pending is not None and self.checks < self.every:
            return False  # between agreements: nothing read, nothing started
        if self.pending is not None:
            stop, seconds_per_check = self.pending.result()  # the largest over the ranks: the same on every rank
            self.agreed = stop > 0
            if seconds_per_check > 0:  # 0: the first agreement, nothing measured yet
                self.every = min(MAX_CHECKS_PER_AGREEMENT, max(1, round(AGREEMENT_SECONDS / seconds_per_check)))
        if self.agreed:
            self.pending = None
            return True
        now = time.perf_counter()
        seconds_per_check = (now - self.started) / self.checks if self.started is not None else 0.0
        self.pending = self.channel.start([self.received is not None, seconds_per_check])
        self.checks, self.started = 0, now
        return False

    def start_window(self, batches_in_epoch, model):
        """Where an accumulation window begins (--gradient_accumulation_steps): its first batch's index in the epoch,
        the random generators and the model's buffers (BatchNorm's running statistics): what a stop inside the
        window goes back to. None when every batch is an optimizer step."""
        if self.accelerator.gradient_accumulation_steps == 1:
            return None
        return AccumulationWindow(batches_in_epoch, self.accelerator.step, runtime.random_states(),
                                  [b.detach().clone() for b in model.buffers()])

    def stops_inside_window(self, completed_steps, window, model):
        """After a batch that took no optimizer step: whether the ranks agreed to stop (a collective, as should_stop).
        If so, the window's batches are undone for the checkpoint, which then holds the position of the window's
        first batch: the random generators, accelerate's count of batches into the window and the model's buffers go
        back to the window's start, and the resumed run trains the whole window again, exactly as the uninterrupted
        run did. A long window does not hold a stop past the launcher's grace."""
        if window is None or not self.should_stop(completed_steps):
            return False
        runtime.set_random_states(window.rng)
        self.accelerator.step = window.micro_step  # save_state keeps it: the resumed window syncs after all its batches
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), window.buffers):
                buffer.copy_(saved)
        self.accelerator.print(f"stopped inside the accumulation window after step {completed_steps}: the checkpoint "
                               f"holds the window's start (batch {window.first_batch} of the epoch), and the resumed "
                               f"run trains the window again")
        return True

    def batches(self, loader):
        """An evaluation's batches of `loader`, abandoned (EvaluationAbandoned) once every rank agreed to stop. A
        check per batch: every rank iterates the same number of evaluation batches (the prepared loader pads the last
        one)."""
        for batch in loader:
            if self.should_stop(self.step):
                reason = self.received or "SIGTERM"
                raise EvaluationAbandoned(f"evaluation after step {self.step} abandoned on {reason}")
            yield batch


def epoch_batches(accelerator, loader, epoch, state):
    """The batches of `epoch` still to train, and the index of the first: all of them, or, in the epoch a run resumed
    in, those after the checkpoint's position (`state`'s epoch and batches_in_epoch).

    accelerate's exact-resume recipe: set_epoch explicitly every epoch (the seedable sampler's order depends on
    seed + epoch only), and skip_first_batches for the resumed epoch alone."""
    loader.set_epoch(epoch)
    skip = state["batches_in_epoch"] if epoch == state["epoch"] else 0
    return (accelerator.skip_first_batches(loader, skip) if skip else loader), skip


# add_selection_args' flags: the checkpoint's best value was measured with the metric and its direction, and the
# count of validations since the best carries on under a changed patience or threshold (utils/checkpoint.py Role)
SELECTION_ROLES = {"--metric_for_best_model": checkpoint.kept_by("metric_for_best_model"),
                   "--greater_is_better": checkpoint.kept_by("greater_is_better"),
                   "--early_stopping_patience": checkpoint.MAY_CHANGE,
                   "--early_stopping_threshold": checkpoint.MAY_CHANGE}


@checkpoint.roles_beside("SELECTION_ROLES")
def add_selection_args(parser, default_help, aliases=()):
    """transformers Trainer's flags for choosing the best model and stopping early (`aliases`: other spellings of
    --metric_for_best_model, such as timm's --eval-metric; `default_help`: the script's default metric, in words).
    Their names are those of the numbers the script's `evaluate` returns, learnt before training (validation_names):
    no list of them here."""
    group = parser.add_argument_group("best model and early stopping (transformers Trainer's names)")
    group.add_argument("--metric_for_best_model", *aliases, dest="metric_for_best_model", default=None,
                       metavar="NAME", help="the validation metric that selects the best model: the name of a number "
                       f"the script's evaluate() returns (its ADAPTATION SECTION), with or without Trainer's eval_ "
                       f"prefix; a run that trains evaluates one validation batch first and lists them if NAME is not "
                       f"one; default: {default_help}")
    group.add_argument("--greater_is_better", type=runtime.hf_bool, nargs="?", const=True, default=None, metavar="BOOL",
                       help="whether a larger metric is better (true/false); default: false for a name ending in "
                       "'loss' and for mse, rmse, mae, else true")
    group.add_argument("--early_stopping_patience", type=int, default=None, metavar="EVALUATIONS",
                       help="stop after this many validations in a row without an improvement; default: never")
    group.add_argument("--early_stopping_threshold", type=float, default=0.0,
                       help="an improvement must exceed this, in the metric's units")
    return group


def check_selection_args(parser, args, training):
    """The checks the command line alone allows (parser.error): a run that does not train would ignore these flags.
    The metric's name waits for the run's validation metrics (resolve_selection)."""
    given = [flag for flag, value in (("--metric_for_best_model", args.metric_for_best_model),
                                      ("--greater_is_better", args.greater_is_better),
                                      ("--early_stopping_patience", args.early_stopping_patience),
                                      ("--early_stopping_threshold", args.early_stopping_threshold or None))
             if value is not None]
    if given and not training:
        parser.error(f"{given[0]} applies to training; this run does not train")
    if args.early_stopping_patience is not None and args.early_stopping_patience < 1:
        parser.error(f"--early_stopping_patience {args.early_stopping_patience}: at least 1 validation")
    if args.early_stopping_threshold < 0:
        parser.error(f"--early_stopping_threshold {args.early_stopping_threshold}: must be >= 0")
    if args.early_stopping_threshold and args.early_stopping_patience is None:
        parser.error("--early_stopping_threshold needs --early_stopping_patience")


LOWER_IS_BETTER = ("mse", "rmse", "mae")  # errors; and, as in Trainer, every name ending in "loss"


def resolve_selection(args, names, renames=None, default=None):
    """--metric_for_best_model (or `default`) as the plain name of one of the run's validation metrics `names` (the
    numbers its evaluate() returns: validation_names; Trainer's `eval_` prefix and the `renames` spellings accepted),
    and --greater_is_better's default from it, written into args. `names` None: the run validates nothing (no
    validation set, or it does not train), so the default stands, unchecked, and a metric or early stopping asked for
    is refused."""
    given = args.metric_for_best_model
    if names is None:
        if args.early_stopping_patience is not None:
            raise runtime.UserError("--early_stopping_patience stops on the validation metric: this run has no "
                                    "validation set")
        if given is not None:
            raise runtime.UserError(f"--metric_for_best_model {given} selects by a validation metric: this run has no "
                                    f"validation set")
        name = default
    else:
        given = given or default
        name = given[len("eval_"):] if given.startswith("eval_") and given not in names else given
        name = (renames or {}).get(name, name)
        if name not in names:
            raise runtime.UserError(f"--metric_for_best_model {given}: not a validation metric of this run; choose "
                                    f"from the numbers its evaluate() returns: {', '.join(names)}")
    args.metric_for_best_model = name
    if args.greater_is_better is None:
        args.greater_is_better = not (name.endswith("loss") or name in LOWER_IS_BETTER)


class OneBatch:
    """A validation loader's stand-in for a dry evaluation (validation_names): one batch of a process's share of one
    of `loader`'s batches, of samples spread evenly over its dataset (every class of a file sorted by label), fetched
    and collated as `loader` fetches and collates them and put on `device` as a prepared loader puts its batches.
    No DataLoader is iterated (no worker starts, no sampler draws) or prepared (accelerate's save_state numbers the
    prepared ones: another would change the checkpoints' layout)."""

    def __init__(self, loader, size, device):
        self.dataset = loader.dataset  # where the evaluation names an unreadable sample's file
        count = len(self.dataset)
        size = max(1, min(size, count))
        indices = sorted({round(i * (count - 1) / max(size - 1, 1)) for i in range(size)})
        fetch = getattr(self.dataset, "__getitems__", None)  # what torch's fetcher calls when the dataset has it
        samples = fetch(indices) if fetch else [self.dataset[i] for i in indices]
        self.batch = send_to_device(loader.collate_fn(samples), device)

    def __len__(self):
        return 1

    def __iter__(self):
        yield self.batch


def validation_names(accelerator, model, loader, evaluate):
    """The names of the numbers the script's evaluation returns, in its order: `evaluate(batches)` run once, before
    training, on one batch (OneBatch) of the validation `loader` (unprepared), on every rank (its gathers are
    collectives). What --metric_for_best_model may then name comes from evaluate() itself, and a broken evaluate()
    fails in seconds rather than after the first epoch (Lightning's sanity check, num_sanity_val_steps).

    The run goes on as it would have without it: the model is put back on its device and each module in its mode, and
    every random generator a training step draws from back where it was (exact resumes compare bitwise)."""
    generators = runtime.random_states()
    modes = [(module, module.training) for module in model.modules()]
    home = next((tensor.device for tensor in model.parameters()), None)
    try:
        model.to(accelerator.device)
        with torch.no_grad():
            metrics = evaluate(OneBatch(loader, loader.batch_size // accelerator.num_processes, accelerator.device))
    finally:
        if home is not None:
            model.to(home)
        for module, training in modes:
            module.training = training
        runtime.set_random_states(generators)
    return list(outputs.number_entries(metrics))


@dataclass(frozen=True)
class Selection:
    """Which validation metric selects the best model (Trainer's metric_for_best_model and greater_is_better), and
    when a run stops early (Trainer's EarlyStoppingCallback: after `patience` validations in a row that do not beat
    the best so far by more than `threshold`).

    Its entries in the loop's `state` (the best value, where it was measured, the patience counter) are saved with
    every checkpoint (utils/checkpoint.py training_state), so a resumed run selects and stops where the
    uninterrupted run would. Every rank decides from the same gathered validation metrics, so every rank takes the
    same branch (the best model's export is a collective) and leaves the loop at the same step."""
    metric: str  # a key of the validation metrics
    greater_is_better: bool
    position: str  # what the state's best_<position> counts: "step" or "epoch"
    patience: int | None = None  # validations without improvement before stopping; None: never stops early
    threshold: float = 0.0  # in the metric's units

    COUNTER = "early_stopping_patience_counter"  # Trainer's name

    @classmethod
    def from_args(cls, args, position):
        return cls(args.metric_for_best_model, args.greater_is_better, position, args.early_stopping_patience,
                   args.early_stopping_threshold)

    @property
    def best_key(self):
        return f"best_{self.metric}"

    @property
    def position_key(self):
        return f"best_{self.position}"

    def fresh_state(self):
        return {self.best_key: None, self.position_key: None, self.COUNTER: 0}

    def must_match(self):
        """A resumed run compares its validations with the checkpoint's best: by the same metric, the same way."""
        return {"metric_for_best_model": self.metric, "greater_is_better": self.greater_is_better}

    def best(self, state):
        """The best value so far, None before the first validation."""
        return state.get(self.best_key) if state.get(self.position_key) is not None else None

    def improves(self, value, best, threshold=0.0):
        """Whether `value` beats `best` (None: nothing measured yet) by more than `threshold`; a NaN never does."""
        if math.isnan(value):
            return False
        return best is None or (value - best if self.greater_is_better else best - value) > threshold

    def update(self, state, metrics, position):
        """After a validation: count it for early stopping, and record a new best in `state`; True if it is one."""
        value, best = metrics[self.metric], self.best(state)
        state[self.COUNTER] = 0 if self.improves(value, best, self.threshold) else state.get(self.COUNTER, 0) + 1
        if not self.improves(value, best):
            return False
        state.update({self.best_key: value, self.position_key: position})
        return True

    def update_ema(self, state, metrics):
        """The same for the EMA's validation (`ema_<metric>`), kept apart: the EMA's own best export."""
        value, key = metrics[f"ema_{self.metric}"], f"best_ema_{self.metric}"
        if not self.improves(value, state.get(key)):
            return False
        state[key] = value
        return True

    def should_stop(self, state):
        return self.patience is not None and state.get(self.COUNTER, 0) >= self.patience

    def stop_reason(self, state):
        """Why the run stopped early. The counter counts evaluations that did not beat the best before them by more
        than the threshold: a smaller gain still makes a new best, so the best can be the last evaluation."""
        by = f" by more than {self.threshold}" if self.threshold else ""
        smaller = " (a smaller gain still makes a new best)" if self.threshold else ""
        best = self.best(state)
        where = (f"best {best:.6g} at {self.position} {state[self.position_key]}" if best is not None
                 else "no evaluation gave a number to select by")
        count = state[self.COUNTER]
        last = "the last evaluation" if count == 1 else f"the last {count} evaluations"
        return f"{self.metric} did not improve on its best{by} in {last}{smaller}; {where}"

    def results(self, state, stopped_at_step=None, ema=False):
        """all_results.json's entries (Trainer's trainer_state.json names where it has them): the metric, the best
        value and where (best_step or best_epoch), with `ema` the EMA's best, whether, where and why the run stopped
        early."""
        stopped = stopped_at_step is not None
        return {"metric_for_best_model": self.metric, "greater_is_better": self.greater_is_better,
                "best_metric": self.best(state), self.position_key: state.get(self.position_key),
                **({f"best_ema_{self.metric}": state.get(f"best_ema_{self.metric}")} if ema else {}),
                "stopped_early": stopped, "stopped_early_at_step": stopped_at_step,
                "stopped_early_reason": self.stop_reason(state) if stopped else None}
def is_out_of_memory(error):
    """An out-of-memory error of the device (torch.OutOfMemoryError, or a message accelerate's
    should_reduce_batch_size recognises: CUDA, XPU, MPS, HPU, the CPU allocator), or another process's
    (OutOfMemoryOnAnotherRank)."""
    return isinstance(error, (torch.OutOfMemoryError, OutOfMemoryOnAnotherRank)) or should_reduce_batch_size(error)


class OutOfMemoryOnAnotherRank(RuntimeError):
    """Raised on the processes that did not run out of memory in a training forward pass when another one did."""


class Attempt:
    """One attempt at training (OutOfMemoryRetry.run): each process runs its share of every batch as micro-batches
    of at most `micro_batch_size` samples, and it starts from `resume`: the launch's own checkpoint to resume from, or
    one an earlier attempt saved (None: from the start)."""

    def __init__(self, accelerator, micro_batch_size, resume=None):
        self.accelerator, self.micro_batch_size, self.resume = accelerator, micro_batch_size, resume

    def micro_batches(self, model, batch):
        """(offset, part) for this process's `batch` (tensors, or a tuple or dict of them): the whole batch at offset 0,
        or its consecutive micro-batches, each yielded while its forward and backward run; all but the last run under
        `accelerator.no_sync(model)`, so that DDP all-reduces the gradients once per batch, as with the whole batch.
        `offset` is the position of the part's first sample in the batch."""
        size = find_batch_size(batch)
        for start in range(0, size, self.micro_batch_size):
            last = start + self.micro_batch_size >= size
            part = batch if start == 0 and last else slice_tensors(batch, slice(start, start + self.micro_batch_size))
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                yield start, part


class OutOfMemoryRetry:
    """--auto_find_batch_size (the Trainer's name): a training step that runs out of device memory does not end the
    run. `run(train)` calls train(Attempt) and, after an out-of-memory error, again with half the per-device
    micro-batch (rounded up), until it fits or one sample does not; each retry prints one line.

    Before a retry every process releases what the failed attempt prepared (accelerator.free_memory, which also resets
    its accumulation counter, and the gradients), and puts back what it changed: the model's weights, the random
    generators and the fp16 loss scale as they were when training started (a CPU copy of the weights, kept from the
    start), or, when the attempt saved a checkpoint, restores that one (the newest). accelerate's
    find_executable_batch_size retries the same way; here the batch that gets smaller is the micro-batch inside each
    process's share, not the loader's.

    Several processes: the error may hit one of them only, and all must retry together. A forward hook on the model
    (always_call: it also runs when the forward raised) ends every training forward pass with an all-reduce of "did I
    run out?" on the host channel (utils/runtime.py HostChannel: one per micro-batch, on several processes only, without
    a device sync: the allocator's error reaches the host when the forward pass asks for the memory); when one ran out,
    the others raise OutOfMemoryOnAnotherRank there and every process retries. An error in the backward pass or the
    optimizer step cannot be agreed on (the others wait inside DDP's gradient all-reduce): that process stops with one
    line and the launcher ends the others. Under FSDP and DeepSpeed the forward pass itself runs collectives (and
    DeepSpeed counts micro-batches itself), so the flag is refused there. An out-of-memory error while evaluating stops
    with one line too: the evaluation batches are not split.
    """

    def __init__(self, accelerator, model, per_device_batch, accumulation_steps, checkpoint_dir, enabled):
        if enabled and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            raise runtime.UserError(f"--auto_find_batch_size: not under {accelerator.distributed_type.value}, whose "
                                    f"forward pass runs collectives (an out-of-memory error on one process cannot be "
                                    f"agreed on); pass a smaller batch or --gradient_checkpointing")
        self.accelerator, self.model, self.enabled = accelerator, model, enabled
        self.channel = runtime.HostChannel.of(accelerator) if enabled else None  # where the forward hook agrees
        self.per_device_batch, self.accumulation_steps = per_device_batch, accumulation_steps
        self.checkpoint_dir = checkpoint_dir
        self.micro_batch_size, self.retries = per_device_batch, 0
        self.agreed = self.while_evaluating = False  # what the forward hook saw of the last error

    @property
    def results(self):
        """all_results.json's record of what was found (with --auto_find_batch_size)."""
        return {"per_device_micro_batch_size": self.micro_batch_size,
                "out_of_memory_retries": self.retries} if self.enabled else {}

    def run(self, train, resume=None):
        """train(attempt) -> its result; with --auto_find_batch_size, again after each out-of-memory error. The first
        attempt starts from `resume` (the checkpoint the launch resumes from, if the script passes it this way)."""
        attempt = Attempt(self.accelerator, self.per_device_batch, resume)
        if not self.enabled:
            return train(attempt)
        start = self._snapshot()
        hook = self.model.register_forward_hook(self._agree_after_forward, always_call=True)
        try:
            while True:
                saved_before = set(checkpoint.complete_checkpoints(self.checkpoint_dir))
                self.agreed = self.while_evaluating = False
                try:
                    return train(attempt)
                except Exception as error:
                    if not is_out_of_memory(error):
                        raise
                    self._check_retriable(error)
                # out of the except block: the failed attempt's frames and tensors can be freed
                saved = [p for p in checkpoint.complete_checkpoints(self.checkpoint_dir) if p not in saved_before]
                attempt = self._next_attempt(attempt, saved[-1] if saved else attempt.resume, start)
        finally:
            hook.remove()

    def _agree_after_forward(self, module, args, output):
        """The model's forward hook: on several processes, every training forward pass ends with all of them agreeing
        whether one ran out of memory in it."""
        failed = sys.exc_info()[1] if output is None else None  # always_call: runs while the forward's error is raised
        out_of_memory = failed is not None and is_out_of_memory(failed)
        if not (module.training and torch.is_grad_enabled()):  # evaluation: every process skips it alike
            self.while_evaluating |= out_of_memory
            return
        if self.channel.any(out_of_memory):
            self.agreed = True
            if not out_of_memory:
                raise OutOfMemoryOnAnotherRank("another process ran out of memory in this training step")

    def _check_retriable(self, error):
        rank = self.accelerator.process_index
        if self.while_evaluating:
            raise runtime.UserError(f"out of memory while evaluating (process {rank}): --auto_find_batch_size splits "
                                    f"the training batches only; evaluate with a smaller batch") from None
        if self.accelerator.num_processes > 1 and not self.agreed:
            raise runtime.UserError(f"out of memory on process {rank} in the backward pass or the optimizer step, "
                                    f"where the other processes wait in a collective: on several processes "
                                    f"--auto_find_batch_size retries an error in the forward pass only; pass a smaller "
                                    f"batch or --gradient_checkpointing") from None
        if self.micro_batch_size == 1:
            raise runtime.UserError("out of memory at a per-device micro-batch of 1 sample (--auto_find_batch_size): "
                                    "the model does not fit; try --gradient_checkpointing or bf16") from None

    def _next_attempt(self, attempt, resume, start):
        smaller = math.ceil(self.micro_batch_size / 2)
        steps = math.ceil(self.per_device_batch / smaller) * self.accumulation_steps
        self.accelerator.print(f"out of memory at per-device batch {self.micro_batch_size}: retrying with {smaller} x "
                               f"{steps} accumulation steps" + (f" from {resume}" if resume else ""), flush=True)
        self._release()
        self._restore(start)
        self.micro_batch_size, self.retries = smaller, self.retries + 1
        return Attempt(self.accelerator, smaller, resume)

    def _snapshot(self):
        scaler = self.accelerator.scaler
        return {"weights": {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()},
                "rng": runtime.random_states(), "scaler": scaler.state_dict() if scaler is not None else None}

    def _restore(self, start):
        self.model.load_state_dict(start["weights"])
        runtime.set_random_states(start["rng"])
        if start["scaler"] is not None:
            self.accelerator.scaler.load_state_dict(start["scaler"])

    def _release(self):
        """Drop every reference the failed attempt left: the accelerator's prepared objects (and its accumulation
        count), the objects it registered for checkpoints (accelerate has no public way to unregister them: the next
        attempt registers its own), the gradients; then the device's cached blocks."""
        self.accelerator.free_memory()
        self.accelerator._custom_objects.clear()
        for parameter in self.model.parameters():
            parameter.grad = None
        clear_device_cache(garbage_collection=True)
