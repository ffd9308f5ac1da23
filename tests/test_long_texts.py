"""train_bert_cls.py on texts longer than --max_seq_len: --truncation tail/head_tail against the tokenizer's own
encoding, --doc_stride windows trained with their text's label and pooled into one prediction per text, counted once
on 1 and 2 processes (against the exported model's own forward in the test), recorded in the export."""
import argparse
import re

import pytest
import tokenizers
import torch
from conftest import needs_whole_windows, one_thread, read_json, read_jsonl, run_here, run_on
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import train_bert_cls
from utils.runtime import UserError
from utils.text_data import LongText, long_text, resolve_head_tokens, tokenize
from utils.text_metrics import StreamedWindows, pool_windows

SCRIPT = "train_bert_cls.py"
LEN = 16  # tokens: most headlines (up to 24 tokens with [CLS] and [SEP]) are longer
TEXT = "体育比赛今天开始球队赢了比赛球迷很高兴财经股票上涨"


def bert_args(data, out, *extra):
    return ["--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch", "--max_seq_len", str(LEN),
            "--config_overrides", "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0",
            "--train_batch_size", "16", "--eval_batch_size", "16", "--learning_rate", "2e-3", "--num_train_epochs",
            "2", "--logging_steps", "20", "--output_dir", out, *extra]


@pytest.fixture(scope="module")
def tokenizer(text_data):
    return AutoTokenizer.from_pretrained(text_data / "model")


def test_tail_is_the_tokenizers_left_truncation(tokenizer):
    [got] = tokenize(tokenizer, [TEXT], None, LEN, cut=LongText(truncation="tail"))["input_ids"][:1]
    tokenizer.truncation_side = "left"
    try:
        expected = tokenizer(TEXT, truncation=True, max_length=LEN)["input_ids"]
    finally:
        tokenizer.truncation_side = "right"
    assert got == expected and len(got) == LEN


def test_head_tail_keeps_the_first_and_last_tokens(tokenizer):
    tokens = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(tokens) > LEN
    dataset = tokenize(tokenizer, [TEXT, "体育"], [3, 4], LEN, cut=LongText(truncation="head_tail", head_tokens=5))
    assert dataset["input_ids"][0] == [tokenizer.cls_token_id, *tokens[:5], *tokens[-(LEN - 2 - 5):],
                                       tokenizer.sep_token_id]
    assert dataset["input_ids"][1] == tokenizer("体育")["input_ids"]  # short texts stay whole
    assert dataset["labels"] == [3, 4]


