"""decode_rgb: TorchCodec where it works, torchvision.io as the fallback, the same pixels and no deprecation noise."""
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import vision.data as image_data


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
