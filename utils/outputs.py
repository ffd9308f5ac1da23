"""What a run writes about itself, and the policy of its output directory: metrics.jsonl, all_results.json (and
all_results_settings.json), run_config.json, the training curves, the experiment trackers (tracker_settings), the
model card of the selected model (ModelCard), each step's samples per process (--log_sample_indices: SampleLog,
read_sample_indices), the console lines and the progress bar. Every RunLog method runs on every process, and only the
main process writes (each process its own sample file): the scripts need no `if is_main_process` around logging. A
failure to write stops every rank with one line; the JSON files are swapped in whole. Why: docs/code.md#outputspy.
Neighbours: utils/checkpoint.py (the checkpoints in output_dir/checkpoints), utils/export.py (the exported models).
"""
import collections
import importlib.metadata
import json
import math
import numbers
import os
import platform
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tqdm.auto import tqdm

from . import checkpoint, runtime


class RunLog:
    """The run's log, results files, trackers and model card; every method is called on every process."""

    def __init__(self, accelerator, output_dir):
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.card = None  # start()'s ModelCard: a run that trains has one
        self.tracker_start = None  # start()'s (project name, configuration) for open() to start the trackers with
        self.trackers_started = False
        self.partial_from = None  # a resume inside a log window: the step its first train line counts from
        self.state = None  # the loop's state (open()): where the trackers' last step is kept for the checkpoints
        self.held = False  # the trackers get nothing more in this launch: a stop signal came (stop_signalled)

    def open(self, resume_step=None, state=None):
        """metrics.jsonl and the sample files afresh, or kept up to the checkpoint's `resume_step`; the trackers
        started once per launch, with the loop's `state`."""
        self.state = state
        if self.accelerator.log_with and not self.trackers_started:
            self.start_trackers(resume_step, state)
            if resume_step is not None:
                self.send_missed(resume_step, state)
        with runtime.writing(self.accelerator, self.output_dir):
            if self.accelerator.is_main_process:
                self.output_dir.mkdir(parents=True, exist_ok=True)
                # and the sample files of ranks this launch does not have
                for path in [self.metrics_path, *sample_files(self.output_dir, self.accelerator.num_processes)]:
                    keep_up_to(path, resume_step)
                self.partial_from = resume_step if resume_step and last_train_step(self.metrics_path) != resume_step \
                    else None
            keep_up_to(sample_file(self.output_dir, self.accelerator.process_index), resume_step)
        if self.partial_from is not None:
            self.console(f"resumed inside a log window: the first train line's numbers are over the steps after step "
                         f"{self.partial_from} only (metrics.jsonl marks it partial_window)")

    def start(self, args, project_name, clear, card=None):
        """A training run's output directory before its first step (every rank): the previous run removed with `clear`,
        run_config.json written, the trackers' start prepared. `card`: the ModelCard write_model_card fills in."""
        self.card = card
        if clear:
            self.accelerator.on_main_process(clear_previous_run)(self.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.write_json("run_config.json", provenance(args))
        if self.accelerator.log_with:  # started by open(), once the checkpoint to resume from is read
            flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in public_args(args).items()}
            self.tracker_start = (project_name, flat)

    def start_trackers(self, resume_step, state):
        """New tracker runs, or those the checkpoint's `state` records, continued after `resume_step`; their ids go
        into `state`. The configuration is logged by the launch that starts them (MLflow's cannot change)."""
        project_name, config = self.tracker_start
        recorded = (state or {}).get(checkpoint.TRACKER_RUNS) or {}
        runs = recorded if resume_step is not None else {}
        init_kwargs, places = tracker_settings(self.accelerator, self.output_dir, project_name, runs, resume_step)
        self.accelerator.init_trackers(project_name, config=None if runs else config, init_kwargs=init_kwargs)
        self.trackers_started = True
        if state is not None:
            state[checkpoint.TRACKER_RUNS] = started_runs(self.accelerator, init_kwargs)
        continued = (f"; continuing the runs that checkpoint step {resume_step} records "
                     f"({', '.join(f'{name} {run}' for name, run in runs.items())})" if runs else "")
        self.console(f"trackers: {', '.join(places)}{continued}")

    def log(self, event, step, values):
        """One JSON line ({"event", "step", **values}) and, with tracking on, the numbers to TensorBoard."""
        if event == "train" and self.partial_from is not None:  # the uninterrupted run's window began earlier
            values, self.partial_from = {**values, "partial_window": True, "window_from_step": self.partial_from}, None
        with runtime.writing(self.accelerator, self.output_dir):
            if self.accelerator.is_main_process:
                with open(self.metrics_path, "a") as f:
                    f.write(json.dumps({"event": event, "step": step, **values}) + "\n")
        if self.accelerator.log_with and not self.hold_trackers():
            self.accelerator.log(tracker_numbers(event, values), step=step)
            if self.state is not None:
                self.state[checkpoint.TRACKERS_LOGGED_TO] = step

    def hold_trackers(self):
        """Whether the trackers get nothing more in this launch: a stop signal came, and the numbers wait for the
        resumed run (docs/faults_and_resume.md#stops-how-each-one-is-delivered-and-what-it-saves)."""
        if runtime.stop_signalled() and not self.held:
            self.held = True
            last = (self.state or {}).get(checkpoint.TRACKERS_LOGGED_TO)
            self.console(f"SIGTERM: the trackers get nothing more from this launch; the resumed run sends them the "
                         f"numbers after step {last or 0} from metrics.jsonl")
        return self.held

    def send_missed(self, resume_step, state):
        """Send the trackers the metrics.jsonl events a stopped launch held back (hold_trackers), to `resume_step`."""
        last = (state or {}).get(checkpoint.TRACKERS_LOGGED_TO)
        if last is None or last >= resume_step:
            return
        events = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()] \
            if self.accelerator.is_main_process and self.metrics_path.exists() else []
        for event in events:
            if last < event.get("step", 0) <= resume_step:
                self.accelerator.log(tracker_numbers(event["event"], event), step=event["step"])
        state[checkpoint.TRACKERS_LOGGED_TO] = resume_step

    def console(self, line):
        """A line on the main process that does not break the tqdm bar."""
        if self.accelerator.is_local_main_process:
            tqdm.write(line)

    def write_json(self, name, data):
        with runtime.writing(self.accelerator, self.output_dir):
            if self.accelerator.is_main_process:
                _write_atomically(self.output_dir / name, json.dumps(data, indent=2, ensure_ascii=False) + "\n")

    def write_results(self, name, results):
        """`results` as a flat results file `name` and its nested entries in NAME_settings.json (main process)."""
        with runtime.writing(self.accelerator, self.output_dir):
            if self.accelerator.is_main_process:
                write_results(self.output_dir / name, results)

    def merge_results(self, results, prefixes=("eval_", "test_")):
        """merge_results into all_results.json (main process), its lines on the console."""
        with runtime.writing(self.accelerator, self.output_dir):
            if self.accelerator.is_main_process:
                for line in merge_results(self.output_dir / "all_results.json", results, prefixes):
                    self.console(line)

    def write_jsonl(self, name, rows):
        """`rows` as JSON lines (main process), swapped into place at the end; `rows` is consumed on every rank, so it
        may run collectives: a failure to write stops the writing, not the iteration."""
        path = self.output_dir / name
        tmp = path.with_name(f".{path.name}.tmp")
        with runtime.writing(self.accelerator, self.output_dir, unfinished=tmp):
            f = open(tmp, "w", encoding="utf-8") if self.accelerator.is_main_process else None
            problem = None
            try:
                for row in rows:
                    problem = problem or _write_line(f, row)
            finally:
                if f is not None:
                    f.close()
            if problem is not None:
                raise problem
            if f is not None:
                os.replace(tmp, path)

    def read_events(self, event):
        """Events of one kind from metrics.jsonl (main process; used for the curves plot)."""
        if not self.metrics_path.exists():
            return []
        events = (json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip())
        return [e for e in events if e.get("event") == event]

    def write_model_card(self, path, results):
        """start()'s model card with `results` (all_results.json's entries so far) at `path` (main process)."""
        if self.card is not None and self.accelerator.is_main_process:
            self.card.write(path, results)

    def end(self):
        """Last call of a run, on every rank: the output directory's lock released, the trackers ended."""
        self.accelerator.wait_for_everyone()  # exits without a barrier crashed about 1 in 10 gloo runs
        runtime.release_output_dirs()  # every rank has written what it writes
        if self.accelerator.log_with:
            self.accelerator.end_training()  # which destroys the process group


