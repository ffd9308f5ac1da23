"""--decode_on_device: JPEGs decoded and augmented on the training device, a batch at a time. A DataLoader worker
reads each file's bytes and draws what each random v2 step draws (seeded as utils/image_data.py seeds the CPU
loader); `decode_on_device(batches, device)` decodes the batch there in one call and replays the same steps with those
draws, giving what the CPU loader gives. A step that draws inside a forward of its own is refused at start-up, in
one line saying how to make it replayable (docs/code.md#image_device_decodepy, docs/resnet.md).
Neighbours: utils/image_data.py (decode_rgb, RGBImageFolder), train_resnet.py's train_transform/val_transform.
"""
import functools
import io
import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision.transforms import v2
from torchvision.transforms.v2._transform import _RandomApplyTransform

from . import image_data, runtime

# v2's own forwards: draw (make_params) then transform(image, params), which a replay splits between worker and device
REPLAYABLE_FORWARDS = (v2.Transform.forward, _RandomApplyTransform.forward)
BATCHED_STEPS = (v2.ToDtype, v2.Normalize)  # elementwise: one call on the stacked batch gives each image's result
STAND_IN_SHAPE = (3, 64, 48)  # any image shape: the start-up check draws once for it


def check_decode_on_device(args, transforms):
    """Refuse, before anything starts, --dummy and a step of `transforms` (the v2.Compose pair) it cannot replay."""
    if not args.decode_on_device:
        return
    if args.dummy is not None:
        raise runtime.UserError("--decode_on_device decodes image files; --dummy has none: drop one of the two")
    for transform in transforms:
        check_replayable(transform)


def check_replayable(transform):
    """A one-line UserError naming the first step of `transform` the device cannot replay, and how to make it so."""
    for step in transform.transforms:
        if type(step).forward not in REPLAYABLE_FORWARDS:
            raise runtime.UserError(f"--decode_on_device: {not_replayable(step)}")
    with torch.random.fork_rng(devices=[]):
        try:
            draw_params(transform, STAND_IN_SHAPE, torch.uint8)
        except Exception as err:  # noqa: BLE001 - a step whose draw needs the pixels: named, whatever it raised
            raise runtime.UserError(f"--decode_on_device: the transform {failing_step(transform)} cannot draw its "
                                    f"parameters without the image's pixels ({type(err).__name__}: "
                                    f"{str(err).splitlines()[0][:120]}); drop --decode_on_device, or that "
                                    f"transform") from None


def not_replayable(step):
    """Why `step` cannot be replayed on the device, and the way to make it replayable (check_replayable's line)."""
    name = type(step).__name__
    way = ("use utils.image_device_decode.ReplayableRandomApply(transforms, p) instead: v2.RandomApply with its draws "
           "in make_params, the same images" if isinstance(step, v2.RandomApply) else
           f"write {name} as torchvision's transforms.v2 steps are written, a v2.Transform subclass that draws every "
           f"random choice in make_params(flat_inputs) and applies them in transform(inpt, params), with no forward of "
           f"its own (v2.RandomApply: ReplayableRandomApply)")
    return (f"the transform {name} draws inside its own forward in the loader workers and cannot be replayed on the "
            f"device; {way}; or drop --decode_on_device")


class ReplayableRandomApply(v2.Transform):
    """v2.RandomApply(transforms, p) drawing in make_params, so --decode_on_device replays it: `torch.rand(1) < p`
    first, then each step's draws, in v2.RandomApply's order (the same images). Its steps must be replayable."""

    def __init__(self, transforms, p=0.5):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p {p}: a probability, between 0 and 1")
        for step in transforms:
            if type(step).forward not in REPLAYABLE_FORWARDS:
                raise ValueError(f"ReplayableRandomApply: {not_replayable(step)}")
        self.transforms = torch.nn.ModuleList(transforms)
        self.p = p

    def make_params(self, flat_inputs):
        if torch.rand(1) >= self.p:
            return {"steps": None}
        stand_in = torch.empty(flat_inputs[0].shape, dtype=flat_inputs[0].dtype, device="meta")
        return {"steps": draw_steps(self.transforms, stand_in)}

    def transform(self, inpt, params):
        for step, drawn in zip(self.transforms, params["steps"] or ()):
            inpt = replay_step(step, inpt, drawn)
        return inpt


