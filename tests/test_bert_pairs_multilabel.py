"""Sentence pairs + multi-label + a GBK-family encoding + --group_by_length, in one set of runs (2 processes through
the real launcher, 1 process in this process): 1 process = 2 processes, exact resume, and an export that
`pipeline(..., top_k=None)` scores like we do."""
import csv
import io
import json
import random
import shutil

import pytest
from conftest import assert_same_curve, assert_same_weights, launch, read_json, read_jsonl, run_here
from safetensors.torch import load_file

from utils.demo_data import make_headline, TOPICS, write_small_bert

SCRIPT = "train_bert_cls.py"
STEPS = 30  # 320 samples / 16 = 20 steps per epoch: the checkpoint at step 10 is mid-epoch, the run crosses an epoch
LABELS = sorted(list(TOPICS)[:4])
ENCODING = "gb18030"


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory):
    """A sentence-pair multi-label task: two headlines, tagged with the topics of both ('|'-separated), gb18030."""
    out = tmp_path_factory.mktemp("pairs")
    rng = random.Random(0)

    def row():
        a, b = rng.choice(LABELS), rng.choice(LABELS)
        return {"sentence1": make_headline(rng, a, 0.0), "sentence2": make_headline(rng, b, 0.0),
                "tags": "|".join(sorted({a, b}))}

    train = "".join(json.dumps(row(), ensure_ascii=False) + "\n" for _ in range(320))
    (out / "train.jsonl").write_bytes(train.encode(ENCODING))
    text = io.StringIO()
    writer = csv.DictWriter(text, ["sentence1", "sentence2", "tags"])
    writer.writeheader()
    writer.writerows(row() for _ in range(41))  # odd: the last evaluation batch is uneven on 2 processes
    (out / "val.csv").write_bytes(text.getvalue().encode(ENCODING))
    write_small_bert(out / "model")
    return out


def pair_args(data, out, *extra):
    # No dropout: its masks are drawn per process, so they legitimately differ between 1 and 2 processes.
    return ["--train_file", data / "train.jsonl", "--validation_file", data / "val.csv", "--predict_file",
            data / "val.csv", "--encoding", ENCODING, "--text_column", "sentence1", "--text_pair_column", "sentence2",
            "--label_column", "tags", "--multi_label", "--label_separator", "|", "--group_by_length",
            "--model_name_or_path", data / "model", "--from_scratch",
            "--config_overrides", "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0",
            "--do_train", "--do_eval", "--do_predict", "--max_seq_len", "48", "--train_batch_size", "16",
            "--eval_batch_size", "16", "--learning_rate", "3e-3", "--max_train_steps", str(STEPS),
            "--checkpointing_steps", "10", "--save_total_limit", "3", "--logging_steps", "5", "--output_dir", out,
            *extra]


