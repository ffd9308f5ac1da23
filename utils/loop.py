"""The training loop's bookkeeping, shared by both scripts: what one optimizer step does besides forward, backward
and `optimizer.step()`. One step, as both scripts' `train()` take it:
1. `epoch_batches` (after a resume, the batches past the checkpoint's position), iterated by `Throughput.epoch`;
2. in `accelerator.accumulate(model)`, per micro-batch (`Attempt.micro_batches`): forward, the per-sample losses
   (`ClassWeights`), `LossScale.loss` to backward; then clipping, `optimizer.step()`, `scheduler.step()`, `zero_grad`;
3. `LossMeter.update` (sums on the device, no `.item()`), and once the gradients synchronised `Throughput.step` and
   `Cadence.after_step`: a log line (after `HealthCheck.check`), a validation (then `Selection`), a checkpoint;
4. `PreemptionGuard.should_stop`: a SIGTERM on any rank becomes a checkpoint at this step on every rank.
`OutOfMemoryRetry` (--auto_find_batch_size) trains again, in smaller micro-batches, after running out of memory.
Methods that reduce over ranks are collectives. Why: docs/code.md#looppy. Neighbours: utils/checkpoint.py (what a
checkpoint writes), utils/outputs.py (the log line), utils/runtime.py (the Accelerator, the host channel)."""
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
    """When a run logs, validates and saves, counted in optimizer steps; a pure value (docs/code.md#cadence)."""
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
        """What is due after step `completed_steps` (1-based, from the run's start), on batch `batches_in_epoch`."""
        finished = self.finished(completed_steps)
        epoch_end = batches_in_epoch == self.batches_per_epoch or finished
        return Due(log=completed_steps % self.log_every == 0 or epoch_end,
                   evaluate=finished or (completed_steps % self.eval_every == 0 if self.eval_every else epoch_end),
                   checkpoint=(completed_steps % self.checkpoint_every == 0 if self.checkpoint_every
                               else epoch_end and not finished),
                   finished=finished)


class LossScale:
    """A training loss that is the mean over exactly the real samples of each optimizer step, on any number of
    processes: docs/code.md#lossscale-and-classweights."""

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
        """How many of `local_batch_size` samples at `offset` of this process's share of batch `index` are real."""
        # the share is the global positions [rank * b, rank * b + b); accelerate's padding follows the real samples
        share = self.global_batch // self.accelerator.num_processes
        first = self.accelerator.process_index * share + offset
        return max(0, min(local_batch_size, self.real_in_batch(index) - first))

    def loss(self, per_sample_losses, index, offset=0):
        """(loss to backward, mean over its real samples, their count) of batch `index`, or of its part at `offset`."""
        real = self.local_real(index, per_sample_losses.shape[0], offset)
        mask = torch.arange(per_sample_losses.shape[0], device=per_sample_losses.device) < real
        total = (per_sample_losses * mask).sum()
        # DDP averages the gradient over the P processes and accelerate divides by the accumulation count N
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
    """--class_weights: one weight per class, multiplying the cross-entropy of that class's samples."""
    by_label: dict  # {label: weight}, in class-id order
    source: str  # "balanced" or the JSON file

    def tensor(self, device):
        return torch.tensor(list(self.by_label.values()), dtype=torch.float32, device=device)  # (C,)

    def line(self):
        """What the run prints once at start."""
        return f"--class_weights {self.source}: " + ", ".join(f"{k} {v:.4g}" for k, v in self.by_label.items())


