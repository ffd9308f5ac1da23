"""--decode_on_device (utils/image_device_decode.py) with device = CPU: the CPU loader's images bitwise for the same seeds,
unreadable files marked as the CPU loader marks them, refusals in one line, and through the real launcher the
CPU loader's weights bitwise on 1 process and the same training on 2."""
import argparse
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from conftest import assert_same_weights, launch, read_json, run_here, run_on
from PIL import Image
from torchvision.transforms import v2

import train_resnet
from utils import image_device_decode as device_decode
from train_resnet import train_transform, val_transform
from utils.image_augment import add_augment_args, resolve_augment_args
from utils.demo_data import write_photo_imagefolder
from utils.image_device_decode import EncodedImageFolder
from utils.runtime import UserError
from utils.image_data import EXIF_ORIENTATION, RGBImageFolder

SCRIPT = "train_resnet.py"
NOT_FOR_THE_DEVICE = {"png.png", "cmyk.jpg", "rotated.jpg"}  # decoded in the worker, sent as pixels
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """44 train / 8 val JPEGs cut from real photos (64 px on the longer side, so the tests run in seconds), and in
    train/china/ one file of each kind the loader treats apart: a PNG, a CMYK JPEG and an EXIF-rotated JPEG (decoded
    in the worker), a grayscale and a progressive JPEG (decoded on the device)."""
    root = write_photo_imagefolder(tmp_path_factory.mktemp("photos"), n_train=44, n_val=8, longer_side=64)
    folder = root / "train" / "china"
    with Image.open(sorted(folder.iterdir())[0]) as first:
        source = first.convert("RGB")
    source.save(folder / "png.png")
    source.convert("CMYK").save(folder / "cmyk.jpg")
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6  # stored rotated: "rotate 90 degrees clockwise to view"
    source.save(folder / "rotated.jpg", exif=exif)
    source.convert("L").save(folder / "gray.jpg")
    source.save(folder / "progressive.jpg", progressive=True)
    return root


def augment_args(*argv):
    parser = argparse.ArgumentParser()
    add_augment_args(parser)
    args = parser.parse_args([str(a) for a in argv])
    resolve_augment_args(args)
    return args


def both_loaders(root, transform, size, epoch, seed=3):
    """All of root's images at `epoch` through the CPU loader's dataset and through the device path (device = CPU):
    ((images, targets) from each, and the EncodedBatch)."""
    cpu, encoded = RGBImageFolder(root, transform, size, seed), EncodedImageFolder(root, transform, size, seed)
    cpu.set_epoch(epoch)
    encoded.set_epoch(epoch)
    samples = [cpu[i] for i in range(len(cpu))]
    expected = torch.stack([image for image, _ in samples]), torch.tensor([target for _, target in samples])
    batch = device_decode.collate_for(encoded)([encoded[i] for i in range(len(encoded))])
    return expected, batch.decode("cpu"), batch


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_same_images_as_the_cpu_loader_bitwise(photos, interpolation):
    """Every replayed step on (crop box, aspect ratio, flip, erasing, resize, centre crop), two epochs, train and val:
    the measured difference on the CPU is 0, so it is asserted as equality."""
    args = augment_args("--image_size", "32", "--val_resize", "36", "--random_erase", "0.5", "--crop_ratio", "0.5",
                        "2", "--interpolation", interpolation)
    train = {}
    for epoch in (0, 1):
        (images, targets), (got, got_targets), batch = both_loaders(photos / "train", train_transform(args), 32, epoch)
        assert got.shape == images.shape == (49, 3, 32, 32) and got.dtype == images.dtype == torch.float32
        assert torch.equal(got, images) and torch.equal(got_targets, targets)
        assert {Path(item.path).name for item in batch.images if item.pixels is not None} == NOT_FOR_THE_DEVICE
        assert sum(item.jpeg is not None for item in batch.images) == 49 - len(NOT_FOR_THE_DEVICE)
        train[epoch] = got
    assert not torch.equal(train[0], train[1])  # new crops each epoch: the comparison is not of one fixed image
    (images, targets), (got, got_targets), _ = both_loaders(photos / "val", val_transform(args), 32, epoch=0)
    assert torch.equal(got, images) and torch.equal(got_targets, targets)


def test_exif_rotated_jpeg_travels_as_its_stored_pixels(photos):
    """decode_rgb's orientation rule on this path too: the stored pixels, as PIL gives them (not TorchCodec's turn)."""
    path = photos / "train" / "china" / "rotated.jpg"
    jpeg, pixels, shape = device_decode.read_encoded(path)
    with Image.open(path) as image:
        stored = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
    assert jpeg is None and shape == tuple(stored.shape) and torch.equal(torch.from_numpy(pixels), stored)


