"""What a run writes about itself, and the policy of its output directory: metrics.jsonl, all_results.json,
run_config.json, the training curves, TensorBoard; the console lines and the progress bar.

Every RunLog method may be called on every process; only the main process writes, so the training scripts need
no `if is_main_process` around logging.

Neighbours: common/checkpoint.py (the checkpoints in output_dir/checkpoints), common/export.py (the exported
models).
"""
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from tqdm.auto import tqdm

from .checkpoint import complete_checkpoints
from .runtime import MASK, SECRET_ARGS, UserError, public_command, release_output_dirs


class RunLog:
    def __init__(self, accelerator, output_dir):
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / "metrics.jsonl"

    def open(self, resume_step=None):
        """Start metrics.jsonl afresh, or, when resuming, keep it up to the checkpoint's step."""
        if self.accelerator.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if resume_step is None:
                self.metrics_path.unlink(missing_ok=True)
            else:
                self._truncate_after(resume_step)

    def _truncate_after(self, step):
        """On resume, drop events logged after the checkpoint, so the log neither repeats nor skips steps."""
        if not self.metrics_path.exists():
            return
        kept = [line for line in self.metrics_path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.metrics_path.write_text("".join(line + "\n" for line in kept))

    def start(self, args, project_name, clear):
        """A training run's output directory before its first step (every rank): with `clear` (--overwrite_output_dir,
        not resuming) the previous run's results and checkpoints removed, so that `latest` cannot find them; the
        directory; run_config.json (resolved arguments, versions, git revision); the trackers."""
        if clear:
            self.accelerator.on_main_process(clear_previous_run)(self.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.write_json("run_config.json", provenance(args))
        if self.accelerator.log_with:
            flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in public_args(args).items()}
            self.accelerator.init_trackers(project_name, config=flat)

    def log(self, event, step, values):
        """One JSON line ({"event", "step", **values}) and, with tracking on, the numbers to TensorBoard."""
        if self.accelerator.is_main_process:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps({"event": event, "step": step, **values}) + "\n")
        if self.accelerator.log_with:
            numbers = {f"{event}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}
            self.accelerator.log(numbers, step=step)

    def console(self, line):
        """A line on the main process that does not break the tqdm bar."""
        if self.accelerator.is_local_main_process:
            tqdm.write(line)

    def write_json(self, name, data):
        if self.accelerator.is_main_process:
            (self.output_dir / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")

    def merge_results(self, results, prefixes=("eval_", "test_")):
        """An evaluation-only run adds its `eval_*`/`test_*` results to a run's all_results.json (main process):
        `merge_results`, which names in one line the numbers it keeps because they were measured with other
        settings."""
        if self.accelerator.is_main_process:
            for line in merge_results(self.output_dir / "all_results.json", results, prefixes):
                self.console(line)

    def write_jsonl(self, name, rows):
        if self.accelerator.is_main_process:
            with open(self.output_dir / name, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)

    def read_events(self, event):
        """Events of one kind from metrics.jsonl (main process; used for the curves plot)."""
        if not self.metrics_path.exists():
            return []
        events = (json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip())
        return [e for e in events if e.get("event") == event]

    def end(self):
        """Last call of a run, on every rank: a barrier (exits without one crashed ~1 in 10 gloo runs), the output
        directory's lock released (every rank has written what it writes), then the trackers' end_training, which
        destroys the process group."""
        self.accelerator.wait_for_everyone()
        release_output_dirs()
        if self.accelerator.log_with:
            self.accelerator.end_training()


def public_args(args):
    """vars(args) with the SECRET_ARGS masked."""
    return {k: MASK if k in SECRET_ARGS and v is not None else v for k, v in vars(args).items()}


def provenance(args):
    """Resolved arguments (secrets masked), versions and git revision, saved beside the results."""
    try:
        revision = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                  cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        revision = None
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in public_args(args).items()},
        "command": public_command(sys.argv),
        "git_revision": revision,
        "versions": {
            "python": platform.python_version(),
            **{name: _version(name) for name in ("torch", "torchvision", "accelerate", "transformers", "datasets")},
        },
    }


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def format_step_line(epoch, step, total_steps, values):
    """`epoch 1 step 120/900 | loss 0.4123 | lr 2.0e-05 | 41.2 ms/step | 1,550 samples/s | eval 3.1 s`."""
    parts = [f"epoch {epoch} step {step}/{total_steps}"]
    for key, value in values.items():
        if key == "lr":
            parts.append(f"lr {value:.1e}")
        elif key == "ms_per_step":
            parts.append(f"{value:.1f} ms/step")
        elif key.endswith("_per_second"):
            parts.append(f"{value:,.0f} {key.replace('_per_second', '')}/s")
        elif key.endswith("_seconds"):  # time kept out of the window's speed: startup, eval, epoch_start
            parts.append(f"{key.replace('_seconds', '').replace('_', ' ')} {value:.1f} s")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.4f}")
        else:
            parts.append(f"{key} {value}")
    return " | ".join(parts)


