"""torch.compile as `accelerate config` enables it ("optimize with torch dynamo?" yes): exports keep plain names.

Compiled, every state_dict key gains `_orig_mod.`; a file with those names loads into a fresh model as random
weights with no error. One BERT run under inductor (1 layer, hidden 32: inductor on CPU costs tens of seconds
per graph) is shared by the export, pipeline, same-predictions and resume checks; its two launches cost a minute and
a half of CPU, nearly all of it inductor compiling, so those checks are `long` (`make test-long`). `make test` keeps
the names' proof: the ResNet run uses dynamo's `eager` backend (the `_orig_mod.` names come from the OptimizedModule
wrapper every backend shares, and a resnet18 under inductor would cost as much again; checked by hand: see
docs/bert_checkpoints_and_compile.md), and the last test strips accelerate's own inductor wrapper in this process.
"""
import shutil

import pytest
import torch
from checkpoint_layouts import bert_base_chinese_layout, finetune_args
from conftest import ACCELERATE, read_json, read_jsonl, run, run_here
from safetensors.torch import load_file

from utils.export import full_state_dict, on_meta_device

# dynamo's INFO log names each compilation: the proof that the run was compiled at all
COMPILED = "Step 2: calling compiler function"


def compiled_launch(backend, script, args):
    head = [*ACCELERATE, "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", backend]
    return run([*head, script, "--cpu", *args], env={"TORCH_LOGS": "dynamo"})


@pytest.fixture(scope="module")
def compiled_bert(text_data, tmp_path_factory):
    """The hub-shaped gamma/beta checkpoint fine-tuned under inductor, then the same run killed after step 3 and
    resumed from `latest` under inductor (its compilation hits inductor's cache)."""
    root = tmp_path_factory.mktemp("compiled_bert")
    model_dir = bert_base_chinese_layout(text_data / "model", root / "checkpoint")
    predict_file = root / "texts.txt"
    texts = [line.split("\t")[1] for line in (text_data / "test.txt").read_text(encoding="utf-8").splitlines()[:33]]
    predict_file.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out, resumed = root / "out", root / "resumed"
    # evaluation batches of 33 divide the 99 validation and test texts, and the 33 texts to predict are one more such
    # batch: one evaluation shape to compile (inductor compiles each batch size anew, seconds of CPU each)
    proc = compiled_launch("inductor", "train_bert_cls.py", finetune_args(text_data, model_dir, out, predict_file,
                                                                          eval_batch_size=33))
    shutil.copytree(out, resumed, ignore=lambda folder, names: ["step_6"] if folder.endswith("checkpoints") else [])
    resume = compiled_launch("inductor", "train_bert_cls.py", finetune_args(
        text_data, model_dir, resumed, predict_file, "--resume_from_checkpoint", "latest", eval_batch_size=33))
    return {"out": out, "resumed": resumed, "texts": texts, "logs": (proc.stderr, resume.stderr)}


@pytest.mark.long
def test_bert_run_was_compiled_by_inductor(compiled_bert):
    for log in compiled_bert["logs"]:
        assert f"{COMPILED} inductor" in log


