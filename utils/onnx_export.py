"""The selected model as ONNX for serving on CPUs (--export_onnx, both scripts): the export, its int8 quantisation
(--onnx_int8), and the check against PyTorch in a second process that has only the .onnx files (this module's
__main__, onnxruntime and numpy only), which writes onnx_check.json.
The export's form, the check's numbers, the optional dependencies: docs/code.md#onnx_exportpy.
Neighbours: utils/export.py (the PyTorch exports), utils/runtime.py (writing: a failure stops every rank).
"""
import argparse
import copy
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from . import checkpoint

# how the ONNX export is made and checked concerns that launch only (utils/checkpoint.py ROLE_MEANINGS)
ONNX_ROLES = checkpoint.this_launch("--export_onnx", "--onnx_int8", "--onnx_check_samples")
CHECK_FILE = "onnx_check.json"
INPUTS_FILE = "check_inputs.npz"
OPSET = 17  # onnxruntime 1.16+ runs it; LayerNormalization is one op from 17 on
LATENCY_REPEATS = 20  # timed runs of one sample after one warm-up; the median is reported
BATCH_REPEATS = 5  # the same for the first batch (a 256-image batch at 224 px: seconds per run in int8)


@checkpoint.roles_beside("ONNX_ROLES")
def add_onnx_args(parser):
    group = parser.add_argument_group("ONNX export (optional: pip install onnx onnxruntime)")
    group.add_argument("--export_onnx", action="store_true",
                       help="write the selected model as OUT/onnx/model.onnx (dynamic batch and sequence axes) and "
                       "check it with onnxruntime against PyTorch on evaluation samples (onnx_* results)")
    group.add_argument("--onnx_int8", action="store_true",
                       help="with --export_onnx: also OUT/onnx/model_int8.onnx (onnxruntime's dynamic int8 "
                       "quantisation), its accuracy and CPU latency beside fp32's")
    group.add_argument("--onnx_check_samples", type=int, default=256,
                       help="evaluation samples the check runs (>= 1)")
    return group


def check_onnx_args(parser, args):
    """Parser errors: --onnx_int8/--onnx_check_samples without --export_onnx, and onnx or onnxruntime missing."""
    if args.onnx_int8 and not args.export_onnx:
        parser.error("--onnx_int8 quantises the ONNX export: add --export_onnx")
    if args.onnx_check_samples < 1:
        parser.error(f"--onnx_check_samples {args.onnx_check_samples}: at least 1")
    if not args.export_onnx:
        return
    for module in ("onnx", "onnxruntime"):
        try:
            importlib.import_module(module)
        except ImportError:
            parser.error(f"--export_onnx needs the optional packages onnx and onnxruntime ({module} is not installed): "
                         f"pip install onnx onnxruntime")


def check_batches(batches, samples):
    """The first `samples` samples of `batches` (({input name: (B, ...) tensor}, labels (B,)) pairs), the last cut."""
    kept, count = [], 0
    for inputs, labels in batches:
        take = min(len(labels), samples - count)
        kept.append(({name: value[:take] for name, value in inputs.items()}, labels[:take]))
        count += take
        if count == samples:
            break
    return kept


def export_and_check(model, batches, out_dir, int8, sequence_axis, say=print):
    """--export_onnx (main process): an fp32 copy of `model` as out_dir/model.onnx (and model_int8.onnx), checked
    on `batches` (check_batches) in a second process; returns the `onnx_*` results. sequence_axis: inputs' axis 1
    is dynamic (text)."""
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(model).float().cpu().eval()
    names = list(batches[0][0])
    axes = {name: {0: "batch", **({1: "sequence"} if sequence_axis else {})} for name in names}
    export(model, batches[0][0], names, {**axes, "logits": {0: "batch"}}, out_dir / "model.onnx")
    files = ["model.onnx"]
    if int8:
        quantize(out_dir / "model.onnx", out_dir / "model_int8.onnx")
        files.append("model_int8.onnx")
    with torch.no_grad():
        logits = [model(*inputs.values()) for inputs, _ in batches]
    logits = [getattr(output, "logits", output).float() for output in logits]  # transformers returns ModelOutput
    arrays = {}
    for index, ((inputs, labels), batch_logits) in enumerate(zip(batches, logits)):
        arrays.update({f"{index}/{name}": value.numpy() for name, value in inputs.items()})
        arrays[f"{index}/labels"] = labels.numpy()
        arrays[f"{index}/torch_logits"] = batch_logits.numpy()
    np.savez(out_dir / INPUTS_FILE, **arrays)
    try:
        check = run_check(out_dir, files)
    finally:
        (out_dir / INPUTS_FILE).unlink(missing_ok=True)
    say(check_line(check))
    return flat_results(check)


