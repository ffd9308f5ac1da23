"""The best model and early stopping (Trainer's metric_for_best_model, greater_is_better, EarlyStoppingCallback),
experiment trackers (--report_to) and the model cards, in both scripts."""
import importlib.util
import json
import shutil
import struct
from types import SimpleNamespace

import pytest
import torch
from conftest import (GRACE, HANG_S, assert_same_curve, assert_same_weights, kill_job, launch, launch_cmd, read_json,
                      read_jsonl, run_here, start, wait_for)
from huggingface_hub import ModelCard
from safetensors.torch import load_file

import train_bert_cls
import train_resnet
from utils.demo_data import write_digits_imagefolder
from utils.checkpoint import read_training_state
from utils.loop import Selection
from utils.outputs import NOT_METRICS, number_entries
from utils.runtime import UserError, build_accelerator, resolve_trackers

BERT, RESNET = "train_bert_cls.py", "train_resnet.py"
TRACKING = {"MLFLOW_DISABLE_TELEMETRY": "true", "WANDB_MODE": "offline"}  # offline: no report attempts, no uploads


def bert_args(data, out, *extra):
    """Validation every 10 steps, stop after 2 without a better accuracy; no dropout, so that 1 and 2 processes
    train the same model (tests/test_launch_matrix.py)."""
    return ["--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch",
            "--config_overrides", "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0", "--max_seq_len", "32",
            "--train_batch_size", "16", "--eval_batch_size", "32", "--learning_rate", "2e-3", "--num_train_epochs",
            "4", "--eval_steps", "10", "--logging_steps", "10", "--checkpointing_steps", "10", "--save_total_limit",
            "0", "--metric_for_best_model", "eval_accuracy", "--early_stopping_patience", "2", "--do_train",
            "--do_eval", "--do_test", "--output_dir", out, *extra]


@pytest.fixture(scope="module")
def stopped(text_data, tmp_path_factory):
    """A 1-process run that stops early (in this process)."""
    out = tmp_path_factory.mktemp("stopped") / "out"
    run_here(BERT, ["--cpu", *bert_args(text_data, out)])
    return out


def trainer_stop(values, patience, threshold=0.0, greater_is_better=True):
    """(index of the validation that stops, index of the best) by transformers' own EarlyStoppingCallback, with the
    best metric updated as Trainer._determine_best_metric does after each evaluation."""
    from transformers import EarlyStoppingCallback

    callback = EarlyStoppingCallback(patience, threshold)
    args, state, best_index = SimpleNamespace(greater_is_better=greater_is_better), SimpleNamespace(best_metric=None), None
    for index, value in enumerate(values):
        callback.check_metric_value(args, state, None, value)
        if state.best_metric is None or (value > state.best_metric if greater_is_better else value < state.best_metric):
            state.best_metric, best_index = value, index
        if callback.early_stopping_patience_counter >= patience:
            return index, best_index
    return None, best_index


@pytest.mark.parametrize("greater_is_better", [True, False])
@pytest.mark.parametrize("patience, threshold", [(1, 0.0), (2, 0.0), (3, 0.05)])
def test_selection_counts_like_trainers_early_stopping(patience, threshold, greater_is_better):
    values = [0.5, 0.6, 0.58, 0.62, 0.64, 0.64, 0.7, 0.69, 0.71, 0.5, 0.4, 0.3]
    values = values if greater_is_better else [1 - v for v in values]
    selection, state = Selection("accuracy", greater_is_better, "step", patience, threshold), {}
    state.update(selection.fresh_state())
    stop = None
    for index, value in enumerate(values):
        selection.update(state, {"accuracy": value}, index)
        if selection.should_stop(state):
            stop = index
            break
    expected_stop, expected_best = trainer_stop(values, patience, threshold, greater_is_better)
    assert (stop, state["best_step"]) == (expected_stop, expected_best)


def test_the_stop_reason_is_true_when_the_best_is_the_last_evaluation():
    """A gain at or below the threshold counts towards patience and still makes a new best: the reason says both, as
    it says there was no best at all when every evaluation gave NaN."""
    selection, state = Selection("top3_accuracy", True, "step", patience=2, threshold=0.015), {}
    state.update(selection.fresh_state())
    for step, value in ((40, 0.95), (45, 0.955), (50, 0.966667)):  # gains of 0.005 and 0.011667
        selection.update(state, {"top3_accuracy": value}, step)
    assert selection.should_stop(state) and state["best_step"] == 50
    assert selection.stop_reason(state) == (
        "top3_accuracy did not improve on its best by more than 0.015 in the last 2 evaluations (a smaller gain still "
        "makes a new best); best 0.966667 at step 50")
    undefined, state = Selection("pearson", True, "epoch", patience=1), {}
    state.update(undefined.fresh_state())
    undefined.update(state, {"pearson": float("nan")}, 1)
    assert undefined.stop_reason(state) == ("pearson did not improve on its best in the last evaluation; no "
                                            "evaluation gave a number to select by")


