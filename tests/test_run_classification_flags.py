"""run_classification.py's flags on train_bert_cls.py, on datasets the tests write with `datasets` (save_to_disk),
offline: regression that learns and resumes exactly, a model split into weights / tokenizer / config directories,
a --token that is never written or printed, class weights with the same weights on 1 and 2 processes."""
import json
import random
import shutil

import numpy as np
import pytest
from conftest import assert_same_curve, assert_same_weights, read_json, read_jsonl, run_here, run_on
from safetensors.torch import load_file

from utils.demo_data import TOPICS, make_headline, write_small_bert

SCRIPT = "train_bert_cls.py"
SECRET = "hf_secret_token_1234"
SCORES = {topic: float(i) for i, topic in enumerate(list(TOPICS)[:5])}  # what a headline's score depends on
STEPS = 30  # regression: 256 samples / 16 = 16 steps per epoch, so the step-20 checkpoint is mid-epoch


def headline_rows(rng, topics, noise=0.0):
    return [make_headline(rng, topic, noise) for topic in topics]


@pytest.fixture(scope="module")
def sts(tmp_path_factory):
    """An STS-B-shaped regression set written by save_to_disk: headlines scored by their topic (0-4) plus noise;
    and a model laid out as --config_name/--tokenizer_name allow: weights alone (no config.json, no vocabulary),
    the tokenizer in a directory of its own, config.json in another."""
    from datasets import Dataset, DatasetDict
    from transformers import AutoConfig, AutoTokenizer, BertForMaskedLM

    root = tmp_path_factory.mktemp("sts")
    rng = random.Random(0)

    def split(n):
        topics = [rng.choice(list(SCORES)) for _ in range(n)]
        return Dataset.from_dict({"sentence": headline_rows(rng, topics),
                                  "score": [SCORES[t] + rng.uniform(-0.3, 0.3) for t in topics]})

    DatasetDict(train=split(256), validation=split(41), test=split(20)).save_to_disk(str(root / "sts"))
    full = write_small_bert(root / "full")
    (root / "config").mkdir()
    shutil.copy(full / "config.json", root / "config")
    AutoTokenizer.from_pretrained(full).save_pretrained(root / "tokenizer")
    BertForMaskedLM(AutoConfig.from_pretrained(full)).save_pretrained(root / "weights")
    (root / "weights" / "config.json").unlink()
    return root


def regression_args(data, out, *extra):
    return ["--cpu", "--dataset_name", data / "sts", "--text_column_names", "sentence", "--label_column_name", "score",
            "--do_regression", "--model_name_or_path", data / "weights", "--config_name", data / "config",
            "--tokenizer_name", data / "tokenizer", "--token", SECRET, "--do_train", "--do_eval", "--do_test",
            "--do_predict", "--max_predict_samples", "7", "--max_seq_length", "32", "--train_batch_size", "16",
            "--eval_batch_size", "16", "--learning_rate", "3e-3", "--max_steps", str(STEPS), "--eval_steps", "10",
            "--save_steps", "10", "--save_total_limit", "3", "--logging_steps", "5", "--with_tracking",
            "--output_dir", out, *extra]


@pytest.fixture(scope="module")
def regression(sts, tmp_path_factory):
    """One run (in this process: 1 process), and a copy resumed from its mid-epoch step-20 checkpoint."""
    out = tmp_path_factory.mktemp("regression") / "out"
    resumed = tmp_path_factory.mktemp("regression_resumed") / "out"
    proc = run_here(SCRIPT, regression_args(sts, out))
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step_{STEPS}")
    run_here(SCRIPT, regression_args(sts, resumed, "--resume_from_checkpoint", "latest"))
    return out, proc, resumed


def test_regression_learns_and_selects_by_validation_mse(regression):
    out, proc, _ = regression
    results = read_json(out / "all_results.json")
    assert results["eval_pearson"] > 0.5 and results["test_pearson"] > 0.5, results  # unrelated scores: 0
    assert {"eval_spearmanr", "eval_rmse", "eval_mae", "test_mse"} <= set(results)
    events = read_jsonl(out / "metrics.jsonl")
    train = [e["loss"] for e in events if e["event"] == "train"]
    assert train[-1] < 0.5 * train[0], train  # the MSE falls
    evals = [e for e in events if e["event"] == "eval"]
    best = min(evals, key=lambda e: e["mse"])
    assert results["best_step"] == best["step"] and results["best_eval_mse"] == best["mse"]
    assert results["eval_mse"] == pytest.approx(best["mse"]) and results["eval_loss"] == results["eval_mse"]
    assert not (out / "eval_report.json").exists() and not (out / "eval_confusion_matrix.csv").exists()
    assert "validation <- split 'validation' (41 rows), test <- split 'test' (20 rows)" in proc.stdout


def test_regression_resumes_mid_epoch_bitwise(regression):
    out, _, resumed = regression
    step = f"checkpoints/step_{STEPS}/model.safetensors"
    assert_same_weights(load_file(out / step), load_file(resumed / step))
    assert_same_curve(out, resumed, ("loss", "lr", "mse", "pearson"))


