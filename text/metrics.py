"""The text classifier's loss, evaluation metrics and predictions, single-label (softmax, cross-entropy) and
multi-label (sigmoid, binary cross-entropy) chosen in one place by `multi_label`; the confusion matrix files; and
`--metric NAME_OR_PATH`, any Hugging Face `evaluate` module beside the built-in metrics.

Metrics are computed locally (scikit-learn, torch): no metric hub, exact sample counts. Inputs are the outputs of
`accelerator.gather_for_metrics`, so every sample is counted once on any number of processes (no duplicates padded
onto the last batch).

`--metric`: a hub id (`matthews_correlation`) needs the hub or its cache; a local path works offline: a metric
script (`my_metric.py`) or a folder `my_metric/` holding `my_metric.py`. Every module is loaded, and computed once
on every class id, before training starts, so that a metric that cannot load or cannot take these predictions fails
in seconds rather than after the run; `selectable_metrics` names the keys --metric_for_best_model may then choose.

Neighbours: text/data.py, text/model.py.
"""
import csv

import numpy as np
import torch
import torch.nn.functional as F

from common.runtime import UserError

# scikit-learn and matplotlib are imported where used: together they add about a second to every process start.


def training_loss(logits, targets, multi_label, label_smoothing=0.0):
    """Loss per sample, (B,), of this process's share of the batch (logits (B, C); targets (B,) ids or (B, C)
    multi-hot; multi-label: the mean over the C labels' binary cross-entropies)."""
    if multi_label:
        return F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none").mean(-1)
    return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing, reduction="none")


def evaluation_metrics(logits, targets, labels, multi_label, threshold=0.5):
    """Accuracy, micro/macro F1, mean loss, the per-class report and the confusion matrix of gathered logits and
    targets.

    Multi-label: a label is predicted when its sigmoid probability is at least `threshold`; `accuracy` is the
    exact-match (subset) accuracy, F1 is over every (sample, label) decision (micro) or averaged per label (macro);
    no confusion matrix (None)."""
    if multi_label:
        y_true = targets.numpy().astype(np.int64)  # (N, C)
        y_pred = (torch.sigmoid(logits) >= threshold).numpy().astype(np.int64)  # (N, C)
        loss = F.binary_cross_entropy_with_logits(logits, targets.float())
    else:
        y_true, y_pred = targets.numpy(), logits.argmax(-1).numpy()  # (N,)
        loss = F.cross_entropy(logits, targets)
    return {**classification_metrics(y_true, y_pred, labels), "loss": loss.item()}


def prediction_rows(logits, examples, labels, multi_label, threshold=0.5):
    """predictions.jsonl rows, one per input record in file order: its `line`, the input, the label(s) the file gave
    (`label_given`), the predicted label(s) with their probability, every probability. A skipped record (a blank
    line) has a row saying why and no prediction; `logits` (N, C) are those of the N others, in order."""
    probabilities = iter((torch.sigmoid(logits) if multi_label else torch.softmax(logits, dim=-1)).tolist())  # (N, C)
    rows = []
    for example in examples:
        row = {"line": example.line, "text": example.text}
        if example.skipped:
            rows.append({**row, "skipped": example.skipped})
            continue
        if example.text_pair is not None:
            row["text_pair"] = example.text_pair
        if example.label is not None:
            row["label_given"] = list(example.label) if isinstance(example.label, tuple) else example.label
        probs = next(probabilities)
        ranked = sorted(range(len(labels)), key=probs.__getitem__, reverse=True)
        if multi_label:  # every label at or above the threshold, most probable first (possibly none)
            row["labels"] = {labels[i]: probs[i] for i in ranked if probs[i] >= threshold}
        else:
            row.update(label=labels[ranked[0]], score=probs[ranked[0]])
        row["probabilities"] = dict(zip(labels, probs))
        rows.append(row)
    if next(probabilities, None) is not None:
        raise ValueError(f"{len(logits)} predictions for {sum(not e.skipped for e in examples)} texts")
    return rows


