"""The metric names come from what `evaluate` returns, in both scripts: a number a user adds to evaluate() (the
ADAPTATION SECTION) is selectable (--metric_for_best_model, timm's --eval-metric), printed in the console's evaluation
lines, logged (metrics.jsonl, TensorBoard), recorded (all_results.json, the model card, model_best.pth) and selects
the best model, with no other list to edit; a mistyped name stops the run before training, in one line listing them.

Each script is copied into a temporary directory and changed there as a user changes it, then run for real. The
changes go where a user's own edits leave them findable (evaluate()'s closing `return`, its loop over the batches),
and the checks look for the added number, not for its place: a copy that already has another user's number there
passes too (the `after_another_number` variants: ResNet's trained copy, and both scripts' copies stopped before
training)."""
import ast
import random
import sys

import numpy as np
import pytest
import torch
import torchvision
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from conftest import ROOT, launch, pythonpath, read_json, read_jsonl, run_here
from huggingface_hub import ModelCard
from PIL import Image
from sklearn.metrics import balanced_accuracy_score, f1_score
from torch.utils.data import DataLoader, TensorDataset

from utils.loop import validation_names
from utils.outputs import number_entries

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")
PYTHONPATH = pythonpath(ROOT / "tests" / "fake_gpu", ROOT)  # launch's simulated GPU, and utils/ beside the copy


def add_to_evaluate(text, script, returned=(), before_loop=(), in_loop=()):
    """`text` (a script) with lines added to its `def evaluate(`, as a user adds a number: `returned` just before it
    returns, the dict it returns bound to `returned`; `before_loop` and `in_loop` before and at the end of its loop
    over the batches (its first `for`). Found by the syntax tree, so that edits elsewhere in evaluate() leave them."""
    tree = ast.parse(text)
    [evaluate] = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "evaluate"] or [None]
    assert evaluate is not None, f"{script} has no top-level def evaluate("
    last = evaluate.body[-1]
    assert isinstance(last, ast.Return) and last.value is not None, f"{script}: evaluate() no longer ends in a return"
    lines = text.splitlines(keepends=True)
    indent = " " * last.col_offset
    value = ast.get_source_segment(text, last.value)
    bound = [] if value == "returned" else [f"{indent}returned = ({value})\n"]  # a second addition: bound already
    lines[last.lineno - 1:last.end_lineno] = [*bound, *(f"{indent}{line}\n" for line in returned),
                                              f"{indent}return returned\n"]
    if before_loop or in_loop:
        loop = next((node for node in evaluate.body if isinstance(node, ast.For)), None)
        assert loop is not None and not loop.orelse, f"{script}: evaluate() has no loop over the batches"
        inner = " " * loop.body[0].col_offset
        lines[loop.end_lineno:loop.end_lineno] = [f"{inner}{line}\n" for line in in_loop]
        lines[loop.lineno - 1:loop.lineno - 1] = [f"{' ' * loop.col_offset}{line}\n" for line in before_loop]
    return "".join(lines)


def edited_copy(script, directory, name, additions):
    """`script` copied to directory/name.py with each of `additions` (add_to_evaluate's keywords) made in turn."""
    text = (ROOT / script).read_text(encoding="utf-8")
    for addition in additions:
        text = add_to_evaluate(text, script, **addition)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    path.write_text(text, encoding="utf-8")
    return path


def evaluated_names(results, prefix="eval"):
    """The numbers among all_results.json's `{prefix}_*` entries, in its order: what evaluate() returned."""
    return [key[len(prefix) + 1:] for key, value in number_entries(results).items() if key.startswith(f"{prefix}_")]


def run_copy(script, args, monkeypatch):
    """A copied script run in this process (run_here), importable from its directory."""
    monkeypatch.syspath_prepend(str(script.parent))
    try:
        return run_here(script.name, args, check=False)
    finally:
        sys.modules.pop(script.stem, None)


REFUSED = ("error: --metric_for_best_model {}: not a validation metric of this run; choose from the numbers its "
           "evaluate() returns: ")


