"""train_resnet.py's train_sampler as a user adapts it: a class-balanced sampler that keeps the contract of its
docstring trains, resumes mid-epoch bitwise and logs the samples it drew (1 process, in this process)."""
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import torchvision
from conftest import assert_same_weights, read_json, run_here

import train_resnet
from utils import outputs
from utils.demo_data import write_digits_imagefolder

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")

# what a user writes in place of train_sampler's body: each image weighed 1 / (its class's images), len(dataset)
# draws with replacement, from a generator seeded by --seed and the epoch alone; an image drawn again is
# (index, repeat), so that each copy is augmented differently
CLASS_BALANCED = '''class ClassBalancedSampler(torch.utils.data.Sampler):
    def __init__(self, targets, seed):
        targets = torch.as_tensor(targets)
        self.weights = 1.0 / torch.bincount(targets).double()[targets]
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.weights)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        drawn = torch.multinomial(self.weights, len(self.weights), replacement=True, generator=generator)
        repeats = Counter()
        for index in drawn.tolist():
            yield index, repeats[index]
            repeats[index] += 1


def train_sampler(args, train_set):
    return ClassBalancedSampler(train_set.targets, args.seed)
'''
BATCH = 16
EPOCHS = 2
SEED = 42  # the script's default --seed


def script_with_a_sampler(folder):
    """A copy of train_resnet.py whose train_sampler is CLASS_BALANCED's. Returns its path."""
    text = Path(train_resnet.__file__).read_text(encoding="utf-8")
    text, replaced = re.subn(r"def train_sampler\(args, train_set\):\n.*?\n\n\n", CLASS_BALANCED + "\n\n", text,
                             flags=re.S)
    assert replaced == 1
    script = folder / "balanced_resnet.py"
    script.write_text(text, encoding="utf-8")
    return script


@pytest.fixture
def imbalanced_digits(tmp_path):
    """220 digits, of which classes 0-4 keep a quarter of their training images (2-5 each, the others 14-22): 108
    training images, 6 steps of 16 per epoch."""
    data = write_digits_imagefolder(tmp_path / "digits", size=16, limit=220)
    for digit in range(5):
        images = sorted((data / "train" / str(digit)).iterdir())
        for image in images[len(images) // 4:]:
            image.unlink()
    return data


def expected_draws(data, epochs):
    """{step: [global batch]} the sampler draws, recomputed here: per epoch len(train) draws, whole batches only."""
    targets = torch.tensor(torchvision.datasets.ImageFolder(data / "train").targets)
    weights = 1.0 / torch.bincount(targets).double()[targets]
    steps = {}
    for epoch in range(epochs):
        drawn = torch.multinomial(weights, len(weights), replacement=True,
                                  generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        repeats, items = Counter(), []
        for index in drawn:
            items.append([index, repeats[index]])
            repeats[index] += 1
        for start in range(0, len(items) - BATCH + 1, BATCH):
            steps[len(steps) + 1] = [items[start:start + BATCH]]
    return steps, targets


def test_a_class_balanced_sampler_trains_resumes_exactly_and_logs_its_samples(imbalanced_digits, tmp_path,
                                                                               monkeypatch):
    script = str(script_with_a_sampler(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))  # run_here imports the script by name
    # training_curves.png is tested with the script itself; here its plotting would be a third of the time
    monkeypatch.setattr(outputs, "plot_training_curves", lambda *args, **kwargs: None)

    def args(out, *extra):
        return ["--cpu", imbalanced_digits, "--image_size", "16", "--val_resize", "16", "-b", str(BATCH), "--lr",
                "0.02", "--momentum", "0", "-j", "0", "--epochs", str(EPOCHS), "--checkpointing_steps", "4", "-p",
                "4", "--save_total_limit", "0", "--log_sample_indices", "--output_dir", out, *extra]

    reference = tmp_path / "reference"
    run_here(script, args(reference))
    expected, targets = expected_draws(imbalanced_digits, EPOCHS)
    steps_per_epoch = len(targets) // BATCH
    assert read_json(reference / "all_results.json")["train_steps"] == EPOCHS * steps_per_epoch == len(expected)
    assert outputs.read_sample_indices(reference) == expected  # the class-balanced draws, step by step
    drawn = Counter(int(targets[index]) for batches in expected.values() for batch in batches for index, _ in batch)
    in_data = Counter(targets.tolist())
    assert min(in_data.values()) / len(targets) < 0.05  # the minority classes: under 5% of the images
    assert all(0.05 < count / drawn.total() < 0.15 for count in drawn.values())  # each class about a tenth of draws
    assert any(repeat > 0 for batches in expected.values() for batch in batches for _, repeat in batch)

    # resumed from step 8, inside epoch 2: the order of that epoch comes from (seed, epoch) again
    resumed = tmp_path / "resumed"
    after_step_8 = ("checkpoint.pth", "model_best.pth", "all_results.json", f"step_{EPOCHS * steps_per_epoch}")
    shutil.copytree(reference, resumed, ignore=shutil.ignore_patterns(*after_step_8))
    assert 8 % steps_per_epoch and 8 // steps_per_epoch == 1
    run_here(script, args(resumed, "--resume", resumed / "checkpoints" / "step_8"))
    assert_same_weights(torch.load(reference / "checkpoint.pth", weights_only=True)["state_dict"],
                        torch.load(resumed / "checkpoint.pth", weights_only=True)["state_dict"])
    assert outputs.read_sample_indices(resumed) == expected
