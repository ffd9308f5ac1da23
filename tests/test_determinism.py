"""--use_deterministic_algorithms in both scripts, under torchvision's spelling (--use-deterministic-algorithms) and the
Trainer's (--full_determinism): the run names it in its first lines and records it (all_results.json's
`deterministic_algorithms`, run_config.json's arguments); an op torch has no deterministic kernel for stops the run in
one line naming the op; a cuBLAS workspace setting torch would refuse is refused before anything is written; without
the flag cuDNN's autotuner is on (utils/runtime.py choose_kernels).

On a CPU the runs are bitwise reproducible with or without the flag, so the runs here prove the plumbing (every
spelling reaches torch, on 1 process and on 2, and two runs with it end equal), not a GPU's determinism:
tools/gpu_check.py's exact-resume check runs with the flag on a GPU, where it needs it to end bitwise equal.
"""
import argparse
import os

import pytest
import torch
from conftest import assert_one_line_error, launch, read_json, run_here
from safetensors.torch import load_file

import train_bert_cls
import train_resnet
from utils.runtime import DETERMINISTIC_CUBLAS, NONDETERMINISTIC_GPU, choose_kernels
from utils import image_model

SPELLINGS = ("--use_deterministic_algorithms", "--use-deterministic-algorithms", "--full_determinism")
LINE = ("deterministic kernels (--use_deterministic_algorithms): torch.use_deterministic_algorithms(True), cuDNN "
        "autotuner off, CUBLAS_WORKSPACE_CONFIG=:4096:8; an op without a deterministic kernel stops the run")
TRAINER_NOTE = "read as: --full_determinism = --use_deterministic_algorithms"
BERT_STEPS = 3


def resnet_args(data, out, spelling):
    return [data, "--image_size", "16", "--val_resize", "16", "-b", "64", "--lr", "0.05", "--epochs", "1", "-j", "0",
            "--output_dir", out, spelling]


def bert_args(data, out, spelling):
    return ["--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch", "--max_seq_len", "16",
            "--train_batch_size", "16", "--learning_rate", "2e-3", "--max_train_steps", str(BERT_STEPS),
            "--checkpointing_steps", str(BERT_STEPS), "--do_train", "--output_dir", out, spelling]


# (script, the arguments, the weights a run ends with, its peer's spelling); each script runs twice on 1 process, once
# under each peer's spelling, and BERT once more on 2 processes under its peer's own: both scripts read the flag in
# one place (utils/runtime.py choose_kernels) from a command line every rank parses alike, so one launch of several
# processes proves what such a launch adds, the line printed once and the records written by the main process
SCRIPTS = {
    "train_resnet.py": (resnet_args, lambda out: torch.load(out / "checkpoint.pth", weights_only=True)["state_dict"],
                        "--use-deterministic-algorithms"),
    "train_bert_cls.py": (bert_args, lambda out: load_file(out / "checkpoints" / f"step_{BERT_STEPS}" /
                                                           "model.safetensors"), "--full_determinism"),
}
RUNS = {"1 process, torchvision's spelling": (1, "--use-deterministic-algorithms"),
        "1 process, the Trainer's spelling": (1, "--full_determinism"), "2 processes, the peer's spelling": (2, None)}
MADE = [(script, run) for script in SCRIPTS for run, (processes, _) in RUNS.items()
        if processes == 1 or script == "train_bert_cls.py"]


@pytest.fixture(scope="module")
def runs(few_digits, text_data, tmp_path_factory):
    """{(script, run): (output directory, what it printed)} for each of MADE."""
    data = {"train_resnet.py": few_digits, "train_bert_cls.py": text_data}
    made = {}
    for script, run in MADE:
        (make_args, _, own_spelling), (processes, spelling) = SCRIPTS[script], RUNS[run]
        out = tmp_path_factory.mktemp(script.split(".")[0])
        args = make_args(data[script], out, spelling or own_spelling)
        proc = run_here(script, ["--cpu", *args]) if processes == 1 else launch(script, args, num_processes=2)
        made[script, run] = (out, proc)
    return made


@pytest.mark.parametrize("module", [train_resnet, train_bert_cls], ids=lambda module: module.__name__)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_is_the_flag(module, spelling):
    required = ["--dummy"] if module is train_resnet else ["--model_name_or_path", "m", "--do_train"]
    args = module.parse_args([*required, spelling])
    assert args.use_deterministic_algorithms is True
    notes = [note for note in args.command_notes if "determinis" in note]
    assert notes == ([TRAINER_NOTE[len("read as: "):]] if spelling == "--full_determinism" else []), notes
    assert module.parse_args(required).use_deterministic_algorithms is False