def failing_step(transform):
    """The name of the first step whose draw fails on the stand-in (check_replayable's message)."""
    stand_in = torch.empty(STAND_IN_SHAPE, dtype=torch.uint8, device="meta")
    for step in transform.transforms:
        try:
            stand_in = step.transform(stand_in, step.make_params([stand_in]))
        except Exception:  # noqa: BLE001 - this step's draw or its shape
            return type(step).__name__
    return type(transform).__name__


@dataclass
class EncodedImage:
    """One sample as a worker leaves it: the JPEG's bytes, or pixels where the device does not decode the file.
    params: per step, what it drew (None: nothing, or a skipped random step); None for the list: unreadable."""
    path: str
    index: int
    jpeg: bytes = None
    pixels: np.ndarray = None  # (3, H, W) uint8
    params: list = None


class EncodedImageFolder(image_data.RGBImageFolder):
    """RGBImageFolder whose samples are EncodedImage; `collate` makes the EncodedBatch that decodes on the device."""

    def __init__(self, root, transform, image_size, seed=0):
        check_replayable(transform)
        super().__init__(root, transform, image_size, seed)

    def __getitem__(self, item):
        key, index = image_data.sample_key(self.seed, self.epoch.get(), item)
        path, target = self.samples[index]
        try:
            jpeg, pixels, shape = read_encoded(path)
        except image_data.DECODE_ERRORS:
            return EncodedImage(path, index), -1 - index  # as RGBImageFolder marks it
        with torch.random.fork_rng(devices=[]):  # the same seeding as RGBImageFolder's, so the same draws
            torch.default_generator.manual_seed(key)
            return EncodedImage(path, index, jpeg, pixels, draw_params(self.transform, shape, torch.uint8)), target

    def collate(self, samples):
        images, targets = zip(*samples)
        return EncodedBatch(list(images), torch.tensor(targets), self.transform, tuple(self.placeholder.shape))


def collate_for(dataset):
    """The DataLoader collate_fn for `dataset`: EncodedBatch for an EncodedImageFolder, torch's default otherwise."""
    return dataset.collate if isinstance(dataset, EncodedImageFolder) else default_collate


def read_encoded(path):
    """(jpeg bytes, None, shape) for a JPEG the device decodes, else (None, pixels, shape); raises DECODE_ERRORS."""
    with open(path, "rb") as file:
        data = file.read()
    try:
        with Image.open(io.BytesIO(data)) as header:  # parses the header only
            if header.format == "JPEG" and header.mode in ("L", "RGB") and image_data.stored_orientation(header) == 1:
                return data, None, (3, header.height, header.width)
    except Exception:  # noqa: BLE001 - any header PIL cannot parse: decode_rgb decides, as in the CPU loader
        pass
    pixels = image_data.decode_rgb(path)
    return None, pixels.numpy(), tuple(pixels.shape)


def draw_params(transform, shape, dtype):
    """Per step of `transform`, what it draws for an image of `shape` and `dtype` (make_params' dict, None where a
    random-apply step is skipped), in the CPU's order, on a meta stand-in (docs/code.md#image_device_decodepy)."""
    return draw_steps(transform.transforms, torch.empty(shape, dtype=dtype, device="meta"))


def draw_steps(steps, stand_in):
    """draw_params for a sequence of `steps`, from `stand_in` (a meta tensor of the image's shape and dtype)."""
    params = []
    for step in steps:
        if type(step).forward is _RandomApplyTransform.forward and torch.rand(1) >= step.p:  # as its forward skips
            params.append(None)
            continue
        drawn = step.make_params([stand_in])
        stand_in = followed(step, stand_in, drawn)
        params.append({key: value.numpy() if torch.is_tensor(value) else value for key, value in drawn.items()})
    return params


_SAME_EVERY_TIME = weakref.WeakKeyDictionary()  # {step: {(shape, dtype): stand-in out}} for steps that draw nothing


def followed(step, stand_in, drawn):
    """The stand-in `step` makes of `stand_in` with `drawn`, not computed where known: a step that drew nothing (kept),
    and RandomResizedCrop (its size); v2's dispatch is most of a draw's cost."""
    if type(step) is v2.RandomResizedCrop:
        return torch.empty((stand_in.shape[0], *step.size), dtype=stand_in.dtype, device="meta")
    if drawn:
        return step.transform(stand_in, drawn)
    known = _SAME_EVERY_TIME.setdefault(step, {})
    key = (tuple(stand_in.shape), stand_in.dtype)
    if key not in known:
        known[key] = step.transform(stand_in, drawn)
    return known[key]


