"""train_bert_cls.py end to end through the real launcher, 1 and 2 CPU processes, on a tiny fixture."""
import ast
import contextlib
import io
import json
import math
import shutil
import subprocess
import sys
import time

import pandas as pd
import pytest
from conftest import ENV, HANG_S, ROOT, STARTED, launch, one_thread, read_json, read_jsonl, run_here, run_on

SCRIPT = "train_bert_cls.py"

HEAD_CUT = {"truncation": "head", "doc_stride": None}  # long texts: the first tokens (the default; no head to record)


def bert_args(data, out, *extra, epochs=3):
    # 16 tokens cut most headlines (up to 24 tokens with [CLS] and [SEP]): an evaluation at another length differs
    return ["--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch",
            "--max_seq_len", "16", "--train_batch_size", "16", "--eval_batch_size", "16",
            "--learning_rate", "2e-3", "--num_train_epochs", str(epochs), "--logging_steps", "10",
            "--output_dir", out, *extra]


@pytest.fixture(scope="module")
def trained(text_data, tmp_path_factory):
    """One 1-process run (in this process) and one 2-process launch, shared by the tests below."""
    runs = {}
    # the 2-process run also predicts the first validation text: the text its model card's pipeline() call classifies
    first_text = tmp_path_factory.mktemp("predict") / "first_validation_text.txt"
    first_text.write_text((text_data / "val.txt").read_text(encoding="utf-8").splitlines()[0].split("\t", 1)[1] + "\n",
                          encoding="utf-8")
    for n in (1, 2):
        out = tmp_path_factory.mktemp(f"bert_{n}proc")
        extra = ["--with_tracking", "--do_predict", "--predict_file", first_text] if n == 2 else []
        proc = run_on(n, SCRIPT, bert_args(text_data, out, "--do_train", "--do_eval", "--do_test", *extra))
        runs[n] = (out, proc)
    return runs


@pytest.mark.parametrize("n", [1, 2])
def test_learns_and_counts_exactly(trained, n):
    out, _ = trained[n]
    results = read_json(out / "all_results.json")
    assert results["num_processes"] == n
    assert results["distributed_type"] == ("NO" if n == 1 else "MULTI_CPU")
    assert results["global_batch_size"] == 16 and results["per_device_batch_size"] == 16 // n
    # 99 samples in batches of 16 on 2 processes: the padded duplicates must not be counted
    assert results["eval_samples"] == 99 and results["test_samples"] == 99
    assert results["test_accuracy"] > 0.6, results  # chance is 0.1
    assert results["test_macro_f1"] > 0.5, results
    assert results["train_unk_rate"] == 0.0
    train_losses = [e["loss"] for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "train"]
    assert train_losses[-1] < 0.5 * train_losses[0], train_losses
    steps = [e["step"] for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "train"]
    assert steps == sorted(set(steps))  # one line per logging step, no repeats
    # flat, as the Trainer's all_results.json: pandas reads it as a table; what each group was measured with and the
    # launches are in all_results_settings.json
    table = pd.read_json(out / "all_results.json", typ="series")
    assert table.index.tolist() == list(results) and table["test_accuracy"] == pytest.approx(results["test_accuracy"])
    settings = read_json(out / "all_results_settings.json")
    assert sorted(settings) == ["eval_settings", "launches", "test_settings"]
    assert settings["launches"] == [{"processes": n, "mixed_precision": "no", "resume_step": None}]


def test_selected_model_is_the_best_on_validation(trained):
    out, _ = trained[1]
    evals = [e for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "eval"]
    best = max(evals, key=lambda e: e["macro_f1"])
    results = read_json(out / "all_results.json")
    assert results["best_step"] == best["step"]
    # the final validation score is that of the reloaded best model, not of the last step
    assert results["eval_macro_f1"] == pytest.approx(best["macro_f1"], abs=1e-6)


