"""Compare two runs' weights tensor by tensor: bitwise equal, or which tensors differ and by how much.

    python tools/compare_weights.py outputs/run_1proc outputs/run_2proc     # two output directories
    python tools/compare_weights.py A/checkpoints/step_60 B/checkpoints/step_60
    python tools/compare_weights.py A/model_best.pth B/best_model/model.safetensors

Each side is a weight file (.safetensors; .pth, .pt, .bin read with torch.load(weights_only=True), which runs no code:
a bare state dict, main.py's and train_resnet.py's `state_dict`, torchvision's `model`), a directory holding
model.safetensors (checkpoints/step_N, best_model), or an output directory of either script, which stands for its
newest complete checkpoint (checkpoints/step_N holding training_state.json), else its exported best model
(best_model/model.safetensors, model_best.pth). The file chosen for each side is printed first.
Then one line per tensor that differs with its largest |A - B|, the tensors only one side has, those whose shape or
dtype differ, and a summary line. Exit status 0: bitwise equal; 1: anything differs; 2: a path missing or unreadable.
"""
import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from utils.checkpoint import latest_checkpoint  # noqa: E402
from utils.export import load_torch_checkpoint, safetensors_problem  # noqa: E402
from utils.runtime import UserError  # noqa: E402

EXPORTS = ("best_model/model.safetensors", "model_best.pth")  # an output directory's, when it has no checkpoint
TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".tar")  # .tar: main.py's checkpoint.pth.tar


def resolve(path):
    """(weight file, why it was chosen) for a path given on the command line."""
    path = Path(path)
    if path.is_file():
        return path, "as given"
    if not path.is_dir():
        raise UserError(f"{path}: no such file or directory")
    if (path / "model.safetensors").is_file():
        return path / "model.safetensors", "the directory's weights"
    checkpoint = latest_checkpoint(path / "checkpoints")
    if checkpoint is not None:
        if not (checkpoint / "model.safetensors").is_file():
            raise UserError(f"{checkpoint}: no model.safetensors (sharded FSDP or DeepSpeed weights are not read "
                            "here); pass a weight file")
        return checkpoint / "model.safetensors", f"the newest complete checkpoint, {checkpoint.name}"
    for export in EXPORTS:
        if (path / export).is_file():
            return path / export, "the exported best model: no complete checkpoint"
    raise UserError(f"{path}: no weights to compare (no model.safetensors, complete checkpoints/step_N, "
                    f"{' or '.join(EXPORTS)})")


def load(path):
    """{name: tensor} of a weight file."""
    if path.suffix == ".safetensors":
        problem = safetensors_problem(path)
        if problem:
            raise UserError(problem)
        return load_file(path)
    if path.suffix in TORCH_SUFFIXES:
        state_dict = load_torch_checkpoint(path)["state_dict"]  # weights_only=True, `module.` prefixes dropped
        return {name: value for name, value in state_dict.items() if torch.is_tensor(value)}
    raise UserError(f"{path}: not a weight file (.safetensors, {', '.join(TORCH_SUFFIXES)})")


def bits(tensor):
    """The tensor's bytes: bitwise equality tells -0.0 from 0.0 and compares NaNs, where torch.equal does not."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def report(a, b):
    """Print how B differs from A; the exit status: 0 if bitwise equal, else 1."""
    differing, compared, mismatched = [], 0, 0
    for name, x in a.items():
        y = b.get(name)
        if y is None:
            print(f"only in A: {name}")
        elif (x.shape, x.dtype) != (y.shape, y.dtype):
            print(f"shape or dtype differs: {name}: A {tuple(x.shape)} {x.dtype}, B {tuple(y.shape)} {y.dtype}")
            mismatched += 1
        else:
            compared += 1
            if not torch.equal(bits(x), bits(y)):
                largest = (x.double() - y.double()).abs().max().item()
                bits_only = " (the bits only: -0.0 against 0.0, or NaNs)" if largest == 0 else ""
                print(f"{name}: largest |A - B| {largest:.3g}{bits_only}")
                differing.append((largest, name))
    only_b = [name for name in b if name not in a]
    for name in only_b:
        print(f"only in B: {name}")
    only_a = len(a) - compared - mismatched
    if not (differing or only_a or only_b or mismatched):
        print(f"bitwise equal: {compared} tensors")
        return 0
    summary = f"{len(differing)} of {compared} tensors differ"
    if differing:
        largest, name = max(differing, key=lambda d: (math.isnan(d[0]), d[0]))  # a NaN against a number: the largest
        summary += f", largest difference {largest:.3g} in {name}"
    others = [f"{count} {what}" for count, what in ((only_a, "only in A"), (len(only_b), "only in B"),
                                                     (mismatched, "with another shape or dtype")) if count]
    print(summary + (f"; {', '.join(others)}" if others else ""))
    return 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", metavar="A", help="weight file, checkpoint directory or output directory")
    parser.add_argument("b", metavar="B", help="the same for the other side")
    args = parser.parse_args(argv)
    try:
        sides = [resolve(args.a), resolve(args.b)]
        for side, (path, why) in zip("AB", sides):
            print(f"{side}: {path} ({why})")
        weights = [load(path) for path, _ in sides]
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return report(*weights)


if __name__ == "__main__":
    sys.exit(main())