def classification_metrics(y_true, y_pred, labels):
    """Accuracy, micro/macro F1, the per-class report and the confusion matrix for label ids 0..len(labels)-1;
    y_true and y_pred are (N,) ids, or (N, C) 0/1 rows for multi-label (exact-match accuracy, no confusion matrix)."""
    from sklearn.metrics import accuracy_score, classification_report, confusion_matrix, f1_score

    ids = list(range(len(labels)))
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    report = classification_report(
        y_true, y_pred, labels=ids, target_names=labels, output_dict=True, zero_division=0
    )
    return {
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "macro_f1": float(f1_score(y_true, y_pred, labels=ids, average="macro", zero_division=0)),
        "micro_f1": float(f1_score(y_true, y_pred, labels=ids, average="micro", zero_division=0)),
        "samples": int(len(y_true)),
        "report": report,
        "confusion_matrix": confusion_matrix(y_true, y_pred, labels=ids) if y_true.ndim == 1 else None,
    }


def save_confusion_matrix(matrix, labels, csv_path, png_path, title="confusion matrix"):
    """CSV with label names (rows: true, columns: predicted) and a PNG heat map."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["true\\predicted", *labels])
        for label, row in zip(labels, matrix):
            writer.writerow([label, *map(int, row)])
    n = len(labels)
    fig, ax = plt.subplots(figsize=(1.0 + 0.55 * n, 0.8 + 0.5 * n))
    ax.imshow(matrix, cmap="Blues")
    # Tick labels are ids: the default fonts have no CJK glyphs; the CSV carries the names.
    ax.set_xticks(range(n), [str(i) for i in range(n)])
    ax.set_yticks(range(n), [f"{i}" for i in range(n)])
    ax.set_xlabel("predicted label id")
    ax.set_ylabel("true label id")
    ax.set_title(title)
    peak = matrix.max() if matrix.size else 0
    for i in range(n):
        for j in range(n):
            ax.text(j, i, int(matrix[i, j]), ha="center", va="center", fontsize=7,
                    color="white" if matrix[i, j] > peak / 2 else "black")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def load_metrics(names_or_paths, num_labels):
    """The loaded modules, each checked on predictions = references = 0..num_labels-1."""
    if not names_or_paths:
        return []
    import evaluate  # a second of start-up, only for runs that ask for it

    modules = []
    for name in names_or_paths:
        try:
            # keep_in_memory: no cache file, so that several processes computing at once do not share a lock
            modules.append(evaluate.load(name, keep_in_memory=True))
        except Exception as err:  # evaluate raises whatever its download or import raised
            raise UserError(f"--metric {name}: cannot load this evaluate module ({first_line(err)}); offline, "
                            "pass a local metric script or a folder <name>/ holding <name>.py") from None
    every_class = list(range(num_labels))
    compute_metrics(modules, every_class, every_class, reserved={})
    return modules


BUILTIN_METRICS = ("accuracy", "macro_f1", "micro_f1", "loss")  # every validation's, besides `samples`


def selectable_metrics(modules, num_labels):
    """The validation metrics --metric_for_best_model may name: the built-in ones and the number-valued keys of the
    --metric modules, under the names their results get (computed once, on every class id, as load_metrics does)."""
    every_class = list(range(num_labels))
    extra = compute_metrics(modules, every_class, every_class, reserved=dict.fromkeys(
        (*BUILTIN_METRICS, "samples", "report", "confusion_matrix")))
    return [*BUILTIN_METRICS, *(key for key, value in extra.items()
                                if isinstance(value, (int, float)) and not isinstance(value, bool))]


def flat_metrics(metrics, prefix):
    """`{prefix}_*` entries of an evaluation's built-in metrics, sample count and --metric results."""
    return {**{f"{prefix}_{k}": metrics[k] for k in (*BUILTIN_METRICS, "samples")},
            **{f"{prefix}_{k}": v for k, v in metrics["extra"].items()}}


def compute_metrics(modules, predictions, references, reserved):
    """{key: number or list} of every module; a key already in `reserved` (or another module's) becomes
    `<module name>_<key>`, so that `--metric accuracy` cannot overwrite the built-in accuracy."""
    results = {}
    for module in modules:
        try:
            values = module.compute(predictions=list(predictions), references=list(references))
        except Exception as err:
            raise UserError(f"--metric {module.name}: compute failed on {len(references)} class ids "
                            f"({first_line(err)})") from None
        for key, value in (values or {}).items():
            taken = key in reserved or key in results
            results[f"{module.name}_{key}" if taken else key] = plain(value)
    return results


def plain(value):
    """JSON-ready: metrics often return numpy scalars and arrays."""
    return value.tolist() if hasattr(value, "tolist") else value


def first_line(err):
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
