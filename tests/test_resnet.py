"""train_resnet.py end to end through the real launcher on 1 and 2 CPU processes, on real handwritten digits."""
import json
import os
import shutil
import signal
import time
import urllib.error
from pathlib import Path

import pandas as pd
import pytest
import torch
import torchvision
from accelerate.state import AcceleratorState
from conftest import (ACCELERATE, FEW_DIGITS_TRAIN, FEW_DIGITS_VAL, HANG_S, STARTED, assert_attempts_kept_apart,
                      assert_group_restarted, assert_job_left_in_grace, assert_one_line_error, assert_same_curve,
                      assert_same_weights, descendants, end_all, free_port, launch, launch_cmd, one_thread, read_json,
                      read_jsonl, run_here, run_on, start, stop_job, wait_for, workers)
from PIL import Image
from shared_image_runs import card_command

import train_resnet
from utils.demo_data import write_digits_imagefolder
from utils.runtime import UserError, release_output_dirs
from utils.export import load_torch_checkpoint, strip_module_prefix
from utils.image_references import check_legacy_compatible
from utils.outputs import read_sample_indices

SCRIPT = "train_resnet.py"
EPOCHS = 3
# Learns the 16x16 digits in seconds: main.py's RandomResizedCrop (down to 8% of the area) makes them hard,
# and without momentum the first epochs are far more stable at this tiny scale (measured: ~60% vs ~40% top-1).
FAST = ["--arch", "resnet18", "--image_size", "16", "--val_resize", "16", "-b", "64", "--lr", "0.02",
        "--momentum", "0", "-j", "0"]
STEPS_PER_EPOCH = FEW_DIGITS_TRAIN // 64  # 336 training images, drop_last: 5 steps per epoch
STEPS = EPOCHS * STEPS_PER_EPOCH
CHECKPOINT_STEPS = 3  # steps 3, 6, 9 and 12 are inside an epoch (resumes mid-epoch); 15 is the run's end
# Every recipe feature on in the shared runs, so the exactness tests cover them all; mild enough for the 1,348 digits
# to reach ~60% in 3 epochs (no flips and crops of >= 25%: a flipped 2 is not a 2), the learning check of
# `make test-long`. EMA decay 0.999 becomes 0.915 after torchvision's adjustment for a 64-image batch, 4-step interval
# and 3 epochs.
ALL_ON = ["--lr", "0.05", "--hflip", "0", "--crop_scale", "0.25", "--auto_augment", "ta_wide", "--random_erase", "0.1",
          "--mixup_alpha", "0.2", "--cutmix_alpha", "0.5", "--model_ema", "--model_ema_steps", "4",
          "--model_ema_decay", "0.999", "--norm_weight_decay", "0", "--bias_weight_decay", "0", "--clip_grad_norm", "5",
          "--lr_scheduler", "cosine", "--warmup_epochs", "0.5", "--lr_min", "0.001", "--ra_sampler", "--ra_reps", "2"]
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def train_args(data, out, *extra, epochs=EPOCHS, checkpoint_steps=CHECKPOINT_STEPS):
    """A log line at every checkpoint, so that a run resumed from one logs the same windows as the uninterrupted run."""
    return [data, *FAST, *ALL_ON, "--epochs", str(epochs), "--checkpointing_steps", str(checkpoint_steps),
            "-p", str(checkpoint_steps), "--save_total_limit", "0", "--log_sample_indices", "--output_dir", out, *extra]


def train_on(processes, data, tmp_path_factory, name, **kwargs):
    runs = {}
    for n in processes:
        out = tmp_path_factory.mktemp(f"{name}_{n}proc")
        run_on(n, SCRIPT, train_args(data, out, **kwargs)) if n < 3 else launch(SCRIPT, train_args(data, out, **kwargs),
                                                                                 num_processes=n)
        runs[n] = out
    return runs


@pytest.fixture(scope="module")
def trained(few_digits, tmp_path_factory):
    """One uninterrupted 1-process and one 4-process run with every recipe feature on, 15 steps on 447 digits, shared
    by the tests below (4: a ring all-reduce over 3 or more ranks sums in an order set by DDP's gradient buckets, which
    the exact resumes below then cover)."""
    return train_on((1, 4), few_digits, tmp_path_factory, "resnet")


@pytest.fixture(scope="module")
def trained_long(digits_data, tmp_path_factory):
    """1 and 2 processes on all 1,348 training digits (63 steps), for the checks of how far they learn."""
    return train_on((1, 2), digits_data, tmp_path_factory, "resnet_long", checkpoint_steps=10)


def val_images(data):
    return sorted((Path(data) / "val").rglob("*.png"))


def assert_counts_exactly(out, data, n, steps):
    """What a run records whatever it learnt: its launch, every validation image once, each step logged once."""
    results = read_json(out / "all_results.json")
    assert results["num_processes"] == n and results["global_batch_size"] == 64
    assert results["distributed_type"] == ("NO" if n == 1 else "MULTI_CPU")
    val = len(val_images(data))
    assert results["eval_samples"] == val and val % 2 == 1  # odd: padding must not be counted
    assert results["eval_acc1"] <= results["eval_acc5"] <= 100
    assert results["best_acc1"] >= results["eval_acc1"] and results["train_steps"] == steps
    assert results["train_images_per_second"] > 0 and results["train_skipped_images"] == 0
    events = read_jsonl(out / "metrics.jsonl")
    train = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in train] == sorted({e["step"] for e in train})  # no repeats
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["epoch"] for e in evals] == [1, 2, 3]
    assert evals[-1]["ema_samples"] == val  # the EMA is validated beside the model
    assert results["best_ema_acc1"] == max(e["ema_acc1"] for e in evals)
    assert (out / "training_curves.png").read_bytes()[:4] == b"\x89PNG"
    # all_results.json is a table of single values, as the Trainer's is: pandas reads it as it reads theirs
    table = pd.read_json(out / "all_results.json", typ="series")
    assert table.index.tolist() == list(results) and table["eval_acc1"] == pytest.approx(results["eval_acc1"])
    settings = read_json(out / "all_results_settings.json")
    assert settings == {"eval_settings": {"val_crop_size": 16, "val_resize": 16, "interpolation": "bilinear"},
                        "launches": [{"processes": n, "mixed_precision": "no", "resume_step": None}]}
    return results, train, evals


