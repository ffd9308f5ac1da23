"""tools/compare_weights.py on weight files and output directories made here as both scripts lay them out (no
training): bitwise equal is exit 0, a difference names its tensor and size (exit 1), an output directory stands for its
newest complete checkpoint or else its best export, a pickle that runs code and a missing path are one line (exit 2)."""
import json
import pickle
import sys

import pytest
import torch
from conftest import ROOT, assert_one_line_error, run
from safetensors.torch import save_file

sys.path.insert(0, str(ROOT / "tools"))
import compare_weights  # noqa: E402

TOOL = ROOT / "tools" / "compare_weights.py"


def weights(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(3, 4, generator=generator), "fc.bias": torch.zeros(3),
            "bn.num_batches_tracked": torch.tensor(7)}


def changed(state_dict, by=0.25):
    other = {name: tensor.clone() for name, tensor in state_dict.items()}
    other["fc.weight"][1, 2] += by
    return other


def checkpoint(out, step, state_dict, complete=True):
    """checkpoints/step_N as accelerate's save_state leaves it; complete once training_state.json is there."""
    folder = out / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    save_file(state_dict, folder / "model.safetensors")
    if complete:
        (folder / "training_state.json").write_text(json.dumps({"completed_steps": step}))
    return folder


def compare(capsys, a, b):
    code = compare_weights.main([str(a), str(b)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_bitwise_equal_files_exit_0(tmp_path, capsys):
    save_file(weights(), tmp_path / "a.safetensors")
    torch.save({"state_dict": {f"module.{k}": v for k, v in weights().items()}, "epoch": 3}, tmp_path / "b.pth")
    code, lines, _ = compare(capsys, tmp_path / "a.safetensors", tmp_path / "b.pth")
    assert code == 0
    assert lines == [f"A: {tmp_path / 'a.safetensors'} (as given)", f"B: {tmp_path / 'b.pth'} (as given)",
                     "bitwise equal: 3 tensors"]


def test_one_changed_tensor_is_named_with_its_difference(tmp_path):
    """The tool as a user runs it: its exit status and what it prints."""
    save_file(weights(), tmp_path / "a.safetensors")
    save_file(changed(weights()), tmp_path / "b.safetensors")
    proc = run(["python", TOOL, tmp_path / "a.safetensors", tmp_path / "b.safetensors"], check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines()[2:] == ["fc.weight: largest |A - B| 0.25",
                                            "1 of 3 tensors differ, largest difference 0.25 in fc.weight"]


def test_missing_extra_and_reshaped_tensors_and_signed_zeros(tmp_path, capsys):
    a, b = weights(), changed(weights(), by=1e-7)
    b["fc.bias"] = -b["fc.bias"]  # -0.0: equal to torch.equal, not bitwise
    b["bn.num_batches_tracked"] = torch.tensor(7.0)
    del b["fc.weight"]
    b["head.weight"] = torch.ones(2)
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    code, lines, _ = compare(capsys, tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert code == 1
    assert sorted(lines[2:]) == sorted([
        "shape or dtype differs: bn.num_batches_tracked: A () torch.int64, B () torch.float32",
        "fc.bias: largest |A - B| 0 (the bits only: -0.0 against 0.0, or NaNs)",
        "only in A: fc.weight", "only in B: head.weight",
        "1 of 1 tensors differ, largest difference 0 in fc.bias; 1 only in A, 1 only in B, 1 with another shape or "
        "dtype"])


def test_output_directories_of_both_scripts_resolve_to_the_right_files(tmp_path, capsys):
    """BERT's: the newest COMPLETE checkpoint (a save cut short, `.tmp-step_N` or a step without training_state.json,
    is not one), not best_model/; ResNet's without checkpoints: model_best.pth (torchvision's `model` layout here),
    not checkpoint.pth; a step_N directory given itself: its model.safetensors."""
    bert, resnet = tmp_path / "bert", tmp_path / "resnet"
    checkpoint(bert, 2, changed(weights(), by=9.0))
    checkpoint(bert, 4, weights())
    checkpoint(bert, 6, changed(weights(), by=9.0), complete=False)
    (bert / "checkpoints" / ".tmp-step_8").mkdir()
    (bert / "best_model").mkdir()
    save_file(changed(weights(), by=9.0), bert / "best_model" / "model.safetensors")
    resnet.mkdir()
    torch.save({"model": changed(weights()), "epoch": 2}, resnet / "model_best.pth")
    torch.save({"state_dict": changed(weights(), by=9.0), "epoch": 3}, resnet / "checkpoint.pth")
    code, lines, _ = compare(capsys, bert, resnet)
    assert lines[:2] == [f"A: {bert / 'checkpoints' / 'step_4' / 'model.safetensors'} (the newest complete checkpoint, "
                         "step_4)",
                         f"B: {resnet / 'model_best.pth'} (the exported best model: no complete checkpoint)"]
    assert code == 1 and lines[2] == "fc.weight: largest |A - B| 0.25"
    checkpoint(resnet, 5, weights())  # ResNet's checkpoints/step_N/model.safetensors now come first
    code, lines, _ = compare(capsys, bert / "checkpoints" / "step_4", resnet)
    assert lines[:2] == [f"A: {bert / 'checkpoints' / 'step_4' / 'model.safetensors'} (the directory's weights)",
                         f"B: {resnet / 'checkpoints' / 'step_5' / 'model.safetensors'} (the newest complete "
                         "checkpoint, step_5)"]
    assert (code, lines[2]) == (0, "bitwise equal: 3 tensors")


class Payload:
    """Unpickling it runs code: it writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('this ran')",)


def test_a_pickle_that_runs_code_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "marker"
    torch.save(Payload(marker), tmp_path / "planted.pth")
    save_file(weights(), tmp_path / "a.safetensors")
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):  # what the tool relies on: torch's own
        torch.load(tmp_path / "planted.pth", weights_only=True)  # refusal
    proc = run(["python", TOOL, tmp_path / "a.safetensors", tmp_path / "planted.pth"], check=False)
    assert_one_line_error(proc, "planted.pth: holds a pickled ", "exec, which torch.load(weights_only=True) refuses")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["missing", "empty_dir", "notes.txt", "cut.safetensors"])
def test_missing_or_unreadable_input_is_one_line(tmp_path, capsys, name):
    save_file(weights(), tmp_path / "a.safetensors")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "notes.txt").write_text("not weights")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "a.safetensors").read_bytes()[:100])
    code, lines, err = compare(capsys, tmp_path / "a.safetensors", tmp_path / name)
    expected = {"missing": "no such file or directory", "empty_dir": "no weights to compare",
                "notes.txt": "not a weight file", "cut.safetensors": "damaged or incomplete"}[name]
    assert code == 2
    assert len(lines) == (0 if name in ("missing", "empty_dir") else 2)  # a file was chosen for each side, then read
    assert err.count("\n") == 1 and err.startswith(f"error: {tmp_path / name}: {expected}"), err
