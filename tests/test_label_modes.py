"""utils.text_metrics and utils.loop's class weights: multi-label, regression and class-weighted losses, metrics and
prediction rows, against hand-made cases, torch and scipy."""
import math

import numpy as np
import pytest
import torch

from utils.text_metrics import evaluation_metrics, prediction_rows, training_loss
from utils.text_data import Example

LABELS = ["a", "b", "c"]


def logit(p):
    return math.log(p / (1 - p))


def test_multi_label_metrics_at_the_threshold():
    probabilities = torch.tensor([[0.9, 0.2, 0.6], [0.4, 0.7, 0.1], [0.55, 0.45, 0.05]])
    logits = probabilities.logit()
    targets = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    metrics = evaluation_metrics(logits, targets, LABELS, multi_label=True, threshold=0.5)
    # predicted {a, c}, {b}, {a}: rows 1 and 3 exact; tp 4, fp 0, fn 1
    assert metrics["accuracy"] == pytest.approx(2 / 3)
    assert metrics["micro_f1"] == pytest.approx(2 * 4 / (2 * 4 + 0 + 1))
    assert metrics["macro_f1"] == pytest.approx((1 + 1 + 2 / 3) / 3)  # c: tp 1, fn 1
    expected_loss = -sum(math.log(p if t else 1 - p) for ps, ts in zip(probabilities.tolist(), targets.tolist())
                         for p, t in zip(ps, ts)) / 9
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert training_loss(logits, targets, multi_label=True).mean().item() == pytest.approx(expected_loss, rel=1e-5)
    assert metrics["confusion_matrix"] is None and metrics["samples"] == 3
    stricter = evaluation_metrics(logits, targets, LABELS, multi_label=True, threshold=0.8)
    assert stricter["micro_f1"] == pytest.approx(2 * 1 / (2 * 1 + 4))  # only a=0.9 is predicted


def test_prediction_rows_list_every_label_above_the_threshold():
    logits = torch.tensor([[logit(0.9), logit(0.3), logit(0.6)], [logit(0.1), logit(0.2), logit(0.3)]])
    examples = [Example("甲", None, "-", text_pair="乙"), Example("丙", None, "-")]
    rows = prediction_rows(logits, examples, LABELS, multi_label=True, threshold=0.5)
    assert list(rows[0]["labels"]) == ["a", "c"]  # most probable first
    assert rows[0]["labels"]["a"] == pytest.approx(0.9) and rows[0]["text_pair"] == "乙"
    assert rows[1]["labels"] == {} and "text_pair" not in rows[1]
    assert rows[1]["probabilities"] == pytest.approx({"a": 0.1, "b": 0.2, "c": 0.3})
    single = prediction_rows(logits, examples, LABELS, multi_label=False)
    assert single[0]["label"] == "a" and sum(single[0]["probabilities"].values()) == pytest.approx(1.0)


def test_regression_metrics_loss_and_rows():
    from scipy.stats import pearsonr, spearmanr

    predictions = torch.tensor([[1.0], [2.5], [2.0], [4.0]])  # (N, 1): the model's single output
    targets = torch.tensor([1.5, 2.0, 3.0, 3.5])
    metrics = evaluation_metrics(predictions, targets, ["score"], multi_label=False, regression=True)
    errors = [-0.5, 0.5, -1.0, 0.5]
    assert metrics["mse"] == metrics["loss"] == pytest.approx(sum(e * e for e in errors) / 4)
    assert metrics["rmse"] == pytest.approx(math.sqrt(metrics["mse"]))
    assert metrics["mae"] == pytest.approx(sum(map(abs, errors)) / 4)
    assert metrics["pearson"] == pytest.approx(pearsonr([1, 2.5, 2, 4], [1.5, 2, 3, 3.5]).statistic)
    assert metrics["spearmanr"] == pytest.approx(spearmanr([1, 2.5, 2, 4], [1.5, 2, 3, 3.5]).statistic)
    assert metrics["samples"] == 4 and metrics["report"] is None and metrics["confusion_matrix"] is None
    losses = training_loss(predictions, targets, multi_label=False, regression=True)
    assert losses.tolist() == pytest.approx([e * e for e in errors])
    constant = evaluation_metrics(torch.ones(3, 1), torch.tensor([1.0, 2.0, 3.0]), ["score"], False, regression=True)
    assert math.isnan(constant["pearson"])  # undefined, said as such (not 0)
    rows = prediction_rows(predictions[:2], [Example("甲", None, "-"), Example("乙", None, "-", "丙")], ["score"],
                           multi_label=False, regression=True)
    assert rows == [{"text": "甲", "score": 1.0}, {"text": "乙", "text_pair": "丙", "score": 2.5}]


