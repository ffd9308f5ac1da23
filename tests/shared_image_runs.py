"""Trained ResNet runs that several test files only read, built once per `pytest -n N` session (conftest.shared_dir:
a file lock, both xdist workers). A test that changes such a run copies it first (shutil.copytree)."""
import importlib.util
import shlex

import pytest
from conftest import launch, run_here, shared_dir

# --export_onnx --onnx_int8 and the check's sample count, as tests/test_onnx_export.py asserts them
ONNX = ["--export_onnx", "--onnx_int8", "--onnx_check_samples", "100"]


def onnx_available():
    return all(importlib.util.find_spec(name) is not None for name in ("onnx", "onnxruntime"))


def train_digits_model(data, out):
    """2 epochs on the 1,348 training digits in this process (1 process: nothing here is about launching), with the
    ONNX export and its check where onnxruntime is installed (tests/test_onnx_export.py skips without it)."""
    run_here("train_resnet.py", [data, "--image_size", "16", "--val_resize", "16", "--hflip", "0", "--crop_scale",
                                 "0.5", "-b", "64", "--lr", "0.05", "--epochs", "2", "-j", "0", "--output_dir",
                                 out, *(ONNX if onnx_available() else [])])


@pytest.fixture(scope="session")
def digits_model(digits_data, tmp_path_factory):
    """A trained ResNet-18 at 16 pixels (model_best.pth, its ONNX export), read by tests/test_resnet.py,
    tests/test_onnx_export.py and tests/test_image_predict.py."""
    return shared_dir(tmp_path_factory, "digits_model", lambda out: train_digits_model(digits_data, out / "run")) / "run"


def card_command(run_dir):
    """The command model_card.md gives for the run's model_best.pth, as a list: `python train_resnet.py DATA -e
    --resume .../model_best.pth`, without the training's size flags (the file records them)."""
    card = (run_dir / "model_card.md").read_text(encoding="utf-8")
    return shlex.split(card.split("## How to use")[1].split("```bash\n")[1].split("```")[0])


def evaluate_digits_model(run_dir, out):
    """The model card's command on 2 processes, with the ONNX export and its check where onnxruntime is installed;
    what it printed is kept in out/stdout.txt."""
    proc = launch("train_resnet.py", [*card_command(run_dir)[2:], "-j", "0", "-b", "64", "--output_dir", out,
                                      *(ONNX if onnx_available() else [])], num_processes=2)
    (out / "stdout.txt").write_text(proc.stdout, encoding="utf-8")


@pytest.fixture(scope="session")
def digits_model_evaluated(digits_model, tmp_path_factory):
    """digits_model's model_best.pth evaluated by its card's command on 2 processes (and exported to ONNX), read by
    tests/test_resnet.py (the evaluation) and tests/test_onnx_export.py (the export)."""
    return shared_dir(tmp_path_factory, "digits_model_evaluated", lambda out: evaluate_digits_model(digits_model, out))