def test_bert_stops_where_the_metric_stopped_improving(stopped):
    results = read_json(stopped / "all_results.json")
    evals = [e for e in read_jsonl(stopped / "metrics.jsonl") if e["event"] == "eval"]
    stop, best = trainer_stop([e["accuracy"] for e in evals], patience=2)
    assert stop is not None, [e["accuracy"] for e in evals]  # the fixture must stop early to test anything
    assert results["stopped_early"] is True and results["stopped_early_at_step"] == evals[stop]["step"]
    assert results["train_steps"] == evals[stop]["step"] < 200  # 4 epochs of 50 steps
    assert (results["metric_for_best_model"], results["greater_is_better"]) == ("accuracy", True)
    assert results["best_step"] == evals[best]["step"]
    assert results["best_metric"] == results["best_eval_accuracy"] == evals[best]["accuracy"]
    assert results["eval_accuracy"] == evals[best]["accuracy"]  # the selected model is the one evaluated
    assert results["stopped_early_reason"] == (
        f"accuracy did not improve on its best in the last 2 evaluations; best {evals[best]['accuracy']:.6g} at step "
        f"{evals[best]['step']}")
    # no checkpoint at the step it stopped: the run is finished, nothing to resume
    assert not (stopped / "checkpoints" / f"step_{evals[stop]['step']}").exists()


def test_bert_model_card(stopped):
    """best_model/README.md as the hub reads it: the metrics of the selected model, validation and test: every number
    its evaluations returned (the counts aside)."""
    results = read_json(stopped / "all_results.json")
    events = {e["event"]: e for e in read_jsonl(stopped / "metrics.jsonl") if e["event"].startswith("best_model_")}
    card = ModelCard.load(stopped / "best_model" / "README.md")
    assert (card.data.library_name, card.data.pipeline_tag) == ("transformers", "text-classification")
    reported = {(r.dataset_split, r.metric_type): r.metric_value for r in card.data.eval_results}
    expected = {(split, name): results[f"{prefix}_{name}"] for split, prefix in (("validation", "eval"),
                                                                                  ("test", "test"))
                for name in number_entries(events[f"best_model_{prefix}"]) if name not in ("step", *NOT_METRICS)}
    assert {name for _, name in expected} >= {"accuracy", "loss"}  # what the evaluation returns, read back
    assert reported == expected
    labels = (stopped / "labels.txt").read_text(encoding="utf-8").split()
    assert all(f"| {i} | {label} |" in card.text for i, label in enumerate(labels))
    assert f"at step {results['best_step']}. Training stopped early at step {results['stopped_early_at_step']}" \
        in card.text
    assert "--early_stopping_patience 2" in card.text and "| max_seq_len | 32 |" in card.text
    assert "| train | `" in card.text and "| 800 |" in card.text  # the data files and their sizes


def test_resumed_run_stops_at_the_same_step(stopped, text_data, tmp_path):
    """Stopped after a validation that did not improve (the patience counter at 1), resumed: it stops where the
    uninterrupted run stopped, with the same model. A counter that started again at 0 would stop 10 steps later."""
    results = read_json(stopped / "all_results.json")
    counters = {int(p.name.split("_")[1]): read_json(p / "training_state.json")["early_stopping_patience_counter"]
                for p in (stopped / "checkpoints").glob("step_*")}
    step = max(s for s, count in counters.items() if count > 0 and s < results["stopped_early_at_step"])
    out = tmp_path / "out"
    shutil.copytree(stopped, out)
    for later in [p for p in (out / "checkpoints").glob("step_*") if int(p.name.split("_")[1]) > step]:
        shutil.rmtree(later)  # what a run preempted at `step` leaves
    (out / "all_results.json").unlink()
    run_here(BERT, ["--cpu", *bert_args(text_data, out, "--resume_from_checkpoint", out / "checkpoints" / f"step_{step}")])
    resumed = read_json(out / "all_results.json")
    for key in ("stopped_early_at_step", "stopped_early_reason", "best_step", "eval_accuracy", "test_accuracy"):
        assert resumed[key] == results[key], key
    assert_same_curve(stopped, out, ("accuracy", "loss"))
    assert_same_weights(load_file(stopped / "best_model" / "model.safetensors"),
                        load_file(out / "best_model" / "model.safetensors"))


