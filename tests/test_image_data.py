"""utils/image_data.py: every image mode loads as RGB, unreadable files are marked (not raised), class checks."""
import os

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from utils.checkpoint import data_fingerprint
from utils.runtime import UserError
from train_resnet import parse_args
from train_resnet import train_transform, val_transform
from utils.image_data import (bad_image_error, build_datasets, build_dummy_datasets, decode_rgb, describe_bad_image,
                         image_classes, ImageFiles, list_images, RGBImageFolder)


def picture(width=40, height=30):
    """A smooth colour image with some texture, as uint8 (H, W, 3)."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    return (rgb + np.random.default_rng(0).normal(0, 10, rgb.shape)).clip(0, 255).astype(np.uint8)


def pil_rgb(path):
    """What main.py's pil_loader gives: PIL's own conversion to RGB, as a (3, H, W) tensor."""
    with Image.open(path) as image:
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


@pytest.mark.parametrize("name, mode", [
    ("gray.png", "L"), ("gray.jpg", "L"), ("palette.png", "P"), ("cmyk.jpg", "CMYK"), ("rgba.png", "RGBA"),
    ("gray_alpha.png", "LA"), ("rgb.jpg", "RGB"), ("rgb.bmp", "RGB"),
])
def test_every_mode_loads_as_rgb(tmp_path, name, mode):
    path = tmp_path / name
    Image.fromarray(picture()).convert(mode).save(path)
    image = decode_rgb(path)
    assert image.shape == (3, 30, 40) and image.dtype == torch.uint8
    assert torch.equal(image, pil_rgb(path))  # the same pixels as PIL's conversion, whichever decoder ran
    if mode in ("L", "LA"):
        assert torch.equal(image[0], image[1]) and torch.equal(image[1], image[2])


def write_folder(root, classes=("cat", "dog"), per_class=3):
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(picture()).convert("P" if i == 1 else "RGB").save(root / name / f"{i}.png")
    return root


def transforms(image_size, val_resize):
    """train_resnet.py's default (main.py's) training and validation transforms at these sizes."""
    args = parse_args(["--dummy", "--image_size", str(image_size), "--val_resize", str(val_resize)])
    return train_transform(args), val_transform(args)


def test_unreadable_image_is_marked_with_its_index(tmp_path):
    root = write_folder(tmp_path / "train")
    bad = root / "dog" / "1.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png")
    dataset = RGBImageFolder(root, transforms(16, 16)[1], image_size=16)
    index = [path for path, _ in dataset.samples].index(str(bad))
    image, target = dataset[index]
    assert target < 0 and dataset.bad_image_path(target) == str(bad)
    assert image.shape == (3, 16, 16)  # same shape as a real sample, so batches collate
    reason = describe_bad_image(bad)
    assert "\n" not in reason and reason
    assert all(dataset[i][1] >= 0 for i in range(len(dataset)) if i != index)


def test_float_image_is_unreadable_with_its_reason(tmp_path):
    root = write_folder(tmp_path / "train")
    bad = root / "cat" / "float.tif"
    Image.fromarray(np.linspace(0, 1, 30 * 40, dtype=np.float32).reshape(30, 40)).save(bad)  # PIL mode F
    dataset = RGBImageFolder(root, transforms(16, 16)[1], image_size=16)
    _, target = dataset[[path for path, _ in dataset.samples].index(str(bad))]
    assert str(bad_image_error(dataset, target)) == (
        f"{bad}: unreadable image (ValueError: float pixels (PIL mode F) have no defined range; save the image with 8 "
        "or 16 bits per channel); replace or remove it, or pass --skip_bad_images")


def test_augmentation_depends_on_seed_epoch_and_index_only(tmp_path):
    dataset = RGBImageFolder(write_folder(tmp_path / "train"), transforms(16, 20)[0], 16, seed=3)
    first = dataset[2][0]
    torch.manual_seed(123)  # the global RNG does not matter
    assert torch.equal(dataset[2][0], first)
    dataset.set_epoch(1)
    assert not torch.equal(dataset[2][0], first)  # a new crop in the next epoch
    before = torch.get_rng_state()
    dataset[0]
    assert torch.equal(torch.get_rng_state(), before)  # and loading leaves the global RNG alone


def test_transforms_shapes():
    image = torch.from_numpy(picture(50, 30)).permute(2, 0, 1)
    train, val = transforms(24, 28)
    assert train(image).shape == (3, 24, 24)
    val = val(image)
    assert val.shape == (3, 24, 24) and val.dtype == torch.float32


def test_empty_class_folder(tmp_path):
    root = write_folder(tmp_path / "train")
    (root / "empty").mkdir()
    (root / "empty" / "notes.txt").write_text("no images here")
    with pytest.raises(UserError, match=r"train/empty: empty class folder"):
        RGBImageFolder(root, None, 16)


def test_each_class_folder_is_listed_once(tmp_path, monkeypatch):
    """One listing of the images (ImageFolder's), which also finds an empty class: none before it to check them."""
    write_folder(tmp_path / "train", classes=("cat", "dog"))
    write_folder(tmp_path / "val", classes=("cat", "dog"), per_class=1)
    listed, real = [], os.scandir

    def scandir(path="."):
        listed.append(os.fspath(path))
        return real(path)
    monkeypatch.setattr(os, "scandir", scandir)
    build_datasets(tmp_path, 0, (*transforms(16, 16), 16, 16))
    for split in ("train", "val"):
        for name in ("cat", "dog"):
            assert listed.count(str(tmp_path / split / name)) == 1, listed


def test_listing_is_torchvisions_with_our_filter_and_the_per_line_fingerprint(tmp_path):
    """The listing in arrays (folder by folder) holds what torchvision's make_dataset lists with ImageFiles as its
    is_valid_file, in its order, and hashes what data_fingerprint hashes line by line: nested folders, a linked
    folder, macOS metadata, hidden and other files, upper-case and non-ASCII names."""
    root = tmp_path / "train"
    for name in ("cat/a.jpg", "cat/B.JPEG", "cat/sub/c.png", "cat/sub/deeper/d.jpg", "cat/._a.jpg", "cat/.jpg",
                 "cat/.hidden.jpg", "cat/notes.txt", "cat/README", "cat/__MACOSX/e.jpg", "dog/ü 1.jpg", "dog/z.webp",
                 "émile/x.bmp", "../elsewhere/g.jpg"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
    (root / "dog" / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    classes = image_classes(root)
    class_to_idx = {name: index for index, name in enumerate(classes)}
    expected_files, files = ImageFiles(root), ImageFiles(root)
    expected = torchvision.datasets.folder.make_dataset(str(root), class_to_idx, is_valid_file=expected_files)
    samples, empty = list_images(root, class_to_idx, files)
    assert list(samples) == expected and [samples[i] for i in range(len(samples))] == expected and empty == []
    assert [os.path.relpath(path, root) for path, _ in expected] == [
        "cat/.hidden.jpg", "cat/B.JPEG", "cat/a.jpg", "cat/sub/c.png", "cat/sub/deeper/d.jpg", "dog/z.webp",
        "dog/ü 1.jpg", "dog/linked/g.jpg", "émile/x.bmp"]
    assert files.notes() == expected_files.notes() and len(files.notes()) == 2
    skip = len(os.path.join(str(root), ""))
    assert samples.fingerprint == data_fingerprint(str(root), (f"{path[skip:]}\t{c}" for path, c in expected))


def test_missing_split_and_no_classes(tmp_path):
    with pytest.raises(UserError, match=r"train: no such directory.*train/<class>"):
        image_classes(tmp_path / "train")
    (tmp_path / "val").mkdir()
    with pytest.raises(UserError, match=r"val: no class folders"):
        image_classes(tmp_path / "val")


def test_train_val_class_mismatch(tmp_path):
    write_folder(tmp_path / "train", classes=("cat", "dog", "fox"))
    write_folder(tmp_path / "val", classes=("cat", "dog", "owl"))
    with pytest.raises(UserError, match=r"only in train: fox; only in val: owl"):
        build_datasets(tmp_path, 0, (*transforms(16, 16), 16, 16))


def test_datasets_share_class_indices(tmp_path):
    write_folder(tmp_path / "train", classes=("b", "a"))
    write_folder(tmp_path / "val", classes=("a", "b"), per_class=1)
    train, val = build_datasets(tmp_path, 0, (*transforms(16, 16), 16, 16))
    assert train.class_to_idx == val.class_to_idx == {"a": 0, "b": 1}
    assert len(train) == 6 and len(val) == 2


def test_dummy_data_is_imagenet_shaped():
    train, val = build_dummy_datasets(1000, 8)
    assert len(train) == 1000 and len(val) == 1000 * 50_000 // 1_281_167
    assert len(train.class_to_idx) == 1000
    image, target = train[5]
    assert image.shape == (3, 8, 8) and 0 <= target < 1000
    assert torch.equal(train[5][0], image)  # a function of the index
