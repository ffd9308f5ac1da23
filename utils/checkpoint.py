"""Resumable checkpoints that a kill can never leave half-written (`Checkpoints`: save, rotate, restore, latest),
the agreement on the one to resume from with its files checked before anything is loaded (`agree_on_resume`), what a
resume must match (the training data's fingerprint too) or may change, and the process counts that can continue a
run (`check_global_batches`). Each flag's role is declared once (`Role`, `roles_beside`); `FlagRoles` checks a table
against its parser and derives what the checkpoints, the exports, the results and --help need. Every function that
calls save_state/load_state or takes a decision all ranks share runs on every process. The layout and the reasoning:
docs/faults_and_resume.md#what-a-checkpoint-holds-and-how-it-is-written, docs/code.md#checkpointpy.
Neighbours: utils/loop.py (when a checkpoint is due), utils/export.py (the exported weights beside the checkpoints),
utils/outputs.py (the output directory's other files).
"""
import argparse
import functools
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object
from safetensors.torch import load_model, save_model

from . import export, runtime

STATE_FILE = "training_state.json"
SELECTION_PREFIXES = ("best_", "early_stopping_")  # the loop's `state` entries a checkpoint keeps (training_state)
TRACKER_RUNS = "tracker_runs"  # the loop's `state` entry with each tracker's run id (utils/outputs.py), kept too
TRACKERS_LOGGED_TO = "trackers_logged_to"  # and the last step the trackers were sent: a resume sends them the rest
# the loop's `state` entry saying that a stop abandoned the validation due at the checkpoint's step: the resumed run
# validates (and selects, exports) first
VALIDATION_DUE = "validation_due"

DATA_KEY = "training_data"  # must_match's entry for data_fingerprint

_NAME = re.compile(r"^step_(\d+)$")
_ABANDONED = re.compile(r"^step_(\d+)\.abandoned_on_resume_from_step_(\d+)$")
_PICKLED_OBJECT = re.compile(r"^custom_checkpoint_\d+\.pkl$")  # accelerate unpickles these with weights_only=False
_RNG_STATE = re.compile(r"^random_states_(\d+)\.pkl$")


def complete_checkpoints(checkpoint_dir):
    """Complete checkpoints, oldest first."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = []
    for path in checkpoint_dir.iterdir():
        match = _NAME.match(path.name)
        if match and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(checkpoint_dir):
    """The newest complete checkpoint in checkpoint_dir, or None."""
    found = complete_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def resolve_resume(resume, checkpoint_dir):
    """`latest` -> newest complete checkpoint (None if there is none yet); a path must be complete."""
    if not resume:
        return None
    if resume == "latest":
        return latest_checkpoint(checkpoint_dir)
    path = Path(resume)
    if not path.exists():
        ours = Path(checkpoint_dir) / path.name
        hint = (f"this run's checkpoints are in {checkpoint_dir}: --resume_from_checkpoint {ours}" if (
            ours / STATE_FILE).is_file() else f"resume from `latest` or one of {checkpoint_dir}/step_N")
        raise runtime.UserError(f"{path}: no such checkpoint directory; {hint} (accelerate's examples save "
                                f"OUTPUT_DIR/step_N and epoch_N; this script saves OUTPUT_DIR/checkpoints/step_N)")
    if not (path / STATE_FILE).is_file():
        raise runtime.UserError(f"{path}: not a complete checkpoint (no {STATE_FILE}: an interrupted save, or a bare "
                                f"accelerate save_state directory, which lacks where the run stood); resume from "
                                f"`latest` or a checkpoints/step_N directory")
    return path


def agree_on_resume(accelerator, resume, checkpoint_dir, modules=()):
    """The checkpoint every rank resumes from (None: a fresh start), decided by the main process and found on every
    node's disk, its files checked (`modules`: the `<name>.safetensors` the run restores). A collective."""
    if not resume:
        return None
    decision = [None]
    if accelerator.is_main_process:
        try:
            found = resolve_resume(resume, checkpoint_dir)
            decision = [("ok", found.name if found is not None else None)]
        except runtime.UserError as err:
            decision = [("error", str(err))]
    broadcast_object_list(decision)
    kind, name = decision[0]
    if kind == "error":
        raise runtime.UserError(name)
    if name is None:
        return None
    path = Path(checkpoint_dir) / name if resume == "latest" else Path(resume)  # each node's own, if not shared
    here = (socket.gethostname(), accelerator.process_index, str(path), (path / STATE_FILE).is_file())
    missing = [(host, rank, where) for host, rank, where, ok in gather_object([here]) if not ok]
    if missing:
        host, rank, where = missing[0]
        raise runtime.UserError(f"{where}: not on the disk of node {host} (rank {rank}), but the main process resumes "
                                f"from {name}; copy that checkpoint to every node's --output_dir, or use a shared "
                                f"--output_dir")
    check_checkpoint_files(accelerator, path, modules)
    return path


