"""Trained ResNet runs that several test files only read, built once per `pytest -n N` session (conftest.shared_dir:
a file lock, both xdist workers). A test that changes such a run copies it first (shutil.copytree)."""
import importlib.util

import pytest
from conftest import run_here, shared_dir

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
    """A trained ResNet-18 at 16 pixels (model_best.pth, its ONNX export), read by tests/test_onnx_export.py and
    tests/test_image_predict.py."""
    return shared_dir(tmp_path_factory, "digits_model", lambda out: train_digits_model(digits_data, out / "run")) / "run"