def test_the_selection_metric_of_each_task():
    """What train_bert_cls.py's main resolves without --metric_for_best_model, among the numbers the evaluation of
    each task returns: macro-F1 (higher is better), and for regression the MSE (lower is better)."""
    from argparse import Namespace

    from utils.loop import Selection, resolve_selection
    from utils.outputs import number_entries
    from utils.text_metrics import default_metric

    def selection(regression):
        logits, targets = (torch.tensor([[0.5], [1.5], [2.0]]), torch.tensor([1.0, 2.0, 2.5])) if regression else (
            torch.eye(3), torch.tensor([0, 1, 1]))
        names = list(number_entries(evaluation_metrics(logits, targets, LABELS, False, regression=regression)))
        args = Namespace(metric_for_best_model=None, greater_is_better=None, early_stopping_patience=None,
                         early_stopping_threshold=0.0)
        resolve_selection(args, names, default=default_metric(regression))
        return Selection.from_args(args, position="step")

    classification, regression = selection(regression=False), selection(regression=True)
    assert (classification.metric, classification.best_key) == ("macro_f1", "best_macro_f1")
    assert regression.metric == "mse" and regression.improves(0.4, 0.5) and not regression.improves(0.5, 0.5)
    assert classification.improves(0.0, None) and classification.improves(0.6, 0.5)


def test_class_weights_multiply_each_samples_cross_entropy():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5], [0.3, 0.2, 0.1], [1.0, 1.0, 3.0]])
    targets = torch.tensor([0, 1, 1, 2])
    weights = torch.tensor([0.5, 2.0, 1.0])
    plain = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    weighted = training_loss(logits, targets, multi_label=False, class_weights=weights)
    assert weighted.tolist() == pytest.approx((plain * weights[targets]).tolist())
    # the step's loss is the mean over its samples (LossScale): sum(w_i * l_i) / N, not torch's sum / sum(w_i)
    assert weighted.mean().item() != pytest.approx(
        torch.nn.functional.cross_entropy(logits, targets, weight=weights).item())
    smoothed = training_loss(logits, targets, False, label_smoothing=0.1, class_weights=weights)
    expected = torch.nn.functional.cross_entropy(logits, targets, weight=weights, label_smoothing=0.1, reduction="none")
    assert smoothed.tolist() == pytest.approx(expected.tolist())


def test_balanced_class_weights_and_weights_files(tmp_path):
    from sklearn.utils.class_weight import compute_class_weight

    from utils.loop import load_class_weights
    from utils.runtime import UserError

    targets = [0, 0, 0, 1, 2, 2]  # "c" (id 3) has no training sample
    weights = load_class_weights("balanced", ["a", "b", "c", "d"], targets)
    assert weights.by_label == pytest.approx({"a": 6 / (3 * 3), "b": 6 / (3 * 1), "c": 6 / (3 * 2), "d": 0.0})
    assert list(weights.by_label.values())[:3] == pytest.approx(
        compute_class_weight("balanced", classes=np.arange(3), y=np.array(targets)).tolist())
    assert weights.line() == "--class_weights balanced: a 0.6667, b 2, c 1, d 0"
    assert weights.tensor("cpu").tolist() == pytest.approx([2 / 3, 2.0, 1.0, 0.0])
    path = tmp_path / "weights.json"
    path.write_text('{"b": 3, "a": 0.5}')
    assert load_class_weights(path, ["a", "b"], None).by_label == {"a": 0.5, "b": 3.0}  # in label order
    for content, message in (('{"a": 1}', "no weight for b"), ('{"a": 1, "b": 1, "z": 2}', "unknown label(s) z"),
                             ('{"a": -1, "b": 1}', "the weight of a is -1; weights are numbers >= 0"),
                             ('{"a": 0, "b": 0}', "every weight is 0"), ("[1, 2]", "expected a JSON object"),
                             ("{oops", "not a JSON file")):
        path.write_text(content)
        with pytest.raises(UserError) as err:
            load_class_weights(path, ["a", "b"], None)
        assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    with pytest.raises(UserError, match="balanced counts the training labels, and this data has none"):
        load_class_weights("balanced", ["a"], None)