def tracker_settings(accelerator, output_dir, project_name, runs=None, resume_step=None):
    """(init_kwargs, where each tracker writes): in output_dir unless the tracker's own environment variable says
    otherwise; continuing the `runs` ({tracker: run id}) of the checkpoint at `resume_step` (docs/code.md#outputspy)."""
    output_dir = Path(output_dir).resolve()
    runs = runs or {}
    init_kwargs, places = {}, []
    for tracker in map(str, accelerator.log_with):
        if tracker == "tensorboard":
            init_kwargs["tensorboard"] = {"purge_step": resume_step + 1} if resume_step is not None else {}
            places.append(f"tensorboard ({output_dir / 'runs' / project_name})")
        elif tracker == "mlflow":
            uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{output_dir / 'mlflow.db'}"
            init_kwargs["mlflow"] = {"run_name": output_dir.name,
                                     **({"run_id": runs["mlflow"]} if runs.get("mlflow") else {})}
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                init_kwargs["mlflow"]["logging_dir"] = str(output_dir / "mlruns")  # artifacts of a new experiment
                if accelerator.is_main_process:
                    import mlflow

                    mlflow.set_tracking_uri(uri)
            places.append(f"mlflow ({uri})")
        elif tracker == "wandb":
            init_kwargs["wandb"] = {"name": output_dir.name, "id": runs.get("wandb") or secrets.token_hex(8),
                                    "resume": "allow", **({} if os.environ.get("WANDB_DIR") else
                                                          {"dir": str(output_dir)})}
            places.append(f"wandb ({os.environ.get('WANDB_DIR') or output_dir / 'wandb'}, mode "
                          f"{os.environ.get('WANDB_MODE', 'online')})")
        else:
            places.append(tracker)
    return init_kwargs, places


