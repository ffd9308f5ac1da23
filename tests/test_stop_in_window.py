"""A stop inside a long accumulation window (--gradient_accumulation_steps): the ranks agree after any batch, not
only at the next optimizer step, so a window longer than the launcher's grace does not hold the stop; the checkpoint
holds the window's start, with the random generators and the model's buffers (BatchNorm's statistics) of that
moment, and the resumed run ends bitwise where the uninterrupted one did. Runs in this process (run_here), so that
the SIGTERM lands after a chosen batch: the first batch of the third window (PreemptionGuard.start_window)."""
import os
import signal

import pytest
import torch
from conftest import assert_same_weights, run_here
from safetensors.torch import load_file

from utils.loop import PreemptionGuard

WINDOW, STEPS, SIGNAL_AT = 4, 4, 8  # batches 8-11 are the third window: the signal comes with batch 8


def bert_args(data, out, *extra):
    return ["--cpu", "--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch", "--do_train",
            "--max_seq_len", "32", "--train_batch_size", "16", "--gradient_accumulation_steps", str(WINDOW),
            "--max_train_steps", str(STEPS), "--checkpointing_steps", "100", "--output_dir", out, *extra]


def resnet_args(data, out, *extra):
    return ["--cpu", data, "--arch", "resnet18", "--image_size", "16", "--val_resize", "16", "-b", "16", "-j", "0",
            "--gradient_accumulation_steps", str(WINDOW), "--epochs", "1", "--output_dir", out, *extra]


CASES = {"bert": ("train_bert_cls.py", bert_args, ["--resume_from_checkpoint", "latest"],
                  lambda out: load_file(out / "best_model" / "model.safetensors")),
         "resnet": ("train_resnet.py", resnet_args, ["--resume", "latest"],
                    lambda out: torch.load(out / "checkpoint.pth", weights_only=True)["state_dict"])}


def sigterm_with_batch(monkeypatch):
    """SIGTERM to this process as the window starting at batch SIGNAL_AT begins."""
    start_window = PreemptionGuard.start_window

    def start_window_and_signal(self, batches_in_epoch, model):
        window = start_window(self, batches_in_epoch, model)
        if batches_in_epoch == SIGNAL_AT:
            os.kill(os.getpid(), signal.SIGTERM)
        return window
    monkeypatch.setattr(PreemptionGuard, "start_window", start_window_and_signal)


@pytest.mark.parametrize("name", ["bert", "resnet"])
def test_a_stop_inside_an_accumulation_window_saves_its_start_and_resumes_exactly(name, text_data, few_digits,
                                                                                  monkeypatch, tmp_path):
    script, args, resume, final_weights = CASES[name]
    data = text_data if name == "bert" else few_digits
    run_here(script, args(data, tmp_path / "uninterrupted"))
    with monkeypatch.context() as patched:
        sigterm_with_batch(patched)
        stopped = run_here(script, args(data, tmp_path / "stopped"))
    assert "stopped inside the accumulation window after step 2" in stopped.stdout, stopped.stdout[-3000:]
    assert f"(batch {SIGNAL_AT} of the epoch)" in stopped.stdout
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").glob("step_*")) == ["step_2"]
    resumed = run_here(script, [*args(data, tmp_path / "stopped"), *resume])
    assert "Resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    assert_same_weights(final_weights(tmp_path / "uninterrupted"), final_weights(tmp_path / "stopped"))