def test_regression_export_scores_like_predictions_jsonl(regression):
    from transformers import pipeline

    out, _, _ = regression
    config = read_json(out / "best_model" / "config.json")
    assert config["problem_type"] == "regression" and config["id2label"] == {"0": "score"}
    rows = read_jsonl(out / "predictions.jsonl")
    assert len(rows) == 7 and all(set(row) == {"text", "score"} for row in rows)  # --max_predict_samples 7
    scorer = pipeline("text-classification", model=str(out / "best_model"), device="cpu")  # --tokenizer_name's
    for row in rows[:3]:
        assert scorer(row["text"])[0]["score"] == pytest.approx(row["score"], abs=1e-5)  # no sigmoid: the number


def test_token_is_never_written_or_printed(regression):
    out, proc, _ = regression
    assert SECRET not in proc.stdout + proc.stderr
    files = [path for path in out.rglob("*") if path.is_file()]
    assert any(path.name.startswith("events.out.tfevents") for path in files)  # TensorBoard's copy of the flags too
    leaks = [path for path in files if SECRET.encode() in path.read_bytes()]
    assert not leaks, leaks
    run_config = read_json(out / "run_config.json")
    assert run_config["args"]["token"] == "***" and "--token ***" in run_config["command"]


WEIGHTED_STEPS = 12  # 144 samples / 16 = 9 steps per epoch: the run crosses an epoch


@pytest.fixture(scope="module")
def imbalanced(tmp_path_factory):
    """Four topics in the proportions 8:4:2:1, a DatasetDict with a ClassLabel written by save_to_disk."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    root = tmp_path_factory.mktemp("imbalanced")
    names = list(TOPICS)[:4]
    features = Features({"text": Value("string"), "label": ClassLabel(names=names)})
    rng = random.Random(1)

    def split(counts):
        ids = [i for i, count in enumerate(counts) for _ in range(count)]
        rng.shuffle(ids)
        return Dataset.from_dict({"text": headline_rows(rng, [names[i] for i in ids], 0.3), "label": ids},
                                 features=features)

    DatasetDict(train=split([96, 48, 24, 12]), validation=split([16, 8, 6, 3])).save_to_disk(str(root / "news"))
    write_small_bert(root / "model")
    return root


def weighted_args(data, out, *extra):
    # No dropout: its masks are drawn per process, so they legitimately differ between 1 and 2 processes.
    return ["--dataset_name", data / "news", "--class_weights", "balanced", "--max_train_samples", "144",
            "--shuffle_train_dataset", "--model_name_or_path", data / "model", "--from_scratch",
            "--config_overrides", "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0", "--do_train", "--do_eval",
            "--max_seq_len", "32", "--train_batch_size", "16", "--eval_batch_size", "16", "--learning_rate", "3e-3",
            "--max_train_steps", str(WEIGHTED_STEPS), "--checkpointing_steps", "6", "--logging_steps", "3",
            "--output_dir", out, *extra]


@pytest.fixture(scope="module")
def weighted(imbalanced, tmp_path_factory):
    """--class_weights balanced on 1 process (in this process) and on 2 (gloo DDP through accelerate launch)."""
    outs = {n: tmp_path_factory.mktemp(f"weighted_{n}") / "out" for n in (1, 2)}
    procs = {n: run_on(n, SCRIPT, weighted_args(imbalanced, outs[n])) for n in (1, 2)}
    return outs, procs


def expected_balanced_weights(data):
    """scikit-learn's balanced weights of the 144 training labels run_classification.py would select."""
    from datasets import load_from_disk
    from sklearn.utils.class_weight import compute_class_weight

    train = load_from_disk(str(data / "news"))["train"].shuffle(seed=42).select(range(144))
    ids = np.array(train["label"])
    return dict(zip(train.features["label"].names, compute_class_weight("balanced", classes=np.arange(4), y=ids)))


def test_class_weights_train_the_same_weights_on_1_and_2_processes(weighted, imbalanced):
    outs, procs = weighted
    step = f"checkpoints/step_{WEIGHTED_STEPS}/model.safetensors"
    single, multi = load_file(outs[1] / step), load_file(outs[2] / step)
    worst = max((single[k] - multi[k]).abs().max().item() for k in single)
    # float32 reduction order only; a weight applied to the wrong sample moves weights by about the learning rate
    assert worst < 1e-5, f"max abs weight difference {worst:.2e}"
    expected = expected_balanced_weights(imbalanced)
    line = "--class_weights balanced: " + ", ".join(f"{label} {w:.4g}" for label, w in expected.items())
    for n in (1, 2):
        assert procs[n].stdout.count(line) == 1, procs[n].stdout[-3000:]  # printed once, by the main process
        state = read_json(outs[n] / f"checkpoints/step_{WEIGHTED_STEPS}/training_state.json")
        assert state["class_weights"] == pytest.approx(expected)
        assert state["--max_train_samples"] == 144 and state["--shuffle_seed"] == 42
        assert read_json(outs[n] / "all_results.json")["eval_samples"] == 33


def test_resume_with_other_class_weights_is_refused(weighted, imbalanced, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(weighted[0][1], out)
    uniform = tmp_path / "uniform.json"
    uniform.write_text(json.dumps({label: 1.0 for label in list(TOPICS)[:4]}, ensure_ascii=False))
    # the later --class_weights wins, as on any command line
    proc = run_here(SCRIPT, ["--cpu", *weighted_args(imbalanced, out, "--resume_from_checkpoint", "latest",
                                                     "--class_weights", uniform)], check=False)
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(error) == 1, proc.stderr[-2000:]
    assert "training_state.json: checkpoint has class_weights={'体育': 0.48" in error[0], error