def load_class_weights(spec, labels, train_targets):
    """ClassWeights of --class_weights `spec` (None without it): `balanced` from `train_targets`, class ids
    (docs/code.md#lossscale-and-classweights), else a JSON file {label: weight}."""
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
    """Training loss as a mean over samples, kept as per-rank sums on the device: read (a device sync) only to log."""

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
    """`check` (a collective) stops every rank with one line once the loss became NaN/inf, before anything is saved."""

    def __init__(self, accelerator, meter, model, last_good, lr_flag, also=()):
        self.accelerator, self.meter, self.model = accelerator, meter, model
        # last_good(): the checkpoint the line names; also: more checks of the kind (ResNet's unreadable images)
        self.last_good, self.lr_flag, self.also = last_good, lr_flag, also

    def check(self, completed_steps, parameters=False):  # parameters before a save: the logged loss lags a step
        if (self.meter.diverged(self.accelerator)
            or (parameters and not parameters_finite(self.accelerator, self.model))):
            raise runtime.UserError(f"loss became NaN/inf by step {completed_steps}; stopped before saving anything "
                                    f"from it. Last good checkpoint: {self.last_good()}. Try a lower {self.lr_flag} or "
                                    f"bf16 instead of fp16.")
        for check in self.also:
            check()


_END = object()  # an exhausted iterator (a batch may be anything, None included)


def seconds_since_process_start():
    """Wall seconds since this process started (the interpreter itself, imports and all)."""
    return time.time() - psutil.Process().create_time()


class Pause:
    """How long one excluded block took (`seconds`, set when it ends)."""
    seconds = 0.0


class Throughput:
    """Steps, samples and training time between two log lines, the pauses apart (docs/code.md#throughput)."""

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
        """Iterate `batches`: the wait for the first is an `epoch_start` pause, for each later one data time."""
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
    """Every rank agreed to stop during an evaluation (PreemptionGuard.batches): save, keeping the validation due."""


class AccumulationWindow(NamedTuple):
    """The start of an accumulation window (PreemptionGuard.start_window)."""
    first_batch: int  # its first batch's index in the epoch
    micro_step: int  # accelerator.step before its first batch: accelerate's count of batches into the window, saved
    rng: dict  # random_states() before its first batch
    buffers: list  # copies of the model's buffers before its first batch


AGREEMENT_SECONDS = 1.0  # how often the ranks agree on a stop: a signal is acted on within about twice that
MAX_CHECKS_PER_AGREEMENT = 100  # however fast the steps: a slow phase after fast steps holds a stop 100 checks at most


class PreemptionGuard:
    """A SIGTERM on any rank becomes a checkpoint at the same step on every rank, then a clean stop; Ctrl-C stops at
    once, its line naming `last_checkpoint()` and the `resume` flag. Its checks are collectives; how the ranks agree:
    docs/faults_and_resume.md#stops-how-each-one-is-delivered-and-what-it-saves."""

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
        """End of the training steps (every rank): SIGTERM stops at once again; one not acted on is delivered again."""
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
        """True on every rank, at the same check, once a rank received the signal (a collective)."""
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
        """What a stop inside the accumulation window starting here goes back to; None when every batch is a step."""
        if self.accelerator.gradient_accumulation_steps == 1:
            return None
        return AccumulationWindow(batches_in_epoch, self.accelerator.step, runtime.random_states(),
                                  [b.detach().clone() for b in model.buffers()])

    def stops_inside_window(self, completed_steps, window, model):
        """After a batch that took no optimizer step: as should_stop, and on a stop the window's batches are undone."""
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
        """An evaluation's batches of `loader`, abandoned (EvaluationAbandoned) once every rank agreed to stop."""
        # a check per batch: every rank iterates as many evaluation batches (the prepared loader pads the last one)
        for batch in loader:
            if self.should_stop(self.step):
                reason = self.received or "SIGTERM"
                raise EvaluationAbandoned(f"evaluation after step {self.step} abandoned on {reason}")
            yield batch