def test_resume_keeps_the_metric_that_selected(stopped, text_data, tmp_path):
    """The checkpoint's best was measured by its metric and direction: another one is refused before training."""
    step = min(int(p.name.split("_")[1]) for p in (stopped / "checkpoints").glob("step_*"))
    out = tmp_path / "out"
    shutil.copytree(stopped, out)
    proc = run_here(BERT, ["--cpu", *bert_args(text_data, out, "--metric_for_best_model", "loss",
                                               "--resume_from_checkpoint", out / "checkpoints" / f"step_{step}")],
                    check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {out / 'checkpoints' / f'step_{step}' / 'training_state.json'}: checkpoint has "
        "metric_for_best_model='accuracy', this run has 'loss'")


def tensorboard_events(run_dir, *tags):
    """{tag: its (step, value) events in order} of a TensorBoard run directory, read once (every event file in it, as
    TensorBoard reads them: what a writer's purge_step discards left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tensorboard = EventAccumulator(str(run_dir))
    tensorboard.Reload()
    return {tag: [(s.step, s.value) for s in tensorboard.Scalars(tag)] for tag in tags}


def wandb_offline_runs(wandb_dir):
    """[(run id, [(step, history row)])] of every offline run under `wandb_dir`, in the order they started (a
    resumed W&B run offline is one directory per launch, offline-run-<time>-<id>, under the same id; `wandb sync`
    uploads them as one run). wandb ships no Python reader of its .wandb files (its reader is in the wandb-core
    binary): they are read here as wandb writes them, a LevelDB log of wandb's own protobuf Records, parsed with
    wandb's classes; a run record, where the file has one, names the directory's id."""
    from wandb.proto.wandb_internal_pb2 import Record

    runs = []
    for run_file in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        run_id = run_file.parent.name.rsplit("-", 1)[1]
        records = [Record.FromString(data) for data in leveldb_log_records(run_file.read_bytes())]
        assert {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"} <= {run_id}
        history = [(r.history.step.num, {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                         for item in r.history.item})
                   for r in records if r.WhichOneof("record_type") == "history"]
        runs.append((run_id, history))
    return runs


def leveldb_log_records(data, block=32768, header=7):
    """The records of a LevelDB log (wandb's .wandb layout: a 7-byte ':W&B' file header, then 32 KiB blocks of chunks,
    each with a 7-byte header: crc32c, length, kind; kind 1 a whole record, 2/3/4 its first/middle/last part); a
    block's tail shorter than a chunk header is padding."""
    assert data[:4] == b":W&B", "not a .wandb file"
    records, parts, pos = [], b"", header
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if kind == 0:  # zero padding: the end of what was written
            break
        parts += data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):
            records.append(parts)
            parts = b""
    return records


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")  # mlflow's SQLAlchemy models
def test_sigterm_and_resume_stop_where_one_process_does_and_continue_one_tracker_run(stopped, text_data, tmp_path):
    """2 processes stopped by SIGTERM and resumed from `latest`: the same early stop and the same selected step as the
    uninterrupted 1-process run; TensorBoard, MLflow and W&B (offline) hold ONE run each, the one the checkpoints
    record, written by the main process, with every logged step once, in order, and the values metrics.jsonl has."""
    for tracker in ("mlflow", "wandb"):
        pytest.importorskip(tracker, reason=f"{tracker} is not installed (requirements-dev.txt)")
    out = tmp_path / "out"
    args = bert_args(text_data, out, "--report_to", "tensorboard", "mlflow", "wandb")
    import signal

    env = {**TRACKING, **{f"WANDB_{d}_DIR": str(tmp_path / f"wandb_{d.lower()}") for d in ("CONFIG", "CACHE", "DATA")}}
    job = start(launch_cmd(BERT, args, num_processes=2), tmp_path / "preempted.log", env=env)
    wait_for(lambda: (out / "checkpoints" / "step_10" / "training_state.json").exists(), job)
    kill_job(job, signal.SIGTERM)
    job.wait(timeout=GRACE + HANG_S)
    assert read_json(out / "all_results.json")["preempted"] is True, (tmp_path / "preempted.log").read_text()[-3000:]
    stopped_at = read_json(out / "all_results.json")["train_steps"]
    first_runs = read_training_state(out / "checkpoints" / f"step_{stopped_at}")["tracker_runs"]
    proc = launch(BERT, [*args, "--resume_from_checkpoint", "latest"], num_processes=2, env=env)
    assert f"continuing the runs that checkpoint step {stopped_at} records" in proc.stdout
    last = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    assert read_training_state(out / "checkpoints" / f"step_{last}")["tracker_runs"] == first_runs
    one, two = read_json(stopped / "all_results.json"), read_json(out / "all_results.json")
    assert two["num_processes"] == 2
    assert (two["stopped_early_at_step"], two["best_step"]) == (one["stopped_early_at_step"], one["best_step"])
    events = read_jsonl(out / "metrics.jsonl")
    train_steps = [e["step"] for e in events if e["event"] == "train"]
    eval_steps = [e["step"] for e in events if e["event"] == "eval"]
    evals = {e["step"]: e["accuracy"] for e in events if e["event"] == "eval"}
    assert train_steps[0] < stopped_at < train_steps[-1]  # logged before and after the stop

    tensorboard = tensorboard_events(out / "runs" / "bert_cls", "train/loss", "eval/accuracy")
    assert [step for step, _ in tensorboard["train/loss"]] == train_steps
    assert [step for step, _ in tensorboard["eval/accuracy"]] == eval_steps
    assert dict(tensorboard["eval/accuracy"]) == pytest.approx(evals)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    [experiment] = [e for e in client.search_experiments() if e.name == "bert_cls"]
    [mlflow_run] = client.search_runs([experiment.experiment_id])
    assert mlflow_run.info.run_id == first_runs["mlflow"]
    history = sorted(client.get_metric_history(mlflow_run.info.run_id, "train/loss"), key=lambda m: m.timestamp)
    assert [m.step for m in history] == train_steps
    history = client.get_metric_history(mlflow_run.info.run_id, "eval/accuracy")
    assert [m.step for m in history] == eval_steps and {m.step: m.value for m in history} == pytest.approx(evals)
    assert mlflow_run.data.params["metric_for_best_model"] == "accuracy"

    # W&B: one run id, the checkpoint's, in both launches, whose rows continue where the stop left them. wandb-core
    # gets the SIGTERM too (Slurm signals every process of a step) and ends the launch's stream at once, so the stopped
    # launch's offline file may hold none of its rows (wandb's own limitation, reported to wandb).
    launches = wandb_offline_runs(out / "wandb")
    assert [run_id for run_id, _ in launches] == [first_runs["wandb"]] * 2
    history = [(step, row) for _, rows in launches for step, row in rows]
    steps = [step for step, _ in history]
    assert steps == sorted(set(steps))  # strictly increasing across the two launches
    # from its stop signal on, the stopped launch sent the trackers nothing (W&B's service may be gone): the resumed
    # launch sends them the steps after the last one they got, which the checkpoint records, then its own
    sent = read_training_state(out / "checkpoints" / f"step_{stopped_at}")["trackers_logged_to"]
    assert sent <= stopped_at
    resumed = launches[1][1]
    assert [step for step, row in resumed if "train/loss" in row] == [s for s in train_steps if s > sent]
    assert [step for step, row in resumed if "eval/accuracy" in row] == [s for s in eval_steps if s > sent]