def test_demo_prints_a_command_that_runs_in_a_plain_shell(trained, monkeypatch):
    """`make demo` ends with a command to try the model: it must run as printed, without an activated venv."""
    import demo

    monkeypatch.chdir(ROOT)  # where `make demo` runs
    command = demo.try_command(trained[1][0] / "best_model")
    assert command.startswith((".venv/bin/python ", f"{sys.executable} "))
    proc = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
                          env={**ENV, "PATH": "/usr/bin:/bin"})  # a plain shell: no venv on the PATH
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'label': '体育'" in proc.stdout, proc.stdout


def test_outputs_load_anywhere(trained, text_data):
    out, _ = trained[2]
    best = out / "best_model"
    config = json.loads((best / "config.json").read_text())
    labels = sorted({line.split("\t")[0] for line in (text_data / "train.txt").read_text().splitlines()})
    assert [config["id2label"][str(i)] for i in range(len(labels))] == labels  # sorted, deterministic
    assert (out / "labels.txt").read_text().split() == labels
    # what it was trained with travels with it; the tokenizer (and so pipeline()) truncates at the training's length
    assert read_json(best / "trained_with.json") == {"max_seq_len": 16, "multi_label": False, **HEAD_CUT}
    assert read_json(best / "tokenizer_config.json")["model_max_length"] == 16
    from safetensors.torch import load_file

    keys = load_file(best / "model.safetensors").keys()
    assert not any(k.startswith("module.") for k in keys)
    # the model card's own pipeline() snippet, as a user copies it (in a namespace of its own: it imports what it
    # uses), then one more text of our own; a fresh interpreter's pipeline() is the demo test's
    snippet = (best / "README.md").read_text(encoding="utf-8").split("```python\n")[1].split("```")[0]
    printed = io.StringIO()
    with one_thread(), contextlib.redirect_stdout(printed):
        exec(snippet + "print(classifier('球队比赛冠军进球今天')[0]['label'])\n", {})
    card_output, label = printed.getvalue().strip().splitlines()[-2:]
    [predicted] = read_jsonl(out / "predictions.jsonl")  # what the run itself predicted for the card's text
    [piped] = ast.literal_eval(card_output)
    assert piped["label"] == predicted["label"] and piped["score"] == pytest.approx(predicted["score"], abs=1e-5)
    assert label == "体育"
    for prefix in ("eval", "test"):
        assert (out / f"{prefix}_confusion_matrix.png").stat().st_size > 1000
        rows = (out / f"{prefix}_confusion_matrix.csv").read_text(encoding="utf-8").splitlines()
        assert len(rows) == 1 + len(labels)
        assert sum(int(x) for row in rows[1:] for x in row.split(",")[1:]) == 99
        report = read_json(out / f"{prefix}_report.json")
        assert set(labels) <= set(report)
    assert read_json(out / "run_config.json")["versions"]["torch"]
    assert list((out / "runs").rglob("events.out.tfevents.*"))  # --with_tracking: TensorBoard logs


def test_predict_and_test_with_saved_model(trained, text_data, tmp_path):
    """2 processes: one row per input line, in input order, blank lines included (36 texts: the last batch of 16 is
    padded with duplicates, which must not become rows)."""
    out, _ = trained[1]
    texts = ["球队比赛冠军进球今天", "股市银行利率上涨", "电影明星导演票房"]
    more = [line.split("\t", 1)[1] for line in (text_data / "test.txt").read_text(encoding="utf-8").splitlines()[:33]]
    lines = [texts[0], "", *texts[1:], *more]
    predict_file = tmp_path / "texts.txt"
    predict_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    pred_out = tmp_path / "pred"
    # the second command users run, without the training's --max_seq_len: the model's 16, not the default 512
    proc = launch(SCRIPT, ["--model_name_or_path", out / "best_model", "--data_dir", text_data, "--do_test",
                           "--do_predict", "--predict_file", predict_file, "--eval_batch_size", "16",
                           "--output_dir", pred_out], num_processes=2)
    assert (f"{out / 'best_model'} was trained with --max_seq_len 16, --truncation head: "
            "evaluating with the same") in proc.stdout
    rows = read_jsonl(pred_out / "predictions.jsonl")
    assert [(r["line"], r["text"]) for r in rows] == list(enumerate(lines, start=1))
    assert rows[1] == {"line": 2, "text": "", "skipped": "blank line"}
    rows = [r for r in rows if "skipped" not in r]
    assert [r["label"] for r in rows[:3]] == ["体育", "财经", "娱乐"]
    for row in rows:
        assert abs(sum(row["probabilities"].values()) - 1) < 1e-4
        assert row["score"] == max(row["probabilities"].values())
    # the saved model reproduces the test accuracy the training run reported
    assert read_json(pred_out / "all_results.json")["test_accuracy"] == pytest.approx(
        read_json(out / "all_results.json")["test_accuracy"])