def epoch_batches(accelerator, loader, epoch, state):
    """(batches of `epoch` still to train, index of the first): after a resume, those past the checkpoint's position."""
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
    """transformers Trainer's flags for the best model and early stopping (`aliases`: other spellings of
    --metric_for_best_model, such as timm's --eval-metric; `default_help`: the default metric, in words)."""
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
    """The checks of add_selection_args' flags the command line alone allows (parser.error)."""
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
    """Writes into args --metric_for_best_model as one of `names` (None: no validation), and its direction."""
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
    """validation_names' stand-in for the validation `loader`: one batch of `size` samples spread over its dataset."""

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
    """The names of the numbers `evaluate(batches)` returns, from one batch of the unprepared validation `loader`; the
    model and the random generators are left as they were. A collective."""
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
    """Which metric selects the best model, and when a run stops early: docs/code.md#selection-and-validation_names."""
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
        """What a resume must keep: the checkpoint's best was measured by this metric, this way."""
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
        """Why the run stopped early, in one line."""
        by = f" by more than {self.threshold}" if self.threshold else ""
        smaller = " (a smaller gain still makes a new best)" if self.threshold else ""
        best = self.best(state)
        where = (f"best {best:.6g} at {self.position} {state[self.position_key]}" if best is not None
                 else "no evaluation gave a number to select by")
        count = state[self.COUNTER]
        last = "the last evaluation" if count == 1 else f"the last {count} evaluations"
        return f"{self.metric} did not improve on its best{by} in {last}{smaller}; {where}"

    def results(self, state, stopped_at_step=None, ema=False):
        """all_results.json's entries of the selection (Trainer's trainer_state.json names where it has them)."""
        stopped = stopped_at_step is not None
        return {"metric_for_best_model": self.metric, "greater_is_better": self.greater_is_better,
                "best_metric": self.best(state), self.position_key: state.get(self.position_key),
                **({f"best_ema_{self.metric}": state.get(f"best_ema_{self.metric}")} if ema else {}),
                "stopped_early": stopped, "stopped_early_at_step": stopped_at_step,
                "stopped_early_reason": self.stop_reason(state) if stopped else None}


def is_out_of_memory(error):
    """An out-of-memory error of the device (as accelerate recognises them) or of another process."""
    return isinstance(error, (torch.OutOfMemoryError, OutOfMemoryOnAnotherRank)) or should_reduce_batch_size(error)


class OutOfMemoryOnAnotherRank(RuntimeError):
    """Raised on the processes that did not run out of memory in a training forward pass when another one did."""


class Attempt:
    """One attempt at training: micro-batches of at most `micro_batch_size`, from checkpoint `resume` (None: start)."""

    def __init__(self, accelerator, micro_batch_size, resume=None):
        self.accelerator, self.micro_batch_size, self.resume = accelerator, micro_batch_size, resume

    def micro_batches(self, model, batch):
        """(offset of its first sample, part) for each micro-batch of `batch` (tensors, or a tuple or dict of them),
        yielded while its forward and backward run; all but the last under `no_sync`: one all-reduce per batch."""
        size = find_batch_size(batch)
        for start in range(0, size, self.micro_batch_size):
            last = start + self.micro_batch_size >= size
            part = batch if start == 0 and last else slice_tensors(batch, slice(start, start + self.micro_batch_size))
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                yield start, part


class OutOfMemoryRetry:
    """--auto_find_batch_size (the Trainer's name): `run(train)` calls train(Attempt) and, after an out-of-memory error
    in a training step, again on every process with half the micro-batch
    (docs/faults_and_resume.md#out-of-device-memory---auto_find_batch_size)."""

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
        """train(attempt) -> its result, retried after each out-of-memory error; the first from checkpoint `resume`."""
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
        """The forward hook: every training forward pass ends with the processes agreeing whether one ran out."""
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
        """Drop every reference the failed attempt left, then the device's cached blocks."""
        self.accelerator.free_memory()  # its prepared objects, and its accumulation count
        self.accelerator._custom_objects.clear()  # no public way to unregister: the next attempt registers its own
        for parameter in self.model.parameters():
            parameter.grad = None
        clear_device_cache(garbage_collection=True)