def final_weights(out):
    return load_file(out / "checkpoints" / f"step_{STEPS}" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(pair_data, tmp_path_factory):
    outs = {n: tmp_path_factory.mktemp(f"multilabel_{n}") for n in (1, 2)}
    train_here(pair_args(pair_data, outs[1]))
    launch(SCRIPT, pair_args(pair_data, outs[2]), num_processes=2)
    # The 1-process run as if killed after its step-10 checkpoint, then resumed from `latest`.
    outs["resumed"] = tmp_path_factory.mktemp("multilabel_resumed") / "out"
    shutil.copytree(outs[1], outs["resumed"])
    for step in (20, STEPS):
        shutil.rmtree(outs["resumed"] / "checkpoints" / f"step_{step}")
    train_here(pair_args(pair_data, outs["resumed"], "--resume_from_checkpoint", "latest"))
    return outs


def train_here(args):
    """A 1-process run in this process (run_here)."""
    run_here(SCRIPT, ["--cpu", *args])


def test_one_process_equals_two_processes(runs):
    single, multi = final_weights(runs[1]), final_weights(runs[2])
    worst = max((single[k] - multi[k]).abs().max().item() for k in single)
    # float32 reduction order only (each process pads and averages its own half; measured 3e-6 at lr 3e-3);
    # a sample in the wrong batch or a wrong loss scale moves weights by about the learning rate
    assert worst < 1e-5, f"max abs weight difference {worst:.2e} after {STEPS} steps"
    initial = load_file(runs[1] / "checkpoints" / "step_10" / "model.safetensors")
    assert max((single[k] - initial[k]).abs().max().item() for k in single) > 1e-3  # and the weights did move
    for n in (1, 2):
        results = read_json(runs[n] / "all_results.json")
        assert results["eval_samples"] == 41 and results["train_steps"] == STEPS
        assert results["pad_to_multiple_of"] is None  # CPU: no padding beyond each batch's longest pair


def test_resume_mid_epoch_is_bitwise_identical(runs):
    assert_same_weights(final_weights(runs[1]), final_weights(runs["resumed"]))
    assert_same_curve(runs[1], runs["resumed"], ("loss", "lr", "accuracy", "macro_f1"))


def test_multi_label_metrics_select_by_macro_f1(runs):
    results = read_json(runs[1] / "all_results.json")
    evals = [e for e in read_jsonl(runs[1] / "metrics.jsonl") if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [20, STEPS]
    best = max(evals, key=lambda e: e["macro_f1"])  # the first of equals: selection needs a strict improvement
    assert results["best_step"] == best["step"] and results["best_eval_macro_f1"] == best["macro_f1"]
    assert results["eval_macro_f1"] == pytest.approx(best["macro_f1"])  # the reloaded best model, evaluated again
    report = read_json(runs[1] / "eval_report.json")
    assert set(LABELS) <= set(report)
    assert not (runs[1] / "eval_confusion_matrix.csv").exists()  # no single confusion matrix for multi-label


def test_export_scores_every_label_like_predictions_jsonl(runs, pair_data):
    from transformers import pipeline

    best = runs[1] / "best_model"
    config = read_json(best / "config.json")
    assert config["problem_type"] == "multi_label_classification"
    assert [config["id2label"][str(i)] for i in range(len(LABELS))] == LABELS
    rows = read_jsonl(runs[1] / "predictions.jsonl")
    assert len(rows) == 41
    for row in rows:
        assert set(row["probabilities"]) == set(LABELS)
        assert row["labels"] == {k: v for k, v in row["probabilities"].items() if v >= 0.5}
    classifier = pipeline("text-classification", model=str(best), top_k=None, device="cpu")
    for row in rows[:3]:
        scores = classifier({"text": row["text"], "text_pair": row["text_pair"]})
        assert {s["label"]: pytest.approx(s["score"], abs=1e-5) for s in scores} == row["probabilities"]


def script_args(data, *extra):
    import train_bert_cls

    return train_bert_cls.parse_args(["--model_name_or_path", str(data / "model"), "--from_scratch", "--do_train",
                                      "--train_file", str(data / "train.jsonl"), *map(str, extra)])


def test_bad_flags_found_before_training(pair_data):
    """Checked when the files are read (before anything is written), in-process: no launch needed."""
    import train_bert_cls
    from utils.runtime import UserError

    columns = ["--text_column", "sentence1", "--text_pair_column", "sentence2", "--label_column", "tags"]
    with pytest.raises(UserError, match=r"train.jsonl:1: not valid UTF-8 .*--encoding gb18030"):
        train_bert_cls.load_splits(script_args(pair_data, *columns), None)
    with pytest.raises(UserError, match=r"train.jsonl:1: no field 'sentence' \(--text_pair_column\)"):
        train_bert_cls.load_splits(script_args(pair_data, "--encoding", ENCODING, "--text_column", "sentence1",
                                               "--text_pair_column", "sentence", "--label_column", "tags"), None)
    labels, examples = train_bert_cls.load_splits(
        script_args(pair_data, *columns, "--encoding", ENCODING, "--multi_label", "--label_separator", "|"), None)
    assert labels == LABELS and all(isinstance(e.label, tuple) and e.text_pair for e in examples["train"])
    with pytest.raises(SystemExit):
        script_args(pair_data, "--multi_label", "--label_smoothing", "0.1")


def test_trained_model_is_used_in_the_mode_it_was_trained_in(runs):
    from utils.runtime import UserError
    from utils.text_model import check_problem_type

    check_problem_type(runs[1] / "best_model", multi_label=True)
    with pytest.raises(UserError, match="trained for multi_label_classification; pass --multi_label"):
        check_problem_type(runs[1] / "best_model", multi_label=False)
