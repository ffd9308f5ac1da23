"""The training loops' bookkeeping, without training: the divergence check both scripts run, the ResNet script's
image counts and unreadable images, the images of a short last window, and where a
resumed epoch starts."""
import re

import pytest
import torch

from utils.runtime import UserError
from utils.image_data import ImageCounts
from utils.loop import epoch_batches
from utils.checkpoint import latest_checkpoint
from utils.loop import HealthCheck, LossMeter
from utils.loop import LossScale


class OneProcess:
    """The part of an Accelerator the bookkeeping uses, on one process: every collective returns its input."""
    device = torch.device("cpu")
    num_processes, process_index = 1, 0

    def __init__(self):
        self.printed = []

    def reduce(self, tensor, reduction="sum"):
        return tensor.clone()

    def gather(self, tensor):
        return tensor.clone()

    def print(self, line):
        self.printed.append(line)

    def skip_first_batches(self, loader, skip):
        return loader[skip:]


def test_health_check_stops_on_a_nan_loss_and_names_the_last_good_checkpoint(tmp_path):
    accelerator, meter, model = OneProcess(), LossMeter("cpu"), torch.nn.Linear(2, 2)
    (tmp_path / "step_5").mkdir()
    (tmp_path / "step_5" / "training_state.json").write_text("{}")
    (tmp_path / ".tmp-step_6").mkdir()  # an interrupted save is never the last good one
    calls = []
    health = HealthCheck(accelerator, meter, model, lambda: latest_checkpoint(tmp_path), "--lr", also=[lambda: calls.append(1)])
    meter.update(torch.tensor(0.5), 4)
    health.check(6, parameters=True)
    assert len(calls) == 1  # the further checks run after the loss's
    meter.mean(accelerator)  # a log line resets the window, not the count of NaN/inf losses
    meter.update(torch.tensor(float("nan")), 4)
    meter.update(torch.tensor(0.5), 4)
    with pytest.raises(UserError) as error:
        health.check(7)
    assert str(error.value) == (f"loss became NaN/inf by step 7; stopped before saving anything from it. Last good "
                                f"checkpoint: {tmp_path / 'step_5'}. Try a lower --lr or bf16 instead of fp16.")
    assert len(calls) == 1


def test_health_check_looks_at_the_weights_before_a_save(tmp_path):
    accelerator, meter, model = OneProcess(), LossMeter("cpu"), torch.nn.Linear(2, 2)
    health = HealthCheck(accelerator, meter, model, lambda: latest_checkpoint(tmp_path), "--learning_rate")
    meter.update(torch.tensor(0.5), 4)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")  # the step after the last logged loss
    health.check(3)  # a log line: the loss alone
    with pytest.raises(UserError, match=r"by step 3; .*Last good checkpoint: None\. Try a lower --learning_rate"):
        health.check(3, parameters=True)


class Images:
    """A dataset's one method the counts use: which file a negative target stands for."""

    def __init__(self, paths):
        self.paths = paths

    def bad_image_path(self, target):
        return self.paths[-1 - target]


def test_image_counts_top1_top5_and_skipped_images(tmp_path):
    accelerator = OneProcess()
    counts = ImageCounts(accelerator, Images([]), skip_bad_images=True)
    logits = torch.tensor([[9.0, 8, 7, 6, 5, 4, 0],  # target 0: top-1
                           [9.0, 8, 7, 6, 5, 4, 0],  # target 4: top-5, not top-1
                           [9.0, 8, 7, 6, 5, 4, 0],  # target 6: neither
                           [0.0, 0, 0, 0, 0, 0, 0]])  # unreadable
    readable = counts.add(logits, torch.tensor([0, 4, 6, -1]))
    assert readable.item() == 3
    counts.add(logits[:1], torch.tensor([1]))  # top-5 only
    assert counts.read() == {"acc1": 25.0, "acc5": 75.0, "skipped_images": 1}
    assert counts.read() == {"acc1": 0.0, "acc5": 0.0, "skipped_images": 0}  # a new window, nothing divided by 0
    assert counts.skipped_total == 1
    counts.add(torch.zeros(1, 3), torch.tensor([-2]))  # fewer than 5 classes: top-3
    assert counts.read()["skipped_images"] == 1 and counts.skipped_total == 2


def test_an_unreadable_image_stops_the_run_or_is_reported_once(tmp_path):
    bad = tmp_path / "train" / "3" / "broken.png"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    strict = ImageCounts(OneProcess(), Images([tmp_path / "fine.png", bad]), skip_bad_images=False)
    strict.add(torch.zeros(2, 10), torch.tensor([3, 7]))
    strict.check_unreadable()  # nothing unreadable yet
    strict.add(torch.zeros(2, 10), torch.tensor([-2, 7]))  # -1 - index: file 1
    message = rf"^{re.escape(str(bad))}: unreadable image \(.*\); replace or remove it, or pass --skip_bad_images$"
    with pytest.raises(UserError, match=message):
        strict.check_unreadable()

    accelerator = OneProcess()
    lenient = ImageCounts(accelerator, Images([tmp_path / "fine.png", bad]), skip_bad_images=True)
    lenient.add(torch.zeros(2, 10), torch.tensor([-2, 7]))
    lenient.check_unreadable()
    lenient.check_unreadable()
    assert accelerator.printed == [f"warning: skipping unreadable image {bad}"]


def test_images_in_each_optimizer_step():
    """21 full batches of 64 per epoch, 4 per step: the epoch's 6th step has 1 batch (and a 4x loss scale)."""
    weights = LossScale(OneProcess(), 21 * 64 + 10, 64, 4, drop_last=True)
    assert [weights.window_batches(i) for i in (0, 3, 19, 20)] == [4, 4, 4, 1]
    assert weights.window_scale(20) == 4.0 and weights.window_scale(3) == 1.0


class Loader(list):
    def set_epoch(self, epoch):
        self.epoch = epoch


def test_epoch_batches_skip_only_in_the_resumed_epoch():
    loader, state = Loader(range(6)), {"epoch": 2, "batches_in_epoch": 4}
    assert epoch_batches(OneProcess(), loader, 2, state) == ([4, 5], 4) and loader.epoch == 2
    assert epoch_batches(OneProcess(), loader, 3, state) == (loader, 0) and loader.epoch == 3