def started_runs(accelerator, init_kwargs):
    """{tracker: run id} of the runs the trackers log to (main process; {} on the others, which log nothing): what a
    checkpoint records for a resumed run to continue. TensorBoard's run is its directory."""
    if not accelerator.is_main_process:
        return {}
    runs = {"tensorboard": accelerator.get_tracker("tensorboard").logging_dir} if "tensorboard" in init_kwargs else {}
    if "mlflow" in init_kwargs:
        runs["mlflow"] = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    if "wandb" in init_kwargs:
        runs["wandb"] = init_kwargs["wandb"]["id"]
    return runs


NOT_METRICS = ("samples", "skipped_images")  # counts: in the card's table, not in its model-index


class ModelCard:
    """A model card for the selected model in the Hugging Face hub's README.md layout, rendered from all_results.json's
    entries (`write`; docs/code.md#outputspy)."""

    def __init__(self, title, metadata, labels, settings, data_files, usage, command):
        self.title = title
        self.metadata = metadata  # ModelCardData's fields: library_name, pipeline_tag, tags, model_name, ...
        self.labels = labels  # names in id order
        self.settings = settings  # {setting: value}, the run's key settings
        self.data_files = data_files  # {split: (path, examples)}
        self.usage = usage  # Markdown: how to load the model
        self.command = command

    def metrics(self, results, prefix):
        """The numbers among `results`' `{prefix}*` entries, without the prefix."""
        return {key[len(prefix):]: value for key, value in results.items()
                if key.startswith(prefix) and isinstance(value, (int, float)) and not isinstance(value, bool)}

    def front_matter(self, results):
        from huggingface_hub import EvalResult, ModelCardData

        task = self.metadata.get("pipeline_tag")
        evaluations = [EvalResult(task_type=task, dataset_type=Path(str(self.data_files[split][0])).suffix.lstrip(".")
                                  or "folder", dataset_name=str(self.data_files[split][0]), dataset_split=split,
                                  metric_type=name, metric_value=value)
                       for split, prefix in (("validation", "eval_"), ("test", "test_")) if split in self.data_files
                       for name, value in self.metrics(results, prefix).items() if name not in NOT_METRICS]
        return ModelCardData(**self.metadata, eval_results=evaluations or None).to_yaml()

    def selection_line(self, results):
        if results.get("best_metric") is None:
            return "The last model of the run: there was no validation set to select with."
        where = f"step {results['best_step']}" if "best_step" in results else f"epoch {results['best_epoch']}"
        line = (f"Selected by validation `{results['metric_for_best_model']}` "
                f"({'higher' if results['greater_is_better'] else 'lower'} is better): {results['best_metric']:.6g} at "
                f"{where}.")
        if results.get("stopped_early"):
            line += (f" Training stopped early at step {results['stopped_early_at_step']}: "
                     f"{results['stopped_early_reason']}.")
        return line

    def launch_lines(self, launches):
        """Each launch's processes and precision, when the run had several (all_results.json's `launches`)."""
        if len(launches) < 2:
            return []
        return ["Trained over several launches, each resumed from the checkpoint of the step named:", "",
                "| launch | from step | processes | mixed_precision |", "|---|---|---|---|",
                *(f"| {i} | {launch.get('resume_step') or 0} | {launch.get('processes')} | "
                  f"{launch.get('mixed_precision')} |" for i, launch in enumerate(launches, 1)), ""]

    def render(self, results):
        splits = [(split, self.metrics(results, prefix)) for split, prefix in (("validation", "eval_"),
                                                                               ("test", "test_"))]
        splits = [(split, values) for split, values in splits if values]
        names = list(dict.fromkeys(name for _, values in splits for name in values))
        lines = [f"# {self.title}", "", self.selection_line(results), "", "## Labels", "", "| id | label |",
                 "|---|---|", *(f"| {i} | {label} |" for i, label in enumerate(self.labels)), "",
                 "## Results of this model", ""]
        if splits:
            lines += [f"| metric | {' | '.join(split for split, _ in splits)} |", "|---" * (len(splits) + 1) + "|",
                      *(f"| {name} | {' | '.join(_number(values.get(name)) for _, values in splits)} |"
                        for name in names)]
        else:
            lines.append("Not evaluated.")
        lines += ["", "## Training", "", "```bash", self.command, "```", "", "| setting | value |", "|---|---|",
                  *(f"| {key} | {value} |" for key, value in self.settings.items()), "",
                  *self.launch_lines(results.get("launches") or []), "## Data", "",
                  "| split | file | examples |", "|---|---|---|",
                  *(f"| {split} | `{path}` | {count} |" for split, (path, count) in self.data_files.items()), "",
                  "## How to use", "", self.usage, ""]
        return f"---\n{self.front_matter(results)}\n---\n" + "\n".join(lines)

    def write(self, path, results):
        """Swapped in whole, like the weights it describes; nothing where there is no exported model."""
        path = Path(path)
        if not path.parent.is_dir():
            return
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(self.render(results), encoding="utf-8")
        os.replace(tmp, path)