def test_labelled_predict_file_predicts_on_its_texts(trained, text_data, tmp_path):
    """test.txt (label<TAB>text) as --predict_file: the labels are given, not read as text, so the predictions agree
    with the given labels exactly as often as the training run's test accuracy says."""
    out, _ = trained[1]
    proc = run_here(SCRIPT, ["--cpu", "--model_name_or_path", out / "best_model", "--do_predict", "--predict_file",
                             text_data / "test.txt", "--output_dir", tmp_path / "pred"])
    assert "every line is 'label<TAB>text' with a label of the model" in proc.stdout
    rows = read_jsonl(tmp_path / "pred" / "predictions.jsonl")
    given = [line.split("\t", 1) for line in (text_data / "test.txt").read_text(encoding="utf-8").splitlines()]
    assert [(r["label_given"], r["text"]) for r in rows] == [(label, text) for label, text in given]
    agreement = sum(r["label"] == r["label_given"] for r in rows) / len(rows)
    assert agreement == pytest.approx(read_json(out / "all_results.json")["test_accuracy"])


def test_predictions_are_made_and_written_a_batch_at_a_time(trained, text_data, tmp_path, monkeypatch):
    """Memory bounded for any number of texts: the rows are made from one batch of logits at a time (never all of
    them at once), in input order, the skipped records before, between and after the texts included."""
    out, _ = trained[1]
    texts = [line.split("\t", 1)[1] for line in (text_data / "test.txt").read_text(encoding="utf-8").splitlines()]
    lines = ["", *texts[:20], "", *texts[20:40], "", ""]
    predict_file = tmp_path / "texts.txt"
    predict_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    from utils import text_metrics

    sizes, real = [], text_metrics.prediction_rows

    def counted(logits, examples, *args):
        sizes.append(len(logits))
        return real(logits, examples, *args)
    monkeypatch.setattr(text_metrics, "prediction_rows", counted)
    run_here(SCRIPT, ["--cpu", "--model_name_or_path", out / "best_model", "--do_predict", "--predict_file",
                      predict_file, "--eval_batch_size", "16", "--output_dir", tmp_path / "pred"])
    assert sizes == [16, 16, 8, 0]  # 40 texts in batches of 16, then the blank lines after the last one
    rows = read_jsonl(tmp_path / "pred" / "predictions.jsonl")
    assert [(r["line"], r["text"]) for r in rows] == list(enumerate(lines, start=1))
    assert [r["line"] for r in rows if "skipped" in r] == [1, 22, 43, 44]