def abandoned_checkpoints(checkpoint_dir):
    """start_new_branch's abandoned checkpoint directories, oldest step first."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = [(int(m.group(1)), int(m.group(2)), path) for path in checkpoint_dir.iterdir()
             if (m := _ABANDONED.match(path.name)) and path.is_dir()]
    return [path for _, _, path in sorted(found)]


def _names(paths):
    return ", ".join(p.name for p in paths) or "none"


def start_new_branch(accelerator, path, output_dir, writer, exports=()):
    """Resuming from an older checkpoint: the later ones, and `exports` if they replaced them, moved aside. Returns
    whether the exports went (the best model is then selected afresh)."""
    path = Path(path)
    if path.parent.resolve() != (Path(output_dir) / "checkpoints").resolve():  # another run's: leave it alone
        return False
    step = int(_NAME.match(path.name).group(1))
    later = [p for p in complete_checkpoints(path.parent) if int(_NAME.match(p.name).group(1)) > step]
    moved_exports = []
    if later:
        best_now = {k: v for k, v in read_training_state(path).items() if k.startswith("best_")}
        best_then = {k: v for k, v in read_training_state(later[-1]).items() if k.startswith("best_")}
        if best_then != best_now:
            moved_exports = [Path(output_dir) / e for e in exports if (Path(output_dir) / e).exists()]
    accelerator.wait_for_everyone()  # every rank has read what it needs before the writer moves anything
    if not later:
        return False
    suffix = f".abandoned_on_resume_from_step_{step}"
    if writer:
        for old in later + moved_exports:
            os.replace(old, old.with_name(old.name + suffix))
    accelerator.wait_for_everyone()
    names = ", ".join(p.name for p in later + moved_exports)
    accelerator.print(f"resuming from {path.name} starts a new branch: the later {names} moved aside (*{suffix})"
                      + ("; the best model is selected afresh from here" if moved_exports else ""))
    return bool(moved_exports)


def set_aside_exports_beyond(accelerator, step, output_dir, writer, exports, best_export_step):
    """`exports` moved aside as start_new_branch does when the best-model export holds a step after `step`
    (`best_export_step()`, read by the main process). Returns whether they went."""
    found = [best_export_step() if accelerator.is_main_process else None]
    broadcast_object_list(found)
    accelerator.wait_for_everyone()  # every rank has read what it needs before the writer moves anything
    if found[0] is None or found[0] <= step:
        return False
    moved = [Path(output_dir) / e for e in exports if (Path(output_dir) / e).exists()]
    suffix = f".abandoned_on_resume_from_step_{step}"
    if writer:
        for old in moved:
            os.replace(old, old.with_name(old.name + suffix))
    accelerator.wait_for_everyone()
    accelerator.print(f"the best model was exported at step {found[0]}, after this checkpoint (step {step}): "
                      f"{', '.join(p.name for p in moved)} moved aside (*{suffix}); the best model is selected afresh "
                      f"from here")
    return True


def read_training_state(path):
    try:
        return json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise runtime.UserError(f"{Path(path) / STATE_FILE}: unreadable checkpoint state ({err})") from None


def add_allow_data_change(group):
    """The flag that resumes on changed training data (`Checkpoints(allow_data_change=...)`)."""
    group.add_argument("--allow_data_change", action="store_true",
                       help="resume although the training data differ from the checkpoint's (its epoch may then skip "
                       "or repeat examples)")


def data_fingerprint(source, records):
    """must_match[DATA_KEY]: `records` (one string per training example, in the order read) as their count and
    SHA-256; `source`: the file or directory they came from, named in messages."""
    fingerprint = DataFingerprint()
    for record in records:  # one at a time: memory stays flat for any number of examples
        fingerprint.add(record)
    return fingerprint.result(source)


class DataFingerprint:
    """data_fingerprint taken record by record as they stream past (a file read), or a block at a time (a folder's)."""

    def __init__(self):
        self.digest, self.count = hashlib.sha256(), 0

    def add(self, record):
        self.add_block((record + "\n").encode("utf-8"), 1)

    def add_block(self, data, records):
        """`records` records already encoded and joined in `data`, each ending in a newline."""
        self.digest.update(data)
        self.count += records

    def result(self, source):
        return {"source": str(source), "examples": self.count, "sha256": self.digest.hexdigest()}


def check_same_data(saved, current, path, allow_change, say):
    """Refuses a resume on other training data than the checkpoint's, unless `allow_change` (then said with `say`)."""
    if not saved or not current or (saved["examples"], saved["sha256"]) == (current["examples"], current["sha256"]):
        return
    change = (f"{saved['examples']} -> {current['examples']} examples" if saved["examples"] != current["examples"]
              else f"the same {current['examples']} examples in count, other contents (SHA-256 {saved['sha256'][:12]} "
              f"-> {current['sha256'][:12]})")
    what = f"{current['source']}: the training data differ from those of {Path(path)} ({change})"
    if not allow_change:
        raise runtime.UserError(f"{what}; resuming would skip or repeat examples of the checkpoint's epoch. Pass "
                                f"--allow_data_change if the change is intended")
    say(f"{what}; resuming as --allow_data_change asks: the resumed epoch may skip or repeat examples")


def check_compatible(saved, expected, path):
    """Refuses a checkpoint whose must_match entries differ from `expected`: what the model is first, then the flags
    (keys starting with `--`, named with both values). The training data are check_same_data's."""
    for key, value in sorted(expected.items(), key=lambda item: item[0].startswith("--")):
        if key in saved and key != DATA_KEY and saved[key] != value:
            if key.startswith("--"):
                raise runtime.UserError(f"{key} {value!r}: {Path(path)} was trained with {key} {saved[key]!r}; resume "
                                        f"with the same value (which samples each step sees, the inputs or the "
                                        f"optimizer's state depend on it)")
            raise runtime.UserError(
                f"{Path(path) / STATE_FILE}: checkpoint has {key}={saved[key]!r}, this run has {value!r}"
            )


def check_precision(accelerator, path):
    """fp16 needs the loss scale the checkpoint's fp16 run kept (scaler.pt); a bf16/fp32 checkpoint has none."""
    if accelerator.scaler is not None and not (Path(path) / "scaler.pt").is_file():
        raise runtime.UserError(f"--mixed_precision fp16: {Path(path)} was not trained in fp16 (no scaler.pt with the "
                                f"loss scale); resume with the checkpoint's precision (bf16 or no)")


def check_global_batches(accelerator, batches, resume_path=None, saved_as=None):
    """The per-process share of the first of `batches` ({flag: GLOBAL batch}, the training batch first), or one line
    if they do not all divide (a resume from `resume_path` keeps its batch, recorded under `saved_as`)."""
    processes, (flag, size) = accelerator.num_processes, next(iter(batches.items()))
    if resume_path is not None:
        kept = read_training_state(resume_path).get(saved_as or flag)
        if kept is not None and kept != size:
            raise runtime.UserError(f"{flag} {size}: {resume_path} was trained with {flag} {kept}, which a resume "
                                    f"keeps; resume with {flag} {kept}, on {_counts_dividing({**batches, flag: kept})} "
                                    f"processes")
    bad = {name: value for name, value in batches.items() if value % processes}
    if not bad:
        return size // processes
    named = " and ".join(f"{name} {value}" for name, value in bad.items())
    if resume_path is None:
        tries = " and ".join(str(max(1, value // processes) * processes) for value in bad.values())
        what = "is the GLOBAL batch" if len(bad) == 1 else "are GLOBAL batches"
        raise runtime.UserError(f"{named} {what} and must divide evenly over {processes} processes (try {tries})")
    counts = _counts_dividing(batches)
    other = {name: value for name, value in batches.items() if name != flag}
    alternative = ""
    if flag not in bad and len(other) == 1:  # only the evaluation batch stands in the way, and a resume may change it
        name, value = next(iter(other.items()))
        alternative = f", or on {processes} with {name} {max(1, value // processes) * processes}"
    raise runtime.UserError(f"{resume_path} cannot continue on {processes} processes: {named} must divide evenly over "
                            f"them (GLOBAL batches; {flag} {size} is kept on a resume); it can continue on {counts} "
                            f"processes{alternative}")


def _counts_dividing(batches):
    """'1, 2, 4 or 8': the process counts that divide every one of `batches`."""
    common = math.gcd(*batches.values())
    counts = [str(count) for count in range(1, common + 1) if common % count == 0]
    return counts[0] if len(counts) == 1 else f"{', '.join(counts[:-1])} or {counts[-1]}"


def resumable_process_counts(global_batch):
    """What a run's summary says of the process counts its checkpoints can resume on."""
    return f"{_counts_dividing({'batch': global_batch})} (the divisors of the GLOBAL batch {global_batch})"


class Checkpoints:
    """The run's resumable checkpoints in output_dir/checkpoints: `save` one at a step, `restore` a run from one,
    `latest`. Constructing it is a collective: it finds out whether output_dir is shared by the nodes."""

    def __init__(self, accelerator, output_dir, total_limit, must_match, settings, exports=(), modules=None,
                 allow_data_change=False, best_export_step=lambda: None, per_process=(), say=None):
        self.accelerator, self.output_dir, self.total_limit = accelerator, Path(output_dir), total_limit
        self.say = say or accelerator.print  # the "saved checkpoint" line (the script's console, beside its bar)
        self.dir = self.output_dir / "checkpoints"
        # must_match: what a resume must share (keys starting with `--` are flags); settings: the flags it may change;
        # exports: the best-model files an abandoned branch may have replaced (start_new_branch)
        self.must_match, self.settings, self.exports = must_match, settings, exports
        # best_export_step(): the step the best-model export holds, or None; per_process: per_process_differences
        self.best_export_step, self.per_process = best_export_step, per_process
        # the run's launches so far (each checkpoint records them): processes, precision, the step each resumed at
        self.launches = [launch_record(accelerator, None)]
        self.modules = modules or {}  # {name: nn.Module} saved as <name>.safetensors, written once (the EMA)
        self.allow_data_change = allow_data_change
        shared = output_dir_is_shared(accelerator, self.dir)
        accelerator.project_configuration.save_on_each_node = not shared
        if not shared:
            self.dir.mkdir(parents=True, exist_ok=True)
            accelerator.print("--output_dir is not shared between the nodes: every node keeps its own complete copy of "
                              "each checkpoint")

    @property
    def writer(self):
        """Whether this process renames and rotates checkpoints: the main process, or each node's on local disks."""
        if self.accelerator.project_configuration.save_on_each_node:
            return self.accelerator.is_local_main_process
        return self.accelerator.is_main_process

    def latest(self):
        """The newest complete checkpoint, or None."""
        return latest_checkpoint(self.dir)

    def save(self, step, state, epoch, batches_in_epoch):
        """Write checkpoint `step_<step>` atomically (every rank), keep the newest `total_limit`, say "saved checkpoint
        PATH"; a failure to write on any rank stops every rank with one line."""
        final, tmp = self.dir / f"step_{step}", self.dir / f".tmp-step_{step}"
        try:
            # three blocks, each ending in a collective: every rank starts writing once tmp exists, and the writer
            # renames it only once every rank has written its part (its RNG state)
            with runtime.writing(self.accelerator, self.dir, unfinished=tmp, writer=self.writer):
                if self.writer:
                    shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
                    tmp.mkdir(parents=True)
            with runtime.writing(self.accelerator, self.dir, unfinished=tmp, writer=self.writer):
                self.accelerator.save_state(str(tmp))
                if self.writer:
                    for name, module in self.modules.items():
                        save_model(module, str(tmp / f"{name}.safetensors"))
                fsync_files(tmp)  # every rank: its files' data reach the disk before the rename publishes them
            with runtime.writing(self.accelerator, self.dir, unfinished=tmp, writer=self.writer):
                if self.writer:
                    _write_json_durably(tmp / STATE_FILE, {
                        **training_state(self.must_match, state, self.settings, step, epoch, batches_in_epoch),
                        "num_processes": self.accelerator.num_processes,
                        "mixed_precision": runtime.effective_precision(self.accelerator), "launches": self.launches})
                    replace_dir_atomically(tmp, final)
                    if self.total_limit:
                        for old in complete_checkpoints(self.dir)[:-self.total_limit]:
                            shutil.rmtree(old, ignore_errors=True)
        except runtime.UserError as err:
            latest = self.latest()
            raise runtime.UserError(f"{err}: checkpoint step_{step} not saved; the latest complete checkpoint is still "
                                    f"{latest if latest else 'none'}") from None
        if self.writer:  # a machine that wrote nothing says nothing of it
            self.say(f"saved checkpoint {final}")
        return final

    def finish(self):
        """After a run that trained to its end (every rank): the abandoned checkpoints rotated as the live ones are."""
        abandoned = abandoned_checkpoints(self.dir)
        removed = abandoned[:-self.total_limit] if self.total_limit else []
        if self.writer:
            for old in removed:
                shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        if abandoned:
            kept = abandoned[len(removed):]
            self.accelerator.print(f"abandoned checkpoints, rotated by --save_total_limit {self.total_limit} now that "
                                   f"the run has finished: removed {_names(removed)}; kept {_names(kept)}")

    def restore(self, path, fresh_state, batches_per_epoch, optimizer=None, scheduler=None):
        """The state a run starts from: `fresh_state`, or the checkpoint at `path` restored into the prepared objects,
        the command line's optimizer hyperparameters and `settings` applied (every rank)."""
        state = {**fresh_state, VALIDATION_DUE: False}
        if path is not None:
            command_line = _hyperparameters(optimizer)
            # an entry an older checkpoint lacks (the early-stopping count) starts fresh
            state = {**fresh_state, **load_checkpoint(self.accelerator, path, self.must_match, self.modules,
                                                      self.allow_data_change)}
            branched = start_new_branch(self.accelerator, path, self.output_dir, self.writer, self.exports)
            if set_aside_exports_beyond(self.accelerator, state["completed_steps"], self.output_dir, self.writer,
                                        self.exports, self.best_export_step) or branched:
                state.update({k: v for k, v in fresh_state.items() if k.startswith(SELECTION_PREFIXES)})
            _apply_hyperparameters(optimizer, scheduler, command_line)
            self.accelerator.print(f"Resumed from {path} at step {state['completed_steps']}")
            _report_changes(self.accelerator, path, state, self.settings, self.per_process)
            self.launches = [*launches_of(state), launch_record(self.accelerator, state["completed_steps"])]
        if state["batches_in_epoch"] >= batches_per_epoch:
            state.update(epoch=state["epoch"] + 1, batches_in_epoch=0)
        return state


def training_state(must_match, state, settings, completed_steps, epoch, batches_in_epoch):
    """training_state.json's entries but the launches: what must match, where the run is, the loop's `state` entries a
    resume needs (the selection, the trackers, the validation due) and the settings a resume may change."""
    return {**must_match, "completed_steps": completed_steps, "epoch": epoch, "batches_in_epoch": batches_in_epoch,
            **{key: value for key, value in state.items() if key.startswith(SELECTION_PREFIXES)},
            **({TRACKER_RUNS: state[TRACKER_RUNS]} if state.get(TRACKER_RUNS) else {}),
            **({TRACKERS_LOGGED_TO: state[TRACKERS_LOGGED_TO]} if state.get(TRACKERS_LOGGED_TO) else {}),
            VALIDATION_DUE: state.get(VALIDATION_DUE, False), "settings": settings}


def resume_settings(args, flags):
    """{flag: value} of the flags a resume may change (`flags`: FlagRoles.resumable): what a checkpoint records."""
    return {flag: json_value(getattr(args, dest)) for flag, dest in flags.items()}


def json_value(value):
    """A flag's value as JSON gives it back (a path as text, a tuple as a list): a resume compares like with like."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


# ---- each flag's role: what a resume may change or must keep, what the exported model records ----

CHANGE = "may change"
KEEP = "must keep"
LAUNCH = "this launch only"
START = "a fresh start only"
ROLE_HELP = {CHANGE: "a resume may change it", KEEP: "a resume must keep it", LAUNCH: "this launch only",
             START: "a fresh start only"}  # what --help says of each flag (utils/runtime.py HelpFormatter)
ROLE_MEANINGS = {  # what each means (docs/faults_and_resume.md shows them beside ROLE_HELP)
    CHANGE: "the new value is named in one line (`resumed with changed settings`), then applied from the checkpoint's "
            "step on",
    KEEP: "the checkpoint records it (or what it makes: the labels, the model's shape, the training data's "
          "fingerprint), and another value is refused with one line",
    LAUNCH: "how the run executes or reports, not what it trains; a resume takes the command line's value without a "
            "word",
    START: "how a fresh run starts (its starting weights or epoch); a resume starts from the checkpoint instead",
}
EXPORTED_HELP = "the exported model records it"
EXPORTED_MEANING = ("an evaluation of the exported model uses the recorded value unless the command line gives "
                    "another, which is named in one line and whose results are kept apart")
ROLE_NAMES = "MAY_CHANGE, MUST_KEEP, THIS_LAUNCH or FRESH_START"  # the constants a table entry is built from


@dataclass(frozen=True)
class Role:
    """What one flag is to a resumed run and to the exported model: an entry of a script's FLAG_ROLES (or of the
    `*_ROLES` beside a shared add_*_args helper). Build one with the constants and functions below."""
    kind: str  # a key of ROLE_MEANINGS
    key: str | None = None  # KEEP: the name the checkpoint records the value under (default: the flag)
    kept_by: str | None = None  # KEEP: the must_match entry the script computes from it (labels, model, data)
    exported: bool = False  # the exported model records it; an evaluation of that model uses it unless given
    evaluation: bool = False  # results record it beside the numbers measured with it
    default: object = None  # exported: the value where neither the command line nor a trained model gives one
    # exported: recorded only when this args attribute is true ("dest"), or has this value ("dest=value")
    only_with: str | None = None

    def recorded(self, default=None, evaluation=True, only_with=None):
        """The same role, and the exported model records the flag (and, with `evaluation`, results record it)."""
        return replace(self, exported=True, evaluation=evaluation, default=default, only_with=only_with)

    def applies(self, values):
        """Whether `only_with` holds in `values` ({args attribute: value}: a run's, or what a model recorded)."""
        if self.only_with is None:
            return True
        dest, _, value = self.only_with.partition("=")
        return values.get(dest) == value if value else bool(values.get(dest))

    def help(self):
        """The role as --help shows it after the flag's own help."""
        condition = f" (with --{self.only_with.replace('=', ' ')})" if self.only_with else ""
        return ROLE_HELP[self.kind] + (f"; {EXPORTED_HELP}{condition}" if self.exported else "")


MAY_CHANGE = Role(CHANGE)
MUST_KEEP = Role(KEEP)
THIS_LAUNCH = Role(LAUNCH)
FRESH_START = Role(START)


def keep_as(key):
    """KEEP, the value recorded under `key` instead of the flag (names older checkpoints already use)."""
    return Role(KEEP, key=key)


def kept_by(entry):
    """KEEP through what the flag makes: the must_match `entry` the script computes (checked to be there)."""
    return Role(KEEP, kept_by=entry)


def this_launch(*flags):
    """{flag: THIS_LAUNCH} for several flags at once."""
    return dict.fromkeys(flags, THIS_LAUNCH)


class RoleError(Exception):
    """A mistake in a role table, which the scripts' parser says in one line before anything starts (utils/flags.py)."""


@dataclass(frozen=True)
class RoleTable:
    """Where a shared helper's flags have their roles: the table `name` in `module` (roles_beside)."""
    name: str
    module: str

    def entries(self):
        table = getattr(sys.modules[self.module], self.name, None)
        if table is None:
            raise RoleError(f"roles_beside(\"{self.name}\"): no such table in {self.module.replace('.', '/')}.py")
        return table

    def __str__(self):
        return f"{self.name} in {self.module.replace('.', '/')}.py"


def roles_beside(name):
    """Decorator of a shared add_*_args(parser_or_group, ...) helper whose flags' roles are the table `name` beside it
    in its module: a mistake in them is named with that table."""
    def decorate(add_args):
        table = RoleTable(name, add_args.__module__)

        @functools.wraps(add_args)
        def add(container, *args, **kwargs):
            before = len(container._actions)  # argument groups share their parser's list of actions
            result = add_args(container, *args, **kwargs)
            for action in container._actions[before:]:
                action.role_table = table
            return result
        add.role_table = table
        return add
    return decorate


class FlagRoles:
    """A role table ({flag: Role}) checked against the parser it describes (a RoleError otherwise), and the lists the
    machinery needs derived from it (docs/code.md#each-flags-role-role-and-flagroles). `where`: the table's name."""

    def __init__(self, parser, table, where="FLAG_ROLES"):
        self.table = dict(table)
        self.dests = {}  # flag: args attribute
        problems, options = [], set()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            names = action.option_strings or [action.dest]
            options.update(names)
            declared = [name for name in names if name in self.table]
            if len(declared) == 1:
                self.dests[declared[0]] = action.dest
                action.role_help = self.table[declared[0]].help()
                if self.table[declared[0]].exported and action.default is not None:
                    # a trained model's value could never replace a parser default: an evaluation would ignore it
                    problems.append(f"{declared[0]} (default={action.default!r}): a .recorded() flag is default=None "
                                    f"in the parser, its default in .recorded(DEFAULT), so that an evaluation takes "
                                    f"the trained model's value where the command line gives none ({where})")
            else:
                problems.append(_undeclared(names, declared, getattr(action, "role_table", None), where))
        for flag in self.table:
            if flag not in options:
                problems.append(f"{flag} has a role but no option: remove its line from "
                                f"{_table_of(flag, parser) or where}")
        if problems:
            raise RoleError("; ".join(problems) + f" (a role is {ROLE_NAMES}: utils/checkpoint.py ROLE_MEANINGS)")

    @classmethod
    def of(cls, add_args, table=None):
        """The roles of one add_*_args helper's flags (its roles_beside table, or `table`), checked against it alone."""
        parser = argparse.ArgumentParser(add_help=False)
        add_args(parser)
        own = getattr(add_args, "role_table", None)
        return cls(parser, own.entries() if table is None else table, str(own) if own else "its table")

    def flags(self, kind):
        return [flag for flag, role in self.table.items() if role.kind == kind]

    def resumable(self):
        """{flag: args attribute} of the flags a resume may change (resume_settings, Checkpoints' `settings`)."""
        return {flag: self.dests[flag] for flag in self.flags(CHANGE)}

    def must_match(self, args, computed):
        """What a resume must share with its checkpoint: the `computed` entries (labels, model, data, ...) and the
        value of every other KEEP flag, under its flag (or `key`)."""
        recorded = {role.key or flag: json_value(getattr(args, self.dests[flag]))
                    for flag, role in self.table.items() if role.kind == KEEP and role.kept_by is None}
        entries = {**computed, **recorded}
        missing = [f"{flag} (kept by {role.kept_by})" for flag, role in self.table.items()
                   if role.kept_by is not None and role.kept_by not in entries]
        if missing:
            raise RoleError(f"flag roles: no must_match entry for {', '.join(missing)}")
        return entries

    def exported(self):
        """{args attribute: default} of the flags the exported model records (an evaluation takes them from it)."""
        return {self.dests[flag]: role.default for flag, role in self.table.items() if role.exported}

    def recorded_in(self, record):
        """{args attribute: value} of the flags the exported model records, as `record` (an export's fields, or a
        checkpoint's training_state.json) holds them."""
        settings = record.get("settings") or {}
        found = {}
        for flag, role in self.table.items():
            dest = self.dests[flag]
            value = record.get(dest, record.get(role.key or flag, settings.get(flag)))
            if role.exported and value is not None:
                found[dest] = value
        return found

    def exported_settings(self, args):
        """{args attribute: value} the exported model records (a flag `only_with` another left out without it)."""
        return {self.dests[flag]: getattr(args, self.dests[flag]) for flag, role in self.table.items()
                if role.exported and role.applies(vars(args))}

    def model_settings(self, recorded):
        """What a trained model `recorded` ({args attribute: value}) that applies to it (Role.only_with)."""
        roles = {self.dests[flag]: role for flag, role in self.table.items() if role.exported}
        return {dest: value for dest, value in recorded.items() if dest not in roles or roles[dest].applies(recorded)}

    def evaluation(self):
        """{flag: args attribute} of the settings results record beside their numbers."""
        return {flag: self.dests[flag] for flag, role in self.table.items() if role.evaluation}


def _undeclared(names, declared, helper_table, where):
    """The problem of an option with no role, or with two (`declared`): what to write where."""
    flag = " / ".join(names)
    if declared:
        return f"{flag} has {len(declared)} roles ({', '.join(declared)}): keep one line in {where}"
    if helper_table is not None and any(name in helper_table.entries() for name in names):
        return f"{flag} has its role in {helper_table}, which {where} leaves out: add **{helper_table.name} there"
    return f"{flag} has no role: add its line to {helper_table or where}"


def _table_of(flag, parser):
    """The shared helper's table that declares `flag`, among the helpers that added the parser's options."""
    tables = {action.role_table for action in parser._actions if getattr(action, "role_table", None)}
    return next((table for table in tables if flag in table.entries()), None)


def output_dir_is_shared(accelerator, checkpoint_dir):
    """Whether every node sees the same checkpoint_dir: the main process leaves a token there, and a rank that cannot
    read it has a disk of its own. A collective; True on one process."""
    if accelerator.num_processes == 1:
        return True
    checkpoint_dir = Path(checkpoint_dir)
    token = [secrets.token_hex(8) if accelerator.is_main_process else None]
    marker = checkpoint_dir / ".node-check"
    if accelerator.is_main_process:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(token[0])
    broadcast_object_list(token)  # a collective: the marker is on disk before any rank looks
    deadline = time.monotonic() + 2  # a network filesystem may take a moment to show another node's new file
    while True:
        try:
            seen = marker.read_text() == token[0]
        except OSError:
            seen = False
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
        if checkpoint_dir.is_dir():
            os.listdir(checkpoint_dir)  # a listing revalidates NFS's cached view of the directory
    shared = all(gather_object([seen]))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        marker.unlink(missing_ok=True)
    return shared


def load_checkpoint(accelerator, path, expected, modules=None, allow_data_change=False):
    """The training state of checkpoint `path` (agree_on_resume's), all of it restored once it is checked to fit."""
    state = read_training_state(path)
    check_compatible(state, expected, path)  # before load_state, whose size-mismatch error is a traceback
    check_same_data(state.get(DATA_KEY), expected.get(DATA_KEY), path, allow_data_change, accelerator.print)
    check_precision(accelerator, path)
    accelerator.wait_for_everyone()
    accelerator.load_state(str(path))
    for name, module in (modules or {}).items():
        load_model(module, str(Path(path) / f"{name}.safetensors"))
    return state


def check_checkpoint_files(accelerator, path, modules=()):
    """Every file of checkpoint `path` this rank will read is whole and runs no code when loaded, or every rank stops
    with one line naming it (a collective: docs/faults_and_resume.md#nothing-in-a-checkpoint-runs-code)."""
    path = Path(path)
    problem = None
    try:
        _check_files(path, modules, accelerator.process_index)
    except runtime.UserError as err:
        problem = str(err)
    runtime.stop_together(accelerator, problem)


def _check_files(path, modules, rank):
    files = sorted(file for file in path.iterdir() if file.is_file())
    for file in files:
        if _PICKLED_OBJECT.match(file.name):
            raise runtime.UserError(f"{file}: holds a pickle, which is never loaded (unpickling runs whatever code it "
                                    f"names); this project saves no such file (train_resnet.py's EMA is "
                                    f"ema.safetensors): remove it to load the rest of the checkpoint")
    for name in modules:
        if not (path / f"{name}.safetensors").is_file():
            raise runtime.UserError(f"{path}: no {name}.safetensors, which this run restores; not a complete "
                                    f"checkpoint of this run")
    for file in files:
        rng_state = _RNG_STATE.match(file.name)
        if file.suffix == ".safetensors" and export.safetensors_problem(file):
            raise runtime.UserError(export.safetensors_problem(file))
        if file.suffix in (".bin", ".pt") or (rng_state and int(rng_state.group(1)) == rank):
            export.check_torch_file(file)
    for directory in sorted(d for d in path.iterdir() if (d / ".metadata").is_file()):
        export.check_dcp_checkpoint(directory)  # FSDP's sharded state dicts


_HYPERPARAMETERS = ("lr", "initial_lr", "weight_decay", "momentum", "betas", "eps")


def _hyperparameters(optimizer):
    if optimizer is None:
        return None
    return [{k: group[k] for k in _HYPERPARAMETERS if k in group} for group in optimizer.param_groups]


def _apply_hyperparameters(optimizer, scheduler, groups):
    """The command line's optimizer `groups` over those load_state restored, the learning rate recomputed from them."""
    if groups is None:
        return
    for group, values in zip(optimizer.param_groups, groups):
        group.update(values)
    if scheduler is not None:
        inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps it
        inner.base_lrs = [values.get("initial_lr", values["lr"]) for values in groups]
        if hasattr(inner, "lr_lambdas"):
            lrs = [base * factor(inner.last_epoch) for base, factor in zip(inner.base_lrs, inner.lr_lambdas)]
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr
            inner._last_lr = lrs


PER_PROCESS_BATCH_NORM = "BatchNorm statistics are computed per process, over its share of each batch"
PER_PROCESS_DROPOUT = "dropout masks are drawn from each process's own random stream"


def per_process_differences(model):
    """What each process of `model` computes on its own (Checkpoints' `per_process`): BatchNorm statistics over its
    share of the batch (SyncBatchNorm aside), dropout and drop-path masks from its own random stream."""
    modules = list(model.modules())
    found = []
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)
           for m in modules):
        found.append(PER_PROCESS_BATCH_NORM)
    if any(_drop_rate(m) > 0 for m in modules):
        found.append(PER_PROCESS_DROPOUT)
    return found


def say_processes(say, num_processes, per_process):
    """One line at the start of a training on several processes: what it gives compared with 1 process
    (`per_process`: per_process_differences of the model)."""
    if num_processes == 1:
        return
    on = f"on {num_processes} processes"
    if not per_process:
        say(f"{on}: the same weights as on 1 process up to float rounding (the order of sums over processes): the "
            f"model has no dropout, drop path or per-process BatchNorm")
    elif PER_PROCESS_BATCH_NORM in per_process:
        # the note on SyncBatchNorm belongs to the BatchNorm clause, whichever clauses follow it
        clauses = [f"{what} (SyncBatchNorm computes them over the global batch)" if what == PER_PROCESS_BATCH_NORM
                   else what for what in per_process]
        say(f"{on}: not the training of 1 process: {'; '.join(clauses)}")
    else:
        say(f"{on}: the same training as on 1 process in distribution, not bitwise: {'; '.join(per_process)} (the same "
            f"weights need a model without dropout or drop path)")


def _drop_rate(module):
    """The drop probability of torch's dropout layers, torchvision's StochasticDepth and timm's DropPath; 0 else."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd) or type(module).__name__ == "StochasticDepth":
        return module.p
    return getattr(module, "drop_prob", 0) or 0


def launch_record(accelerator, resume_step):
    """all_results.json's record of one launch of the run (`launches`)."""
    return {"processes": accelerator.num_processes, "mixed_precision": runtime.effective_precision(accelerator),
            "resume_step": resume_step}


def launches_of(saved):
    """The launches a checkpoint's training_state records; one for a checkpoint that records none."""
    return saved.get("launches") or [{"processes": saved.get("num_processes"),
                                      "mixed_precision": saved.get("mixed_precision"), "resume_step": None}]


def _report_changes(accelerator, path, saved, settings, per_process=()):
    """One line for the settings that differ from the checkpoint's (they apply), one for the process count (with
    `per_process`: what is computed per process, and so differs), one for the precision."""
    saved_settings = saved.get("settings", {})
    changed = [f"{flag} {saved_settings[flag]} -> {value}" for flag, value in settings.items()
               if flag in saved_settings and saved_settings[flag] != value]
    if changed:
        accelerator.print(f"resumed with changed settings (applied from here on): {', '.join(changed)}")
    before = saved.get("num_processes")
    if before and before != accelerator.num_processes:
        differs = "".join(f"; {what}" for what in per_process)
        now = _processes(accelerator.num_processes)
        accelerator.print(f"resumed on {now} from a checkpoint of {_processes(before)}: the global batch and the "
                          f"sample order are the same{differs}; sums over the processes add up in another order: "
                          f"training goes on as on {now}, not bit for bit as on {before}")
        if accelerator.num_processes > before:
            accelerator.on_main_process(_warn)(
                f"warning: ranks {before}-{accelerator.num_processes - 1} have no saved random state in {path}: their "
                f"dropout/augmentation draws start afresh (the run stays valid, but is not the bit-for-bit "
                f"continuation of the uninterrupted one)")
    precision, now = saved.get("mixed_precision"), runtime.effective_precision(accelerator)
    if precision and precision != now:
        accelerator.print(f"resumed in {_precision_name(now)} from a checkpoint trained in "
                          f"{_precision_name(precision)}: the steps from here compute in {_precision_name(now)}")


def _processes(count):
    return f"{count} process" if count == 1 else f"{count} processes"


def _precision_name(precision):
    return "fp32" if precision == "no" else precision


def _warn(message):
    print(message, file=sys.stderr, flush=True)


def replace_dir_atomically(tmp, final):
    """Swap a freshly written directory into place; a kill at any moment leaves one complete copy."""
    tmp, final = Path(tmp), Path(final)
    old = final.with_name(final.name + ".old")  # not a step_N name: never `latest`
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(final.parent)  # the new name on disk
    shutil.rmtree(old, ignore_errors=True)


def fsync_files(directory):
    """Every file under `directory` on disk, then the directory's entries, before a rename publishes them; files that
    vanish meanwhile are skipped (another rank's temporary files, which that rank syncs under their final names)."""
    for path in sorted(Path(directory).rglob("*")):
        try:
            if path.is_file():
                _fsync(path)
        except FileNotFoundError:
            continue
    _fsync(directory)


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_durably(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def load_weights(accelerator, path):
    """A checkpoint's model weights (agree_on_resume's `path`) into the prepared model for evaluation, in whatever
    layout save_state wrote them (DDP, FSDP, DeepSpeed); the modules beside, the EMA, are not read."""
    accelerator.load_state(str(path))