def _number(value):
    return "" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def command_line():
    """The command this process runs, as a shell would take it back, secrets masked (public_argv)."""
    return shlex.join(["python", *runtime.public_argv(sys.argv)])


def public_args(args):
    """vars(args) with the SECRET_ARGS masked."""
    return {k: runtime.MASK if k in runtime.SECRET_ARGS and v is not None else v for k, v in vars(args).items()}


def provenance(args):
    """Resolved arguments (secrets masked), versions and git revision, saved beside the results."""
    try:
        revision = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                  cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        revision = None
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in public_args(args).items()},
        "command": runtime.public_command(sys.argv),
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


def number_entries(values):
    """The entries of `values` that are numbers (a bool is not one), in its order: of what `evaluate` returns, what
    --metric_for_best_model may name and the console prints."""
    return {key: value for key, value in values.items()
            if isinstance(value, numbers.Real) and not isinstance(value, bool)}


def format_numbers(values):
    """`loss 0.4123 | accuracy 0.9100 | samples 99` of `values`' numbers: a fraction to 4 decimals, a count whole."""
    return " | ".join(f"{key} {value}" if isinstance(value, numbers.Integral) else f"{key} {value:.4f}"
                      for key, value in number_entries(values).items())


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


def plot_training_curves(train_events, eval_events, png_path, steps_per_epoch, panels, title="training curves"):
    """One plot per panel ((metrics.jsonl key, axis label), e.g. ("loss", "loss")) against epochs: training at each log
    line (`train_events`, with step), validation after each epoch (`eval_events`, with epoch)."""
    import matplotlib  # imported where used: it adds about half a second to every process start

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    train_x = [e["step"] / steps_per_epoch for e in train_events]
    eval_x = [e["epoch"] for e in eval_events]
    for ax, (key, label) in zip(axes[0], panels):
        # a gap (NaN) where an event lacks the key: a run resumed after its evaluate() changed
        if any(key in e for e in train_events):
            ax.plot(train_x, [e.get(key, math.nan) for e in train_events], label="train", alpha=0.7)
        ax.plot(eval_x, [e.get(key, math.nan) for e in eval_events], "o-", label="validation")
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


