"""Memory relief in both scripts: --gradient_checkpointing trains exactly as without it (dropout and drop path drawn
the same, BatchNorm statistics updated once), and --auto_find_batch_size, after an out-of-memory error, trains again
with half the per-device micro-batch and ends with the weights of the run started with that micro-batch (half the -b,
twice the accumulation), on 1 process and on 2 where only one of them runs out.

The out-of-memory errors are simulated from the test: the model's forward is replaced (in this process) or, under the
launcher, a sitecustomize module written by the test replaces torch's Embedding.forward on rank 1 only. The scripts
have no test-only path."""
import gc
import types

import pytest
import torch
import transformers
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from conftest import launch_cmd, one_thread, pythonpath, read_json, read_jsonl, run, run_here
from safetensors.torch import load_file
from torchvision.datasets import ImageFolder

import train_resnet
from utils.image_data import RGBImageFolder
from utils.loop import OutOfMemoryRetry
from utils.runtime import UserError

TINY_BERT = "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,intermediate_size=64"
NO_DROPOUT = ",hidden_dropout_prob=0,attention_probs_dropout_prob=0"
SIMULATED = "CUDA out of memory. Tried to allocate 2.00 GiB (simulated)"


@pytest.fixture(autouse=True, scope="module")
def in_one_thread():
    """The in-process runs and models use one torch thread, as the launched runs (conftest's one_thread)."""
    with one_thread():
        yield


def bert_args(text_data, out, *extra, config=TINY_BERT):
    """4 steps of a tiny BERT, dropout on (the fixture's 0.1), every batch padded to one length: the dropout masks
    of a micro-batch are then those of a batch of its size. No validation: the last weights are exported."""
    return ["--cpu", "--train_file", text_data / "train.txt", "--model_name_or_path", text_data / "model",
            "--from_scratch", "--config_overrides", config, "--max_seq_len", "32", "--pad_to_max_length",
            "--learning_rate", "1e-3", "--max_train_steps", "4", "--logging_steps", "1", "--do_train",
            "--output_dir", out, *extra]


def bert_weights(out):
    return load_file(out / "best_model" / "model.safetensors")


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def out_of_memory_above(monkeypatch, cls, per_device_batch, after_calls=0):
    """`cls.forward` raises torch.OutOfMemoryError in a training forward pass of more than `per_device_batch` samples
    (from its `after_calls`-th such call on), as a device that cannot hold the activations of a larger batch."""
    forward, calls = cls.forward, []

    def limited(self, *args, **kwargs):
        batch = (args[0] if args else kwargs["input_ids"]).shape[0]
        if self.training and torch.is_grad_enabled() and batch > per_device_batch:
            calls.append(batch)
            if len(calls) > after_calls:
                raise torch.OutOfMemoryError(SIMULATED)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", limited)