@pytest.mark.parametrize("n", [1, 4])
def test_counts_exactly(trained, few_digits, n):
    results, _, _ = assert_counts_exactly(trained[n], few_digits, n, STEPS)
    assert results["eval_samples"] == FEW_DIGITS_VAL


@pytest.mark.long
@pytest.mark.parametrize("n", [1, 2])
def test_learns_and_counts_exactly(trained_long, digits_data, n):
    results, train, evals = assert_counts_exactly(trained_long[n], digits_data, n, EPOCHS * (1348 // 64))
    assert results["eval_samples"] == 449
    assert results["eval_acc1"] > 40, results  # chance is 10%
    # the training loss is on mixed images and soft targets (MixUp/CutMix): it falls, but stays high; the
    # validation loss is on plain images
    assert train[-1]["loss"] < 0.95 * train[0]["loss"], [e["loss"] for e in train]
    assert evals[-1]["loss"] < 0.8 * evals[0]["loss"], [e["loss"] for e in evals]
    assert evals[-1]["ema_acc1"] > 20


def torchvision_test_only(path, num_classes, with_ema=False):
    """What torchvision's references/classification/train.py does with `--resume PATH --test-only` (and
    `--model-ema`), its lines as it reads the file: its model, its ExponentialMovingAverage (an AveragedModel of the
    buffers too). Returns (model, EMA or None, its start epoch)."""
    model = torchvision.models.get_model("resnet18", num_classes=num_classes)
    model_without_ddp = model
    model_ema = torch.optim.swa_utils.AveragedModel(model_without_ddp, use_buffers=True) if with_ema else None
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model_without_ddp.load_state_dict(checkpoint["model"])
    start_epoch = checkpoint["epoch"] + 1
    if model_ema:
        model_ema.load_state_dict(checkpoint["model_ema"])
    return model, model_ema, start_epoch


def top1_top5(model, data, class_to_idx):
    """Top-1/top-5 (%) on the validation digits with nothing from this project: PIL, torchvision transforms,
    argsort."""
    to_tensor = torchvision.transforms.Compose([
        torchvision.transforms.Resize(16), torchvision.transforms.CenterCrop(16), torchvision.transforms.ToTensor(),
        torchvision.transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    paths = val_images(data)
    images = torch.stack([to_tensor(Image.open(p).convert("RGB")) for p in paths])
    targets = torch.tensor([class_to_idx[p.parent.name] for p in paths])
    with torch.no_grad():
        ranking = model.eval()(images).argsort(dim=1, descending=True)  # (N, 10)
    rank_of_target = (ranking == targets[:, None]).float().argmax(dim=1)  # 0 = top-1
    return 100 * (rank_of_target == 0).float().mean().item(), 100 * (rank_of_target < 5).float().mean().item()


@pytest.mark.parametrize("suffix", ["", "_ema"])
def test_exports_load_into_plain_torchvision(trained, few_digits, suffix, tmp_path):
    """model_best.pth and checkpoint.pth load into plain torchvision as main.py's files (`state_dict`) and as
    torchvision's references read theirs (`model`, `epoch`, `model_ema`), and score what the run reported."""
    out = trained[4]
    results = read_json(out / "all_results.json")
    evals = [e for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "eval"]
    if suffix:  # the EMA's own files: the same layout and checks, against its own validation results
        ema_evals = [{k[4:]: v for k, v in e.items() if k.startswith("ema_")} | {"epoch": e["epoch"]} for e in evals]
        results = {"best_acc1": results["best_ema_acc1"], "eval_acc1": results["eval_ema_acc1"],
                   "best_epoch": max(ema_evals, key=lambda e: e["acc1"])["epoch"]}
    best = torch.load(out / f"model_best{suffix}.pth", weights_only=True)
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(best["state_dict"])  # strict: no `module.` prefix, nothing missing
    assert best["arch"] == "resnet18" and best["class_to_idx"] == {str(d): d for d in range(10)}
    assert {k: best[k] for k in ("train_crop_size", "val_crop_size", "val_resize", "interpolation")} == {
        "train_crop_size": 16, "val_crop_size": 16, "val_resize": 16, "interpolation": "bilinear"}
    assert best["best_acc1"] == best["acc1"] == results["best_acc1"] and best["epoch"] == results["best_epoch"]
    last = torch.load(out / f"checkpoint{suffix}.pth", weights_only=True)
    assert last["epoch"] == EPOCHS and last["acc1"] == results["eval_acc1"]
    # torchvision's `model` is the same dict as `state_dict`, pickled once: the file is the weights' size, not twice
    for name, checkpoint in ((f"model_best{suffix}.pth", best), (f"checkpoint{suffix}.pth", last)):
        assert checkpoint["model"] is checkpoint["state_dict"]
        weights_alone = tmp_size(checkpoint["state_dict"], tmp_path)
        extra = tmp_size(checkpoint["model_ema"], tmp_path) if "model_ema" in checkpoint else 0
        assert (out / name).stat().st_size < 1.01 * (weights_alone + extra), name

    # torchvision's `--resume model_best.pth --test-only`: the accuracy the run reported for that epoch
    model, _, start_epoch = torchvision_test_only(out / f"model_best{suffix}.pth", 10)
    assert start_epoch == best["epoch"] + 1  # torchvision's epoch is the last one's index: it counts one more
    top1, top5 = top1_top5(model, few_digits, best["class_to_idx"])
    assert top1 == pytest.approx(best["acc1"], abs=1e-4)
    assert top5 == pytest.approx(evals[best["epoch"] - 1][f"{suffix[1:]}_acc5".lstrip("_")], abs=1e-4)
    if not suffix:  # `--resume checkpoint.pth --test-only --model-ema`: the EMA checkpoint_ema.pth also holds
        _, model_ema, _ = torchvision_test_only(out / "checkpoint.pth", 10, with_ema=True)
        assert_same_weights(model_ema.module.state_dict(),
                            torch.load(out / "checkpoint_ema.pth", weights_only=True)["state_dict"])
        assert top1_top5(model_ema.module, few_digits, best["class_to_idx"])[0] == pytest.approx(
            evals[-1]["ema_acc1"], abs=1e-4)


def tmp_size(state_dict, folder):
    """The bytes torch.save writes for `state_dict` alone."""
    path = folder / "size_probe.pth"
    torch.save(state_dict, path)
    return path.stat().st_size


def test_evaluate_reproduces_reported_accuracy(trained, digits_model, digits_model_evaluated, digits_data,
                                              few_digits, tmp_path, capsys):
    """The second command users run: `-e --resume model_best.pth` without the training's size flags evaluates at the
    sizes the model was trained with (16 px, not 224/256), in a second process, on 2 processes (the shared digits
    model's evaluation, tests/shared_image_runs.py; its ONNX export is tests/test_onnx_export.py's)."""
    # the command model_card.md gives for model_best.pth: no size flags, the file records them
    command = card_command(digits_model)
    assert command[:2] == ["python", SCRIPT] and str(digits_model / "model_best.pth") in command
    assert not {"--image_size", "--val_resize", "--val_crop_size", "--interpolation"} & set(command)
    assert "was trained with --image_size 16, --val_resize 16, --interpolation bilinear: evaluating with the same" \
        in (digits_model_evaluated / "stdout.txt").read_text(encoding="utf-8")
    evaluated = read_json(digits_model_evaluated / "eval_results.json")
    assert evaluated["num_processes"] == 2
    assert evaluated["eval_samples"] == len(val_images(digits_data)) and evaluated["eval_samples"] % 2 == 1
    assert evaluated["eval_acc1"] == pytest.approx(read_json(digits_model / "all_results.json")["best_acc1"],
                                                   abs=1e-9)
    assert read_json(digits_model_evaluated / "eval_results_settings.json")["eval_settings"] == {
        "val_crop_size": 16, "val_resize": 16, "interpolation": "bilinear"}
    out = trained[1]
    # our own checkpoints evaluate too: `latest` is the run's last step, written beside its all_results.json, and
    # scores what the run's last validation scored
    main_here(["--cpu", few_digits, "-j", "0", "-e", "--resume", "latest", "--output_dir", out])
    evaluated = read_json(out / "eval_results.json")
    training = read_json(out / "all_results.json")
    assert evaluated["eval_samples"] == FEW_DIGITS_VAL
    assert evaluated["eval_acc1"] == pytest.approx(training["eval_acc1"], abs=1e-9)
    assert training["train_steps"] == STEPS  # the training results are left alone
    # other sizes than the training's: named, and their numbers never pass for the training's
    capsys.readouterr()
    main_here(["--cpu", few_digits, "-j", "0", "-e", "--resume", out / "model_best.pth", "--val_resize", "20",
               "--output_dir", out])
    assert "--val_resize 20 differs from the model's 16 (trained with): evaluating with 20" in capsys.readouterr().out
    merged = read_json(out / "all_results.json")
    assert {k: merged[k] for k in training} == training  # the training's numbers, and their eval_settings:
    assert read_json(out / "all_results_settings.json")["eval_settings"] == {
        "val_crop_size": 16, "val_resize": 16, "interpolation": "bilinear"}
    assert read_json(out / "eval_val_resize_20_results_settings.json")["eval_val_resize_20_settings"] == {
        "val_crop_size": 16, "val_resize": 20, "interpolation": "bilinear"}
    other = read_json(out / "eval_val_resize_20_results.json")
    assert merged["eval_val_resize_20_acc1"] == other["eval_val_resize_20_acc1"]
    # the export as starting weights (--weights PATH) of an evaluation: the same sizes, the same number
    main_here(["--cpu", few_digits, "-j", "0", "-e", "--weights", out / "model_best.pth", "--output_dir",
               tmp_path / "weights"])
    assert f"{out / 'model_best.pth'} was trained with --image_size 16, --val_resize 16, --interpolation bilinear" \
        in capsys.readouterr().out
    assert read_json(tmp_path / "weights" / "eval_results.json")["eval_acc1"] == pytest.approx(training["best_acc1"],
                                                                                              abs=1e-9)


def test_evaluate_takes_the_architecture_from_the_model(small_digits, tmp_path, monkeypatch):
    """`-e --resume model_best.pth` (or a checkpoint) without -a: the architecture comes from the file, as the sizes
    do (resnet34, not the default resnet18), and the accuracy is the training's; an -a that differs is one line
    naming both."""
    monkeypatch.setattr("utils.outputs.plot_training_curves", lambda *args, **kwargs: None)  # half the training time
    out = tmp_path / "resnet34"
    run_here(SCRIPT, small_args(small_digits, out, "-a", "resnet34", "--checkpointing_steps", "3"))  # 3 steps
    best_acc1 = read_json(out / "all_results.json")["best_acc1"]
    for resume, evaluated in ((out / "model_best.pth", tmp_path / "eval"), ("latest", out)):
        proc = run_here(SCRIPT, ["--cpu", small_digits, "-j", "0", "-e", "--resume", resume, "--output_dir", evaluated])
        assert "was trained with --image_size 16, --val_resize 16" in proc.stdout
        assert read_json(evaluated / "eval_results.json")["eval_acc1"] == pytest.approx(best_acc1, abs=1e-9)
    proc = run_here(SCRIPT, ["--cpu", small_digits, "-j", "0", "-e", "--resume", out / "model_best.pth", "-a",
                             "resnet18", "--output_dir", tmp_path / "other"], check=False)
    assert_one_line_error(proc, f"{out / 'model_best.pth'}: checkpoint's arch: 'resnet34'; this run's: 'resnet18'")


def script_with_a_head_flag(folder):
    """train_resnet.py as a user adapts it: a --head_hidden flag in build_parser, its role line in FLAG_ROLES (a
    shape the exports record), and build_model putting a hidden layer into the head. Returns its path."""
    text = (Path(train_resnet.__file__)).read_text(encoding="utf-8")
    edits = {
        "    image_model.add_model_args(model)  #":
            "    model.add_argument(\"--head_hidden\", type=runtime.positive_int, default=None, "
            "help=\"a hidden layer of this width in the head\")\n    image_model.add_model_args(model)  #",
        '    "-a": checkpoint.keep_as("arch"),':
            '    "--head_hidden": checkpoint.MUST_KEEP.recorded(0),\n    "-a": checkpoint.keep_as("arch"),',
        "    return image_model.build(args, num_classes, print_fn, class_to_idx)\n":
            "    model = image_model.build(args, num_classes, print_fn, class_to_idx)\n"
            "    if args.head_hidden:\n"
            "        model.fc = torch.nn.Sequential(torch.nn.Linear(model.fc.in_features, args.head_hidden), "
            "torch.nn.ReLU(), torch.nn.Linear(args.head_hidden, num_classes))\n"
            "    return model\n"}
    for old, new in edits.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    script = folder / "my_resnet.py"
    script.write_text(text, encoding="utf-8")
    return script


def test_a_users_head_flag_is_recorded_and_rebuilt_from_the_export(few_digits, digits_model, digits_data, tmp_path,
                                                                  monkeypatch):
    """A user adds a head flag with a `.recorded()` role: model_best.pth records it, and -e, --predict, the model
    card's snippet and its command rebuild the model from the file alone; an export made before the flag existed
    still evaluates, with the flag's default, said once."""
    script = str(script_with_a_head_flag(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))  # run_here imports the script by name, as the card's snippet does
    out = tmp_path / "out"
    run_here(script, ["--cpu", few_digits, *FAST, "--head_hidden", "64", "--epochs", "1", "--output_dir", out])
    export = torch.load(out / "model_best.pth", weights_only=True)
    assert export["head_hidden"] == 64 and export["model"]["fc.0.weight"].shape == (64, 512)
    best_acc1 = read_json(out / "all_results.json")["best_acc1"]

    command = card_command(out)  # -e --resume model_best.pth, without --head_hidden
    assert command[1] == script and "--head_hidden" not in command
    proc = run_here(script, [*command[2:], "--cpu", "-j", "0", "-b", "64", "--output_dir", tmp_path / "eval"])
    assert f"{out / 'model_best.pth'} was trained with --image_size 16, --val_resize 16, --interpolation bilinear, " \
           "--head_hidden 64: evaluating with the same" in proc.stdout
    assert read_json(tmp_path / "eval" / "eval_results.json")["eval_acc1"] == pytest.approx(best_acc1, abs=1e-9)

    run_here(script, ["--cpu", "--predict", few_digits / "val", "--resume", out / "model_best.pth", "-j", "0",
                      "--output_dir", tmp_path / "predicted"])
    predicted = read_jsonl(tmp_path / "predicted" / "predictions.jsonl")
    targets = [Path(row["file"]).parent.name for row in predicted]
    assert len(predicted) == FEW_DIGITS_VAL
    assert 100 * sum(row["label"] == t for row, t in zip(predicted, targets)) / len(targets) == pytest.approx(
        best_acc1, abs=1e-9)

    # the card's snippet, as a user runs it: the model rebuilt by the script from the file, and its top-1
    card = (out / "model_card.md").read_text(encoding="utf-8")
    snippet = card.split("```python\n")[1].split("```")[0]
    assert "from my_resnet import exported_model" in snippet and "--head_hidden 64" in snippet
    namespace = {}
    exec(snippet, namespace)
    assert top1_top5(namespace["model"], few_digits, export["class_to_idx"])[0] == pytest.approx(best_acc1, abs=1e-4)

    # an export of the script before it had the flag: the default (no hidden layer), said once
    proc = run_here(script, ["--cpu", digits_data, "-j", "0", "-b", "64", "-e", "--resume",
                             digits_model / "model_best.pth", "--output_dir", tmp_path / "older"])
    said = [line for line in proc.stdout.splitlines() if "records no" in line]
    assert said == [f"{digits_model / 'model_best.pth'} records no --head_hidden (exported before the script "
                    "recorded it): using the default, --head_hidden 0"], said
    assert read_json(tmp_path / "older" / "eval_results.json")["eval_acc1"] == pytest.approx(
        read_json(digits_model / "all_results.json")["best_acc1"], abs=1e-9)


def same_run(reference, resumed, stopped_at=None):
    """Bitwise-identical weights and EMA weights at the end, and the same curve (timings aside), no step twice."""
    for key in ("state_dict", "model_ema"):
        assert_same_weights(torch.load(reference / "checkpoint.pth", weights_only=True)[key],
                            torch.load(resumed / "checkpoint.pth", weights_only=True)[key])
    assert_same_curve(reference, resumed, ("loss", "acc1", "acc5", "lr", "ema_acc1"), stopped_at)
    assert read_sample_indices(resumed) == read_sample_indices(reference)  # the same images and copies, step by step


def test_4_processes_train_the_images_of_1_step_by_step(trained):
    """--log_sample_indices with repeated augmentation ([index, copy] pairs): each step's global batch, the processes'
    shares joined in rank order, is the 1-process step's."""
    one = read_sample_indices(trained[1])
    assert list(one) == list(range(1, STEPS + 1)) and read_sample_indices(trained[4]) == one


def test_resume_mid_epoch_then_sigterm_then_resume_latest_is_exact(trained, few_digits, tmp_path):
    """4 processes: --resume from a mid-epoch checkpoint of the reference run with 2 DataLoader workers per rank, then
    Slurm's time limit and scancel: SIGTERM to the launcher, the ranks and their workers at once. The ranks save and
    leave before the launcher's grace ends, no process of the job is left, and --resume latest ends exactly as the
    uninterrupted run (which loaded its images without workers)."""
    out = tmp_path / "preempted"
    shutil.copytree(trained[4], out)
    for later in ("checkpoint.pth", "model_best.pth", "checkpoint_ema.pth", "model_best_ema.pth", "all_results.json",
                  "training_curves.png"):
        (out / later).unlink()
    for step in (9, 12, 15):
        shutil.rmtree(out / "checkpoints" / f"step_{step}")
    # step 6 = epoch 2, batch 1 of 5: the rest of epoch 2 and its validation come from the resumed run
    job = start(launch_cmd(SCRIPT, train_args(few_digits, out, "--resume", out / "checkpoints" / "step_6", "-j", "2"),
                           num_processes=4), tmp_path / "job.log")
    processes = []
    try:
        wait_for(lambda: (out / "checkpoints" / "step_9" / "training_state.json").exists(), job)
        wait_for(lambda: len(workers(job, out)) >= 4 + 4 * 2, job)  # the ranks and each one's 2 loader workers
        processes = [job.pid, *descendants(job.pid)]
        seconds, ended = stop_job(job, processes, signal.SIGTERM)  # Slurm and cloud preemption: every process
    finally:
        end_all([job.pid, *processes])
    log = (tmp_path / "job.log").read_text()
    assert "at step 6" in log and "stopped on SIGTERM after saving a checkpoint" in log, log[-3000:]
    assert_job_left_in_grace(log, SCRIPT, ended)
    assert not (out / ".lock").exists()
    results = read_json(out / "all_results.json")
    assert results["preempted"] is True and 9 <= results["train_steps"] < STEPS
    assert (out / "checkpoints" / f"step_{results['train_steps']}").is_dir()
    print(f"SIGTERM to every process, -j 2: launcher exit {job.returncode}, checkpoint step {results['train_steps']}, "
          f"{seconds:.1f} s")
    launch(SCRIPT, train_args(few_digits, out, "--resume", "latest"), num_processes=4)
    same_run(trained[4], out, stopped_at=results["train_steps"])
    assert read_json(out / "all_results.json")["best_acc1"] == read_json(trained[4] / "all_results.json")["best_acc1"]


def test_sigkill_then_accelerate_max_restarts_resumes_latest_exactly(trained, few_digits, tmp_path):
    """4 processes, every recipe feature on, elastic: `accelerate launch --max_restarts 1` with `--resume latest` from
    the start, the first worker (rank 0, the one that writes and holds the output directory's lock) SIGKILLed
    mid-epoch 1; the launcher restarts the group, which takes the dead worker's lock over, resumes from the latest
    checkpoint and ends bitwise as the uninterrupted run, EMA included (accelerate's own static rendezvous, whose
    store the restarted group shares: no variable set, the script keeps each attempt's keys apart)."""
    out = tmp_path / "elastic"
    cmd = [*ACCELERATE, "--multi_gpu", "--num_processes", "4", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", free_port(), "--max_restarts", "1", SCRIPT, "--cpu",
           *train_args(few_digits, out, "--resume", "latest")]
    job = start(cmd, tmp_path / "job.log")
    wait_for(lambda: (out / "checkpoints" / "step_3" / "training_state.json").exists(), job)
    # a second run on the running job's directory stops before writing anything, naming the holder
    with pytest.raises(UserError, match=rf"{out}: another run is using this directory \(host \S+, PID \d+"):
        main_here(train_args(few_digits, out, "--cpu", "--resume", "latest"))
    assert job.poll() is None  # it was refused while the job held the directory
    holder = read_json(out / ".lock")["pid"]  # rank 0
    assert holder in workers(job, out)
    os.kill(holder, signal.SIGKILL)
    job.wait(timeout=HANG_S)
    log = (tmp_path / "job.log").read_text()
    assert job.returncode == 0, log[-3000:]
    assert_group_restarted(log)
    assert_attempts_kept_apart(log)
    assert f"{out / '.lock'}: taking over the lock of a run that is no longer running" in log, log[-3000:]
    same_run(trained[4], out)
    assert not (out / ".lock").exists()


def main_py_checkpoint(path, best):
    """What imagenet/main.py saves from a DDP model: `module.` keys, optimizer state, epoch, a tensor best_acc1."""
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(best["state_dict"])
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    model(torch.randn(4, 3, 16, 16)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    torch.save({"epoch": EPOCHS, "arch": "resnet18", "best_acc1": torch.tensor(best["best_acc1"]),
                "state_dict": {f"module.{k}": v for k, v in best["state_dict"].items()},
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, path)
    return path


def resume_main_py_checkpoint(trained_dir, data, tmp_path, print_freq):
    """Trains one more epoch from the run's best model saved as main.py saves it; (metrics events, results)."""
    best = torch.load(trained_dir / "model_best.pth", weights_only=True)
    checkpoint = main_py_checkpoint(tmp_path / "checkpoint.pth.tar", best)
    out = tmp_path / "out"
    proc = run_here(SCRIPT, ["--cpu", data, *FAST, "--epochs", str(EPOCHS + 1), "--resume", checkpoint,
                             "-p", print_freq, "--hflip", "0", "--crop_scale", "0.25",  # the weights' augmentation
                             "--output_dir", out])
    assert f"Loaded {checkpoint} (epoch {EPOCHS}" in proc.stdout
    events = read_jsonl(out / "metrics.jsonl")
    assert {e["epoch"] for e in events} == {EPOCHS + 1}  # main.py's epoch = epochs done: only the 4th is trained
    return events, read_json(out / "all_results.json")


def test_resumes_a_main_py_checkpoint(trained, few_digits, tmp_path):
    events, _ = resume_main_py_checkpoint(trained[1], few_digits, tmp_path, print_freq=1)
    assert events[0]["step"] == STEPS + 1  # the schedule goes on from main.py's epoch: step 16 of 20


@pytest.mark.long
def test_a_main_py_checkpoint_goes_on_from_its_weights(trained_long, digits_data, tmp_path):
    events, results = resume_main_py_checkpoint(trained_long[1], digits_data, tmp_path, print_freq=5)
    assert events[0]["step"] == 65  # the schedule goes on from main.py's epoch: step 63 of 84, logged every 5
    assert results["eval_acc1"] > 40  # went on from the trained weights
    assert events[0]["loss"] < 2.0  # a fresh model starts at ln(10) = 2.3


def test_legacy_checkpoint_files(tmp_path):
    weights = {"module.conv.weight": torch.ones(2), "module.fc.bias": torch.zeros(1)}
    assert strip_module_prefix({f"module.{k}": v for k, v in weights.items()}) == {
        "conv.weight": weights["module.conv.weight"], "fc.bias": weights["module.fc.bias"]}  # DP inside DDP
    assert strip_module_prefix({"module.a": 1, "b": 2}) == {"module.a": 1, "b": 2}  # not all prefixed: a real name
    torch.save(weights, tmp_path / "bare.pth")  # torch.save(model.state_dict()) from any script
    assert load_torch_checkpoint(tmp_path / "bare.pth")["state_dict"].keys() == {"conv.weight", "fc.bias"}
    torch.save({"state_dict": weights, "best_acc1": torch.tensor(76.1), "args": urllib.error.URLError("x")},
               tmp_path / "pickled.pth.tar")
    with pytest.raises(UserError, match=r"pickled.pth.tar: holds a pickled \S*URLError, which torch.load\("
                                        r"weights_only=True\) refuses"):
        load_torch_checkpoint(tmp_path / "pickled.pth.tar")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match=r"junk.pth: not a PyTorch checkpoint"):
        load_torch_checkpoint(tmp_path / "junk.pth")
    with pytest.raises(UserError, match=r"x.pth: checkpoint's class_to_idx: 10 classes \[0, 1, 2, 3, ...\]; "
                                        r"this run's: 2 classes \[cat, dog\]"):
        check_legacy_compatible({"class_to_idx": {str(d): d for d in range(10)}, "arch": "resnet18"},
                                {"arch": "resnet18", "class_to_idx": {"cat": 0, "dog": 1}}, "x.pth")
    check_legacy_compatible({"arch": "resnet18"}, {"arch": "resnet18", "class_to_idx": {"cat": 0}}, "main.py.tar")


def test_dummy_data_and_modern_options(tmp_path):
    out = tmp_path / "out"
    # 128 random images in 1000 classes; two micro-batches per step; 1 process, so --sync_bn is a no-op
    with pytest.warns(UserWarning, match="--data_parallel uses legacy single-process nn.DataParallel"):
        run_here(SCRIPT, ["--cpu", "--dummy", "128", "--image_size", "16", "--val_resize", "16", "-b", "32",
                          "-j", "0", "--epochs", "1", "--gradient_accumulation_steps", "2", "--lr_scheduler", "cosine",
                          "--warmup_epochs", "0.5", "--label_smoothing", "0.1", "--channels_last", "--sync_bn",
                          "--data_parallel", "--with_tracking", "--output_dir", out])
    results = read_json(out / "all_results.json")
    assert results["train_steps"] == 2 and results["eval_samples"] == 128 * 50_000 // 1_281_167
    exported = torch.load(out / "model_best.pth", weights_only=True)
    torchvision.models.resnet18().load_state_dict(exported["state_dict"])  # 1000 classes, as in main.py
    assert any((out / "runs").rglob("events.out.tfevents.*"))


def test_torchvision_recipe_command_runs(tmp_path):
    """torchvision's ResNet-50 V2 command (tests/test_recipe.py RECIPE), `accelerate launch` for torchrun, on 2
    processes. Changed to run in seconds: --dummy 8 images, 1 epoch, --batch-size 4 (the GLOBAL batch: 2 per process)."""
    from test_recipe import RECIPE
    out = tmp_path / "recipe"
    proc = launch(SCRIPT, [*RECIPE, "--dummy", "8", "--batch-size", "4", "--epochs", "1", "-j", "0",
                           "--output-dir", out], num_processes=2)
    assert proc.stdout.splitlines()[0].startswith("batch: -b 4 = 2 per process x 2 processes"), proc.stdout[:500]
    assert proc.stdout.count("read as: --model resnet50 = --arch resnet50") == 1 and "mixup 0.2 cutmix 1.0" in proc.stdout
    results = read_json(out / "all_results.json")
    assert results["global_batch_size"] == 4 and results["train_steps"] == 2 and "eval_ema_acc1" in results
    run_config = read_json(out / "run_config.json")
    assert run_config["args"]["train_crop_size"] == 176 and run_config["args"]["val_resize"] == 232, run_config
    ema_export = torch.load(out / "checkpoint_ema.pth", weights_only=True)
    torchvision.models.resnet50().load_state_dict(ema_export["state_dict"])  # 1000 classes, as torchvision's


def test_parse_keeps_our_flags_apart_from_main_py_ones():
    args = train_resnet.parse_args(["--dummy", "--dist_backend", "gloo", "--wd", "5e-5", "-b", "32"])
    assert args.dist_backend == "gloo" and args.weight_decay == 5e-5 and args.batch_size == 32
    assert args.dummy == 1_281_167 and args.data is None


def test_main_py_distribution_flag_prints_the_mapping(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_resnet.parse_args(["/data/imagenet", "--dist-url", "tcp://10.1.1.20:23456", "--rank", "0"])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr == ("error: --dist-url is a flag of pytorch/examples imagenet/main.py; here: accelerate launch "
                      "--main_process_ip HOST --main_process_port PORT (config: main_process_ip, main_process_port), "
                      "or --rdzv_backend c10d (accelerate_configs/multinode_c10d.yaml)\n")


@pytest.mark.parametrize("argv,flag", [
    (["-p", "0"], "-p/--print-freq"), (["--lr_step_epochs", "0"], "--lr_step_epochs/--lr-step-size"),
    (["--lr", "0", "--lr_scheduler", "cosine"], "--lr/--learning-rate"), (["--image_size", "0"], "--image_size"),
    (["--val_resize", "-8"], "--val_resize/--val_resize_size/--val-resize-size"), (["-b", "0"], None),
    (["--epochs", "0"], "--epochs"), (["-j", "-1"], "-j/--workers"), (["--model_ema_steps", "0"], None),
    (["--ra_reps", "0"], "--ra_reps/--ra-reps"), (["--gradient_accumulation_steps", "0"], None),
    (["--save_total_limit", "-1"], None), (["--checkpointing_steps", "0"], None), (["--dummy", "0"], None),
    (["--wd=-1e-4"], "--wd/--weight-decay/--weight_decay"), (["--mixup_alpha", "inf"], None)])
def test_counts_and_intervals_are_checked_by_the_parser(argv, flag, capsys):
    """Each a ZeroDivisionError or RuntimeError after start-up before; now the parser's one line naming the flag."""
    with pytest.raises(SystemExit) as exit_info:
        train_resnet.parse_args(["--dummy", *argv])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "error: argument " in stderr and ": must be " in stderr and (flag or argv[0]) in stderr, stderr


def test_classification_loss_ignores_unreadable_images():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [5.0, -5.0]])
    targets = torch.tensor([0, 0, -3])  # the third image was unreadable
    expected = torch.nn.functional.cross_entropy(logits[:2], targets[:2])
    assert train_resnet.classification_loss(logits, targets).item() == pytest.approx(expected.item())
    assert train_resnet.classification_loss(logits[2:], targets[2:]).item() == 0.0  # not NaN


def test_class_weights_weigh_hard_and_mixed_targets():
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 2.0, 0.5], [1.0, 1.0, 1.0]])
    targets = torch.tensor([0, 2, -2])  # the third image was unreadable
    weights = torch.tensor([0.5, 1.0, 3.0])
    per_image = torch.nn.functional.cross_entropy(logits[:2], targets[:2], reduction="none") * weights[targets[:2]]
    assert train_resnet.classification_loss(logits, targets, class_weights=weights).item() == pytest.approx(
        per_image.mean().item())  # the mean over the readable images of each one's weighted loss
    from utils.image_augment import soft_cross_entropy

    mixed = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.4, 0.6], [0.0, 0.0, 0.0]])  # a placeholder's row is all zeros
    log_p = torch.log_softmax(logits, dim=1)
    by_hand = -(mixed * weights * log_p).sum(dim=1)[:2].mean()  # each class of a mixed row weighed by its share
    assert soft_cross_entropy(logits, mixed, class_weights=weights).item() == pytest.approx(by_hand.item())


