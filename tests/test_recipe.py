"""The torchvision/timm recipe features of train_resnet.py, unit by unit (utils/image_augment.py,
utils/image_optim.py, the dashed flags): each feature's effect, against torchvision's own definitions where it has one."""
import math
import types

import pytest
import torch
import torchvision
from conftest import assert_same_weights
from PIL import Image
from torch.optim.swa_utils import AveragedModel

import train_resnet
from train_resnet import train_transform, val_transform
from utils.image_augment import RepeatedAugmentationSampler
from utils.image_optim import adjusted_decay, ExponentialMovingAverage, update_ema
from utils.image_data import decode_rgb, RGBImageFolder
from utils.image_augment import BatchMixer, build_mixer, dominant_labels, soft_cross_entropy
from utils.image_optim import build_optimizer, lr_lambda, parameter_groups

# torchvision's classification README, ResNet-50 V2 (80.858% top-1), as a user pastes it after `accelerate launch`
RECIPE = ("--model resnet50 --batch-size 128 --lr 0.5 --lr-scheduler cosineannealinglr --lr-warmup-epochs 5 "
          "--lr-warmup-method linear --auto-augment ta_wide --epochs 600 --random-erase 0.1 --weight-decay 0.00002 "
          "--norm-weight-decay 0.0 --label-smoothing 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 --train-crop-size 176 "
          "--model-ema --val-resize-size 232 --ra-sampler --ra-reps 4").split()


def parse(*argv):
    return train_resnet.parse_args(["--dummy", *argv])