def test_clue_style_data_dir_trains_with_validation(text_data, tmp_path):
    """train.json/dev.json/test.json in JSON lines with `sentence` (CLUE), read without a column flag as
    run_classification.py reads them (said once): dev.json validates; the unlabelled test.json cannot be a --do_test
    file, and is a --predict_file."""
    clue = tmp_path / "clue"
    clue.mkdir()
    for source, name, count in (("train.txt", "train.json", 64), ("val.txt", "dev.json", 16), ("test.txt", "test.json", 5)):
        rows = [line.split("\t", 1) for line in (text_data / source).read_text(encoding="utf-8").splitlines()[:count]]
        records = [{"sentence": text} if name == "test.json" else {"label": label, "sentence": text}
                   for label, text in rows]
        (clue / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    common = ["--cpu", "--data_dir", clue]
    proc = run_here(SCRIPT, [*common, *bert_args(text_data, tmp_path / "out", "--do_train", "--do_eval")[2:],
                             "--max_train_steps", "2"])
    assert proc.stdout.count(f"--text_column sentence: {clue / 'train.json'} has a 'sentence' field and no 'text' "
                             "(run_classification.py's default text column)") == 1
    assert f"--data_dir {clue}: train {clue / 'train.json'}, validation {clue / 'dev.json'}, test {clue / 'test.json'}" \
        in proc.stdout
    results = read_json(tmp_path / "out" / "all_results.json")
    assert results["best_step"] == 2 and results["eval_samples"] == 16
    model = ["--model_name_or_path", tmp_path / "out" / "best_model"]
    refused = run_here(SCRIPT, [*common, *model, "--do_test", "--output_dir", tmp_path / "test"], check=False)
    assert refused.returncode == 2
    assert f"{clue / 'test.json'}:1: no field 'label' (--label_column); files to train or evaluate on need labels" \
        in refused.stderr
    run_here(SCRIPT, [*common, *model, "--do_predict", "--predict_file", clue / "test.json", "--output_dir",
                      tmp_path / "pred"])
    assert [r["line"] for r in read_jsonl(tmp_path / "pred" / "predictions.jsonl")] == [1, 2, 3, 4, 5]


def test_evaluation_with_other_settings_keeps_the_training_numbers(trained, text_data, tmp_path):
    """Evaluating into the training's output directory at another --max_seq_len: named in one line, and its numbers
    go under names that say so; all_results.json's training numbers and the per-class files stay the training's."""
    out = tmp_path / "out"
    shutil.copytree(trained[1][0], out, ignore=shutil.ignore_patterns("checkpoints"))
    training, report = read_json(out / "all_results.json"), (out / "test_report.json").read_text()
    settings = read_json(out / "all_results_settings.json")
    proc = run_here(SCRIPT, ["--cpu", "--model_name_or_path", out / "best_model", "--data_dir", text_data,
                             "--do_test", "--max_seq_len", "8", "--output_dir", out])
    assert "--max_seq_len 8 differs from the model's 16 (trained with): evaluating with 8" in proc.stdout
    merged, merged_settings = read_json(out / "all_results.json"), read_json(out / "all_results_settings.json")
    assert {k: merged[k] for k in training} == training and {k: merged_settings[k] for k in settings} == settings
    assert settings["test_settings"] == {"max_seq_len": 16, "multi_label": False, **HEAD_CUT}
    other = read_json(out / "test_max_seq_len_8_results_settings.json")
    assert other["test_max_seq_len_8_settings"] == {"max_seq_len": 8, "multi_label": False, **HEAD_CUT}
    assert merged_settings["test_max_seq_len_8_settings"] == other["test_max_seq_len_8_settings"]
    other = read_json(out / "test_max_seq_len_8_results.json")
    assert merged["test_max_seq_len_8_accuracy"] == other["test_max_seq_len_8_accuracy"]
    assert (out / "test_report.json").read_text() == report and (out / "test_max_seq_len_8_report.json").is_file()


def test_reference_repo_best_pt_imports(trained, text_data, tmp_path):
    """The reference's best.pt (DataParallel `module.` keys, bert.* + linear.* head) gives the same test accuracy."""
    import torch
    from safetensors.torch import load_file

    out, _ = trained[1]
    weights = load_file(out / "best_model" / "model.safetensors")
    legacy = {"module." + k.replace("classifier.", "linear."): v for k, v in weights.items()}
    torch.save({"state_dict": legacy, "epoch": 3, "best_acc": 0.9}, tmp_path / "best.pt")
    test_out = tmp_path / "legacy_test"
    run_here(SCRIPT, ["--cpu", "--model_name_or_path", text_data / "model", "--init_from_legacy", tmp_path / "best.pt",
                      "--labels_file", out / "labels.txt", "--data_dir", text_data, "--do_test", "--max_seq_len", "16",
                      "--eval_batch_size", "16", "--output_dir", test_out])
    assert read_json(test_out / "all_results.json")["test_accuracy"] == pytest.approx(
        read_json(out / "all_results.json")["test_accuracy"])
    # a head for another number of classes, and a file that would unpickle arbitrary objects, are refused
    torch.save({"state_dict": {**legacy, "module.linear.weight": torch.zeros(3, 64),
                               "module.linear.bias": torch.zeros(3)}}, tmp_path / "three.pt")
    import pathlib

    # (an argparse.Namespace, torchvision's checkpoint args, is the one class allowed: any other is refused)
    torch.save({"state_dict": legacy, "args": pathlib.PurePosixPath("x")}, tmp_path / "pickled.pt")
    for name, message in (("three.pt", "its head predicts 3 classes, this run has 10 labels"), ("pickled.pt", "weights_only")):
        proc = run_here(SCRIPT, ["--cpu", "--model_name_or_path", text_data / "model", "--init_from_legacy",
                                 tmp_path / name, "--labels_file", out / "labels.txt", "--data_dir", text_data,
                                 "--do_test", "--output_dir", tmp_path / "refused"], check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_label_smoothing_reaches_the_training_loss(trained, text_data, tmp_path):
    """Cross-entropy against the smoothed targets can never fall below their entropy; the plain run falls below it."""
    epsilon = 0.5
    run_here(SCRIPT, ["--cpu", *bert_args(text_data, tmp_path / "ls", "--do_train", "--label_smoothing",
                                          str(epsilon))])
    k = len((tmp_path / "ls" / "labels.txt").read_text().split())
    on, off = epsilon / k, 1 - epsilon + epsilon / k
    floor = -(off * math.log(off) + (k - 1) * on * math.log(on))
    smoothed = [e["loss"] for e in read_jsonl(tmp_path / "ls" / "metrics.jsonl") if e["event"] == "train"]
    plain = [e["loss"] for e in read_jsonl(trained[1][0] / "metrics.jsonl") if e["event"] == "train"]
    assert min(smoothed) >= floor - 1e-4, (floor, smoothed)
    assert plain[-1] < floor, (floor, plain)  # the same data and steps without smoothing go below the floor
    assert smoothed[-1] < smoothed[0]  # and it still learns


def test_label_smoothing_out_of_range_is_refused(text_data, tmp_path):
    proc = run_here(SCRIPT, ["--cpu", *bert_args(text_data, tmp_path / "o", "--do_train"),
                             "--label_smoothing", "1.0"], check=False)
    assert proc.returncode == 2 and "--label_smoothing 1.0: must be in [0, 1)" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_startup_and_pauses_are_reported_apart_from_the_speed(trained):
    """The launched run (the 1-process one runs in the pytest process, whose start is long past)."""
    out, proc = trained[2]
    results = read_json(out / "all_results.json")
    events = read_jsonl(out / "metrics.jsonl")
    windows = [e for e in events if e["event"] == "train"]
    assert 0 < results["startup_seconds"] < time.time() - STARTED + 1
    assert windows[0]["startup_seconds"] == results["startup_seconds"]  # in the first log line, once
    assert "startup" in proc.stdout and not any("startup_seconds" in w for w in windows[1:])
    assert all(e["eval_seconds"] > 0 for e in events if e["event"] == "eval")
    # 50 steps per epoch, a log line every 10: each epoch's first window holds its start and the last eval
    assert all("epoch_start_seconds" in w for w in windows if w["step"] % 50 == 10)
    assert all("eval_seconds" in w for w in windows if w["step"] % 50 == 10 and w["step"] > 50)
    # the windows split the training time exactly: their steps add up, their times (training + pauses) fit in it
    steps = [w["step"] for w in windows]
    assert steps[-1] == results["train_steps"]
    spent = sum((b - a) * w["ms_per_step"] / 1000 + sum(v for k, v in w.items() if k.endswith("_seconds")
                                                        and k != "startup_seconds")
                for a, b, w in zip([0, *steps], steps, windows))
    assert spent <= results["train_runtime"]
