"""decode_rgb: TorchCodec where it works, torchvision.io as the fallback, the same pixels and no deprecation noise."""
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import utils.image_data as image_data


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode")
    rgb = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    paths = {"rgb.jpg": "RGB", "gray.jpg": "L", "palette.png": "P", "rgba.png": "RGBA", "rgb.bmp": "RGB"}
    for name, mode in paths.items():
        Image.fromarray(rgb).convert(mode).save(root / name)
    return [root / name for name in paths]


def pil_rgb(path):
    with Image.open(path) as image:
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


@pytest.mark.parametrize("decoder", ["torchcodec", "torchvision fallback"])
def test_same_pixels_as_pil_and_no_deprecation_warning(images, decoder, monkeypatch):
    if decoder == "torchcodec":
        pytest.importorskip("torchcodec")
        assert image_data.torchcodec_decoder() is not None  # installed, so it must be the one used
    else:
        monkeypatch.setattr(image_data, "torchcodec_decoder", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoded = [image_data.decode_rgb(path) for path in images]
    assert [w for w in caught if issubclass(w.category, DeprecationWarning)] == []
    for path, image in zip(images, decoded):
        assert image.shape == (3, 30, 40) and image.dtype == torch.uint8
        assert torch.equal(image, pil_rgb(path)), path.name


@pytest.fixture(params=["torchcodec", "torchvision fallback"])
def decoder(request, monkeypatch):
    """decode_rgb with TorchCodec, or with torchvision.io (and PIL) as where TorchCodec is absent."""
    if request.param == "torchcodec":
        pytest.importorskip("torchcodec")
        assert image_data.torchcodec_decoder() is not None
    else:
        monkeypatch.setattr(image_data, "torchcodec_decoder", lambda: None)
    return request.param


@pytest.fixture(scope="module")
def stored_rgb():
    return np.random.default_rng(1).integers(0, 256, (40, 60, 3), dtype=np.uint8)  # (H, W, 3): wider than tall


@pytest.mark.parametrize("name", ["rotated.jpg", "rotated.png", "rotated.webp"])
def test_exif_orientation_is_not_applied(tmp_path, decoder, stored_rgb, name):
    """Pixels as stored, as main.py's PIL loader gives them (TorchCodec alone would rotate these to 60 x 40)."""
    exif = Image.Exif()
    exif[image_data.EXIF_ORIENTATION] = 6  # "rotate 90 degrees clockwise to view"
    Image.fromarray(stored_rgb).save(tmp_path / name, exif=exif, **({"lossless": True} if name.endswith("webp") else {}))
    image = image_data.decode_rgb(tmp_path / name)
    assert image.shape == (3, 40, 60)
    assert torch.equal(image, pil_rgb(tmp_path / name))


@pytest.mark.parametrize("name", ["gray16.png", "gray16.tif", "gray16.pgm"])
def test_16_bit_images_scale_to_8_bits(tmp_path, decoder, name):
    """value >> 8 (torchvision's to_dtype) on every decoder; PIL's own conversion clips them at 255."""
    values = np.linspace(0, 65535, 30 * 40).reshape(30, 40).astype(np.uint16)
    Image.fromarray(values).save(tmp_path / name)  # mode I;16
    image = image_data.decode_rgb(tmp_path / name)
    expected = torch.from_numpy((values >> 8).astype(np.uint8))
    assert image.dtype == torch.uint8 and all(torch.equal(channel, expected) for channel in image)


def test_float_images_are_unreadable_with_the_reason(tmp_path, decoder):
    Image.fromarray(np.linspace(0, 1, 30 * 40, dtype=np.float32).reshape(30, 40)).save(tmp_path / "float.tif")
    with pytest.raises(ValueError):
        image_data.decode_rgb(tmp_path / "float.tif")
    assert image_data.describe_bad_image(tmp_path / "float.tif") == (
        "ValueError: float pixels (PIL mode F) have no defined range; save the image with 8 or 16 bits per channel")