def progress(accelerator, iterable=None, **kwargs):
    """tqdm on the local main process only, and only on a terminal: log files get the step lines instead."""
    return tqdm(iterable, disable=True if not accelerator.is_local_main_process else None, **kwargs)


def plot_training_curves(train_events, eval_events, png_path, steps_per_epoch, title="training curves"):
    """Loss and top-1 accuracy (%) against epochs: training at each log line, validation after each epoch.

    train_events: dicts with step, loss and acc1; eval_events: dicts with epoch, loss and acc1.
    """
    import matplotlib  # imported where used: it adds about half a second to every process start

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    train_x = [e["step"] / steps_per_epoch for e in train_events]
    eval_x = [e["epoch"] for e in eval_events]
    for ax, key, label in ((loss_ax, "loss", "loss"), (acc_ax, "acc1", "top-1 accuracy (%)")):
        ax.plot(train_x, [e[key] for e in train_events], label="train", alpha=0.7)
        ax.plot(eval_x, [e[key] for e in eval_events], "o-", label="validation")
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


RUN_MARKERS = ("all_results.json", "metrics.jsonl", "checkpoints", "best_model", "model_best.pth")


def check_output_dir(output_dir, overwrite, resume):
    """Before a training run writes anything: refuse to write a new run over another one's results unless asked to
    (`resume`: --resume_from_checkpoint/--resume, a checkpoint or `latest`, else None), and refuse `latest` in a
    directory that holds a finished run but no checkpoint, which would train it again from scratch, over its results
    (a run killed before its first checkpoint left no all_results.json: `latest` starts it afresh)."""
    output_dir = Path(output_dir)
    taken = [name for name in RUN_MARKERS if (output_dir / name).exists()]
    if taken and not overwrite and not resume:
        raise UserError(
            f"{output_dir}: holds another run ({', '.join(taken)}); pass --overwrite_output_dir to replace it "
            "or --resume_from_checkpoint/--resume latest to continue it"
        )
    results = output_dir / "all_results.json"
    if resume != "latest" or overwrite or not results.is_file() or complete_checkpoints(output_dir / "checkpoints"):
        return
    try:
        preempted = json.loads(results.read_text()).get("preempted", False)
    except (OSError, json.JSONDecodeError):
        preempted = False
    if not preempted:
        raise UserError(f"{output_dir}: holds a finished run (all_results.json) but no checkpoint to resume from "
                        "(--checkpointing_steps longer than the run?); pass --overwrite_output_dir to train again")


def clear_previous_run(output_dir):
    """With --overwrite_output_dir: remove the old run's results and checkpoints so `latest` cannot find them."""
    for name in RUN_MARKERS:
        path = Path(output_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def merge_results(path, results, prefixes=("eval_", "test_")):
    """An evaluation-only run adds its `eval_*`/`test_*` results to a run's all_results.json (main process): the
    training results there are kept, and the run information stays that of the training run. Each prefix's
    `{prefix}settings` entry says what its numbers were measured with (max_seq_len, image sizes, ...): numbers that
    all_results.json holds for other settings than this run's are never replaced (this run's are in its own results
    file). Returns one line per prefix kept that way."""
    path = Path(path)
    kept = []
    if not path.is_file():
        merged = dict(results)
    else:
        merged = json.loads(path.read_text())
        for prefix in prefixes:
            settings = f"{prefix}settings"
            if (any(k.startswith(prefix) for k in results) and settings in merged
                    and merged[settings] != results.get(settings)):
                kept.append(prefix)
        merged.update({k: v for k, v in results.items() if k.startswith(prefixes) and not k.startswith(tuple(kept))})
    path.write_text(json.dumps(merged, indent=2, ensure_ascii=False) + "\n")
    return [f"{path}: keeps its {prefix}* numbers, measured with {merged[f'{prefix}settings']} (this evaluation: "
            f"{results.get(f'{prefix}settings')}, in its own {prefix}results.json)" for prefix in kept]