# ---- bad input: one line naming the problem, exit 2, no traceback ----

@pytest.fixture
def small_digits(tmp_path):
    """120 train / 40 val images of all 10 digits: the private, corruptible copy a bad-input test needs."""
    return write_digits_imagefolder(tmp_path / "digits", size=16, limit=160)


def small_args(data, out, *extra):
    return ["--cpu", data, "--image_size", "16", "--val_resize", "16", "-b", "40", "-j", "0", "--epochs", "1",
            "--output_dir", out, *extra]


def main_here(argv):
    """The script's main() in this process (no start-up cost), for one process; restores what it changes and, as
    run_cli does, releases the output directory's lock however main() ended."""
    sigterm, sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)  # PreemptionGuard's own
    try:
        return train_resnet.main(train_resnet.parse_args([str(a) for a in argv]))
    finally:
        release_output_dirs()
        signal.signal(signal.SIGTERM, sigterm)
        signal.signal(signal.SIGINT, sigint)
        AcceleratorState._reset_state(reset_partial_state=True)


def corrupt(path):
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    return path


def test_corrupt_image_is_a_one_line_error(small_digits, tmp_path):
    bad = corrupt(sorted((small_digits / "train" / "3").iterdir())[0])
    proc = run_here(SCRIPT, small_args(small_digits, tmp_path / "out"), check=False)  # `python SCRIPT`: exit 2
    assert_one_line_error(proc, str(bad), "unreadable image", "--skip_bad_images")
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_skip_bad_images_counts_them(small_digits, tmp_path, capsys):
    corrupt(sorted((small_digits / "train" / "3").iterdir())[0])
    corrupt(sorted((small_digits / "val" / "5").iterdir())[0])
    results = main_here(small_args(small_digits, tmp_path / "out", "--skip_bad_images"))
    assert "warning: skipping unreadable image" in capsys.readouterr().out
    assert results["train_skipped_images"] == 1  # 120 images in 3 full batches: each seen once
    assert results["eval_skipped_images"] == 1 and results["eval_samples"] == 39