def export(model, example, names, dynamic_axes, path):
    """torch.onnx.export to `path`, atomically (a failed export leaves no file)."""
    import warnings

    import torch

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with warnings.catch_warnings():
            # the exporter's notice that a newer one exists; the tracer's notes on Python values it records as
            # constants (transformers' mask helpers: sizes that the dynamic axes keep equal)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
            # transformers' attention masks index with non-negative positions only
            warnings.filterwarnings("ignore", message="Exporting aten::index operator")
            torch.onnx.export(model, tuple(example.values()), str(tmp), input_names=names, output_names=["logits"],
                              dynamic_axes=dynamic_axes, opset_version=OPSET, dynamo=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def quantize(source, target):
    """onnxruntime's dynamic int8 quantisation of `source` to `target`."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger().setLevel(logging.ERROR)  # its advice to pre-process first is for static quantisation
    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)


def run_check(out_dir, files):
    """The check in a second Python process (this module's __main__); its results, or a UserError with its error."""
    from utils.runtime import UserError

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "utils.onnx_export", str(out_dir), *files], cwd=root,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{out_dir}: the onnxruntime check of the ONNX export failed ({last})")
    return json.loads((Path(out_dir) / CHECK_FILE).read_text())


def check_line(check):
    """One line per checked file for the console."""
    parts = []
    for name, found in check["files"].items():
        accuracy = f", accuracy {found['accuracy']:.2%}" if "accuracy" in found else ""
        parts.append(f"{name}: max |logit difference| {found['max_abs_diff']:.2e}, top-1 agreement "
                     f"{found['top1_agreement']:.2%}{accuracy}, {found['ms_per_batch']:.2f} ms/batch, "
                     f"{found['ms_one_sample']:.2f} ms/sample alone")
    torch_accuracy = f"; PyTorch accuracy {check['torch_accuracy']:.2%}" if "torch_accuracy" in check else ""
    return (f"ONNX check on {check['samples']} samples in {check['batches']} batches with onnxruntime "
            f"{check['onnxruntime']} ({check['threads'] or 'default'} threads){torch_accuracy}: " + "; ".join(parts))


def flat_results(check):
    """onnx_check.json's numbers as results keys: onnx_samples, onnx_max_abs_diff, onnx_int8_accuracy, ..."""
    results = {"onnx_samples": check["samples"], "onnx_threads": check["threads"]}
    if "torch_accuracy" in check:
        results["onnx_torch_accuracy"] = check["torch_accuracy"]
    for name, found in check["files"].items():
        prefix = "onnx_int8_" if "int8" in name else "onnx_"
        results.update({prefix + key: value for key, value in found.items()})
    return results


# --- the second process: onnxruntime and numpy only ---

def load_batches(path):
    """check_inputs.npz as [(inputs {name: array}, labels, torch_logits)] in batch order; never unpickles."""
    with np.load(path, allow_pickle=False) as data:
        grouped = {}
        for key in data.files:
            index, name = key.split("/", 1)
            grouped.setdefault(int(index), {})[name] = data[key]
    batches = []
    for index in sorted(grouped):
        arrays = grouped[index]
        labels, torch_logits = arrays.pop("labels"), arrays.pop("torch_logits")
        batches.append((arrays, labels, torch_logits))
    return batches


def median_ms(run, repeats=LATENCY_REPEATS):
    run()  # warm-up: the first run allocates
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def check_file(path, batches, threads):
    """One .onnx file against PyTorch's logits: agreement, accuracy and latency."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    logits = [session.run(["logits"], inputs)[0] for inputs, _, _ in batches]  # (B, C) each
    ours, theirs = np.concatenate(logits), np.concatenate([t for _, _, t in batches])
    labels = np.concatenate([labels for _, labels, _ in batches])
    found = {"max_abs_diff": float(np.abs(ours - theirs).max()),
             "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).mean())}
    if labels.ndim == 1 and labels.dtype.kind in "iu":  # single-label classes
        found["accuracy"] = float((ours.argmax(-1) == labels).mean())
    first = batches[0][0]  # a full batch
    found["ms_per_batch"] = median_ms(lambda: session.run(["logits"], first), repeats=BATCH_REPEATS)
    found["ms_one_sample"] = median_ms(lambda: session.run(["logits"], {k: v[:1] for k, v in first.items()}))
    found["file_bytes"] = Path(path).stat().st_size
    return found


def check_main(argv=None):
    """`python -m utils.onnx_export DIR FILE...`: check each DIR/FILE against DIR/check_inputs.npz."""
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=check_main.__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    batches = load_batches(args.directory / INPUTS_FILE)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    labels = np.concatenate([labels for _, labels, _ in batches])
    torch_logits = np.concatenate([t for _, _, t in batches])
    check = {"samples": len(labels), "batches": len(batches),
             "batch_sizes": sorted({len(b[1]) for b in batches}),
             "input_shapes": sorted({str(list(v.shape)) for b in batches for v in b[0].values()}),
             "onnxruntime": ort.__version__, "threads": threads,
             "files": {name: check_file(args.directory / name, batches, threads) for name in args.files}}
    if labels.ndim == 1 and labels.dtype.kind in "iu":
        check["torch_accuracy"] = float((torch_logits.argmax(-1) == labels).mean())
    (args.directory / CHECK_FILE).write_text(json.dumps(check, indent=2) + "\n")


if __name__ == "__main__":
    check_main()
