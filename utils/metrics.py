"""Classification metrics computed locally (scikit-learn, torch): no metric hub, exact sample counts.

Inputs are the outputs of `accelerator.gather_for_metrics`, so every sample is counted once on any
number of processes (no duplicates padded onto the last batch).
"""
import csv

import numpy as np

# scikit-learn and matplotlib are imported where used: together they add about a second to every process start.


def classification_metrics(y_true, y_pred, labels):
    """Accuracy, micro/macro F1, the per-class report and the confusion matrix for label ids 0..len(labels)-1."""
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
        "confusion_matrix": confusion_matrix(y_true, y_pred, labels=ids),
    }


def topk_correct(logits, targets, ks=(1, 5)):
    """Number of samples whose target is among the k highest logits, for each k (k capped at the class count)."""
    maxk = min(max(ks), logits.shape[1])
    top = logits.topk(maxk, dim=1).indices  # (N, maxk)
    hits = top.eq(targets.view(-1, 1))  # (N, maxk)
    return {k: int(hits[:, : min(k, maxk)].any(dim=1).sum()) for k in ks}


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