def test_class_mismatch(small_digits, tmp_path):  # an empty class folder: tests/test_image_data.py
    shutil.rmtree(small_digits / "train" / "7")
    with pytest.raises(UserError, match=rf"{small_digits / 'val'}: classes differ .*only in train: none; "
                                        r"only in val: 7"):
        main_here(small_args(small_digits, tmp_path / "out"))


def test_pretrained_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "empty_cache"))  # nothing cached
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    args = train_resnet.parse_args(["--dummy", "--pretrained"])
    with pytest.raises(UserError, match=r"--pretrained: cannot get torchvision's resnet18 weights .*needs the network"):
        train_resnet.build_model(args, 10)


def offline(url, *args, **kwargs):
    raise urllib.error.URLError("[Errno -2] Name or service not known")


def test_nan_loss_stops_before_anything_is_written(small_digits, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UserError, match="loss became NaN/inf by step .*stopped before saving anything"):
        main_here(small_args(small_digits, out, "--lr", "1e30", "-p", "1"))
    assert not (out / "checkpoints").exists() and not (out / "model_best.pth").exists()


def test_resume_refuses_another_arch_and_a_missing_file(trained, small_digits, tmp_path):
    step_dir = trained[1] / "checkpoints" / f"step_{STEPS}"
    with pytest.raises(UserError, match=f"{step_dir / 'training_state.json'}: checkpoint has arch='resnet18', "
                                        "this run has 'resnet34'"):
        main_here(small_args(small_digits, tmp_path / "a", "-a", "resnet34", "-b", "64", "--resume", step_dir))
    with pytest.raises(UserError, match=r"--resume \S*model_bets.pth: no such file or directory"):
        main_here(small_args(small_digits, tmp_path / "b", "--resume", trained[1] / "model_bets.pth"))


