"""--metric: evaluate modules the test writes (offline), computed on the gathered validation and test predictions."""
import csv

import pytest
import torch
from conftest import read_json, read_jsonl, run
from launch_options import default_config, launch_with_config
from safetensors.torch import load_file

from utils.runtime import UserError
from utils.text_metrics import load_metrics

MODULE = '''
import datasets
import evaluate


class {cls}(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="test metric", citation="", inputs_description="",
                                   features=datasets.Features({{"predictions": datasets.Value("int64"),
                                                               "references": datasets.Value("int64")}}))

    def _compute(self, predictions, references):
{body}
'''
BALANCED_ACCURACY = """\
        recalls = [sum(p == r for p, r in zip(predictions, references) if r == c) / references.count(c)
                   for c in sorted(set(references))]
        # "accuracy" is also a built-in key: it must not replace the built-in one
        return {"balanced_accuracy": sum(recalls) / len(recalls),
                "accuracy": sum(p == r for p, r in zip(predictions, references)) / len(references)}"""
ERROR_COUNT = """\
        return {"errors": sum(p != r for p, r in zip(predictions, references))}"""
BINARY_ONLY = """\
        if max(references) > 1:
            raise ValueError("Target is multiclass but average='binary'")
        return {"f1": 1.0}"""


def write_module(path, cls, body):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(MODULE.format(cls=cls, body=body))
    return path


@pytest.fixture(scope="module")
def metric_run(text_data, tmp_path_factory):
    """2 processes (gathered predictions), launched with `accelerate config default --mixed_precision bf16`'s file."""
    root = tmp_path_factory.mktemp("metric")
    script = write_module(root / "balanced_accuracy.py", "BalancedAccuracy", BALANCED_ACCURACY)
    folder = write_module(root / "error_count" / "error_count.py", "ErrorCount", ERROR_COUNT).parent
    out = root / "out"
    launch_with_config(default_config(tmp_path_factory, "bf16"), "train_bert_cls.py", [
        "--data_dir", text_data, "--model_name_or_path", text_data / "model", "--from_scratch", "--config_overrides",
        "num_hidden_layers=1,hidden_size=32,intermediate_size=64", "--do_train", "--do_eval", "--do_test",
        "--max_seq_len", "32", "--train_batch_size", "16", "--eval_batch_size", "32", "--learning_rate", "1e-3",
        "--max_train_steps", "4", "--eval_steps", "2", "--metric", script, "--metric", folder,
        "--metric_for_best_model", "eval_balanced_accuracy", "--output_dir", out], num_processes=2)
    return out


def test_bf16_run_from_a_default_config_file_exports_fp32_that_pipeline_loads(metric_run):
    """Accelerate applies bf16 autocast on the CPU (an fp16 request trains in fp32: tests/test_launch_matrix.py)."""
    from transformers import AutoModelForSequenceClassification

    results = read_json(metric_run / "all_results.json")
    assert (results["num_processes"], results["mixed_precision_requested"], results["mixed_precision"]) == (
        2, "bf16", "bf16")
    _, info = AutoModelForSequenceClassification.from_pretrained(metric_run / "best_model", output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    weights = load_file(metric_run / "best_model" / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}  # autocast: the weights themselves stay fp32
    assert all(torch.isfinite(w).all() for w in weights.values())


def balanced_accuracy_from_confusion_matrix(path):
    rows = list(csv.reader(path.read_text(encoding="utf-8").splitlines()))[1:]
    counts = [[int(x) for x in row[1:]] for row in rows]
    recalls = [row[i] / sum(row) for i, row in enumerate(counts) if sum(row)]
    return sum(recalls) / len(recalls)


@pytest.mark.parametrize("prefix", ["eval", "test"])
def test_metric_modules_see_every_sample_once(metric_run, prefix):
    results = read_json(metric_run / "all_results.json")
    assert results[f"{prefix}_balanced_accuracy"] == pytest.approx(
        balanced_accuracy_from_confusion_matrix(metric_run / f"{prefix}_confusion_matrix.csv"))
    # a colliding key is namespaced by its module, and agrees with the built-in one on the same predictions
    assert results[f"{prefix}_balanced_accuracy_accuracy"] == pytest.approx(results[f"{prefix}_accuracy"])
    assert results[f"{prefix}_errors"] == round((1 - results[f"{prefix}_accuracy"]) * results[f"{prefix}_samples"])
    [event] = [e for e in read_jsonl(metric_run / "metrics.jsonl") if e["event"] == f"best_model_{prefix}"]
    assert event["balanced_accuracy"] == results[f"{prefix}_balanced_accuracy"]
    assert event["errors"] == results[f"{prefix}_errors"]


def test_a_metric_module_key_selects_the_best_model(metric_run):
    """--metric_for_best_model names a module's key (Trainer's eval_ prefix accepted): every validation during
    training computes it, and the best one by it is the selected model."""
    results = read_json(metric_run / "all_results.json")
    evals = [e for e in read_jsonl(metric_run / "metrics.jsonl") if e["event"] == "eval"]
    best = max(evals, key=lambda e: e["balanced_accuracy"])  # the first of equals, as the selection keeps it
    assert [e["step"] for e in evals] == [2, 4]
    assert (results["metric_for_best_model"], results["greater_is_better"]) == ("balanced_accuracy", True)
    assert results["best_step"] == best["step"]
    assert results["best_metric"] == results["best_eval_balanced_accuracy"] == best["balanced_accuracy"]
    assert results["eval_balanced_accuracy"] == pytest.approx(best["balanced_accuracy"])


def test_hub_metric_offline_is_a_one_line_error_before_training(text_data, tmp_path):
    out = tmp_path / "out"
    proc = run(["python", "train_bert_cls.py", "--cpu", "--data_dir", text_data, "--model_name_or_path",
                text_data / "model", "--from_scratch", "--do_train", "--metric", "accuracy", "--output_dir", out],
               check=False)
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()
    assert error[-1].startswith("error: --metric accuracy: cannot load"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (out / "checkpoints").exists() and not (out / "all_results.json").exists()


def test_metric_that_cannot_take_these_labels_fails_before_training(tmp_path):
    binary = write_module(tmp_path / "binary_f1.py", "BinaryF1", BINARY_ONLY)
    with pytest.raises(UserError, match="--metric binary_f1: compute failed.*multiclass"):
        load_metrics([str(binary)], num_labels=10)
    assert [m.name for m in load_metrics([str(binary)], num_labels=2)] == ["binary_f1"]