def asymmetric_folder(root, size=16):
    """One class, 3 square images whose left half is bright: a flip is visible in every output."""
    (root / "a").mkdir(parents=True)
    pixels = torch.zeros(size, size, 3, dtype=torch.uint8)
    pixels[:, : size // 2] = 255
    for i in range(3):
        Image.fromarray(pixels.numpy()).save(root / "a" / f"{i}.png")
    return root


def test_hflip_zero_never_flips_and_one_always_does(tmp_path):
    root = asymmetric_folder(tmp_path / "train")
    full_crop = ["--crop_scale", "1", "--crop_ratio", "1", "1", "--image_size", "16"]  # the crop is the whole image
    reference = val_transform(parse(*full_crop, "--val_resize", "16"))(decode_rgb(root / "a" / "0.png"))
    for hflip, expected in (("0", reference), ("1", reference.flip(-1))):
        dataset = RGBImageFolder(root, train_transform(parse(*full_crop, "--hflip", hflip)), 16)
        for epoch in range(20):  # 60 draws: at p=0.5, some would flip
            dataset.set_epoch(epoch)
            assert all(torch.equal(dataset[i][0], expected) for i in range(3))
    assert not torch.equal(reference, reference.flip(-1))


def test_auto_augment_and_erasing_are_seeded_per_image_and_copy(tmp_path):
    root = asymmetric_folder(tmp_path / "train")
    args = parse("--image_size", "16", "--auto_augment", "ta_wide", "--random_erase", "1", "--ra_sampler")
    dataset = RGBImageFolder(root, train_transform(args), 16, seed=5)
    first = dataset[1][0]
    torch.manual_seed(0)  # the global RNG plays no part
    assert torch.equal(dataset[1][0], first) and torch.equal(dataset[(1, 0)][0], first)  # copy 0 = the plain index
    assert not torch.equal(dataset[(1, 1)][0], first)  # another copy of the same image: another augmentation
    for policy in ("ra", "augmix", "imagenet"):
        out = RGBImageFolder(root, train_transform(parse("--image_size", "16", "--auto_augment", policy,
                                                         "--interpolation", "bicubic")), 16)[0][0]
        assert out.shape == (3, 16, 16) and out.dtype == torch.float32


def test_repeated_augmentation_sampler_splits_like_torchvision():
    sampler = RepeatedAugmentationSampler(list(range(20)), batch_size=8, reps=4, seed=1)
    items = list(sampler)
    assert len(items) == len(sampler) == 16  # an epoch is len(dataset) samples, whole batches only
    for batch in (items[:8], items[8:]):
        images = [i for i, _ in batch[:2]]
        assert batch == [(i, r) for r in range(4) for i in images]  # copy-major: 2 images x 4 copies
    assert len({i for i, _ in items}) == 4  # 20 / 4 distinct images... of which whole batches: 4
    assert items == list(RepeatedAugmentationSampler(list(range(20)), 8, 4, seed=1))  # seed + epoch only
    sampler.set_epoch(1)
    assert list(sampler) != items
    with pytest.raises(Exception, match="--ra_reps 3: must divide the global batch"):
        RepeatedAugmentationSampler(list(range(20)), 8, 3, seed=1)


def test_mixed_targets_sum_to_one_and_do_not_depend_on_the_process_split():
    torch.manual_seed(0)
    inputs, targets = torch.randn(8, 3, 8, 8), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    mixer = BatchMixer(0.2, 1.0, num_classes=10, seed=3)
    one = types.SimpleNamespace(process_index=0)
    mixed, soft = mixer(one, inputs, targets, epoch=2, batch=5)
    assert soft.shape == (8, 10) and torch.allclose(soft.sum(dim=1), torch.ones(8))
    assert (soft > 0).sum(dim=1).max() == 2 and not torch.equal(mixed, inputs)  # pairs of two labels
    halves = [mixer(types.SimpleNamespace(process_index=k), inputs[4 * k:4 * k + 4], targets[4 * k:4 * k + 4],
                    epoch=2, batch=5) for k in (0, 1)]
    assert torch.equal(torch.cat([h[0] for h in halves]), mixed)  # 2 processes mix exactly what 1 does
    assert torch.equal(torch.cat([h[1] for h in halves]), soft)
    assert not torch.equal(mixer(one, inputs, targets, epoch=2, batch=6)[0], mixed)  # the next batch: new draws
    assert torch.equal(dominant_labels(soft, targets), soft.argmax(dim=1))


def test_mixing_flags():
    assert build_mixer(parse(), 10, 32) is None  # off by default
    assert build_mixer(parse("--cutmix-alpha", "1.0", "--mixup_mode", "batch"), 10, 7).mode == "batch"
    with pytest.raises(Exception, match=r"per-process batch \(7\) must be even"):
        build_mixer(parse("--mixup-alpha", "0.2"), 10, 7)


def test_unreadable_images_are_never_mixed(monkeypatch):
    """... and the mixer never reads the targets on the host (`bool(tensor)` would be a device sync on a GPU)."""
    inputs, targets = torch.randn(4, 3, 8, 8), torch.tensor([1, -7, 2, 3])  # image 1 unreadable
    mixer = BatchMixer(1.0, 0.0, 5, seed=0)
    with monkeypatch.context() as no_host_reads:
        no_host_reads.setattr(torch.Tensor, "__bool__", lambda t: pytest.fail("a tensor read on the host"))
        mixed, soft = mixer(types.SimpleNamespace(process_index=0), inputs, targets, 0, 0)
    assert torch.equal(mixed[:2], inputs[:2]) and soft[0].tolist() == [0, 1, 0, 0, 0] and soft[1].sum() == 0
    assert torch.allclose(soft[2:].sum(dim=1), torch.ones(2)) and not torch.equal(mixed[2:], inputs[2:])
    assert dominant_labels(soft, targets)[1] == -7
    logits = torch.randn(4, 5)
    expected = torch.nn.functional.cross_entropy(logits[[0, 2, 3]], soft[[0, 2, 3]], label_smoothing=0.1)
    assert soft_cross_entropy(logits, soft, 0.1).item() == pytest.approx(expected.item())


def test_ema_equals_the_hand_computed_average_and_follows_torchvision():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    ema = ExponentialMovingAverage(model, decay=0.9)
    expected = {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    args = types.SimpleNamespace(model_ema_steps=2, warmup_epochs=0)
    for step in range(7):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model(torch.randn(4, 3))  # moves the BatchNorm running statistics (buffers are averaged too)
        update_ema(ema, model, step, epoch=0, args=args)
        if step == 0:  # the first update copies
            expected = {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}
        elif step % 2 == 0:
            expected = {k: 0.9 * expected[k] + 0.1 * v for k, v in model.state_dict().items() if k in expected}
    for key, value in expected.items():
        torch.testing.assert_close(ema.module.state_dict()[key], value)
    warmup = types.SimpleNamespace(model_ema_steps=2, warmup_epochs=1)
    update_ema(ema, model, 0, epoch=0, args=warmup)  # averages, then resets: the next update copies
    assert not torch.equal(ema.module[0].weight, model[0].weight)
    update_ema(ema, model, 2, epoch=0, args=warmup)
    assert torch.equal(ema.module[0].weight, model[0].weight)  # during warmup epochs the EMA follows the weights
    # torchvision's adjustment for the recipe: 8 GPUs x 128 images, every 32 steps, 600 epochs
    alpha = min(1.0, (1 - 0.99998) * 8 * 128 * 32 / 600)
    assert adjusted_decay(0.99998, 1024, 32, 600) == pytest.approx(1 - alpha) and alpha == pytest.approx(1.0923e-3,
                                                                                                        rel=1e-3)


def test_ema_updates_as_averaged_model_does_without_reading_its_count_on_the_host(monkeypatch):
    """ExponentialMovingAverage.update_parameters: bitwise AveragedModel's (copy first, then average; buffers too, the
    integer batch count included), and no `bool(tensor)` on the count, which is a device sync on a GPU."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    ours, reference = ExponentialMovingAverage(model, decay=0.9), ExponentialMovingAverage(model, decay=0.9)
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model(torch.randn(4, 3))
        AveragedModel.update_parameters(reference, model)
        with monkeypatch.context() as no_host_reads:
            no_host_reads.setattr(torch.Tensor, "__bool__", lambda t: pytest.fail("a tensor read on the host"))
            ours.update_parameters(model)
        assert_same_weights(ours.state_dict(), reference.state_dict())
    assert ours.n_averaged.item() == 4 and ours.module[1].num_batches_tracked.item() > 0


def test_weight_decay_groups_like_torchvisions_set_weight_decay():
    model = torchvision.models.resnet18(num_classes=10)
    groups = parameter_groups(model, 1e-4, norm_weight_decay=0.0, bias_weight_decay=0.5)
    by_decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in groups}
    norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()}
    assert by_decay[0.5] == {id(model.fc.bias)} | {id(m.bias) for m in model.modules()
                                                   if isinstance(m, torch.nn.BatchNorm2d)}
    assert by_decay[0.0] == {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert by_decay[1e-4].isdisjoint(norms) and sum(map(len, by_decay.values())) == len(list(model.parameters()))
    assert len(parameter_groups(model, 1e-4)) == 1  # neither flag: one group, as plain SGD
    args = parse("--opt", "rmsprop", "--wd", "1e-5")
    optimizer = build_optimizer(model, args)
    assert isinstance(optimizer, torch.optim.RMSprop) and optimizer.defaults["eps"] == 0.0316
    assert optimizer.param_groups[0]["weight_decay"] == 1e-5
    assert build_optimizer(model, parse("--opt", "sgd_nesterov")).defaults["nesterov"]


def test_learning_rate_schedule():
    args = parse("--lr", "0.5", "--lr-scheduler", "cosineannealinglr", "--lr-warmup-epochs", "2", "--lr_min", "0.05")
    factor = lr_lambda(args, steps_per_epoch=10, total_steps=100)
    assert factor(0) == pytest.approx(0.01 + 0.99 / 20)  # torchvision's --lr-warmup-decay 0.01, per step
    assert factor(19) == pytest.approx(1.0) and factor(20) == pytest.approx(1.0)
    assert 0.5 * factor(100) == pytest.approx(0.05)  # cosine ends at --lr_min
    assert 0.5 * factor(60) == pytest.approx(0.05 + 0.45 * 0.5 * (1 + math.cos(math.pi * 40 / 80)))
    constant = lr_lambda(parse("--lr-warmup-epochs", "1", "--lr-warmup-method", "constant", "--lr-warmup-decay",
                               "0.1"), 10, 100)
    assert constant(0) == constant(9) == 0.1 and constant(10) == 1.0
    step = lr_lambda(parse("--lr-scheduler", "steplr", "--lr-step-size", "2", "--lr-gamma", "0.5"), 10, 100)
    assert step(19) == 1.0 and step(20) == 0.5 and step(45) == 0.25


def test_torchvision_recipe_command_parses_with_one_batch_rule(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = train_resnet.parse_args(RECIPE + ["--data-path", "/data/imagenet"])
    assert args.batch_size == 128  # -b is GLOBAL whatever else the command names
    assert "--model resnet50 = --arch resnet50" in args.command_notes
    assert (args.arch, args.lr, args.lr_scheduler, args.warmup_epochs, args.epochs) == (
        "resnet50", 0.5, "cosineannealinglr", 5, 600)
    assert (args.auto_augment, args.random_erase, args.weight_decay, args.norm_weight_decay) == (
        "ta_wide", 0.1, 2e-5, 0.0)
    assert (args.label_smoothing, args.mixup_alpha, args.cutmix_alpha, args.model_ema) == (0.1, 0.2, 1.0, True)
    assert (args.train_crop_size, args.val_crop_size, args.val_resize) == (176, 224, 232)
    assert (args.ra_sampler, args.ra_reps, str(args.data)) == (True, 4, "/data/imagenet")
    per_process = [word if word != "--batch-size" else "--per_device_batch_size" for word in RECIPE]
    args = train_resnet.parse_args(per_process + ["--data-path", "/data/imagenet"])
    assert args.batch_size == 1024  # torchvision's 128 per process on 8 processes
    assert "--per_device_batch_size 128 x 8 processes = -b 1024 (the GLOBAL batch)" in args.command_notes
    assert train_resnet.parse_args(["--dummy", "-b", "128"]).batch_size == 128
    assert train_resnet.parse_args(["--dummy", "--model", "resnet50", "--batch_size", "128"]).batch_size == 128
    with pytest.raises(SystemExit):
        train_resnet.parse_args(["--data-path", "x", "--per_device_batch_size", "8", "--batch_size", "64"])
    assert capsys.readouterr().err == ("error: --per_device_batch_size and --batch_size set the same thing "
                                       "(--batch_size); pass one\n")
    assert train_resnet.parse_args(["--dummy", "--test-only", "--pretrained"]).evaluate
    for conflicting, message in ((["--dummy", "--test-only", "--pretrained", "--model-ema"],
                                  "for the EMA, --resume checkpoint_ema.pth"),
                                 (["x", "--data-path", "y"], "two data paths: x and --data-path y")):
        with pytest.raises(SystemExit):
            train_resnet.parse_args(conflicting)
        assert message in capsys.readouterr().err
    assert train_resnet.parse_args(["--dummy", "--amp"]).mixed_precision == "fp16"  # torchvision's and timm's --amp


def test_weights_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "empty_cache"))  # nothing cached, offline
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(Exception, match=r"^--weights ResNet50_Weights.IMAGENET1K_V2: cannot get torchvision's "
                                        r"resnet50 weights .*needs the network"):
        train_resnet.build_model(parse("-a", "resnet50", "--weights", "ResNet50_Weights.IMAGENET1K_V2"), 10)
    with pytest.raises(Exception, match=r"--weights ResNet50_Weights.IMAGENET1K_V9: not weights of torchvision's "
                                        "resnet50"):
        train_resnet.build_model(parse("-a", "resnet50", "--weights", "ResNet50_Weights.IMAGENET1K_V9"), 10)


def offline(url, *args, **kwargs):
    import urllib.error
    raise urllib.error.URLError("[Errno -2] Name or service not known")


def test_timm_models_by_name(capsys):
    pytest.importorskip("timm")
    model = train_resnet.build_model(parse("-a", "timm:resnet18"), 7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(SystemExit):
        parse("-a", "timm:resnet_18x")
    assert "not a timm model" in capsys.readouterr().err