@needs_whole_windows
def test_windows_cover_the_text_with_its_label(tokenizer):
    tokens = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    dataset = tokenize(tokenizer, [TEXT, "体育"], [7, 2], LEN, cut=LongText(doc_stride=4), keep_doc=True)
    windows = [ids[1:-1] for ids, doc in zip(dataset["input_ids"], dataset["doc"]) if doc == 0]
    assert len(windows) == 1 + -(-(len(tokens) - (LEN - 2)) // (LEN - 2 - 4))  # each window adds 10 new tokens
    assert windows[0] == tokens[:LEN - 2] and windows[1][:4] == windows[0][-4:]  # overlapping by 4
    assert windows[-1][-1] == tokens[-1]
    assert dataset["labels"] == [7] * len(windows) + [2] and dataset["doc"] == [0] * len(windows) + [1]
    assert "doc" not in tokenize(tokenizer, [TEXT], [7], LEN, cut=LongText(doc_stride=4)).column_names


class TwoWindowsAtMost:
    """A tokenizer whose overflowing windows stop after two, as tokenizers 0.23.2's do."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        encoded = self.tokenizer(*args, **kwargs)
        if kwargs.get("return_overflowing_tokens"):
            encoded["input_ids"] = encoded["input_ids"][:2]
        return encoded


def test_windows_that_drop_tokens_are_refused_before_any_text_is_cut(tokenizer):
    with pytest.raises(UserError, match=r"^--doc_stride: this tokenizer's windows hold (\d+) of a 48-token text \(2 "
                                        r"windows, tokenizers .*pip install 'tokenizers>=0.23.3'$") as refused:
        tokenize(TwoWindowsAtMost(tokenizer), [TEXT], [7], LEN, cut=LongText(doc_stride=4))
    covered = int(re.search(r"hold (\d+) of", str(refused.value)).group(1))
    # two windows of 14 tokens overlapping by 4; tokenizers 0.23.2 cuts its own two windows first
    assert covered == 24 or (tokenizers.__version__ == "0.23.2" and covered < 48), covered


def test_pool_windows_by_mean_and_max():
    logits = torch.tensor([[1.0, 5.0], [3.0, 1.0], [0.0, 2.0], [4.0, 4.0], [2.0, 0.0]])
    docs, targets = torch.tensor([0, 0, 0, 1, 2]), torch.tensor([1, 1, 1, 0, 1])
    mean, pooled_targets = pool_windows(logits, targets, docs, "mean")
    assert torch.allclose(mean, torch.tensor([[4 / 3, 8 / 3], [4.0, 4.0], [2.0, 0.0]]))
    assert pooled_targets.tolist() == [1, 0, 1]
    assert pool_windows(logits, targets, docs, "max")[0].tolist() == [[3.0, 5.0], [4.0, 4.0], [2.0, 0.0]]


@pytest.mark.parametrize("pool", ["mean", "max"])
def test_streamed_windows_pool_as_the_whole_does(pool):
    """Predictions come a gathered batch at a time: a text whose windows span batches is pooled once, whole."""
    logits = torch.arange(18.0).view(9, 2) % 5
    docs = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 3])  # text 0 and text 2 span batches of 2
    streamed = StreamedWindows(pool)
    parts = [streamed.add(logits[i:i + 2], docs[i:i + 2]) for i in range(0, 9, 2)]
    assert [len(part) for part in parts] == [0, 1, 1, 0, 1]  # a text once the next one has begun
    whole = torch.cat([*parts, streamed.end(2)])
    assert whole.tolist() == pool_windows(logits, None, docs, pool)[0].tolist()
    assert StreamedWindows(pool).end(2).shape == (0, 2)  # nothing predicted


def pooled_accuracy(model_dir, texts, labels, stride, pool):
    """Accuracy of the exported model over whole texts, each pooling its windows as the model card says."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    label2id = model.config.label2id
    hits = 0
    for text, label in zip(texts, labels):
        inputs = tokenizer(text, truncation=True, max_length=LEN, stride=stride, return_overflowing_tokens=True,
                           padding=True, return_tensors="pt")
        inputs.pop("overflow_to_sample_mapping")
        with torch.no_grad():
            logits = model(**inputs).logits
        pooled = logits.mean(0) if pool == "mean" else logits.max(0).values
        hits += int(pooled.argmax()) == label2id[label]
    return hits / len(texts)


def card_windows_probabilities(model_dir, card, text):
    """Run the model card's windows code block, as a pipeline() user would, on `text`: its pooled probabilities, in
    the model's label order."""
    from transformers import pipeline

    [code] = [block.split("\n", 1)[1] for block in card.split("```python")[1:] if "return_overflowing_tokens" in block]
    scope = {"classifier": pipeline("text-classification", model=str(model_dir)), "text": text}
    with one_thread():
        exec(code.split("```")[0], scope)
    return scope["probabilities"].tolist()


@needs_whole_windows
@pytest.mark.parametrize("n, pool", [(1, "max"), (2, "mean")])
def test_windows_pool_once_per_text_on_any_process_count(text_data, tmp_path, n, pool):
    out = tmp_path / "out"
    predict = tmp_path / "predict.txt"
    rows = [line.split("\t", 1) for line in (text_data / "test.txt").read_text(encoding="utf-8").splitlines()]
    predict.write_text("".join(f"{text}\n" for _, text in rows[:9]) + "\n", encoding="utf-8")  # and a blank line
    args = bert_args(text_data, out, "--doc_stride", "4", "--pool", pool, "--num_train_epochs", "1", "--do_train",
                     "--do_eval", "--do_test", "--do_predict", "--predict_file", predict)
    run_on(n, SCRIPT, args)  # 1 process in this process: the launcher is the 2-process case's point
    results = read_json(out / "all_results.json")
    assert results["eval_samples"] == results["test_samples"] == 99  # texts, not windows
    assert results["validation_windows"] > 99 and results["train_windows"] > 800
    expected = pooled_accuracy(out / "best_model", [t for _, t in rows], [label for label, _ in rows], 4, pool)
    assert results["test_accuracy"] == pytest.approx(expected, abs=1e-9)
    predictions = read_jsonl(out / "predictions.jsonl")
    assert [p["text"] for p in predictions] == [t for _, t in rows[:9]] + [""] and "skipped" in predictions[-1]
    assert read_json(out / "best_model" / "trained_with.json") == {
        "max_seq_len": LEN, "multi_label": False, "truncation": "head", "doc_stride": 4, "pool": pool}
    card = (out / "best_model" / "README.md").read_text(encoding="utf-8")
    assert "stride=4, return_overflowing_tokens=True" in card
    # the card's code for pipeline() users gives predictions.jsonl's probabilities
    assert card_windows_probabilities(out / "best_model", card, predictions[0]["text"]) == pytest.approx(
        list(predictions[0]["probabilities"].values()), abs=1e-5)
    if n == 2:  # evaluating the export later: the model's windows, the training's numbers
        later = run_here(SCRIPT, ["--cpu", "--data_dir", text_data, "--model_name_or_path", out / "best_model",
                                  "--do_test", "--eval_batch_size", "16", "--output_dir", tmp_path / "later"])
        assert "was trained with" in later.stdout and "--doc_stride 4" in later.stdout
        assert read_json(tmp_path / "later" / "test_results.json")["test_accuracy"] == results["test_accuracy"]


HEAD_LINE = ("--head_tokens 4: --truncation head_tail keeps the first 4 and the last 10 of the 14 text tokens of "
             "--max_seq_len 16 (a quarter from the head, as Sun et al.'s 128 of 510)")


def test_head_tail_trains_with_a_quarter_of_the_text_as_head_and_records_it(text_data, tmp_path):
    """--head_tokens' default is a quarter of --max_seq_len's 14 text tokens, said once; the export records the number,
    and an evaluation of it later uses that head, at the model's length and at another one."""
    out = tmp_path / "out"
    proc = run_here(SCRIPT, ["--cpu", *bert_args(text_data, out, "--truncation", "head_tail", "--num_train_epochs",
                                                "1", "--do_train", "--do_eval")])
    assert proc.stdout.count(HEAD_LINE) == 1
    assert read_json(out / "best_model" / "trained_with.json")["head_tokens"] == 4
    assert "ids[:4] + ids[-10:]" in (out / "best_model" / "README.md").read_text(encoding="utf-8")
    results = read_json(out / "all_results.json")
    assert results["long_texts"] == "the first 4 tokens and the last ones"
    evaluate = ["--cpu", "--data_dir", text_data, "--model_name_or_path", out / "best_model", "--do_eval",
                "--eval_batch_size", "16"]
    later = run_here(SCRIPT, [*evaluate, "--output_dir", tmp_path / "later"])
    assert (f"{out / 'best_model'} was trained with --max_seq_len 16, --truncation head_tail, --head_tokens 4: "
            "evaluating with the same") in later.stdout and HEAD_LINE not in later.stdout
    assert read_json(tmp_path / "later" / "eval_results.json")["eval_accuracy"] == results["eval_accuracy"]
    shorter = run_here(SCRIPT, [*evaluate, "--max_seq_len", "12", "--output_dir", tmp_path / "shorter"])
    assert "--head_tokens 4" in shorter.stdout  # the model's head, not a quarter of 10 text tokens
    assert read_json(tmp_path / "shorter" / "eval_max_seq_len_12_results_settings.json")[
        "eval_max_seq_len_12_settings"]["head_tokens"] == 4


def test_a_head_recorded_beside_another_cut_is_not_the_models():
    """An export that recorded --head_tokens beside --truncation head (as exports did before they left it out) has no
    head: evaluating it with head_tail takes the default for the length, not that 128."""
    roles = train_bert_cls.flag_roles()
    old_export = {"max_seq_len": 64, "multi_label": False, "truncation": "head", "head_tokens": 128, "doc_stride": None}
    assert roles.model_settings(old_export) == {k: v for k, v in old_export.items() if k != "head_tokens"}
    head_tail = {**old_export, "truncation": "head_tail"}
    assert roles.model_settings(head_tail) == head_tail


@pytest.mark.parametrize("max_seq_len, head", [(512, 128), (128, 32), (64, 16), (4, 1)])
def test_the_default_head_fits_every_length(max_seq_len, head):
    said = []
    args = argparse.Namespace(truncation="head_tail", head_tokens=None, doc_stride=None, pool="mean",
                              max_seq_len=max_seq_len)
    resolve_head_tokens(args, said.append)
    assert args.head_tokens == head and len(said) == 1
    assert long_text(args, max_seq_len, paired=False).head_tokens == head
    args.truncation, args.head_tokens = "head", None
    resolve_head_tokens(args, said.append)
    assert args.head_tokens == 128 and len(said) == 1  # no head cut: nothing to say
    with pytest.raises(UserError, match="--truncation head_tail: --max_seq_len 3 holds 1 text tokens; a head and a "
                                        "tail need 2 or more"):
        long_text(argparse.Namespace(truncation="head_tail", head_tokens=1, doc_stride=None, pool="mean"), 3, False)


@pytest.mark.parametrize("extra, message", [
    (["--doc_stride", "4", "--truncation", "tail"], "--doc_stride 4 keeps every token in windows: --truncation tail"),
    (["--doc_stride", "14"], "--doc_stride 14: windows of --max_seq_len 16 tokens hold 14 text tokens"),
    (["--truncation", "head_tail", "--head_tokens", "14"],
     "--head_tokens 14: --max_seq_len 16 holds 14 text tokens; leave some for the tail"),
])
def test_bad_long_text_flags_are_one_line(text_data, tmp_path, extra, message):
    proc = run_here(SCRIPT, ["--cpu", *bert_args(text_data, tmp_path / "out", *extra, "--do_train")], check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