def test_requeued_run_continues_one_wandb_run(text_data, tmp_path, monkeypatch):
    """A run resumed from `latest` (a requeue) continues the W&B run its checkpoint records (offline): one id, every
    logged step once, strictly increasing, as metrics.jsonl has them."""
    pytest.importorskip("wandb", reason="wandb is not installed (requirements-dev.txt)")
    for name, value in {**TRACKING, **{f"WANDB_{d}_DIR": str(tmp_path / f"wandb_{d.lower()}")
                                       for d in ("CONFIG", "CACHE", "DATA")}}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    args = ["--cpu", *bert_args(text_data, out, "--report_to", "wandb", "--early_stopping_patience", "100")]
    run_here(BERT, [*args, "--max_train_steps", "20"])
    resumed = run_here(BERT, [*args, "--max_train_steps", "40", "--resume_from_checkpoint", "latest"])
    assert "continuing the runs that checkpoint step 20 records" in resumed.stdout
    run_id = read_training_state(out / "checkpoints" / "step_20")["tracker_runs"]["wandb"]
    assert read_training_state(out / "checkpoints" / "step_40")["tracker_runs"]["wandb"] == run_id
    launches = wandb_offline_runs(out / "wandb")
    assert [launch_id for launch_id, _ in launches] == [run_id] * 2
    history = [(step, row) for _, rows in launches for step, row in rows]
    steps = [step for step, _ in history]
    assert steps == sorted(set(steps)) and steps[-1] == 40  # strictly increasing across the two launches
    events = read_jsonl(out / "metrics.jsonl")
    assert [step for step, row in history if "train/loss" in row] == [e["step"] for e in events if e["event"] == "train"]
    assert {step: row["eval/accuracy"] for step, row in history if "eval/accuracy" in row} == pytest.approx(
        {e["step"]: e["accuracy"] for e in events if e["event"] == "eval"})


