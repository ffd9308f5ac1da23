"""Single-label (softmax, cross-entropy) and multi-label (sigmoid, binary cross-entropy) classification:
the loss, the evaluation metrics and the prediction rows, chosen in one place by `multi_label`."""
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .errors import UserError
from .metrics import classification_metrics


def training_loss(logits, targets, multi_label, label_smoothing=0.0):
    """Loss per sample, (B,), of this process's share of the batch (logits (B, C); targets (B,) ids or (B, C)
    multi-hot; multi-label: the mean over the C labels' binary cross-entropies)."""
    if multi_label:
        return F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none").mean(-1)
    return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing, reduction="none")


def evaluation_metrics(logits, targets, labels, multi_label, threshold=0.5):
    """Accuracy, micro/macro F1, mean loss and the per-class report of gathered logits and targets.

    Multi-label: a label is predicted when its sigmoid probability is at least `threshold`; `accuracy` is the
    exact-match (subset) accuracy, F1 is over every (sample, label) decision (micro) or averaged per label (macro);
    no confusion matrix (None)."""
    if not multi_label:
        metrics = classification_metrics(targets.numpy(), logits.argmax(-1).numpy(), labels)
        metrics["loss"] = F.cross_entropy(logits, targets).item()
        return metrics
    from sklearn.metrics import accuracy_score, classification_report, f1_score

    y_true = targets.numpy().astype(np.int64)  # (N, C)
    y_pred = (torch.sigmoid(logits) >= threshold).numpy().astype(np.int64)  # (N, C)
    ids = list(range(len(labels)))
    return {
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "macro_f1": float(f1_score(y_true, y_pred, labels=ids, average="macro", zero_division=0)),
        "micro_f1": float(f1_score(y_true, y_pred, labels=ids, average="micro", zero_division=0)),
        "samples": int(len(y_true)),
        "loss": F.binary_cross_entropy_with_logits(logits, targets.float()).item(),
        "report": classification_report(y_true, y_pred, labels=ids, target_names=labels, output_dict=True,
                                        zero_division=0),
        "confusion_matrix": None,
    }


def prediction_rows(logits, examples, labels, multi_label, threshold=0.5):
    """predictions.jsonl rows: the input, the predicted label(s) with their probability, every probability."""
    probabilities = (torch.sigmoid(logits) if multi_label else torch.softmax(logits, dim=-1)).tolist()  # (N, C)
    rows = []
    for example, probs in zip(examples, probabilities):
        row = {"text": example.text}
        if example.text_pair is not None:
            row["text_pair"] = example.text_pair
        ranked = sorted(range(len(labels)), key=probs.__getitem__, reverse=True)
        if multi_label:  # every label at or above the threshold, most probable first (possibly none)
            row["labels"] = {labels[i]: probs[i] for i in ranked if probs[i] >= threshold}
        else:
            row.update(label=labels[ranked[0]], score=probs[ranked[0]])
        row["probabilities"] = dict(zip(labels, probs))
        rows.append(row)
    return rows


def check_problem_type(model_name_or_path, multi_label):
    """A trained model evaluated or used for prediction in the mode it was trained in (config.json problem_type)."""
    config_file = Path(model_name_or_path) / "config.json"
    saved = json.loads(config_file.read_text(encoding="utf-8")).get("problem_type") if config_file.is_file() else None
    wanted = "multi_label_classification" if multi_label else "single_label_classification"
    if saved in ("multi_label_classification", "single_label_classification") and saved != wanted:
        flag = "drop --multi_label" if not saved.startswith("multi") else "pass --multi_label"
        raise UserError(f"{config_file}: the model was trained for {saved}; {flag}")
