"""text.metrics: multi-label loss, metrics at the threshold and prediction rows, against hand-made cases."""
import math

import pytest
import torch

from text.metrics import evaluation_metrics, prediction_rows, training_loss
from text.data import Example

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