@pytest.fixture
def resnet_selection(digits_data, tmp_path):
    """selection(*flags) -> (metric, greater_is_better) as train_resnet.py's main resolves them for a run on the
    digits: its evaluate() on one validation batch names the metrics (in this process, 1 process on the CPU)."""
    from accelerate.state import AcceleratorState, GradientState

    base = [digits_data, "--cpu", "--image_size", "16", "--val_resize", "16", "-b", "8", "-j", "0"]
    args = train_resnet.parse_args(base)
    accelerator = build_accelerator(args, tmp_path)
    loader = train_resnet.build_dataloaders(accelerator, args).val_loader
    model = train_resnet.build_model(args, len(loader.dataset.classes))

    def selection(*flags):
        chosen = train_resnet.best_model_selection(accelerator, train_resnet.parse_args([*base, *flags]), model,
                                                   loader)
        return chosen.metric, chosen.greater_is_better

    yield selection
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_metric_names_follow_trainer_and_timm(resnet_selection):
    assert resnet_selection() == ("acc1", True)
    assert resnet_selection("--eval-metric", "top5") == ("acc5", True)  # timm's names
    assert resnet_selection("--metric_for_best_model", "eval_loss") == ("loss", False)  # Trainer's prefix and default
    assert resnet_selection("--eval_metric", "loss", "--greater_is_better", "true") == ("loss", True)
    assert resnet_selection("--metric_for_best_model", "acc1", "--greater_is_better", "false") == ("acc1", False)


@pytest.mark.parametrize("script, argv, message", [
    (RESNET, ["-e", "--resume", "x.pth", "--eval-metric", "top5"],
     "--metric_for_best_model applies to training; this run does not train"),
    (RESNET, ["--early_stopping_threshold", "0.1"], "--early_stopping_threshold needs --early_stopping_patience"),
    (RESNET, ["--early_stopping_patience", "0"], "--early_stopping_patience 0: at least 1 validation"),
    (RESNET, ["-e", "--resume", "x.pth", "--early_stopping_patience", "2"],
     "--early_stopping_patience applies to training; this run does not train"),
    (RESNET, ["--greater_is_better", "maybe"], "'maybe': expected true or false"),
    (BERT, ["--data_dir", "DATA", "--early_stopping_patience", "2"],
     "--early_stopping_patience applies to training; this run does not train"),
    (BERT, ["--data_dir", "DATA", "--metric_for_best_model", "accuracy"],
     "--metric_for_best_model applies to training; this run does not train"),
])
def test_selection_flags_refused_by_the_parser(script, argv, message, digits_data, text_data, capsys):
    base = [digits_data] if script == RESNET else ["--model_name_or_path", text_data / "model", "--do_eval"]
    argv = [str(a) for a in base] + [str(text_data) if a == "DATA" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        (train_resnet if script == RESNET else train_bert_cls).parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, error", [
    (["--early_stopping_patience", "2"],
     "--early_stopping_patience stops on the validation metric: this run has no validation set"),
    (["--metric_for_best_model", "accuracy"],
     "--metric_for_best_model accuracy selects by a validation metric: this run has no validation set")])