@dataclass
class EncodedBatch:
    """A batch as the workers leave it; `decode(device)` decodes and augments it on the device (decode_on_device)."""
    images: list  # EncodedImage per sample
    targets: torch.Tensor  # (B,) class indices; -1 - index where the file is unreadable
    transform: v2.Compose
    image_shape: tuple  # (3, S, S): the transform's output, and the zeros an unreadable file becomes

    def decode(self, device):
        """(images (B, 3, S, S) float, targets (B,)) on `device`: every image decoded and augmented there."""
        device = torch.device(device)
        targets = self.targets.clone()
        decoded = decode_images(self.images, device)
        for row, (item, image) in enumerate(zip(self.images, decoded)):
            if image is None and targets[row] >= 0:  # its header read, its data did not decode anywhere
                targets[row] = -1 - item.index
        readable = [row for row, image in enumerate(decoded) if image is not None]
        batch = torch.zeros(len(self.images), *self.image_shape, device=device)  # (B, 3, S, S)
        if readable:
            batch[readable] = replay(self.transform, [decoded[row] for row in readable],
                                     [self.images[row].params for row in readable])
        return batch, targets.to(device)


def decode_on_device(batches, device):
    """The loader's batches as (images, targets): an EncodedBatch decoded and augmented on `device`, others as made."""
    for batch in batches:
        yield batch.decode(device) if isinstance(batch, EncodedBatch) else batch


@functools.cache
def jpeg_decoder():
    """decode(JPEG bytes list, device) -> (3, H, W) uint8 list on `device`: TorchCodec's, else torchvision.io's."""
    if image_data.torchcodec_decoder() is not None:
        from torchcodec.decoders import decode_jpeg as torchcodec_decode_jpeg
        return lambda jpegs, device: torchcodec_decode_jpeg(jpegs, mode="RGB", device=device)
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(jpegs, device):
        with warnings.catch_warnings():  # torchvision's deprecation points to TorchCodec, which is unusable here
            warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                                    category=DeprecationWarning)
            return decode_jpeg([torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs],
                               mode=ImageReadMode.RGB, device=device)
    return decode


def decode_images(images, device):
    """Each EncodedImage as a (3, H, W) uint8 tensor on `device`; None where its file is unreadable."""
    decode = jpeg_decoder()
    jpegs = [row for row, item in enumerate(images) if item.jpeg is not None]
    try:
        decoded = dict(zip(jpegs, decode([images[row].jpeg for row in jpegs], device))) if jpegs else {}
    except (RuntimeError, ValueError):  # one bad file fails the whole call: decode one by one to find it
        decoded = {row: decode_one(images[row], decode, device) for row in jpegs}
    for row, item in enumerate(images):
        if item.pixels is not None:
            decoded[row] = torch.from_numpy(item.pixels).to(device)
    return [decoded.get(row) for row in range(len(images))]


def decode_one(item, decode, device):
    try:
        return decode([item.jpeg], device)[0]
    except (RuntimeError, ValueError):  # not for this decoder (nvJPEG): the CPU loader's decoder, here
        try:
            return image_data.decode_rgb(item.path).to(device)
        except image_data.DECODE_ERRORS:
            return None


def replay(transform, images, params):
    """`transform` on decoded images ((3, H, W) uint8 each), each step with the worker's draws: per image for geometry
    and erasing, on the stacked batch for ToDtype and Normalize. Returns (B, 3, S, S) float."""
    batch = images  # a list until the first batched step stacks it
    for k, step in enumerate(transform.transforms):
        if isinstance(step, BATCHED_STEPS):
            batch = step(torch.stack(batch) if isinstance(batch, list) else batch)
            continue
        rows = [replay_step(step, image, drawn[k]) for image, drawn in zip(batch, params)]
        batch = torch.stack(rows) if isinstance(batch, torch.Tensor) else rows
    return torch.stack(batch) if isinstance(batch, list) else batch


def replay_step(step, image, drawn):
    """One image through one step, with what the worker drew for it (None: skipped, as its `p` decided)."""
    if drawn is None:
        return image
    # on a meta stand-in (a ReplayableRandomApply followed while drawing), the draws stay values on the CPU
    device = "cpu" if image.device.type == "meta" else image.device
    drawn = {key: torch.from_numpy(value).to(device) if isinstance(value, np.ndarray) else value
             for key, value in drawn.items()}
    return step.transform(image, drawn)
