"""The text classifier's loss, evaluation metrics and predictions, for single-label, multi-label and regression
models alike: the per-sample loss (`training_loss`), the default selection metric (`default_metric`), what an
evaluation records (`recorded`), window pooling (`pool_windows`, `StreamedWindows`), predictions.jsonl's rows, the
confusion matrix files, and `--metric` modules (`load_metrics`, `compute_metrics`).
Why each works as it does: docs/code.md#text_metricspy.
Neighbours: utils/text_data.py (the windows' `doc` index), utils/text_model.py, utils/loop.py (LossScale).
"""
import csv
import math

import numpy as np
import torch
import torch.nn.functional as F

from . import outputs, runtime

# scikit-learn and matplotlib are imported where used: together they add about a second to every process start.


def training_loss(logits, targets, multi_label, label_smoothing=0.0, class_weights=None, regression=False):
    """Loss per sample (B,) of logits (B, C) and targets: (B,) ids, (B, C) multi-hot or (B,) numbers;
    class_weights (C,) multiply each sample's cross-entropy (docs/code.md#text_metricspy)."""
    if regression:
        return F.mse_loss(logits.float().squeeze(-1), targets.float(), reduction="none")
    if multi_label:
        return F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none").mean(-1)
    return F.cross_entropy(logits.float(), targets, weight=class_weights, label_smoothing=label_smoothing,
                           reduction="none")


def default_metric(regression):
    """The metric that selects the best model by default: macro-F1, or for regression the mean squared error."""
    return "mse" if regression else "macro_f1"


def recorded(metrics):
    """The entries of an evaluation's result that its records keep, in its order: its numbers and lists."""
    return {**outputs.number_entries(metrics), **{key: value for key, value in metrics.items() if isinstance(value,
                                                                                                             list)}}


def check_task_args(args):
    """Loss and metric flags that do not fit the task, refused while parsing (UserError)."""
    for flag, value in (("--label_smoothing", args.label_smoothing), ("--labels_file", args.labels_file),
                        ("--metric", args.metric), ("--class_weights", args.class_weights)):
        if args.do_regression and value:
            raise runtime.UserError(f"{flag} is for classes; --do_regression predicts a number (evaluated by mse, "
                                    f"rmse, mae, pearson and spearmanr)")
    if args.class_weights and args.multi_label:
        raise runtime.UserError("--class_weights weighs single-label cross-entropy; --multi_label's binary "
                                "cross-entropy is not weighted per class here")
    if args.class_weights and not args.do_train:
        raise runtime.UserError("--class_weights weighs the training loss: it needs --do_train")
    if not 0.0 <= args.label_smoothing < 1.0:
        raise runtime.UserError(f"--label_smoothing {args.label_smoothing}: must be in [0, 1)")
    if args.multi_label and args.label_smoothing:
        raise runtime.UserError("--label_smoothing applies to single-label cross-entropy, not to --multi_label")
    if args.metric and args.multi_label:
        take_multi_label_builtins(args)
    if args.threshold is not None and not 0.0 < args.threshold < 1.0:  # None: the trained model's, or 0.5
        raise runtime.UserError(f"--threshold {args.threshold}: must be in (0, 1)")


# run_classification.py's --metric_name with --multi_label: evaluate's module on the multi-hot rows, average="micro"
MULTI_LABEL_BUILTINS = {"f1": "micro_f1"}


def take_multi_label_builtins(args):
    """--metric with --multi_label: `f1` becomes the built-in micro_f1 (said once), any other module a UserError."""
    others = [name for name in args.metric if name not in MULTI_LABEL_BUILTINS]
    if others:
        raise runtime.UserError(f"--metric {others[0]} passes one class id per sample to the evaluate module; with "
                                f"--multi_label use the built-in exact-match accuracy and micro/macro F1")
    args.command_notes = (*getattr(args, "command_notes", ()),
                          *(f"--metric {name} with --multi_label = the built-in {MULTI_LABEL_BUILTINS[name]} "
                            f"(run_classification.py's average='micro')" for name in args.metric))
    args.metric = []


def regression_metrics(predictions, targets):
    """mse, rmse, mae, Pearson and Spearman (NaN when either side is constant) of (N,) predictions and targets."""
    from scipy.stats import pearsonr, spearmanr

    predictions, targets = predictions.double().numpy(), targets.double().numpy()
    mse = float(np.mean((predictions - targets) ** 2))
    correlated = len(targets) > 1 and np.ptp(predictions) > 0 and np.ptp(targets) > 0
    return {"loss": mse, "mse": mse, "rmse": math.sqrt(mse), "mae": float(np.mean(np.abs(predictions - targets))),
            "pearson": float(pearsonr(predictions, targets).statistic) if correlated else math.nan,
            "spearmanr": float(spearmanr(predictions, targets).statistic) if correlated else math.nan,
            "samples": int(len(targets)), "report": None, "confusion_matrix": None}


def evaluation_metrics(logits, targets, labels, multi_label, threshold=0.5, regression=False):
    """Accuracy, micro/macro F1, mean loss, the per-class report and the confusion matrix (None for multi-label) of
    gathered logits and targets; for regression `regression_metrics` of the single output."""
    if regression:
        return regression_metrics(logits.squeeze(-1), targets)
    if multi_label:
        y_true = targets.numpy().astype(np.int64)  # (N, C)
        y_pred = (torch.sigmoid(logits) >= threshold).numpy().astype(np.int64)  # (N, C)
        loss = F.binary_cross_entropy_with_logits(logits, targets.float())
    else:
        y_true, y_pred = targets.numpy(), logits.argmax(-1).numpy()  # (N,)
        loss = F.cross_entropy(logits, targets)
    return {"loss": loss.item(), **classification_metrics(y_true, y_pred, labels)}