@pytest.mark.long
def test_compiled_bert_exports_names_that_pipeline_loads(compiled_bert):
    from transformers import AutoModelForSequenceClassification

    best = compiled_bert["out"] / "best_model"
    assert not [k for k in load_file(best / "model.safetensors") if "_orig_mod" in k or "gamma" in k]
    _, info = AutoModelForSequenceClassification.from_pretrained(best, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


@pytest.mark.long
def test_uncompiled_pipeline_predicts_what_the_compiled_run_did(compiled_bert):
    from transformers import pipeline

    classifier = pipeline("text-classification", model=str(compiled_bert["out"] / "best_model"), device="cpu",
                          top_k=None)
    rows = read_jsonl(compiled_bert["out"] / "predictions.jsonl")
    assert [row["text"] for row in rows] == compiled_bert["texts"]
    for row, scores in zip(rows, classifier(compiled_bert["texts"])):
        assert {s["label"]: pytest.approx(s["score"], abs=1e-5) for s in scores} == row["probabilities"]


@pytest.mark.long
def test_compiled_run_resumes_from_latest(compiled_bert):
    out, resumed = compiled_bert["out"], compiled_bert["resumed"]
    reference = load_file(out / "checkpoints" / "step_6" / "model.safetensors")
    got = load_file(resumed / "checkpoints" / "step_6" / "model.safetensors")
    assert reference.keys() == got.keys() and not [k for k in got if "_orig_mod" in k]
    # kernels specialised to other shapes may sum in another order: equal up to float rounding, not bitwise
    worst = max((reference[k] - got[k]).abs().max().item() for k in reference)
    assert worst < 1e-5, worst
    before, after = read_json(out / "all_results.json"), read_json(resumed / "all_results.json")
    assert after["test_loss"] == pytest.approx(before["test_loss"], abs=1e-5)


def resnet_args(data, out, *extra):
    return [data, "--arch", "resnet18", "--image_size", "16", "--val_resize", "16", "-b", "64", "--lr", "0.05",
            "-j", "0", "-p", "5", "--epochs", "1", "--output_dir", out, *extra]


def test_compiled_resnet_exports_what_plain_torchvision_loads(few_digits, tmp_path):
    import torchvision

    out = tmp_path / "compiled"
    # 5 steps of 64 of the 336 training images, a checkpoint at steps 2 and 4 (inside the epoch)
    proc = compiled_launch("eager", "train_resnet.py", resnet_args(few_digits, out, "--checkpointing_steps", "2"))
    assert f"{COMPILED} eager" in proc.stderr
    uninterrupted = torch.load(out / "checkpoint.pth", weights_only=True)["state_dict"]
    for name in ("checkpoint.pth", "model_best.pth"):
        model = torchvision.models.resnet18(num_classes=10)
        model.load_state_dict(torch.load(out / name, weights_only=True)["state_dict"])  # strict: every key
    # the uncompiled model from the export scores the validation set as the compiled one did (in this process: no
    # dynamo backend set, nothing compiles)
    again = tmp_path / "evaluated"
    run_here("train_resnet.py", ["--cpu", *resnet_args(few_digits, again, "--evaluate", "--resume",
                                                       out / "model_best.pth")])
    trained, evaluated = read_json(out / "all_results.json"), read_json(again / "eval_results.json")
    assert evaluated["eval_acc1"] == trained["eval_acc1"]
    assert evaluated["eval_loss"] == pytest.approx(trained["eval_loss"], abs=1e-4)
    # resumed under compile from a mid-epoch checkpoint, it ends where the uninterrupted compiled run ended
    compiled_launch("eager", "train_resnet.py", resnet_args(few_digits, out, "--checkpointing_steps", "2",
                                                            "--resume", out / "checkpoints" / "step_2"))
    resumed = torch.load(out / "checkpoint.pth", weights_only=True)["state_dict"]
    assert resumed.keys() == uninterrupted.keys()
    assert max((resumed[k].float() - uninterrupted[k].float()).abs().max().item() for k in resumed) < 1e-6


def test_export_strips_the_compile_wrapper_and_refuses_foreign_keys():
    """In process: accelerate's own dynamo wrapping (compilation itself is lazy, so this costs nothing)."""
    from accelerate import Accelerator
    from accelerate.utils import TorchDynamoPlugin

    from accelerate.state import AcceleratorState

    def build():
        return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))

    try:
        accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
        prepared = accelerator.prepare(build())
        assert all(k.startswith("_orig_mod.") for k in accelerator.get_state_dict(prepared))  # why this exists
        fresh = on_meta_device(build)
        assert set(full_state_dict(accelerator, prepared, fresh)) == set(fresh.state_dict())
        with pytest.raises(RuntimeError, match="refusing to export"):
            full_state_dict(accelerator, prepared, torch.nn.Sequential(torch.nn.Linear(2, 3)))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
