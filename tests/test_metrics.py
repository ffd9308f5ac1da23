"""utils.text_metrics against hand-computed values and scikit-learn."""
import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score, precision_recall_fscore_support

from utils.text_metrics import classification_metrics, save_confusion_matrix
from utils.image_data import topk_hits


def test_classification_metrics_by_hand():
    # true:  a a a b b c ; pred: a a b b c c
    y_true, y_pred = [0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 2]
    m = classification_metrics(y_true, y_pred, ["a", "b", "c"])
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["micro_f1"] == pytest.approx(4 / 6)
    # per class F1: a: p=1 r=2/3 -> 0.8; b: p=1/2 r=1/2 -> 0.5; c: p=1/2 r=1 -> 2/3
    assert m["macro_f1"] == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
    assert m["confusion_matrix"].tolist() == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert m["samples"] == 6
    assert m["report"]["a"]["support"] == 3


def test_classification_metrics_match_sklearn_with_absent_classes():
    rng = np.random.default_rng(0)
    y_true, y_pred = rng.integers(0, 4, 200), rng.integers(0, 4, 200)
    labels = ["w", "x", "y", "z", "never_seen"]
    m = classification_metrics(y_true, y_pred, labels)
    assert m["macro_f1"] == pytest.approx(f1_score(y_true, y_pred, labels=range(5), average="macro", zero_division=0))
    p, r, f, s = precision_recall_fscore_support(y_true, y_pred, labels=range(5), zero_division=0)
    assert m["report"]["x"]["recall"] == pytest.approx(r[1])
    assert m["report"]["never_seen"]["support"] == 0
    assert m["confusion_matrix"].shape == (5, 5) and m["confusion_matrix"].sum() == 200


def test_topk_by_hand():
    logits = torch.tensor([
        [0.1, 0.9, 0.0, 0.0, 0.0, 0.0],  # target 1: top-1 hit
        [0.5, 0.4, 0.3, 0.2, 0.1, 0.0],  # target 4: 5th highest -> top-5 hit only
        [0.5, 0.4, 0.3, 0.2, 0.1, 0.0],  # target 5: lowest -> miss both
        [0.0, 0.0, 0.9, 0.8, 0.0, 0.0],  # target 3: 2nd -> top-5 hit only
    ])
    targets = torch.tensor([1, 4, 5, 3])
    assert topk_hits(logits, targets, ks=(1, 5)).tolist() == [1, 3]


def test_topk_with_fewer_classes_than_k():
    logits = torch.tensor([[0.2, 0.8], [0.9, 0.1]])
    assert topk_hits(logits, torch.tensor([0, 1]), ks=(1, 5)).tolist() == [0, 2]


def test_confusion_matrix_files(tmp_path):
    matrix = np.array([[3, 1], [0, 2]])
    save_confusion_matrix(matrix, ["体育", "财经"], tmp_path / "cm.csv", tmp_path / "cm.png")
    assert (tmp_path / "cm.csv").read_text(encoding="utf-8").splitlines() == [
        "true\\predicted,体育,财经", "体育,3,1", "财经,0,2"]
    assert (tmp_path / "cm.png").read_bytes()[:4] == b"\x89PNG"