RUN_MARKERS = ("all_results.json", "all_results_settings.json", "metrics.jsonl", "checkpoints", "best_model",
               "model_best.pth", "model_card.md")


def check_output_dir(output_dir, overwrite, resume):
    """Before a training run writes anything: refuse a new run over another's results unless `overwrite` or `resume`
    (a checkpoint or `latest`), and `latest` over a finished run with no checkpoint
    (docs/faults_and_resume.md#finished-runs)."""
    output_dir = Path(output_dir)
    taken = [name for name in RUN_MARKERS if (output_dir / name).exists()]
    if taken and not overwrite and not resume:
        raise runtime.UserError(
            f"{output_dir}: holds another run ({', '.join(taken)}); pass --overwrite_output_dir to replace it or "
            f"--resume_from_checkpoint/--resume latest to continue it"
        )
    results = output_dir / "all_results.json"
    if (resume != "latest" or overwrite or not results.is_file()
        or checkpoint.complete_checkpoints(output_dir / "checkpoints")):
        return
    try:
        preempted = json.loads(results.read_text()).get("preempted", False)
    except (OSError, json.JSONDecodeError):
        preempted = False
    if not preempted:
        raise runtime.UserError(f"{output_dir}: holds a finished run (all_results.json) but no checkpoint to resume "
                                f"from (--checkpointing_steps longer than the run?); pass --overwrite_output_dir to "
                                f"train again")