def assert_refused_before_training(proc, out, flag, names):
    """A name evaluate() does not return: exit 2, no traceback, one line listing what it returns (`names`, in any
    order), nothing written."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(REFUSED.format(flag)), line
    assert sorted(line[len(REFUSED.format(flag)):].split(", ")) == sorted(names), line
    assert "Running training" not in proc.stdout and not out.exists()


# ---- train_bert_cls.py with a weighted F1 ----

WEIGHTED_F1 = {"returned": ["from sklearn.metrics import f1_score",
                            "returned[\"weighted_f1\"] = f1_score(targets.numpy(), logits.argmax(-1).numpy(), "
                            "average=\"weighted\", zero_division=0)"]}
# another user's number, added first at the same place
MEDIAN_CONFIDENCE = {"returned": ["returned[\"median_confidence\"] = logits.softmax(-1).amax(-1).median().item()"]}
BERT_VARIANTS = {"alone": [], "after_another_number": [MEDIAN_CONFIDENCE]}


@pytest.fixture(scope="module")
def bert_copy(tmp_path_factory):
    return edited_copy("train_bert_cls.py", tmp_path_factory.mktemp("bert_copy"), "my_bert_cls", [WEIGHTED_F1])


def bert_args(data, out, *extra):
    """40 steps: enough to learn a little (the validations differ, so that the selection has a choice)."""
    return ["--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch", "--max_seq_len", "32",
            "--train_batch_size", "16", "--eval_batch_size", "32", "--learning_rate", "3e-3", "--max_train_steps",
            "40", "--eval_steps", "10", "--logging_steps", "10", "--do_train", "--do_eval", "--do_test",
            "--output_dir", out, *extra]


@pytest.fixture(scope="module")
def bert_run(bert_copy, text_data, tmp_path_factory):
    """The copy selecting by its new number (Trainer's eval_ prefix), 2 processes (gathered predictions), with
    TensorBoard."""
    out = tmp_path_factory.mktemp("bert_weighted_f1") / "out"
    proc = launch(bert_copy, bert_args(text_data, out, "--metric_for_best_model", "eval_weighted_f1", "--report_to",
                                       "tensorboard"), num_processes=2, env=PYTHONPATH)
    return out, proc


def weighted_f1_of_confusion_matrix(path):
    """sklearn's weighted F1 of the (true, predicted) pairs a confusion matrix CSV counts."""
    rows = [line.split(",")[1:] for line in path.read_text(encoding="utf-8").splitlines()[1:]]
    pairs = [(i, j) for i, row in enumerate(rows) for j, count in enumerate(row) for _ in range(int(count))]
    return f1_score(*zip(*pairs), average="weighted", zero_division=0)


def test_a_number_added_to_bert_evaluate_is_selected_printed_logged_and_recorded(bert_run):
    out, proc = bert_run
    results = read_json(out / "all_results.json")
    events = read_jsonl(out / "metrics.jsonl")
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [10, 20, 30, 40]
    assert len({e["weighted_f1"] for e in evals}) > 1, evals  # the model learns: the selection has a choice
    best = max(evals, key=lambda e: e["weighted_f1"])  # the first of equals: selection needs a strict improvement
    assert (results["metric_for_best_model"], results["greater_is_better"]) == ("weighted_f1", True)
    assert results["best_step"] == best["step"]
    assert results["best_metric"] == results["best_eval_weighted_f1"] == best["weighted_f1"]
    # computed over every validation and test text once on 2 processes, as the confusion matrices count them
    for prefix in ("eval", "test"):
        assert results[f"{prefix}_weighted_f1"] == pytest.approx(
            weighted_f1_of_confusion_matrix(out / f"{prefix}_confusion_matrix.csv"))
        [selected] = [e for e in events if e["event"] == f"best_model_{prefix}"]
        assert selected["weighted_f1"] == results[f"{prefix}_weighted_f1"]
    # printed: every number evaluate() returns, in its order, in each console line of an evaluation
    names = evaluated_names(results)
    assert {"weighted_f1", "loss", "accuracy", "samples"} <= set(names)
    shown = [line for line in proc.stdout.splitlines() if line.startswith(("eval step ", "eval: ", "test: "))]
    assert len(shown) == len(evals) + 2
    for line in shown:
        numbers = line.split(" | ", 1)[1] if line.startswith("eval step ") else line.split(": ", 1)[1]
        assert [part.split()[0] for part in numbers.split(" | ")] == names
    # TensorBoard: every validation's value
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tensorboard = EventAccumulator(str(out / "runs" / "bert_cls"))
    tensorboard.Reload()
    logged = [(s.step, s.value) for s in tensorboard.Scalars("eval/weighted_f1")]
    assert [step for step, _ in logged] == [e["step"] for e in evals]
    assert dict(logged) == pytest.approx({e["step"]: e["weighted_f1"] for e in evals})
    # the model card of best_model/: validation and test
    card = ModelCard.load(out / "best_model" / "README.md")
    reported = {(r.dataset_split, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert reported[("validation", "weighted_f1")] == results["eval_weighted_f1"]
    assert reported[("test", "weighted_f1")] == results["test_weighted_f1"]


@pytest.mark.parametrize("variant", BERT_VARIANTS)
def test_a_name_bert_evaluate_does_not_return_stops_before_training(variant, bert_run, text_data, tmp_path,
                                                                   monkeypatch):
    script = edited_copy("train_bert_cls.py", tmp_path / "copy", "my_bert_cls", [*BERT_VARIANTS[variant], WEIGHTED_F1])
    out = tmp_path / "out"
    proc = run_copy(script, ["--cpu", *bert_args(text_data, out, "--metric_for_best_model", "weighted_f2")],
                    monkeypatch)
    names = evaluated_names(read_json(bert_run[0] / "all_results.json"))
    assert_refused_before_training(proc, out, "weighted_f2", names + (["median_confidence"] if BERT_VARIANTS[variant]
                                                                      else []))


# ---- train_resnet.py with balanced accuracy ----

BALANCED_ACCURACY = {"before_loop": ["predicted, labelled = [], []"],
                     "in_loop": ["kept = targets >= 0  # readable images",
                                 "predicted += logits[kept].argmax(-1).tolist()",
                                 "labelled += targets[kept].tolist()"],
                     "returned": ["from sklearn.metrics import balanced_accuracy_score",
                                  "returned[\"balanced_acc\"] = 100.0 * balanced_accuracy_score(labelled, predicted)"]}
# another user's number, added first at the same place
ERROR_RATE = {"returned": ["returned[\"error_rate\"] = 100.0 - returned[\"acc1\"]"]}
RESNET_VARIANTS = {"alone": [], "after_another_number": [ERROR_RATE]}
RESNET_FAST = ["-a", "resnet18", "--image_size", "16", "--val_resize", "16", "-b", "64", "--lr", "0.02",
               "--momentum", "0", "-j", "0"]


@pytest.fixture(scope="module")
def resnet_copy(tmp_path_factory):
    """The copy given another user's number first, where its own then goes (the launched BERT copy has its own
    alone)."""
    return edited_copy("train_resnet.py", tmp_path_factory.mktemp("resnet_copy"), "my_resnet",
                       [*RESNET_VARIANTS["after_another_number"], BALANCED_ACCURACY])


@pytest.fixture(scope="module")
def resnet_run(resnet_copy, few_digits, tmp_path_factory):
    """The copy selecting model_best.pth by its new number through timm's flag, 3 epochs on 1 process, in this
    process (BERT's copy runs on 2: the number computed from gathered predictions)."""
    out = tmp_path_factory.mktemp("resnet_balanced") / "out"
    with pytest.MonkeyPatch.context() as monkeypatch:
        proc = run_copy(resnet_copy, ["--cpu", few_digits, *RESNET_FAST, "--epochs", "3", "--eval-metric",
                                      "balanced_acc", "--output_dir", out], monkeypatch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_a_number_added_to_resnet_evaluate_selects_model_best_and_is_printed_logged_and_recorded(resnet_run,
                                                                                                 few_digits):
    out, proc = resnet_run
    results = read_json(out / "all_results.json")
    evals = [e for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "eval"]
    assert [e["epoch"] for e in evals] == [1, 2, 3]
    best = max(evals, key=lambda e: e["balanced_acc"])  # the first of equals
    assert (results["metric_for_best_model"], results["greater_is_better"]) == ("balanced_acc", True)
    assert results["best_epoch"] == best["epoch"]
    assert results["best_metric"] == results["best_balanced_acc"] == best["balanced_acc"]
    assert results["eval_balanced_acc"] == evals[-1]["balanced_acc"]
    # printed after each epoch, with every number evaluate() returns, by name
    names = evaluated_names(results)
    assert {"balanced_acc", "acc1", "loss", "samples"} <= set(names)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(" * Epoch ")]
    assert len(lines) == 3
    for line, event in zip(lines, evals):
        parts = line.split(" | ")
        assert [part.split()[0] for part in parts[1:-1]] == names
        assert f"balanced_acc {event['balanced_acc']:.4f}" in parts and parts[-1].startswith("best balanced_acc ")
    # model_best.pth holds the selected epoch's weights and numbers; its card says them
    exported = torch.load(out / "model_best.pth", weights_only=True)
    assert exported["epoch"] == best["epoch"] and exported["best_balanced_acc"] == best["balanced_acc"]
    assert {name: exported[name] for name in names} == {name: best[name] for name in names}
    card = ModelCard.load(out / "model_card.md")
    assert {r.metric_type: r.metric_value for r in card.data.eval_results}["balanced_acc"] == best["balanced_acc"]
    # ... and its weights give that balanced accuracy on every validation image, with nothing from this project
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(exported["state_dict"])
    to_tensor = torchvision.transforms.Compose([
        torchvision.transforms.Resize(16), torchvision.transforms.CenterCrop(16), torchvision.transforms.ToTensor(),
        torchvision.transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    paths = sorted((few_digits / "val").rglob("*.png"))
    images = torch.stack([to_tensor(Image.open(p).convert("RGB")) for p in paths])
    with torch.no_grad():
        predicted = model.eval()(images).argmax(1).tolist()
    targets = [exported["class_to_idx"][p.parent.name] for p in paths]
    assert 100 * balanced_accuracy_score(targets, predicted) == pytest.approx(best["balanced_acc"], abs=1e-4)


@pytest.mark.parametrize("variant", RESNET_VARIANTS)
def test_a_name_resnet_evaluate_does_not_return_stops_before_training(variant, resnet_run, few_digits, tmp_path,
                                                                     monkeypatch):
    script = edited_copy("train_resnet.py", tmp_path / "copy", "my_resnet", [*RESNET_VARIANTS[variant],
                                                                             BALANCED_ACCURACY])
    out = tmp_path / "out"
    proc = run_copy(script, ["--cpu", few_digits, *RESNET_FAST, "--epochs", "1", "--eval-metric", "balanced",
                             "--output_dir", out], monkeypatch)
    names = evaluated_names(read_json(resnet_run[0] / "all_results.json"))  # its copy has error_rate too
    assert_refused_before_training(proc, out, "balanced", [name for name in names
                                                           if RESNET_VARIANTS[variant] or name != "error_rate"])


@pytest.mark.parametrize("variant", RESNET_VARIANTS)
def test_a_broken_evaluate_fails_before_training(variant, few_digits, tmp_path, monkeypatch):
    """evaluate() runs on one validation batch before the first step: its bug shows in seconds, not after an epoch."""
    script = edited_copy("train_resnet.py", tmp_path / "copy", "broken_resnet",
                         [*RESNET_VARIANTS[variant], {"returned": ["returned[\"typo\"] = top5 / skiped"]}])
    out = tmp_path / "out"
    with pytest.raises(NameError, match="'skiped' is not defined"):  # a bug in the code: its traceback
        run_copy(script, ["--cpu", few_digits, *RESNET_FAST, "--epochs", "1", "--output_dir", out], monkeypatch)
    assert not out.exists()  # nothing trained or written


# ---- the dry evaluation itself ----

@pytest.fixture
def accelerator():
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_the_dry_evaluation_leaves_the_run_as_it_found_it(accelerator):
    """One batch of samples spread over the validation set (the last included), no loader prepared or left
    registered (accelerate's save_state numbers the prepared ones), every random generator, and each module's mode,
    as they were; its names are the numbers of what the evaluation returned, in its order."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(3))
    model[2].eval()  # a frozen BatchNorm in a model that trains
    modes = [module.training for module in model.modules()]
    loader = DataLoader(TensorDataset(torch.randn(10, 4), torch.arange(10)), batch_size=4, shuffle=True)
    seen = []

    def evaluate(batches):
        model.eval()
        for inputs, targets in batches:
            seen.append(targets.tolist())
            model(inputs)
        model.train()
        torch.rand(3), np.random.rand(), random.random()  # an evaluation that draws
        return {"loss": 0.5, "report": {"a": 1.0}, "samples": 4, "matrix": np.eye(2), "per_class": [0.1, 0.2],
                "stopped": False, "errors": np.int64(2)}

    torch.manual_seed(0)
    generators = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    assert validation_names(accelerator, model, loader, evaluate) == ["loss", "samples", "errors"]
    assert seen == [[0, 3, 6, 9]]  # 4 samples (the batch of a process), spread evenly, in order
    assert torch.equal(torch.get_rng_state(), generators[0])
    assert np.array_equal(np.random.get_state()[1], generators[1]) and random.getstate() == generators[2]
    assert [module.training for module in model.modules()] == modes
    assert accelerator._dataloaders == [] and not GradientState().in_dataloader


def test_a_window_batch_spread_over_the_texts_pools_per_text():
    """The dry evaluation's batch of a --doc_stride validation set holds windows of texts far apart: each text's
    windows still pool into one row (utils/text_metrics.py pool_windows numbers the texts again)."""
    from utils.text_metrics import pool_windows

    logits = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 4.0], [7.0, 6.0]])
    pooled, targets = pool_windows(logits, torch.tensor([0, 1, 1, 2]), torch.tensor([3, 7, 7, 12]))
    assert pooled.tolist() == [[1.0, 0.0], [4.0, 3.0], [7.0, 6.0]] and targets.tolist() == [0, 1, 2]