def pool_windows(logits, targets, docs, how="mean"):
    """(N, C) logits and (N, ...) targets of N texts, from the (W, C) logits of their windows, pooled by `how`;
    docs (W,): each window's text index, in order, gaps allowed (docs/code.md#text_metricspy)."""
    docs = torch.unique_consecutive(docs, return_inverse=True)[1]
    count = int(docs[-1]) + 1
    rows = docs.view(-1, 1).expand_as(logits)
    if how == "max":
        pooled = torch.full((count, logits.shape[1]), -torch.inf).scatter_reduce(0, rows, logits, "amax")
    else:
        windows = torch.zeros(count).index_add_(0, docs, torch.ones(len(docs)))
        pooled = torch.zeros(count, logits.shape[1]).index_add_(0, docs, logits) / windows.view(-1, 1)
    first = torch.ones(len(docs), dtype=torch.bool)
    first[1:] = docs[1:] != docs[:-1]
    return pooled, None if targets is None else targets[first]


class StreamedWindows:
    """pool_windows a gathered batch at a time; the last text of a batch is held until its windows end."""

    def __init__(self, how="mean"):
        self.how = how
        self.held = None  # (logits, docs) of the windows of the text the last batch ended in

    def add(self, logits, docs):
        """The pooled logits (n, C) of the texts whose last window is in this batch, but for its last text."""
        if self.held is not None:
            logits, docs = torch.cat([self.held[0], logits]), torch.cat([self.held[1], docs])
        ended = docs != docs[-1]
        self.held = logits[~ended], docs[~ended]
        return self._pool(logits[ended], docs[ended])

    def end(self, classes):
        """The pooled logits (0 or 1, C) of the held text, after the last batch."""
        held, self.held = self.held, None
        return torch.empty(0, classes) if held is None else self._pool(*held)

    def _pool(self, logits, docs):
        if not len(docs):
            return logits
        return pool_windows(logits, None, docs - docs[0], self.how)[0]


def prediction_rows(logits, examples, labels, multi_label, threshold=0.5, regression=False):
    """predictions.jsonl's rows, one per record of `examples`; `logits` (N, C) are those of the N records not
    skipped, in order (docs/bert_data_formats.md#predict-files-and-predictionsjsonl)."""
    values = iter(logits.squeeze(-1).tolist() if regression else  # (N,) numbers or (N, C) probabilities
                  (torch.sigmoid(logits) if multi_label else torch.softmax(logits, dim=-1)).tolist())
    rows = []
    for example in examples:
        row = {**({"line": example.line} if example.line is not None else {}), "text": example.text}
        if example.skipped:
            rows.append({**row, "skipped": example.skipped})
            continue
        if example.text_pair is not None:
            row["text_pair"] = example.text_pair
        if example.label is not None:
            row["label_given"] = list(example.label) if isinstance(example.label, tuple) else example.label
        if regression:
            rows.append({**row, "score": next(values)})
            continue
        probs = next(values)
        ranked = sorted(range(len(labels)), key=probs.__getitem__, reverse=True)
        if multi_label:  # every label at or above the threshold, most probable first (possibly none)
            row["labels"] = {labels[i]: probs[i] for i in ranked if probs[i] >= threshold}
        else:
            row.update(label=labels[ranked[0]], score=probs[ranked[0]])
        row["probabilities"] = dict(zip(labels, probs))
        rows.append(row)
    if next(values, None) is not None:
        raise ValueError(f"{len(logits)} predictions for {sum(not e.skipped for e in examples)} texts")
    return rows


def classification_metrics(y_true, y_pred, labels):
    """evaluation_metrics' numbers of (N,) ids, or of (N, C) 0/1 rows for multi-label, for ids 0..len(labels)-1."""
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


def load_metrics(names_or_paths, num_labels, cache_dir=None):
    """The loaded modules, each checked on predictions = references = 0..num_labels-1 (a UserError if one fails)."""
    if not names_or_paths:
        return []
    import evaluate  # a second of start-up, only for runs that ask for it

    modules = []
    for name in names_or_paths:
        try:
            # keep_in_memory: no cache file, so that several processes computing at once do not share a lock
            modules.append(evaluate.load(name, keep_in_memory=True, cache_dir=cache_dir and str(cache_dir)))
        except Exception as err:  # evaluate raises whatever its download or import raised
            raise runtime.UserError(f"--metric {name}: cannot load this evaluate module ({first_line(err)}); offline, "
                                    f"pass a local metric script or a folder <name>/ holding <name>.py") from None
    every_class = list(range(num_labels))
    compute_metrics(modules, every_class, every_class, reserved={})
    return modules


def flat_metrics(metrics, prefix):
    """`{prefix}_*` entries of what an evaluation's result records."""
    return {f"{prefix}_{key}": value for key, value in recorded(metrics).items()}


def compute_metrics(modules, predictions, references, reserved):
    """{key: number or list} of every module; a key in `reserved` or another module's becomes `<module>_<key>`."""
    results = {}
    for module in modules:
        try:
            values = module.compute(predictions=list(predictions), references=list(references))
        except Exception as err:
            raise runtime.UserError(f"--metric {module.name}: compute failed on {len(references)} class ids "
                                    f"({first_line(err)})") from None
        for key, value in (values or {}).items():
            taken = key in reserved or key in results
            results[f"{module.name}_{key}" if taken else key] = plain(value)
    return results


def plain(value):
    # JSON-ready: metrics often return numpy scalars and arrays
    return value.tolist() if hasattr(value, "tolist") else value


def first_line(err):
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
