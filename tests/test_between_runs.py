"""Between runs: a run continued from main.py-style files (--resume FILE.pth, --start-epoch) goes on with its schedule,
and a finished run can be extended."""
import math

import pytest
import torch
from conftest import launch, read_json, read_jsonl, run_here

from utils.demo_data import write_digits_imagefolder

RESNET = "train_resnet.py"
LR = 0.05
STEPS_PER_EPOCH = 3  # 120 training images at -b 40
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """120 train / 40 val images of all 10 digits."""
    return write_digits_imagefolder(tmp_path_factory.mktemp("digits") / "d", size=16, limit=160)


def resnet_args(data, out, epochs, *extra):
    """A cosine schedule (to 0 at the last step) logged every step: each step's learning rate says where the
    schedule is."""
    return [data, "--image_size", "16", "--val_resize", "16", "-b", "40", "-j", "0", "-p", "1", "--lr", str(LR),
            "--lr_scheduler", "cosine", "--epochs", str(epochs), "--output_dir", out, *extra]


def cosine_lr(step, total_steps):
    return LR * 0.5 * (1 + math.cos(math.pi * step / total_steps))


def logged(out, event):
    return [e for e in read_jsonl(out / "metrics.jsonl") if e["event"] == event]


def assert_schedule_goes_on(out, first_step, total_steps):
    """The run's log from first_step to the end: one line per step, none repeated, each at the schedule's rate."""
    trained = [e for e in logged(out, "train") if e["step"] >= first_step]
    assert [e["step"] for e in trained] == list(range(first_step, total_steps + 1))
    for event in trained:
        assert event["lr"] == pytest.approx(cosine_lr(event["step"], total_steps), abs=1e-9), event


def test_a_finished_run_is_extended_from_its_checkpoint_pth(digits, tmp_path):
    """main.py's way to train longer, on 2 processes: `--resume OUT/checkpoint.pth --epochs 2` in the finished run's
    own directory continues its log, schedule and best-model selection, and says that the momentum starts afresh."""
    out = tmp_path / "run"
    launch(RESNET, resnet_args(digits, out, 1), num_processes=2)
    first = read_json(out / "all_results.json")
    proc = launch(RESNET, resnet_args(digits, out, 2, "--resume", out / "checkpoint.pth"), num_processes=2)
    assert (f"--resume {out / 'checkpoint.pth'}: epoch 1 counts as done: training starts at epoch 2, step 3 of 6 of "
            "the --lr_scheduler cosine schedule") in proc.stdout
    assert "the optimizer's momentum starts afresh" in proc.stdout
    # epoch 1's lines kept (a 1-epoch schedule's), epoch 2's follow on the 2-epoch schedule
    assert [e["step"] for e in logged(out, "train")] == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    assert_schedule_goes_on(out, STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH)
    assert [e["epoch"] for e in logged(out, "eval")] == [1, 2]
    results = read_json(out / "all_results.json")
    assert results["train_steps"] == 2 * STEPS_PER_EPOCH
    best = torch.load(out / "model_best.pth", weights_only=True)
    assert results["best_epoch"] == best["epoch"] and results["best_metric"] == best["best_acc1"]
    if results["best_epoch"] == 1:  # epoch 2 did not beat the first run's best: the first run's file stands
        assert results["best_metric"] == first["best_metric"]
    assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] == 2


def test_continues_from_model_best_pth(digits, tmp_path):
    """`--resume OUT/model_best.pth` goes on from the best epoch: the log after it is replaced, and the file's best
    is the one to beat."""
    out = tmp_path / "run"
    run_here(RESNET, ["--cpu", *resnet_args(digits, out, 1)])
    proc = run_here(RESNET, ["--cpu", *resnet_args(digits, out, 3, "--resume", out / "model_best.pth")])
    assert "training starts at epoch 2, step 3 of 9" in proc.stdout
    assert [e["step"] for e in logged(out, "train")] == list(range(1, 3 * STEPS_PER_EPOCH + 1))
    assert_schedule_goes_on(out, STEPS_PER_EPOCH + 1, 3 * STEPS_PER_EPOCH)
    assert [e["epoch"] for e in logged(out, "eval")] == [1, 2, 3]
    results = read_json(out / "all_results.json")
    assert results["best_epoch"] == torch.load(out / "model_best.pth", weights_only=True)["epoch"]


def test_start_epoch_starts_inside_the_schedule(digits, tmp_path):
    """main.py's --start-epoch: the epochs before it count as done, the schedule starts after them, said in one
    line."""
    out = tmp_path / "run"
    proc = run_here(RESNET, ["--cpu", *resnet_args(digits, out, 2, "--start-epoch", "1")])
    assert ("--start-epoch 1: epoch 1 counts as done: training starts at epoch 2, step 3 of 6 of the --lr_scheduler "
            "cosine schedule") in proc.stdout
    assert "from the starting weights" in proc.stdout
    assert_schedule_goes_on(out, 4, 2 * STEPS_PER_EPOCH)
    assert [e["step"] for e in logged(out, "train")][0] == 4
    assert read_json(out / "all_results.json")["train_steps"] == 2 * STEPS_PER_EPOCH