def test_bert_selection_without_a_validation_set_is_refused_before_training(flags, error, text_data, tmp_path):
    """A training file alone: nothing to select by, known before the model is built, nothing written. (A name
    evaluate() does not return: tests/test_metric_names.py.)"""
    out = tmp_path / "out"
    args = ["--train_file", text_data / "train.txt", "--model_name_or_path", text_data / "model", "--from_scratch",
            "--do_train", *flags, "--output_dir", out]
    proc = run_here(BERT, ["--cpu", *args], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: {error}"
    assert not out.exists()


def test_report_to_names_trackers_accelerate_knows():
    pytest.importorskip("mlflow", reason="mlflow is not installed (requirements-dev.txt)")
    def trackers(*names, with_tracking=False):
        return resolve_trackers(SimpleNamespace(report_to=list(names) or None, with_tracking=with_tracking))

    assert trackers() == [] and trackers("none") == []
    assert trackers(with_tracking=True) == ["tensorboard"] == trackers("tensorboard", with_tracking=True)
    assert trackers("tensorboard", "mlflow") == ["tensorboard", "mlflow"]
    assert {"tensorboard", "mlflow"} <= set(trackers("all"))  # the installed ones, as accelerate finds them
    with pytest.raises(UserError, match="--report_to none cannot be combined with tensorboard"):
        trackers("none", "tensorboard")


def test_missing_tracker_package_is_a_one_line_error(text_data, tmp_path):
    missing = next((name for name in ("wandb", "comet_ml") if importlib.util.find_spec(name) is None), None)
    if missing is None:
        pytest.skip("wandb and comet_ml are both installed")
    proc = run_here(BERT, ["--cpu", *bert_args(text_data, tmp_path / "out", "--report_to", "tensorboard", missing)],
                    check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --report_to {missing}: the {missing} package is not installed (pip install {missing})")
    assert not (tmp_path / "out").exists()


# ---- train_resnet.py: stops by epochs, and resumes into the same stop ----

def resnet_args(data, out, epochs, *extra):
    """A small torchvision model, 3 steps per epoch (120 images, -b 40); an improvement must exceed 100 points of
    acc@1, so every validation after the first counts towards the patience of 2: the run stops after epoch 3."""
    return ["--cpu", data, "-a", "shufflenet_v2_x0_5", "--image_size", "16", "--val_resize", "16", "-b", "40",
            "--lr", "0.02", "--momentum", "0", "-j", "0", "--epochs", epochs,
            "--checkpointing_steps", "3", "--eval-metric", "top1", "--early_stopping_patience", "2",
            "--early_stopping_threshold", "100", "--output_dir", out, *extra]


def test_resnet_stops_early_resumes_into_the_same_stop_and_writes_a_card(tmp_path):
    def train(out, epochs, *extra):
        run_here(RESNET, resnet_args(data, tmp_path / out, epochs, *extra))
        return read_json(tmp_path / out / "all_results.json")

    data = write_digits_imagefolder(tmp_path / "digits", size=16, limit=160)
    reference = train("reference", 6)
    assert reference["stopped_early"] and reference["stopped_early_at_step"] == reference["train_steps"] == 9
    # cut after epoch 2 (its checkpoint holds the patience counter at 1), then resumed for 6 epochs
    cut = train("cut", 2)
    assert not cut["stopped_early"] and cut["train_steps"] == 6
    assert read_json(tmp_path / "cut" / "checkpoints" / "step_6" / "training_state.json")[
        "early_stopping_patience_counter"] == 1
    resumed = train("cut", 6, "--resume", "latest")
    for key in ("stopped_early_at_step", "stopped_early_reason", "best_epoch", "best_acc1", "eval_acc1"):
        assert resumed[key] == reference[key], key
    best = {name: torch.load(tmp_path / name / "model_best.pth", weights_only=True) for name in ("reference", "cut")}
    assert_same_weights(best["reference"]["state_dict"], best["cut"]["state_dict"])

    card = ModelCard.load(tmp_path / "reference" / "model_card.md")
    [selected] = [e for e in read_jsonl(tmp_path / "reference" / "metrics.jsonl")
                  if e["event"] == "eval" and e["epoch"] == reference["best_epoch"]]
    names = [k for k in number_entries(selected) if f"eval_{k}" in reference and k not in NOT_METRICS]  # evaluate()'s
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == {k: selected[k] for k in names}
    assert best["reference"]["best_acc1"] == selected["acc1"]
    # the card's Python snippet, as a user runs it, reproduces the selected model's top-1 on the validation images
    snippet = card.text.split("```python\n")[1].split("```")[0]
    namespace = {}
    exec(snippet, namespace)
    from PIL import Image

    paths = sorted((data / "val").rglob("*.png"))
    images = torch.stack([namespace["preprocess"](Image.open(p).convert("RGB")) for p in paths])
    with torch.no_grad():
        predicted = namespace["model"](images).argmax(1)
    targets = torch.tensor([int(p.parent.name) for p in paths])
    assert 100 * (predicted == targets).float().mean().item() == pytest.approx(selected["acc1"], abs=1e-4)
