"""Resumable checkpoints that a kill can never leave half-written, and their rotation.

Layout: output_dir/checkpoints/step_<N>/ holds what `accelerator.save_state` writes (model, optimizer,
scheduler, RNG states of every rank, sampler) plus training_state.json (where in training we were).
A checkpoint is first written to `.tmp-step_<N>`, and renamed to `step_<N>` only once every rank has
finished and training_state.json is on disk, so `latest` always resolves to a complete one.
All functions that call save_state/load_state must run on every process.
"""
import json
import os
import re
import shutil
from pathlib import Path

from .errors import UserError

STATE_FILE = "training_state.json"
_NAME = re.compile(r"^step_(\d+)$")
RUN_MARKERS = ("all_results.json", "metrics.jsonl", "checkpoints", "best_model", "model_best.pth")


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


def resolve_resume(resume, checkpoint_dir):
    """`latest` -> newest complete checkpoint (None if there is none yet); a path must be complete."""
    if not resume:
        return None
    if resume == "latest":
        found = complete_checkpoints(checkpoint_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise UserError(f"{path}: not a complete checkpoint (no {STATE_FILE}); resume from `latest` or a "
                        "checkpoints/step_N directory")
    return path


def read_training_state(path):
    try:
        return json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{Path(path) / STATE_FILE}: unreadable checkpoint state ({err})") from None


def check_compatible(saved, expected, path):
    """A checkpoint from another model or label set must not be loaded silently."""
    for key, value in expected.items():
        if key in saved and saved[key] != value:
            raise UserError(
                f"{Path(path) / STATE_FILE}: checkpoint has {key}={saved[key]!r}, this run has {value!r}"
            )


def save_checkpoint(accelerator, checkpoint_dir, step, training_state, total_limit=None):
    """Write checkpoint `step_<step>` atomically on all ranks; keep only the newest `total_limit`."""
    checkpoint_dir = Path(checkpoint_dir)
    final = checkpoint_dir / f"step_{step}"
    tmp = checkpoint_dir / f".tmp-step_{step}"
    if final.exists():  # e.g. a SIGTERM right after resuming from this very step
        return final
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_json_durably(tmp / STATE_FILE, training_state)
        os.replace(tmp, final)
        if total_limit:
            for old in complete_checkpoints(checkpoint_dir)[:-total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path, expected):
    """Restore everything save_checkpoint wrote, after checking it belongs to this run; return its training state."""
    state = read_training_state(path)
    check_compatible(state, expected, path)  # before load_state, whose size-mismatch error is a traceback
    accelerator.wait_for_everyone()
    accelerator.load_state(str(path))
    return state


def restore_training_state(accelerator, path, expected, fresh_state, batches_per_epoch):
    """The state a run starts from: `fresh_state`, or the checkpoint at `path` restored into the prepared objects.

    A checkpoint written at an epoch's end continues at the start of the next epoch.
    """
    state = dict(fresh_state)
    if path is not None:
        state = load_checkpoint(accelerator, path, expected)
        accelerator.print(f"Resumed from {path} at step {state['completed_steps']}")
    if state["batches_in_epoch"] >= batches_per_epoch:
        state.update(epoch=state["epoch"] + 1, batches_in_epoch=0)
    return state


def replace_dir_atomically(tmp, final):
    """Swap a freshly written directory into place; a kill at any moment leaves one complete copy."""
    tmp, final = Path(tmp), Path(final)
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def check_output_dir(output_dir, overwrite, resuming):
    """Refuse to write a new run over another one's results unless asked to."""
    output_dir = Path(output_dir)
    taken = [name for name in RUN_MARKERS if (output_dir / name).exists()]
    if taken and not overwrite and not resuming:
        raise UserError(
            f"{output_dir}: holds another run ({', '.join(taken)}); pass --overwrite_output_dir to replace it "
            "or --resume_from_checkpoint/--resume latest to continue it"
        )


def clear_previous_run(output_dir):
    """With --overwrite_output_dir: remove the old run's results and checkpoints so `latest` cannot find them."""
    for name in RUN_MARKERS:
        path = Path(output_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _write_json_durably(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