@pytest.fixture(scope="module")
def bert_runs(text_data, tmp_path_factory):
    """The BERT runs the tests compare, each in this process."""
    outs = {name: tmp_path_factory.mktemp(f"bert_{name}") for name in
            ("plain", "checkpointing", "auto", "direct", "late", "plain_no_dropout")}
    logs = {}
    logs["plain"] = run_here("train_bert_cls.py", bert_args(text_data, outs["plain"], "--train_batch_size", "16",
                                                            "--checkpointing_steps", "2"))
    logs["checkpointing"] = run_here("train_bert_cls.py", bert_args(
        text_data, outs["checkpointing"], "--train_batch_size", "16", "--gradient_checkpointing"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        out_of_memory_above(monkeypatch, transformers.BertForSequenceClassification, 8)
        logs["auto"] = run_here("train_bert_cls.py", bert_args(text_data, outs["auto"], "--train_batch_size", "16",
                                                               "--auto_find_batch_size"))
    logs["direct"] = run_here("train_bert_cls.py", bert_args(text_data, outs["direct"], "--train_batch_size", "8",
                                                             "--gradient_accumulation_steps", "2"))
    with pytest.MonkeyPatch.context() as monkeypatch:  # runs out at step 3, after the checkpoint of step 2
        out_of_memory_above(monkeypatch, transformers.BertForSequenceClassification, 8, after_calls=2)
        logs["late"] = run_here("train_bert_cls.py", bert_args(text_data, outs["late"], "--train_batch_size", "16",
                                                               "--auto_find_batch_size", "--checkpointing_steps", "2"))
    logs["plain_no_dropout"] = run_here("train_bert_cls.py", bert_args(
        text_data, outs["plain_no_dropout"], "--train_batch_size", "16", config=TINY_BERT + NO_DROPOUT))
    return outs, logs


def test_bert_gradient_checkpointing_trains_the_same(bert_runs):
    outs, _ = bert_runs
    assert max_difference(bert_weights(outs["plain"]), bert_weights(outs["checkpointing"])) == 0.0


def test_bert_auto_find_batch_size_trains_as_half_the_batch_twice(bert_runs):
    """Out of memory at the first step: every later step runs 2 micro-batches of 8 per process, and the weights are
    those of -b 8 with 2 accumulation steps, dropout included (the random state is put back for the retry)."""
    outs, logs = bert_runs
    retries = [line for line in logs["auto"].stdout.splitlines() if line.startswith("out of memory")]
    assert retries == ["out of memory at per-device batch 16: retrying with 8 x 2 accumulation steps"]
    results = read_json(outs["auto"] / "all_results.json")
    assert (results["per_device_micro_batch_size"], results["out_of_memory_retries"]) == (8, 1)
    assert (results["global_batch_size"], results["train_steps"]) == (16, 4)
    assert max_difference(bert_weights(outs["auto"]), bert_weights(outs["direct"])) == 0.0
    assert max_difference(bert_weights(outs["auto"]), bert_weights(outs["plain"])) > 1e-4  # the masks differ


def test_bert_retry_starts_from_the_checkpoint_the_failed_go_saved(bert_runs):
    outs, logs = bert_runs
    retries = [line for line in logs["late"].stdout.splitlines() if line.startswith("out of memory")]
    assert retries == ["out of memory at per-device batch 16: retrying with 8 x 2 accumulation steps from "
                       f"{outs['late'] / 'checkpoints' / 'step_2'}"]
    steps = [e["step"] for e in read_jsonl(outs["late"] / "metrics.jsonl") if e["event"] == "train"]
    assert steps == [1, 2, 3, 4]  # logged once each: the failed attempt's step 3 is not in the log
    losses = {run: [e["loss"] for e in read_jsonl(outs[run] / "metrics.jsonl") if e["event"] == "train"]
              for run in ("late", "plain")}
    assert losses["late"][:2] == losses["plain"][:2]  # the same run until it ran out


def test_bert_two_processes_one_runs_out(bert_runs, text_data, tmp_path):
    """Rank 1 alone runs out in its forward pass: both processes agree, retry with 4 x 2 per process and end with the
    weights of 1 process without the error (dropout off: 1 and 2 processes draw different masks), checkpointing on."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nimport torch\n\n_forward = torch.nn.Embedding.forward\n\n\n"
        "def forward(self, input):\n"
        "    if os.environ.get('RANK') == '1' and self.training and torch.is_grad_enabled() and input.shape[0] > 4:\n"
        f"        raise torch.OutOfMemoryError({SIMULATED!r})\n"
        "    return _forward(self, input)\n\n\n"
        "torch.nn.Embedding.forward = forward\n")
    out = tmp_path / "two"
    args = bert_args(text_data, out, "--train_batch_size", "16", "--auto_find_batch_size", "--gradient_checkpointing",
                     config=TINY_BERT + NO_DROPOUT)
    proc = run(launch_cmd("train_bert_cls.py", args[1:], num_processes=2), env=pythonpath(site))
    assert proc.stdout.count("out of memory at per-device batch 8: retrying with 4 x 2 accumulation steps") == 1
    results = read_json(out / "all_results.json")
    assert (results["num_processes"], results["per_device_micro_batch_size"]) == (2, 4)
    outs, _ = bert_runs
    assert max_difference(bert_weights(out), bert_weights(outs["plain_no_dropout"])) < 1e-5


def resnet_args(out, *extra):
    """Random images (--dummy: 96, 3 steps of 32), a small timm ResNet with BatchNorm."""
    return ["--cpu", "--dummy", "96", "-a", "timm:test_resnet", "--image_size", "32", "--lr", "0.05", "-j", "0",
            "--epochs", "1", "--output_dir", out, *extra]


def test_resnet_auto_find_batch_size_trains_as_half_the_batch_twice(tmp_path, monkeypatch):
    """The same on train_resnet.py (with --gradient_checkpointing and BatchNorm, whose statistics are those of each
    micro-batch): the weights and BatchNorm statistics of -b 16 with 2 accumulation steps."""
    import timm
    out_of_memory_above(monkeypatch, timm.models.ResNet, 16)
    auto = run_here("train_resnet.py", resnet_args(tmp_path / "auto", "-b", "32", "--auto_find_batch_size",
                                                   "--gradient_checkpointing"))
    assert "out of memory at per-device batch 32: retrying with 16 x 2 accumulation steps" in auto.stdout
    run_here("train_resnet.py", resnet_args(tmp_path / "direct", "-b", "16", "--gradient_accumulation_steps", "2"))
    weights = {run: torch.load(tmp_path / run / "checkpoint.pth", weights_only=True)["state_dict"]
               for run in ("auto", "direct")}
    assert max_difference(weights["auto"], weights["direct"]) == 0.0
    assert read_json(tmp_path / "auto" / "all_results.json")["per_device_micro_batch_size"] == 16


@pytest.mark.parametrize("arch", ["resnet18", "timm:test_resnet"])
def test_resnet_gradient_checkpointing_trains_the_same(arch):
    """The script's model (build_model, place_model) with and without it: the same weights and BatchNorm statistics
    after 3 SGD steps (timm's with drop path, whose draws are replayed)."""
    states = []
    for flags in ([], ["--gradient_checkpointing"]):
        args = train_resnet.parse_args(["--dummy", "-a", arch, "--drop_path", "0.2", *flags] if arch.startswith("timm")
                                       else ["--dummy", "-a", arch, *flags])
        torch.manual_seed(0)
        model = train_resnet.place_model(train_resnet.build_model(args, 10), args)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            inputs, targets = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append(model.state_dict())
    assert max_difference(*states) == 0.0
    batch_counts = [v.item() for k, v in states[1].items() if k.endswith("num_batches_tracked")]
    assert set(batch_counts) == {3}  # each BatchNorm counted 3 batches, not 6


def test_gradient_checkpointing_of_other_torchvision_models_is_refused(capsys):
    with pytest.raises(SystemExit):
        train_resnet.parse_args(["--dummy", "-a", "vgg11", "--gradient_checkpointing"])
    assert "--gradient_checkpointing: covers torchvision's ResNet family" in capsys.readouterr().err
    assert train_resnet.parse_args(["--dummy", "-a", "wide_resnet50_2", "--grad-checkpointing"]).gradient_checkpointing


@pytest.fixture
def accelerator():
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_retry_puts_back_the_start_and_stops_at_one_sample(accelerator, tmp_path):
    """Every attempt starts from the same weights and random state; an error at a micro-batch of 1 sample ends the
    run."""
    model = torch.nn.Linear(4, 2)
    retry = OutOfMemoryRetry(accelerator, model, 6, 1, tmp_path, enabled=True)
    seen = []

    def train(attempt):
        seen.append((attempt.micro_batch_size, model.weight.clone(), torch.rand(1)))
        with torch.no_grad():
            model.weight.add_(1.0)
        parts = [offset for offset, _ in attempt.micro_batches(model, torch.zeros(6, 4))]
        assert parts == list(range(0, 6, attempt.micro_batch_size))
        raise torch.OutOfMemoryError(SIMULATED)

    with pytest.raises(UserError, match="out of memory at a per-device micro-batch of 1 sample"):
        retry.run(train)
    assert [size for size, _, _ in seen] == [6, 3, 2, 1]
    assert all(torch.equal(w, seen[0][1]) and torch.equal(r, seen[0][2]) for _, w, r in seen)


def test_out_of_memory_while_evaluating_is_not_retried(accelerator, tmp_path):
    model = torch.nn.Linear(4, 2)
    retry = OutOfMemoryRetry(accelerator, model, 8, 1, tmp_path, enabled=True)
    calls = []

    def train(attempt):
        calls.append(attempt)
        model.eval()
        with torch.no_grad():
            model(torch.zeros(8, 4))  # the hook sees the forward that raised in it: patched below
        return None

    def evaluation_runs_out(self, *args):
        raise torch.OutOfMemoryError(SIMULATED)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(torch.nn.Linear, "forward", evaluation_runs_out)
        with pytest.raises(UserError, match="out of memory while evaluating .*splits the training batches only"):
            retry.run(train)
    assert len(calls) == 1


def test_refused_where_the_forward_pass_runs_collectives(tmp_path):
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        fake = types.SimpleNamespace(distributed_type=kind)
        with pytest.raises(UserError, match=f"--auto_find_batch_size: not under {kind.value}"):
            OutOfMemoryRetry(fake, torch.nn.Linear(1, 1), 8, 1, tmp_path, enabled=True)
    OutOfMemoryRetry(types.SimpleNamespace(distributed_type=DistributedType.FSDP), None, 8, 1, tmp_path, False)


def python_objects(root):
    """How many Python objects `root` reaches (functions, classes and modules not followed: they are shared code)."""
    shared = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    seen, todo = set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, shared):
            continue
        seen.add(id(obj))
        todo.extend(gc.get_referents(obj))
    return len(seen)


def test_the_image_list_holds_no_python_object_per_image(few_digits):
    """A DataLoader worker reading a Python object writes its reference count, and so copies the page it is on: a
    worker grows by ~160 B per image over an epoch of a list of (path, class) tuples. The list is numpy arrays: the
    objects the dataset reaches do not grow with its images, and it reads as ImageFolder's list."""
    folder = RGBImageFolder(few_digits / "train", None, 16)
    reference = ImageFolder(str(few_digits / "train"))
    assert list(folder.samples) == [folder.samples[i] for i in range(len(folder))] == reference.samples
    assert folder.samples[-1] == reference.samples[-1] and folder.samples[2:5] == reference.samples[2:5]
    assert list(folder.targets) == reference.targets
    assert python_objects(folder) < 100 < len(folder) == 336, python_objects(folder)