def test_a_file_the_device_decoder_refuses_is_decoded_as_the_cpu_loader_does(photos, monkeypatch):
    def refuses(jpegs, device):
        raise RuntimeError("nvJPEG: unsupported")
    monkeypatch.setattr(device_decode, "jpeg_decoder", lambda: refuses)
    args = augment_args("--image_size", "32")
    (images, targets), (got, got_targets), _ = both_loaders(photos / "train", train_transform(args), 32, epoch=0)
    assert torch.equal(got, images) and torch.equal(got_targets, targets) and (targets >= 0).all()


def test_unreadable_files_are_marked_as_the_cpu_loader_marks_them(photos, tmp_path):
    root = shutil.copytree(photos / "train", tmp_path / "train")
    garbage, truncated = sorted((root / "flower").glob("0*.jpg"))[:2]
    garbage.write_bytes(b"not an image at all")  # no header: the worker marks it
    data = truncated.read_bytes()
    truncated.write_bytes(data[:data.index(b"\xff\xda") + 20])  # the header reads, the image data stops
    args = augment_args("--image_size", "32")
    (images, targets), (got, got_targets), _ = both_loaders(root, train_transform(args), 32, epoch=0)
    assert torch.equal(got_targets, targets) and torch.equal(got, images)
    assert (targets < 0).sum() >= 1 and (got[targets < 0] == 0).all()  # placeholders: zeros, as RGBImageFolder's


def test_refused_before_anything_starts(photos, tmp_path):
    for argv, fragment in ((["--dummy", "64"], "--dummy has none"),
                           ([photos, "--auto_augment", "ta_wide"], "the transform TrivialAugmentWide draws inside")):
        args = train_resnet.parse_args(["--cpu", "--decode_on_device", *argv])
        with pytest.raises(UserError, match=fragment):
            train_resnet.build_dataloaders(None, args)
    with pytest.raises(UserError, match="TrivialAugmentWide"):
        EncodedImageFolder(photos / "train", train_transform(augment_args("--auto_augment", "ta_wide")), 32)
    proc = run_here(SCRIPT, ["--cpu", photos, "--decode-on-device", "--auto-augment", "ra",
                             "--output_dir", tmp_path / "out"], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-2000:]
    assert "--decode_on_device: the transform RandAugment" in errors[0] and not (tmp_path / "out").exists()


def extended_transform(args):
    """train_transform as a user extends it in the script: transforms.v2 steps that no list names, random (colour,
    vertical flip, rotation, grayscale, blur, with a `p` or without) and not (a resize after the crop)."""
    steps = train_transform(args).transforms
    return v2.Compose([steps[0], v2.RandomVerticalFlip(0.5), v2.ColorJitter(0.4, 0.4, 0.4, 0.1),
                       v2.RandomRotation(15), v2.RandomGrayscale(0.3), v2.Resize(30, antialias=True),
                       v2.GaussianBlur(3, sigma=(0.1, 2.0)), *steps[1:]])


def test_a_new_transform_is_replayed_bitwise(photos):
    """Steps the device path was never told about are replayed from the pipeline itself: the CPU loader's images,
    bitwise, over two epochs."""
    args = augment_args("--image_size", "32", "--random_erase", "0.5")
    for epoch in (0, 1):
        (images, targets), (got, got_targets), _ = both_loaders(photos / "train", extended_transform(args), 30, epoch)
        assert got.shape == images.shape == (49, 3, 30, 30)
        assert torch.equal(got, images) and torch.equal(got_targets, targets)


class ContentDependent(v2.Transform):
    """A user's step that draws from the image's pixels inside a forward of its own: not replayable."""

    def forward(self, image):
        return image.flip(-1) if image.float().mean() > torch.rand(1) * 255 else image


def test_a_transform_that_cannot_be_replayed_is_refused_in_one_line(photos, tmp_path, monkeypatch):
    """The script's pipeline with a step the device cannot replay (a RandomApply, and a user's own forward): one line
    naming it, exit status 2, before anything is written; without --decode_on_device the same pipeline is used."""
    for step, name, way in (
            (v2.RandomApply([v2.ColorJitter(0.4)], p=0.5), "RandomApply",
             "use utils.image_device_decode.ReplayableRandomApply(transforms, p) instead"),
            (ContentDependent(), "ContentDependent",
             "write ContentDependent as torchvision's transforms.v2 steps are written, a v2.Transform subclass that "
             "draws every random choice in make_params(flat_inputs) and applies them in transform(inpt, params)")):
        monkeypatch.setattr(train_resnet, "train_transform",
                            lambda args, step=step: v2.Compose([*train_transform(args).transforms, step]))
        common = [photos, "--cpu", "--image_size", "16", "--val_resize", "16", "-b", "8", "--epochs", "1", "-j", "0"]
        out = tmp_path / name
        proc = run_here(SCRIPT, [*common, "--decode_on_device", "--output_dir", out], check=False)
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert f"--decode_on_device: the transform {name} draws inside its own forward" in errors[0], errors
        assert way in errors[0] and errors[0].endswith("; or drop --decode_on_device"), errors
        assert not out.exists()
        args = train_resnet.parse_args([*common])
        assert type(train_resnet.build_dataloaders(types.SimpleNamespace(print=print), args).train_set.transform.transforms[-1]) is type(step)


