"""Model directories laid out as users download them from the hub, small and with random weights.

Each builder starts from the fixture's vocab.txt (tests/conftest.py `text_data`) so that the demo text
tokenises, and returns the directory. `encoder_weights(dir)` reads a directory's weights back under the
names the loaded model uses, for checking that fine-tuning really starts from them.
"""
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (AutoTokenizer, BertConfig, BertForPreTraining, ElectraConfig, ElectraForPreTraining)

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def vocab_size(vocab_dir):
    return len((Path(vocab_dir) / "vocab.txt").read_text(encoding="utf-8").splitlines())


def bert_base_chinese_layout(vocab_dir, out_dir, seed=0):
    """The hub's bert-base-chinese shape: BertForPreTraining weights (MLM + NSP heads) in pytorch_model.bin with
    the original Google conversion's LayerNorm names `gamma`/`beta` (as transformers' conversion scripts wrote them), vocab.txt only."""
    torch.manual_seed(seed)
    model = BertForPreTraining(BertConfig(vocab_size=vocab_size(vocab_dir), **TINY))
    state_dict = {key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): value
                  for key, value in model.state_dict().items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    torch.save(state_dict, out_dir / "pytorch_model.bin")
    model.config.architectures = ["BertForPreTraining"]
    model.config.save_pretrained(out_dir)
    shutil.copy(Path(vocab_dir) / "vocab.txt", out_dir / "vocab.txt")
    return out_dir


def save_with_tokenizer_json(model, vocab_dir, out_dir, max_shard_size=None):
    """model.save_pretrained (safetensors, sharded with an index when max_shard_size is small) and the tokenizer
    as tokenizer.json alone (no vocab.txt), as fast-tokenizer-only repositories ship it."""
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer = AutoTokenizer.from_pretrained(vocab_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "vocab.txt").unlink(missing_ok=True)
    assert (out_dir / "tokenizer.json").is_file()
    return out_dir


def sharded_bert_layout(vocab_dir, out_dir, seed=1):
    torch.manual_seed(seed)
    model = BertForPreTraining(BertConfig(vocab_size=vocab_size(vocab_dir), **TINY))
    out_dir = save_with_tokenizer_json(model, vocab_dir, out_dir, max_shard_size="40KB")
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "expected several shards"
    return out_dir


def electra_layout(vocab_dir, out_dir, seed=2):
    """A non-BERT architecture through the Auto classes: an ELECTRA discriminator, model.safetensors, vocab.txt."""
    torch.manual_seed(seed)
    config = ElectraConfig(vocab_size=vocab_size(vocab_dir), embedding_size=16, **TINY)
    model = ElectraForPreTraining(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    shutil.copy(Path(vocab_dir) / "vocab.txt", out_dir / "vocab.txt")
    assert (out_dir / "model.safetensors").is_file()
    return out_dir


def checkpoint_weights(model_dir):
    """A directory's weights under the standard module names (gamma/beta read as weight/bias)."""
    model_dir = Path(model_dir)
    if (model_dir / "pytorch_model.bin").is_file():
        raw = torch.load(model_dir / "pytorch_model.bin", weights_only=True)
    else:
        raw = {}
        for path in sorted(model_dir.glob("model*.safetensors")):
            raw.update(load_file(path))
    return {key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): value
            for key, value in raw.items()}


def finetune_args(data, model_dir, out, predict_file, *extra, eval_batch_size=32):
    """A short fine-tune of a checkpoint directory on the fixture's text: 6 steps, checkpoints and evaluations every 3,
    test and predictions at the end (shared by the checkpoint-layout and compile tests)."""
    return ["--model_name_or_path", model_dir, "--data_dir", data, "--do_train", "--do_eval", "--do_test",
            "--do_predict", "--predict_file", predict_file, "--max_seq_len", "32", "--train_batch_size", "16",
            "--eval_batch_size", eval_batch_size, "--learning_rate", "1e-3", "--max_train_steps", "6",
            "--checkpointing_steps", "3", "--eval_steps", "3", "--logging_steps", "3", "--output_dir", out, *extra]