def clear_previous_run(output_dir):
    """With --overwrite_output_dir: remove the old run's results and checkpoints so `latest` cannot find them."""
    for name in RUN_MARKERS:
        path = Path(output_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def settings_path(path):
    """NAME_settings.json, beside the results file NAME.json: its entries that are no single value."""
    path = Path(path)
    return path.with_name(f"{path.stem}_settings.json")


def write_results(path, results):
    """`results` as a flat results file at `path` and its other entries (dicts, lists) in settings_path(path), each
    swapped in whole, the settings first: the results file is what says that a run finished."""
    path = Path(path)
    flat = {key: value for key, value in results.items() if not isinstance(value, (dict, list, tuple))}
    nested = {key: value for key, value in results.items() if key not in flat}
    if nested:
        _write_atomically(settings_path(path), json.dumps(nested, indent=2, ensure_ascii=False) + "\n")
    else:
        settings_path(path).unlink(missing_ok=True)
    _write_atomically(path, json.dumps(flat, indent=2, ensure_ascii=False) + "\n")


def read_results(path):
    """A results file joined with its NAME_settings.json (write_results), as one dict (an older nested one too)."""
    path = Path(path)
    results = {}
    for part in (path, settings_path(path)):
        if part.is_file():
            try:
                results.update(json.loads(part.read_text(encoding="utf-8")))
            except json.JSONDecodeError as err:
                raise runtime.UserError(f"{part}: not valid JSON ({err}), so the results cannot be added to it; move "
                                        f"it aside") from None
    return results


def merge_results(path, results, prefixes=("eval_", "test_")):
    """An evaluation-only run's `eval_*`/`test_*` `results` added to the run's all_results.json at `path`, but over
    numbers measured with other settings (`{prefix}settings`); returns one line per prefix kept that way."""
    path = Path(path)
    kept = []
    if not path.is_file():
        merged = dict(results)
    else:
        merged = read_results(path)
        for prefix in prefixes:
            settings = f"{prefix}settings"
            if (any(k.startswith(prefix) for k in results) and settings in merged
                and merged[settings] != results.get(settings)):
                kept.append(prefix)
        merged.update({k: v for k, v in results.items() if k.startswith(prefixes) and not k.startswith(tuple(kept))})
    write_results(path, merged)
    return [f"{path}: keeps its {prefix}* numbers, measured with {merged[f'{prefix}settings']} (this evaluation: "
            f"{results.get(f'{prefix}settings')}, in its own {prefix}results.json)" for prefix in kept]


def tracker_numbers(event, values):
    """{"event/name": number} of one metrics.jsonl event, as the trackers get it."""
    return {f"{event}/{k}": v for k, v in values.items() if isinstance(v, (int, float)) and k not in ("event", "step")}


def last_train_step(path):
    """The step of the last `train` event of metrics.jsonl, None without one."""
    steps = [json.loads(line).get("step") for line in Path(path).read_text().splitlines()
             if line.strip() and json.loads(line).get("event") == "train"] if Path(path).exists() else []
    return steps[-1] if steps else None


def keep_up_to(path, step):
    """A JSON-lines log (metrics.jsonl, a sample file) kept up to `step` on resume, or removed (`step` None); a last
    line cut short is dropped with a note, another line that is not JSON is an error naming it."""
    path = Path(path)
    if step is None or not path.exists():
        path.unlink(missing_ok=True)
        return
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    kept = []
    for number, line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError as err:
            if number != lines[-1][0]:
                raise runtime.UserError(f"{path}:{number}: not a JSON line ({err.msg}); only the last line can be cut "
                                        f"short by a crash: remove or repair this one") from None
            print(f"note: {path}:{number}: the last line is cut short (a crash or a full disk during a write) and is "
                  f"dropped", flush=True)
            break
        if event.get("step", 0) <= step:
            kept.append(line)
    _write_atomically(path, "".join(line + "\n" for line in kept))


SAMPLES_DIR = "sample_indices"  # OUTPUT_DIR/sample_indices/process_<rank>.jsonl (--log_sample_indices)


def sample_file(output_dir, process_index):
    return Path(output_dir) / SAMPLES_DIR / f"process_{process_index}.jsonl"


def sample_files(output_dir, first=0):
    """The sample files of processes `first` and above, by process index."""
    found = []
    for path in (Path(output_dir) / SAMPLES_DIR).glob("process_*.jsonl"):
        index = path.stem.removeprefix("process_")
        if index.isdigit() and int(index) >= first:
            found.append((int(index), path))
    return [path for _, path in sorted(found)]


class _DrawnOrder:
    """A sampler that yields what `sampler` yields, keeping what it drew this epoch until `take` hands it out."""

    def __init__(self, sampler):
        self.sampler, self.drawn, self.first = sampler, collections.deque(), 0  # first: drawn[0]'s epoch position

    def __iter__(self):
        self.drawn.clear()
        self.first = 0
        for item in self.sampler:
            self.drawn.append(item)
            yield item

    def __len__(self):
        return len(self.sampler)

    def __getattr__(self, name):  # set_epoch and the rest: the sampler's own, so accelerate finds what it looks for
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def take(self, start, stop):
        """The items at positions [start, stop) of the epoch's order (fewer at its end); those before are dropped."""
        items = []
        while self.drawn and self.first < stop:
            item = self.drawn.popleft()
            if self.first >= start:
                items.append(item)
            self.first += 1
        return items


class SampleLog:
    """--log_sample_indices: each optimizer step's samples on this process, a JSON line per step in its own file
    (docs/faults_and_resume.md#the-samples-of-each-step-on-each-process---log_sample_indices). No collective."""

    def __init__(self, accelerator, output_dir, loader, accumulation_steps, enabled=True):
        self.enabled, self.accumulation = enabled, accumulation_steps
        if not enabled:
            return
        self.process, self.processes = accelerator.process_index, accelerator.num_processes
        self.path = sample_file(output_dir, self.process)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        shard = loader.batch_sampler  # accelerate's BatchSamplerShard on N processes, the global BatchSampler on 1
        self.batches = getattr(shard, "batch_sampler", shard)
        sampler = self.batches.sampler  # a retry after running out of memory prepares the same loader again
        self.order = sampler if isinstance(sampler, _DrawnOrder) else _DrawnOrder(sampler)
        self.batches.sampler = self.order

    def step(self, step, epoch, batches_in_epoch):
        """After optimizer step `step` (1-based) on the epoch's batches up to `batches_in_epoch` (1-based, its
        accumulation window's last); `epoch` counted from 0."""
        if not self.enabled:
            return
        last = batches_in_epoch - 1
        share = self.batches.batch_size // self.processes
        # split_batches: this process's share of global batch k is its slice of it (accelerate's BatchSamplerShard),
        # epoch positions [k * B + rank * share, ... + share), cut at the epoch's end: the repeats accelerate pads a
        # short last batch with weigh nothing in the loss and are left out
        starts = [k * self.batches.batch_size + self.process * share for k in range(last - last % self.accumulation,
                                                                                    batches_in_epoch)]
        line = {"step": step, "epoch": epoch + 1, "process": self.process,
                "batches": [self.order.take(start, start + share) for start in starts]}
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as err:
            raise runtime.UserError(runtime.write_failure(err, self.path.parent)) from None


def read_sample_indices(output_dir):
    """{step: [global batch, ...]} of a run's sample files (--log_sample_indices), each global batch its processes'
    shares joined in process order: the same on 1 and N processes, and after a resume."""
    steps = {}
    for path in sample_files(output_dir):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                steps.setdefault(row["step"], []).append(row["batches"])
    return {step: [[item for share in shares for item in share] for shares in zip(*by_process)]
            for step, by_process in sorted(steps.items())}


def _write_line(f, row):
    """Write `row` as a JSON line to `f` (None: not this rank's to write); the OSError of a failed write, else None."""
    if f is None:
        return None
    try:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
    except OSError as err:
        return err
    return None


def _write_atomically(path, text):
    """`path` holds `text` or, whatever happens while writing (a full disk, a kill), its previous content."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
