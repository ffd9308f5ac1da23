"""utils.text_data: what the collator really builds per device, sentence pairs, multi-label targets."""
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DynamoBackend
from transformers import AutoTokenizer

from utils.demo_data import write_small_bert
from utils.runtime import UserError
from utils.text_data import build_collator, label_targets, resolve_padding, tokenize, tokenize_examples
from utils.text_data import Example

TEXTS = ["比赛球队", "股市上涨银行利率投资", "楼盘房价开发商地产住宅成交购房"]  # 4, 10, 15 characters: one token each


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_small_bert(tmp_path_factory.mktemp("bert")))


def fake_accelerator(device, backend=DynamoBackend.NO):
    return SimpleNamespace(device=torch.device(device), state=SimpleNamespace(dynamo_plugin=SimpleNamespace(
        backend=backend)))


def run_args(multiple=None, max_length=False):
    return SimpleNamespace(pad_to_multiple_of=multiple, pad_to_max_length=max_length)


def batch_length(tokenizer, padding, max_seq_len=64):
    dataset = tokenize(tokenizer, TEXTS, None, max_seq_len)
    batch = build_collator(tokenizer, max_seq_len, **padding)([dataset[i] for i in range(len(dataset))])
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["attention_mask"].sum(1).tolist() == [len(t) + 2 for t in TEXTS]  # [CLS] text [SEP], no more
    return batch["input_ids"].shape[1]


@pytest.mark.parametrize("device, backend, asked, expected", [
    ("cpu", DynamoBackend.NO, run_args(), 17),  # the longest text + [CLS] + [SEP]: no padding for its own sake
    ("cuda", DynamoBackend.NO, run_args(), 24),  # multiples of 8 for tensor cores
    ("cpu", DynamoBackend.INDUCTOR, run_args(), 32),  # under compile: a coarse bound on the shapes
    ("cuda", DynamoBackend.INDUCTOR, run_args(), 32),
    ("cpu", DynamoBackend.NO, run_args(8), 24),  # what the user asks for wins
    ("cuda", DynamoBackend.NO, run_args(1), 17),
    ("cpu", DynamoBackend.INDUCTOR, run_args(max_length=True), 64),  # every batch at --max_seq_len
])
def test_padded_batch_length_per_device(tokenizer, device, backend, asked, expected):
    padding = resolve_padding(asked, fake_accelerator(device, backend))
    assert batch_length(tokenizer, padding) == expected


def test_padding_multiple_must_be_positive():
    with pytest.raises(UserError, match="--pad_to_multiple_of 0: must be a positive"):
        resolve_padding(run_args(0), fake_accelerator("cpu"))


def test_sentence_pair_is_the_tokenizers_pair_truncated_longest_first(tokenizer):
    pair = Example(TEXTS[2], None, "-", text_pair=TEXTS[0])  # 15 + 4 characters
    row = tokenize_examples(tokenizer, [pair], None, max_seq_len=13)[0]
    tokens = tokenizer.convert_ids_to_tokens(row["input_ids"])
    # 13 = [CLS] 6 of the long text [SEP] all 4 of the short one [SEP]: the longer sentence lost its tail
    assert tokens == ["[CLS]", *TEXTS[2][:6], "[SEP]", *TEXTS[0], "[SEP]"]
    assert row["token_type_ids"] == [0] * 8 + [1] * 5


def test_multi_label_targets_are_multi_hot_floats(tokenizer):
    examples = [Example("比赛", ("体育",), "-"), Example("股市", ("体育", "财经"), "-"), Example("球队", (), "-")]
    targets = label_targets(examples, ["体育", "娱乐", "财经"], multi_label=True)
    dataset = tokenize_examples(tokenizer, examples, targets, 16)
    batch = build_collator(tokenizer, 16)([dataset[i] for i in range(3)])
    assert batch["labels"].dtype == torch.float32
    assert batch["labels"].tolist() == [[1, 0, 0], [1, 0, 1], [0, 0, 0]]
