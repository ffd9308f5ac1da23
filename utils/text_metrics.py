"""The text classifier's loss, evaluation metrics and predictions, single-label (softmax, cross-entropy),
multi-label (sigmoid, binary cross-entropy) and regression (one output, mean squared error) chosen in one place by
`multi_label` / `regression`; the validation metric that selects the best model by default (`default_metric`; the
others a run may choose are the numbers train_bert_cls.py's evaluate returns); which of an evaluation's entries its
results record (`recorded`); the confusion matrix files; and `--metric NAME_OR_PATH`, any Hugging Face `evaluate`
module beside the built-in metrics.

Class weights (--class_weights, single-label only) multiply each sample's cross-entropy by its class's weight, as
torch's `cross_entropy(weight=...)` with `reduction="none"` does; the training loop then takes the mean over the
step's samples (utils/loop.py LossScale), which needs no collective and is the same on any number of processes. That
is the mean of the weighted losses, sum(w_i * l_i) / N, not torch's reduction="mean" (sum(w_i * l_i) / sum(w_i)):
that denominator would depend on which classes each step drew. With `balanced` weights both agree over an epoch
(the weights of the training samples sum to N). The evaluation loss stays unweighted, comparable between runs.

Metrics are computed locally (scikit-learn, torch): no metric hub, exact sample counts. Inputs are the outputs of
`accelerator.gather_for_metrics`, so every sample is counted once on any number of processes (no duplicates padded
onto the last batch).

`--metric`: a hub id (`matthews_correlation`) needs the hub or its cache; a local path works offline: a metric
script (`my_metric.py`) or a folder `my_metric/` holding `my_metric.py`. Every module is loaded, and computed once
on every class id, before training starts, so that a metric that cannot load or cannot take these predictions fails
in seconds rather than after the run; its number-valued keys are then among evaluate's numbers, which
--metric_for_best_model may name.

Neighbours: utils/text_data.py, utils/text_model.py.
"""
import csv
import math

import numpy as np
import torch
import torch.nn.functional as F

from . import outputs, runtime

# scikit-learn and matplotlib are imported where used: together they add about a second to every process start.


def training_loss(logits, targets, multi_label, label_smoothing=0.0, class_weights=None, regression=False):
    """Loss per sample, (B,), of this process's share of the batch (logits (B, C); targets (B,) ids, (B, C)
    multi-hot or (B,) numbers; multi-label: the mean over the C labels' binary cross-entropies; regression: the
    squared error; class_weights (C,): each sample's cross-entropy times its class's weight)."""
    if regression:
        return F.mse_loss(logits.float().squeeze(-1), targets.float(), reduction="none")
    if multi_label:
        return F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none").mean(-1)
    return F.cross_entropy(logits.float(), targets, weight=class_weights, label_smoothing=label_smoothing,
                           reduction="none")


def default_metric(regression):
    """Classification: macro-F1 (rare classes count as much as frequent ones). Regression: the mean squared error,
    the training loss itself and run_classification.py's default regression metric (Pearson and Spearman ignore the
    predictions' scale and offset, so a model they prefer can be off by a constant)."""
    return "mse" if regression else "macro_f1"


def recorded(metrics):
    """What an evaluation's result (train_bert_cls.py evaluate) gives metrics.jsonl, all_results.json and the model
    card, in its order: its numbers, and the lists a --metric module may return (one number per class); the per-class
    report and the confusion matrix are written as files."""
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
    """--metric with --multi_label: run_classification.py's `f1` is the built-in micro_f1 (said once); any other
    module is refused, since an evaluate module is passed one class id per sample here."""
    others = [name for name in args.metric if name not in MULTI_LABEL_BUILTINS]
    if others:
        raise runtime.UserError(f"--metric {others[0]} passes one class id per sample to the evaluate module; with "
                                f"--multi_label use the built-in exact-match accuracy and micro/macro F1")
    args.command_notes = (*getattr(args, "command_notes", ()),
                          *(f"--metric {name} with --multi_label = the built-in {MULTI_LABEL_BUILTINS[name]} "
                            f"(run_classification.py's average='micro')" for name in args.metric))
    args.metric = []


def regression_metrics(predictions, targets):
    """Mean squared and absolute error, and the Pearson and Spearman correlations (scipy.stats; NaN when either
    side is constant) of (N,) predictions and targets."""
    from scipy.stats import pearsonr, spearmanr

    predictions, targets = predictions.double().numpy(), targets.double().numpy()
    mse = float(np.mean((predictions - targets) ** 2))
    correlated = len(targets) > 1 and np.ptp(predictions) > 0 and np.ptp(targets) > 0
    return {"loss": mse, "mse": mse, "rmse": math.sqrt(mse), "mae": float(np.mean(np.abs(predictions - targets))),
            "pearson": float(pearsonr(predictions, targets).statistic) if correlated else math.nan,
            "spearmanr": float(spearmanr(predictions, targets).statistic) if correlated else math.nan,
            "samples": int(len(targets)), "report": None, "confusion_matrix": None}


def evaluation_metrics(logits, targets, labels, multi_label, threshold=0.5, regression=False):
    """Accuracy, micro/macro F1, mean loss, the per-class report and the confusion matrix of gathered logits and
    targets; for regression `regression_metrics` of the single output.

    Multi-label: a label is predicted when its sigmoid probability is at least `threshold`; `accuracy` is the
    exact-match (subset) accuracy, F1 is over every (sample, label) decision (micro) or averaged per label (macro);
    no confusion matrix (None)."""
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
    """One row per text from the rows of its windows (utils/text_data.py tokenize_windows): logits (W, C) pooled by
    their mean or maximum, the text's target (every window carries it) taken from its first window. docs (W,): each
    window's text index, in order (an evaluation's windows come in dataset order), with gaps where texts are left out
    (the one batch of utils/loop.py validation_names: N texts numbered 0..N-1 again). Returns (N, C), (N, ...)."""
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
    """pool_windows a gathered batch of window logits at a time (predictions streamed): the texts whose windows all
    came are pooled; the last text of a batch, whose windows may go on in the next one, is held until they end."""

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
    """predictions.jsonl rows, one per input record in file order: its `line` (a file's; a dataset's rows are in
    its order), the input, the label(s) the file gave (`label_given`), the predicted label(s) with their probability,
    every probability; for regression the predicted number (`score`, as `pipeline()` names it). A skipped record (a
    blank line) has a row saying why and no prediction; `logits` (N, C) are those of the N others, in order."""
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


def load_metrics(names_or_paths, num_labels, cache_dir=None):
    """The loaded modules, each checked on predictions = references = 0..num_labels-1; hub modules are kept in
    cache_dir (--cache_dir) when given."""
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
    """{key: number or list} of every module; a key already in `reserved` (or another module's) becomes
    `<module name>_<key>`, so that `--metric accuracy` cannot overwrite the built-in accuracy."""
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
    """JSON-ready: metrics often return numpy scalars and arrays."""
    return value.tolist() if hasattr(value, "tolist") else value


def first_line(err):
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