def test_refuses_to_overwrite_another_run(small_digits, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model_best.pth").write_bytes(b"someone's best model")
    with pytest.raises(UserError, match=r"holds another run \(model_best.pth\); pass --overwrite_output_dir"):
        main_here(small_args(small_digits, out))
    assert (out / "model_best.pth").read_bytes() == b"someone's best model"


def test_startup_seconds_is_recorded(trained):
    """The launched run (the 1-process one runs in the pytest process, whose start is long past)."""
    results = read_json(trained[4] / "all_results.json")
    assert 0.5 < results["startup_seconds"] < time.time() - STARTED + 1  # importing torch alone takes over 0.5 s


def test_class_weights_balanced_from_the_image_counts(small_digits, tmp_path, capsys):
    import numpy as np
    from sklearn.utils.class_weight import compute_class_weight

    out = tmp_path / "out"
    with one_thread():
        main_here(small_args(small_digits, out, "--class_weights", "balanced", "--mixup_alpha", "0.2",
                             "--checkpointing_steps", "3"))
    train = torchvision.datasets.ImageFolder(small_digits / "train")
    expected = compute_class_weight("balanced", classes=np.arange(10), y=np.array(train.targets))
    state = read_json(out / "checkpoints" / "step_3" / "training_state.json")
    assert state["class_weights"] == pytest.approx(dict(zip(train.classes, expected)))
    assert capsys.readouterr().out.count("--class_weights balanced: 0 ") == 1  # printed once, class by class
    weights_file = tmp_path / "uniform.json"
    weights_file.write_text(json.dumps({str(digit): 1.0 for digit in range(10)}))
    with pytest.raises(UserError, match=r"checkpoint has class_weights=\{'0': "):
        main_here(small_args(small_digits, out, "--class_weights", weights_file, "--resume", "latest"))
    with pytest.raises(UserError, match="balanced counts the training labels, and this data has none"):
        main_here(["--cpu", "--dummy", "8", "-b", "8", "-j", "0", "--class_weights", "balanced", "--output_dir",
                   tmp_path / "dummy"])
    with pytest.raises(SystemExit):
        train_resnet.parse_args([small_digits, "-e", "--resume", "x.pth", "--class_weights", "balanced"])