def test_replayable_random_apply_is_random_apply_replayed_bitwise(photos):
    """The way out the refusal names for v2.RandomApply: ReplayableRandomApply gives v2.RandomApply's images on the
    CPU loader (the same draws in the same order), and the device path replays it bitwise, over two epochs."""
    args = augment_args("--image_size", "32")
    steps = train_transform(args).transforms

    def pipeline(random_apply):
        inner = [v2.ColorJitter(0.4, 0.4, 0.4, 0.1), v2.RandomRotation(15), v2.RandomGrayscale(0.5)]
        return v2.Compose([steps[0], random_apply(inner, p=0.5), *steps[1:]])

    applied = 0
    for epoch in (0, 1):
        (images, targets), (got, got_targets), batch = both_loaders(
            photos / "train", pipeline(device_decode.ReplayableRandomApply), 32, epoch)
        theirs = RGBImageFolder(photos / "train", pipeline(v2.RandomApply), 32, seed=3)
        theirs.set_epoch(epoch)
        assert torch.equal(torch.stack([theirs[i][0] for i in range(len(theirs))]), images)
        assert torch.equal(got, images) and torch.equal(got_targets, targets)
        applied += sum(item.params[1]["steps"] is not None for item in batch.images if item.params)
    assert 0 < applied < 2 * len(batch.images)  # both branches of p were taken
    with pytest.raises(ValueError, match="ReplayableRandomApply: the transform TrivialAugmentWide draws inside"):
        device_decode.ReplayableRandomApply([v2.TrivialAugmentWide()])


def parameters(out):
    """The trained parameters (BatchNorm's running statistics are per process: not compared)."""
    state = torch.load(out / "checkpoint.pth", weights_only=True)["state_dict"]
    return {name: state[name] for name, _ in torchvision.models.resnet18(num_classes=2).named_parameters()}


def test_trains_as_the_cpu_loader_on_1_and_2_processes(photos, tmp_path):
    """1 process: the CPU loader's weights bitwise. 2 processes x 8 images = 1 process x 8 images x 2 accumulation
    steps (the same BatchNorm batches; tests/test_launch_matrix.py), with loader workers sending EncodedBatches."""
    common = [photos, "--arch", "resnet18", "--image_size", "32", "--val_resize", "36", "--random_erase", "0.25",
              "--lr", "0.05", "--momentum", "0", "--epochs", "1", "-p", "1"]
    one = [*common, "-b", "8", "--gradient_accumulation_steps", "2"]
    outs = {name: tmp_path / name for name in ("cpu_loader", "device_1", "device_2")}
    run_on(1, SCRIPT, [*one, "-j", "0", "--output_dir", outs["cpu_loader"]])
    run_on(1, SCRIPT, [*one, "-j", "1", "--decode_on_device", "--output_dir", outs["device_1"]])
    launch(SCRIPT, [*common, "-b", "16", "-j", "1", "--decode_on_device", "--output_dir", outs["device_2"]],
           num_processes=2)
    results = {name: read_json(out / "all_results.json") for name, out in outs.items()}
    assert [r["num_processes"] for r in results.values()] == [1, 1, 2]
    # 49 images: 6 batches of 8 (3 steps of 2) on 1 process, 3 of 16 on 2
    assert all(r["train_steps"] == 3 and r["eval_samples"] == 8 for r in results.values()), results
    assert_same_weights(parameters(outs["cpu_loader"]), parameters(outs["device_1"]))
    for key in ("eval_acc1", "eval_loss"):
        assert results["device_1"][key] == results["cpu_loader"][key]
    single, multi = parameters(outs["device_1"]), parameters(outs["device_2"])
    worst = max((single[k] - multi[k]).abs().max().item() for k in single)
    assert worst < 1e-4, f"max abs weight difference {worst:.2e}"  # gloo's reduction order only
    torch.manual_seed(42)  # the script's --seed: the initial weights
    untrained = dict(torchvision.models.resnet18(num_classes=2).named_parameters())
    assert max((single[k] - untrained[k].detach()).abs().max().item() for k in single) > 1e-3  # it did train
