"""Fine-tuning starts from the checkpoint layouts users download, and exports what pipeline() loads.

The layouts are built here (tests/checkpoint_layouts.py): bert-base-chinese's pytorch_model.bin with
LayerNorm gamma/beta names and MLM + NSP heads, sharded safetensors with an index and tokenizer.json only,
and an ELECTRA discriminator through the Auto classes. A mistyped local path is never taken for a hub id.
"""
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from checkpoint_layouts import (bert_base_chinese_layout, checkpoint_weights, electra_layout, finetune_args,
                                sharded_bert_layout, vocab_size)
from conftest import assert_same_weights, read_json, read_jsonl, run_here
from launch_options import default_config, launch_with_config
from safetensors.torch import load_file

import train_bert_cls
from utils.outputs import RunLog
from utils import text_model
from utils.runtime import UserError
from utils.text_model import check_hub_ids_or_paths

SCRIPT = "train_bert_cls.py"
LAYOUTS = {"bin_gamma_beta": bert_base_chinese_layout, "sharded_tokenizer_json": sharded_bert_layout,
           "electra": electra_layout}
TEXTS = ["球队比赛冠军进球今天", "股市银行利率上涨", "电影明星导演票房"]


@pytest.fixture(scope="module")
def layouts(text_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {name: build(text_data / "model", root / name) for name, build in LAYOUTS.items()}


def labels_of(text_data):
    return sorted({line.split("\t")[0] for line in (text_data / "train.txt").read_text().splitlines()})


def build(text_data, model_dir):
    args = train_bert_cls.parse_args(["--model_name_or_path", str(model_dir), "--data_dir", str(text_data),
                                      "--do_train"])
    return train_bert_cls.build_model(args, labels_of(text_data))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_encoder_starts_from_the_checkpoint_and_only_the_head_is_new(layouts, text_data, name):
    tokenizer, model = build(text_data, layouts[name])
    checkpoint = checkpoint_weights(layouts[name])
    loaded = model.state_dict()
    new = sorted(key for key in loaded if key not in checkpoint)
    assert new and all(key.startswith("classifier.") for key in new), new
    different = [key for key in loaded if key not in new and not torch.equal(loaded[key], checkpoint[key])]
    assert not different, f"not the checkpoint's values: {different[:3]}"
    assert len(tokenizer) == vocab_size(text_data / "model")


def test_max_seq_len_defaults_to_the_positions_of_a_smaller_model(layouts, text_data):
    """These layouts have 64 positions: without --max_seq_len the run takes 64, not the default 512 (which would
    stop at the first text longer than 64 tokens), and says so."""
    args = train_bert_cls.parse_args(["--model_name_or_path", str(layouts["electra"]), "--data_dir", str(text_data),
                                      "--do_train"])
    said = []
    train_bert_cls.build_model(args, labels_of(text_data), said.append)
    assert args.max_seq_len == 64 and said == [
        f"--max_seq_len 64: the most {layouts['electra']} takes (its learned position embeddings), not the default 512"]


def test_checkpoint_of_another_architecture_is_refused(layouts, text_data, tmp_path):
    """ELECTRA weights under a BERT config.json: every encoder weight would start from random."""
    wrong = tmp_path / "wrong"
    shutil.copytree(layouts["electra"], wrong)
    shutil.copy(layouts["bin_gamma_beta"] / "config.json", wrong / "config.json")
    with pytest.raises(UserError, match="encoder weights are not in the checkpoint"):
        build(text_data, wrong)


@pytest.fixture(scope="module")
def finetuned(layouts, text_data, tmp_path_factory):
    """Each layout fine-tuned once on 1 process, predicting three texts: ELECTRA launched with `accelerate config
    default`'s file, as a CPU machine's user launches, the other two as `python train_bert_cls.py` (in this process:
    what is under test is the layout; runs of 2 processes, fp16 requested, are tests/test_launch_matrix.py's)."""
    root = tmp_path_factory.mktemp("finetuned")
    predict_file = root / "texts.txt"
    predict_file.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    outs = {name: root / name for name in LAYOUTS}
    args = {name: finetune_args(text_data, layouts[name], outs[name], predict_file) for name in LAYOUTS}
    run_here(SCRIPT, ["--cpu", *args["bin_gamma_beta"]])
    run_here(SCRIPT, ["--cpu", *args["sharded_tokenizer_json"]])
    launch_with_config(default_config(tmp_path_factory), SCRIPT, args["electra"])
    return outs, predict_file


def test_a_default_config_file_launches_one_process(finetuned):
    launched = read_json(finetuned[0]["electra"] / "all_results.json")
    assert (launched["num_processes"], launched["distributed_type"], launched["mixed_precision"]) == (1, "NO", "no")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_export_loads_in_pipeline_with_no_missing_weight(finetuned, name):
    from transformers import AutoModelForSequenceClassification, pipeline

    best = finetuned[0][name] / "best_model"
    keys = set(load_file(best / "model.safetensors"))
    _, info = AutoModelForSequenceClassification.from_pretrained(best, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert not [k for k in keys if "gamma" in k or "beta" in k or k.startswith(("module.", "_orig_mod."))]
    classifier = pipeline("text-classification", model=str(best), device="cpu")
    rows = read_jsonl(finetuned[0][name] / "predictions.jsonl")
    for row, got in zip(rows, classifier(TEXTS)):
        assert got["label"] == row["label"]
        assert got["score"] == pytest.approx(row["score"], abs=1e-5)
    results = read_json(finetuned[0][name] / "all_results.json")
    assert results["train_steps"] == 6 and results["test_samples"] == 99


def test_gamma_beta_run_resumes_from_latest(finetuned, layouts, text_data):
    """Killed after step 3 (the step-6 checkpoint never written), `latest` resumes to the same weights and results."""
    out, predict_file = finetuned[0]["bin_gamma_beta"], finetuned[1]
    reference = load_file(out / "checkpoints" / "step_6" / "model.safetensors")
    resumed = out.with_name("resumed")
    shutil.copytree(out, resumed, ignore=lambda folder, names: ["step_6"] if folder.endswith("checkpoints") else [])
    run_here(SCRIPT, ["--cpu", *finetune_args(text_data, layouts["bin_gamma_beta"], resumed, predict_file,
                                              "--resume_from_checkpoint", "latest")])
    assert_same_weights(reference, load_file(resumed / "checkpoints" / "step_6" / "model.safetensors"))
    assert read_json(resumed / "all_results.json")["test_accuracy"] == read_json(out / "all_results.json")[
        "test_accuracy"]


def test_export_of_a_gamma_beta_checkpoint_uses_the_models_names(layouts, text_data, tmp_path):
    """In process, the crash itself: transformers 5 wrote `LayerNorm.gamma` back and loading best_model failed."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from safetensors.torch import load_model

    tokenizer, model = build(text_data, layouts["bin_gamma_beta"])
    try:
        accelerator = Accelerator(cpu=True)
        train_bert_cls.save_best_model(accelerator, accelerator.prepare(model), tokenizer, tmp_path / "best_model",
                                       {"max_seq_len": 64, "multi_label": False}, RunLog(accelerator, tmp_path), {})
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert load_file(tmp_path / "best_model" / "model.safetensors").keys() == model.state_dict().keys()
    load_model(model, tmp_path / "best_model" / "model.safetensors")  # strict


@pytest.fixture
def network_guard(monkeypatch):
    """Hub access switched on for this process (no HF_HUB_OFFLINE), and every connection recorded and refused."""
    import socket

    import huggingface_hub.constants

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("no network in this test")

    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def test_a_mistyped_local_path_is_an_error_without_network_access(text_data, tmp_path, network_guard):
    """`tests/` is a directory here, so `tests/no_such_model` is a mistyped path, not the hub repo of that name."""
    from huggingface_hub import get_session

    with pytest.raises(Exception):
        get_session().head("https://huggingface.co/api/models/bert-base-chinese")
    assert network_guard, "the guard must see what the hub client sends"  # it would have seen the hub lookups
    network_guard.clear()
    proc = run_here(SCRIPT, ["--cpu", "--model_name_or_path", "tests/no_such_model", "--data_dir", text_data,
                             "--do_train", "--output_dir", tmp_path / "out"], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and errors == [
        "error: --model_name_or_path tests/no_such_model: no such file or directory (a local path, since tests/ is a "
        "local directory)"], proc.stderr[-2000:]
    assert network_guard == [] and not (tmp_path / "out").exists()


def test_hub_ids_and_paths_are_told_apart_without_the_network(tmp_path, monkeypatch, network_guard):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d" / "model").mkdir(parents=True)

    def flags(**given):
        return SimpleNamespace(**{"model_name_or_path": "m", "config_name": None, "tokenizer_name": None,
                                  "dataset_name": None, "metric": [], **given})

    for hub_id in ("hfl/chinese-bert-wwm-ext", "bert-base-chinese", "d/model", str(tmp_path / "d")):
        check_hub_ids_or_paths(flags(model_name_or_path=hub_id, tokenizer_name=hub_id, metric=["accuracy", hub_id]))
    for path, reason in (("d/modle", "d/ is a local directory"), ("./model", "it is written as a path"),
                         ("../model", "it is written as a path"), ("~/no_such_model", "it is written as a path"),
                         (str(tmp_path / "no_such_model"), "it is written as a path"),
                         ("a/b/c", "a hub id has at most one '/'"), ("my model", "it is not of a hub id's form")):
        for flag in ("--model_name_or_path", "--tokenizer_name", "--config_name", "--dataset_name", "--metric"):
            given = {flag[2:]: [path] if flag == "--metric" else path}
            with pytest.raises(UserError, match=f"{flag} {re.escape(path)}: no such file or directory .*{reason}"):
                check_hub_ids_or_paths(flags(**given))
    assert network_guard == []


def mean_pooling_classes():
    """A classifier transformers does not ship: AutoModel's BERT encoder, its token states averaged over the real
    tokens, a linear head; registered with the Auto classes, as a user's own model is for pipeline()."""
    from torch import nn
    from transformers import (AutoConfig, AutoModel, AutoModelForSequenceClassification, BertConfig,
                              PreTrainedModel)
    from transformers.modeling_outputs import SequenceClassifierOutput

    class MeanPoolingConfig(BertConfig):
        model_type = "bert_mean_pooling_test"

    class MeanPoolingClassifier(PreTrainedModel):
        config_class = MeanPoolingConfig
        base_model_prefix = "bert"  # a BERT checkpoint's encoder weights load into self.bert

        def __init__(self, config):
            super().__init__(config)
            encoder_config = BertConfig.from_dict({**config.to_dict(), "model_type": "bert"})
            self.bert = AutoModel.from_config(encoder_config, add_pooling_layer=False)
            self.head = nn.Linear(config.hidden_size, config.num_labels)
            self.post_init()

        def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                               token_type_ids=token_type_ids).last_hidden_state  # (B, T, H)
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            return SequenceClassifierOutput(logits=self.head((hidden * mask).sum(1) / mask.sum(1)))

    AutoConfig.register(MeanPoolingConfig.model_type, MeanPoolingConfig, exist_ok=True)
    AutoModelForSequenceClassification.register(MeanPoolingConfig, MeanPoolingClassifier, exist_ok=True)
    return MeanPoolingConfig, MeanPoolingClassifier


def test_another_model_class_is_a_change_in_the_adaptation_section_alone(layouts, text_data, tmp_path, monkeypatch):
    """new_model and load_model replaced (as a user edits them) by a mean-pooling classifier: it starts from the
    BERT checkpoint's encoder, trains, exports under its own names, loads in pipeline() with the run's predictions,
    and a later --do_test on the export reproduces the run's test accuracy."""
    from transformers import pipeline

    config_class, model_class = mean_pooling_classes()
    started_new = []

    def as_pooling(config):
        return config_class.from_dict({**config.to_dict(), "model_type": config_class.model_type})

    def new_model(config, trust_remote_code=False):
        return model_class(as_pooling(config))

    def load_model(path, config, trust_remote_code=False, hub=None):
        model, info = model_class.from_pretrained(path, config=as_pooling(config), output_loading_info=True)
        started_new.extend(info["missing_keys"])
        return model, text_model.new_weight_names(info)

    monkeypatch.setattr(train_bert_cls, "new_model", new_model)
    monkeypatch.setattr(train_bert_cls, "load_model", load_model)
    predict_file = tmp_path / "texts.txt"
    predict_file.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    proc = run_here(SCRIPT, ["--cpu", *finetune_args(text_data, layouts["bin_gamma_beta"], out, predict_file)])
    assert sorted(started_new) == ["head.bias", "head.weight"], started_new  # the encoder: the checkpoint's
    best = out / "best_model"
    assert read_json(best / "config.json")["architectures"] == ["MeanPoolingClassifier"]
    assert {key.split(".")[0] for key in load_file(best / "model.safetensors")} == {"bert", "head"}
    classifier = pipeline("text-classification", model=str(best), device="cpu")
    assert type(classifier.model) is model_class
    for row, got in zip(read_jsonl(out / "predictions.jsonl"), classifier(TEXTS)):
        assert got["label"] == row["label"] and got["score"] == pytest.approx(row["score"], abs=1e-5)
    evaluated = tmp_path / "evaluated"
    run_here(SCRIPT, ["--cpu", "--model_name_or_path", best, "--data_dir", text_data, "--do_test",
                      "--output_dir", evaluated])
    trained = read_json(out / "all_results.json")
    assert read_json(evaluated / "test_results.json")["test_accuracy"] == trained["test_accuracy"], proc.stdout[-2000:]