@pytest.mark.parametrize("script, run", MADE)
def test_first_lines_name_it_and_the_run_records_it(runs, script, run):
    out, proc = runs[script, run]
    lines = proc.stdout.splitlines()
    start = lines.index("***** Running training *****")  # the start-up summary: the lines before are the first
    assert lines.count(LINE) == 1 and lines.index(LINE) < start, lines[:start + 1]  # once, by the main process
    spelling = RUNS[run][1] or SCRIPTS[script][2]
    assert lines.count(TRAINER_NOTE) == (spelling == "--full_determinism"), lines[:start + 1]
    summary = [line for line in lines[start:] if line.split(":")[0].strip() == "deterministic_algorithms"]
    assert len(summary) == 1 and summary[0].endswith(": True"), summary
    results = read_json(out / "all_results.json")
    assert results["deterministic_algorithms"] is True and results["num_processes"] == RUNS[run][0]
    assert read_json(out / "run_config.json")["args"]["use_deterministic_algorithms"] is True


@pytest.mark.parametrize("script", SCRIPTS)
def test_two_runs_with_it_end_bitwise_equal(runs, script):
    """The plumbing only (the module docstring): CPU runs end equal without the flag too."""
    weights = SCRIPTS[script][1]
    first, again = (weights(runs[script, run][0]) for run in list(RUNS)[:2])
    assert first.keys() == again.keys()
    assert all(torch.equal(first[key], again[key]) for key in first)


class Unpooling(torch.nn.Module):
    """Max-pooling, then unpooling back to the input's size (as encoder-decoder models do): torch has no deterministic
    kernel for max_unpool2d, on the CPU too."""

    def forward(self, x):
        pooled, indices = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
        return torch.nn.functional.max_unpool2d(pooled, indices, 2, output_size=x.shape[-2:])


def test_an_op_without_a_deterministic_kernel_stops_the_run_in_one_line(few_digits, tmp_path, monkeypatch):
    """A model changed as a user changes it (build_model, in the adaptation section), with an op torch has no
    deterministic kernel for: the run stops at the op's first use, in one line naming it and what to do."""
    def build_model(args, num_classes, print_fn=print, class_to_idx=None):
        model = image_model.build(args, num_classes, print_fn, class_to_idx)
        model.maxpool = torch.nn.Sequential(Unpooling(), model.maxpool)  # no parameters: the same names
        return model

    monkeypatch.setattr(train_resnet, "build_model", build_model)
    proc = run_here("train_resnet.py", ["--cpu", *resnet_args(few_digits, tmp_path / "out", "--full_determinism")],
                    check=False)
    assert_one_line_error(proc, "error: max_unpooling2d_forward_out: torch ", "has no deterministic kernel for this op",
                          "drop the flag", "change the model or loss")
    assert "Epoch: [1]" not in proc.stdout  # it stopped in the first step


def test_a_cublas_setting_torch_would_refuse_is_refused_before_anything_is_written(few_digits, tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    out = tmp_path / "out"
    proc = run_here("train_resnet.py", ["--cpu", *resnet_args(few_digits, out, "--use-deterministic-algorithms")],
                    check=False)
    assert_one_line_error(proc, "--use_deterministic_algorithms: CUBLAS_WORKSPACE_CONFIG=:0:0 is not deterministic "
                                "(torch accepts :4096:8 or :16:8)")
    assert not out.exists()


@pytest.fixture
def kernels_as_found():
    deterministic, benchmark = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.benchmark = benchmark


def test_without_it_the_autotuner_is_on_and_with_it_off(kernels_as_found, monkeypatch):
    """The one place both scripts choose their kernels: cuDNN's autotuner without the flag (main.py's and
    torchvision's default), torch's deterministic kernels and a deterministic cuBLAS workspace with it; a user's own
    deterministic workspace setting is kept."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the pytest process runs on the CPU
    assert choose_kernels(argparse.Namespace(use_deterministic_algorithms=False, cpu=False)) is None
    assert torch.backends.cudnn.benchmark and not torch.are_deterministic_algorithms_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU run says that it is not bitwise
    assert choose_kernels(argparse.Namespace(use_deterministic_algorithms=False, cpu=False)) == NONDETERMINISTIC_GPU
    assert choose_kernels(argparse.Namespace(use_deterministic_algorithms=False, cpu=True)) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert choose_kernels(argparse.Namespace(use_deterministic_algorithms=True)) == LINE
    assert not torch.backends.cudnn.benchmark and torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS[1])
    assert choose_kernels(argparse.Namespace(use_deterministic_algorithms=True)).endswith(
        f"CUBLAS_WORKSPACE_CONFIG={DETERMINISTIC_CUBLAS[1]}; an op without a deterministic kernel stops the run")
