"""The image classifier's data: ImageFolder data as pytorch/examples imagenet/main.py reads it, decoded to RGB with the
same pixels whichever decoder is installed, an unreadable file marked (target -1 - index) rather than raised in a
worker, augmentation seeded per (seed, epoch, index), the listing held in numpy arrays, main.py's --dummy data, the
training images' top-1/top-5 and unreadable counts (ImageCounts), --predict's inputs and rows, and the training
set's fingerprint for a resume to check (docs/code.md#image_datapy).
Neighbours: utils/image_augment.py (the transforms), utils/image_device_decode.py (decoding on the training device).
"""
import functools
import io
import itertools
import os
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision import datasets
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2
from torchvision.transforms.functional import pil_to_tensor

from . import checkpoint, runtime

IMAGENET_MEAN = (0.485, 0.456, 0.406)

IMAGENET_STD = (0.229, 0.224, 0.225)

# What a decoder raises for a broken file (PIL raises SyntaxError for some broken PNGs).
DECODE_ERRORS = (OSError, RuntimeError, ValueError, SyntaxError, Image.DecompressionBombError)

EXIF_ORIENTATION = 0x0112  # the EXIF tag; 1 (or none): stored upright

SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")  # PIL's 16-bit grayscale

DUMMY_CLASSES = 1000

IMAGENET_TRAIN_IMAGES, IMAGENET_VAL_IMAGES = 1_281_167, 50_000


@functools.cache
def torchcodec_decoder():
    """torchcodec.decoders.decode_image if TorchCodec imports and decodes a probe JPEG here, else None."""
    try:
        from torchcodec.decoders import decode_image as decode
        probe = io.BytesIO()
        Image.new("RGB", (8, 8)).save(probe, "JPEG")
        decode(probe.getvalue(), mode="RGB")
    except Exception:  # noqa: BLE001 - absent, or unusable for any reason: torchvision.io decodes the same pixels
        return None
    return decode


def torchvision_decode(data):
    """torchvision.io's decoder on a file's bytes, where TorchCodec is absent."""
    with warnings.catch_warnings():
        # the deprecation points users to TorchCodec, which this module already prefers when it is installed
        warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                                category=DeprecationWarning)
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def stored_orientation(image):
    """The EXIF orientation an opened PIL image's file declares, 1 (stored upright) without one; header only."""
    return image.getexif().get(EXIF_ORIENTATION, 1) if "exif" in image.info else 1


def decode_rgb(path):
    """The image at `path` as (3, H, W) uint8 RGB, the same pixels whichever decoder is installed (stored orientation,
    16 bits scaled to 8, float refused: docs/resnet.md); raises one of DECODE_ERRORS if unreadable."""
    with open(path, "rb") as file:
        data = file.read()
    with Image.open(io.BytesIO(data)) as header:  # parses the header; the pixels only if PIL decodes them
        image = None
        if stored_orientation(header) == 1:
            decode = torchcodec_decoder()
            try:
                image = decode(data, mode="RGB", output_dtype="auto") if decode else torchvision_decode(data)
            except (RuntimeError, ValueError):  # BMP, TIFF, PPM or a broken file: let PIL decide
                image = None
        if image is None or image.ndim != 3:  # animated GIF/WebP decode to (N, 3, H, W): PIL gives the first frame
            image = pil_rgb(header)
    return v2.functional.to_dtype(image, torch.uint8, scale=True) if image.dtype == torch.uint16 else image


def pil_rgb(image):
    """An opened PIL image as (3, H, W) RGB; 16-bit grayscale kept as uint16 (Pillow's mode I) to be scaled."""
    if image.mode in SIXTEEN_BIT_MODES or (image.mode == "I" and image.format == "PPM"):
        gray = torch.from_numpy(np.asarray(image).astype(np.uint16))  # (H, W)
        return gray.expand(3, *gray.shape).contiguous()
    if image.mode in ("F", "I"):
        kind = "float" if image.mode == "F" else "32-bit integer"
        raise ValueError(f"{kind} pixels (PIL mode {image.mode}) have no defined range; save the image with 8 or 16 "
                         f"bits per channel")
    return pil_to_tensor(image.convert("RGB"))


def describe_bad_image(path):
    """Why `path` cannot be read, in one line (PIL's wording where PIL tried last, which names the problem plainly)."""
    try:
        decode_rgb(path)
    except DECODE_ERRORS as err:
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return "cannot be decoded"


# Every type the decoders read: torchvision's list, and those PIL reads here (AVIF in Pillow 11+; HEIC/HEIF with the
# pillow-heif plugin; animated GIF's first frame), so that no image is left out unnoticed.
IMAGE_EXTENSIONS = tuple(dict.fromkeys((*datasets.folder.IMG_EXTENSIONS, *(
    ext for ext in (".gif", ".avif", ".heic", ".heif", ".jxl", ".jfif") if ext in Image.registered_extensions()))))
MACOS_METADATA = "__MACOSX"  # a folder that macOS's Archive Utility adds to a zip, beside AppleDouble `._*` files


class RGBImageFolder(datasets.ImageFolder):
    """ImageFolder that decodes to RGB tensors, marks unreadable files, and seeds augmentation per sample."""

    def __init__(self, root, transform, image_size, seed=0):
        # ImageFolder's attributes, set here rather than by its __init__, which would copy the samples' classes into
        # a list (1.3M Python ints for ImageNet): the listing's arrays hold them already
        datasets.VisionDataset.__init__(self, str(root), transform=transform)
        self.classes, self.class_to_idx = self.find_classes(self.root)
        files = ImageFiles(self.root)
        self.samples = self.imgs = self.make_dataset(self.root, self.class_to_idx, is_valid_file=files)
        self.targets = self.samples.targets
        self.loader, self.extensions = decode_rgb, None
        self.left_out = files.notes()  # what the listing passed over, one line each
        self.placeholder = torch.zeros(3, image_size, image_size)
        self.seed, self.epoch = seed, EpochValue()  # shared with persistent workers' copies of this dataset

    def find_classes(self, directory):
        """ImageFolder's class scan, with its errors as one line (`image_classes`)."""
        classes = image_classes(directory)
        return classes, {name: index for index, name in enumerate(classes)}

    @staticmethod
    def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        """ImageFolder's one listing (`list_images`), finding empty class folders too; ImageFiles picks the images."""
        files = is_valid_file if isinstance(is_valid_file, ImageFiles) else ImageFiles(directory)
        samples, empty = list_images(directory, class_to_idx, files)
        if empty:
            raise runtime.UserError(f"{Path(directory) / empty[0]}: empty class folder (no "
                                    f"{', '.join(IMAGE_EXTENSIONS)} files); remove it or add its images")
        return samples

    def set_epoch(self, epoch):
        self.epoch.set(epoch)

    def __getitem__(self, item):
        key, index = sample_key(self.seed, self.epoch.get(), item)
        path, target = self.samples[index]
        try:
            image = decode_rgb(path)
        except DECODE_ERRORS:
            return self.placeholder, -1 - index  # negative: unreadable, and which file it was
        # Python's hash of a tuple of ints is deterministic (PYTHONHASHSEED only affects str/bytes). Seeding the
        # CPU generator alone takes 1 us; torch.manual_seed, which also seeds every accelerator, takes 70.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(key)
            return self.transform(image), target

    def bad_image_path(self, target):
        """The file a negative target points at."""
        return self.samples[-1 - target][0]


class SampleArrays(Sequence):
    """ImageFolder's (path, class) list held in numpy arrays (paths' bytes with end offsets, int64 classes), so that
    workers' copy-on-write pages stay shared (docs/code.md#image_datapy). `fingerprint`: fingerprint_images'."""

    def __init__(self, paths, ends, targets, fingerprint):
        self.paths, self.ends, self.targets, self.fingerprint = paths, ends, targets, fingerprint

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # an IndexError past either end, as a list's
        start = self.ends[index - 1] if index else 0
        return os.fsdecode(self.paths[start:self.ends[index]].tobytes()), int(self.targets[index])

    def __iter__(self):  # in one pass (the fingerprint reads every sample)
        data, start = self.paths.tobytes(), 0
        for end, target in zip(self.ends.tolist(), self.targets.tolist()):
            yield os.fsdecode(data[start:end]), target
            start = end


def list_images(directory, class_to_idx, files):
    """torchvision's make_dataset walk done once, folder by folder, into arrays and the fingerprint's hash:
    (SampleArrays, the class folders with no image)."""
    directory = os.path.expanduser(os.fspath(directory))
    skip = len(os.path.join(directory, ""))
    blobs, lengths, targets, empty = [], [], [], []
    fingerprint = checkpoint.DataFingerprint()
    for name in sorted(class_to_idx):
        index, found = class_to_idx[name], 0
        for folder, _, names in sorted(os.walk(os.path.join(directory, name), followlinks=True)):
            names = files.keep(folder, sorted(names))
            if not names:
                continue
            prefix = os.path.join(folder, "")
            paths = prefix + prefix.join(names)  # every path of the folder, one after the other
            blobs.append(os.fsencode(paths))
            lengths.append([len(prefix) + len(file) for file in names] if paths.isascii() else
                           [len(os.fsencode(prefix + file)) for file in names])
            targets.append(np.full(len(names), index, dtype=np.int64))
            relative, tail = prefix[skip:], f"\t{index}\n"
            fingerprint.add_block((relative + (tail + relative).join(names) + tail).encode("utf-8", "surrogateescape"),
                                  len(names))
            found += len(names)
        if not found:
            empty.append(name)
    ends = np.cumsum(np.fromiter(itertools.chain.from_iterable(lengths), dtype=np.int64))
    samples = SampleArrays(np.frombuffer(b"".join(blobs), dtype=np.uint8), ends,
                           np.concatenate(targets) if targets else np.zeros(0, dtype=np.int64),
                           fingerprint.result(directory))
    return samples, empty


def sample_key(seed, epoch, item):
    """(augmentation seed, index) of an item: an index, or (index, repeat) seeded apart; repeat 0 as the index."""
    index, repeat = item if isinstance(item, tuple) else (item, 0)
    return hash((seed, epoch, index) if repeat == 0 else (seed, epoch, index, repeat)), index


def image_classes(root):
    """Sorted class folder names of an ImageFolder root (its top level only); a missing root or no class is an error."""
    root = Path(root)
    if not root.is_dir():
        raise runtime.UserError(f"{root}: no such directory; the data argument must be an ImageFolder root holding "
                                f"train/<class>/*.jpg and val/<class>/*.jpg")
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and entry.name != MACOS_METADATA)
    if not classes:
        raise runtime.UserError(f"{root}: no class folders (expected {root}/<class>/<image files>)")
    return classes


class ImageFiles:
    """ImageFolder's is_valid_file: the images of a type the decoders read; macOS metadata (`._NAME`, __MACOSX/) and
    other files counted for one note each."""

    def __init__(self, root):
        self.root = Path(root)
        self.prefix = os.path.expanduser(str(root)) + os.sep  # how ImageFolder's listing begins each path
        self.metadata = 0
        self.others = Counter()

    def __call__(self, path):
        # string operations, not pathlib: this runs once per file, 1.8M times for ImageNet's train and val
        path = os.fspath(path)  # ImageFolder's listing gives strings, --predict's a Path
        name = os.path.basename(path)
        if name.startswith("._") or (MACOS_METADATA in path and MACOS_METADATA in self.inside(path).split(os.sep)):
            self.metadata += 1
            return False
        suffix = os.path.splitext(name)[1].lower()
        if suffix not in IMAGE_EXTENSIONS:
            self.others[suffix or "(no suffix)"] += 1
            return False
        return True

    def keep(self, folder, names):
        """The files among `names` (sorted, in `folder`) that __call__ keeps, in order; a folder of image files alone
        is passed whole, by one test of each name."""
        if MACOS_METADATA in folder and MACOS_METADATA in self.inside(folder).split(os.sep):
            self.metadata += len(names)
            return []
        # a name starting with "." may be AppleDouble metadata, or all suffix (".jpg": no suffix to splitext)
        images = [name for name in names if name[0] != "." and name.lower().endswith(IMAGE_EXTENSIONS)]
        if len(images) == len(names):
            return images
        return [name for name in names if self(os.path.join(folder, name))]  # each decided and counted

    def inside(self, path):
        """`path` relative to the root, as a string."""
        return path[len(self.prefix):] if path.startswith(self.prefix) else os.path.relpath(path, self.root)

    def notes(self):
        """One line each for what was not read; the root's own __MACOSX/ (not a class) is counted here."""
        metadata = self.metadata + sum(path.is_file() for path in (self.root / MACOS_METADATA).rglob("*"))
        notes = []
        if metadata:
            notes.append(f"{self.root}: {metadata} macOS archive metadata files (__MACOSX/, AppleDouble ._*) skipped: "
                         f"not images")
        if self.others:
            counts = ", ".join(f"{count} {suffix}" for suffix, count in sorted(self.others.items()))
            notes.append(f"{self.root}: files of types no decoder here reads left out ({counts}); read: "
                         f"{' '.join(IMAGE_EXTENSIONS)}")
        return notes


def check_same_classes(train_classes, val_classes, train_root, val_root):
    """Train and val must hold the same classes, or every val label index after the difference is silently wrong."""
    if train_classes != val_classes:
        only_train = sorted(set(train_classes) - set(val_classes))
        only_val = sorted(set(val_classes) - set(train_classes))
        raise runtime.UserError(f"{val_root}: classes differ from {train_root} (only in train: {_few(only_train)}; "
                                f"only in val: {_few(only_val)}); both must hold the same class folders")


def _few(names, limit=5):
    shown = ", ".join(names[:limit]) or "none"
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def build_datasets(data, seed, transforms, folder=RGBImageFolder, say=print):
    """(train, val) datasets of `data`/train and `data`/val sharing their classes; transforms: (train, val, train_crop,
    val_crop); folder: RGBImageFolder or a subclass; say: prints what the listing left out."""
    train_root, val_root = Path(data) / "train", Path(data) / "val"
    check_same_classes(image_classes(train_root), image_classes(val_root), train_root, val_root)
    train = folder(train_root, transforms[0], transforms[2], seed)
    val = folder(val_root, transforms[1], transforms[3], seed)
    for note in train.left_out + val.left_out:
        say(note)
    return train, val


class FakeImages(datasets.FakeData):
    """FakeData (each image a function of its index alone) with the class names the training script records."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.class_to_idx = {str(i): i for i in range(self.num_classes)}

    def set_epoch(self, epoch):
        pass  # nothing random per epoch

    def __getitem__(self, item):  # (index, repeat) from the repeated-augmentation sampler: the same image
        return super().__getitem__(item[0] if isinstance(item, tuple) else item)


def build_dummy_datasets(train_images, image_size, val_image_size=None):
    """main.py's --dummy: random images (FakeData), 1000 classes; val sized in ImageNet's proportion."""
    val_images = max(1, train_images * IMAGENET_VAL_IMAGES // IMAGENET_TRAIN_IMAGES)
    to_tensor = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
    train = FakeImages(train_images, (3, image_size, image_size), DUMMY_CLASSES, to_tensor)
    val_image_size = val_image_size or image_size
    val = FakeImages(val_images, (3, val_image_size, val_image_size), DUMMY_CLASSES, to_tensor,
                     random_offset=train_images)  # different images from the training ones
    return train, val


class EpochValue:
    """An epoch in shared memory: `set` reaches persistent workers' dataset copies (docs/code.md#image_datapy)."""

    def __init__(self, epoch=0):
        self.value = torch.tensor(epoch, dtype=torch.long).share_memory_()

    def set(self, epoch):
        self.value.fill_(epoch)

    def get(self):
        return int(self.value)


def bad_image_error(dataset, target):
    """The one-line error for the unreadable image whose placeholder target is `target` (< 0)."""
    path = dataset.bad_image_path(target)
    return runtime.UserError(f"{path}: unreadable image ({describe_bad_image(path)}); replace or remove it, or pass "
                             f"--skip_bad_images")


class ImageCounts:
    """Top-1/top-5 hits of the readable training images between two log lines, and the unreadable ones: one stops the
    run naming the file, or with --skip_bad_images is reported once and counted. Kept on the device until read."""

    def __init__(self, accelerator, dataset, skip_bad_images):
        self.accelerator, self.dataset, self.skip_bad_images = accelerator, dataset, skip_bad_images
        self.window = torch.zeros(4, dtype=torch.long, device=accelerator.device)  # readable, top-1, top-5, skipped
        self.lowest_target = torch.zeros((), dtype=torch.long, device=accelerator.device)  # < 0: an unreadable one
        self.reported, self.skipped_total = set(), 0

    def add(self, logits, targets):
        """Count one batch, logits (B, C) and targets (B,); returns how many of its images were readable."""
        readable = targets >= 0  # an unreadable image's negative target is never among the top k
        top1, top5 = topk_hits(logits.detach(), targets, ks=(1, 5))
        self.window += torch.stack([readable.sum(), top1, top5, (~readable).sum()])
        self.lowest_target = torch.minimum(self.lowest_target, targets.min())
        return readable.sum()

    def read(self):
        """Top-1/top-5 accuracy (%) over the window's readable images on all ranks, and the images skipped; then
        start a new window. A collective."""
        readable, top1, top5, skipped = self.accelerator.reduce(self.window, reduction="sum").tolist()
        self.window.zero_()
        self.skipped_total += skipped
        n = max(1, readable)
        return {"acc1": 100.0 * top1 / n, "acc5": 100.0 * top5 / n, "skipped_images": skipped}

    def check_unreadable(self):
        """Stop on the first unreadable image any rank has seen, or without stopping report each one once. A
        collective."""
        lowest = self.accelerator.gather(self.lowest_target.view(1)).min().item()
        if lowest < 0 and not self.skip_bad_images:
            raise bad_image_error(self.dataset, lowest)
        if lowest < 0 and lowest not in self.reported:
            self.reported.add(lowest)
            self.accelerator.print(f"warning: skipping unreadable image {self.dataset.bad_image_path(lowest)}")


def topk_hits(logits, targets, ks=(1, 5)):
    """(len(ks),) tensor on the logits' device: the samples whose target is among the k highest logits, per k."""
    maxk = min(max(ks), logits.shape[1])
    hits = logits.topk(maxk, dim=1).indices.eq(targets.view(-1, 1))  # (N, maxk)
    return torch.stack([hits[:, :min(k, maxk)].any(dim=1).sum() for k in ks])


def fingerprint_images(dataset):
    """The training set's fingerprint for its checkpoints: its (relative path, class) list, or --dummy's image count."""
    if not hasattr(dataset, "samples"):  # FakeImages: each image a function of its index
        return checkpoint.data_fingerprint("--dummy", (str(index) for index in range(len(dataset))))
    return dataset.samples.fingerprint  # hashed by the listing (list_images)


LIST_SUFFIX = ".txt"  # a --predict file with this suffix lists image paths, one a line


def files_to_predict(paths):
    """The images --predict names, in input order: folders (recursively, sorted), image files, .txt lists
    (docs/resnet.md); a listed file missing or not an image keeps its place; a missing path or empty folder: error."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            images = ImageFiles(path)  # the types the decoders read, macOS archive metadata left out
            found = sorted(str(p) for p in path.rglob("*") if p.is_file() and images(p))
            if not found:
                raise runtime.UserError(f"--predict {path}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in this "
                                        f"folder or below it")
            files += found
        elif not path.is_file():
            raise runtime.UserError(f"--predict {path}: no such file or directory")
        elif path.suffix.lower() == LIST_SUFFIX:
            files += [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            files.append(str(path))
    return files


class PredictImages(torch.utils.data.Dataset):
    """Files to label: item i is (image, i), or (placeholder, -1 - i) unreadable; `transform`: the validation's."""

    def __init__(self, files, transform, image_size):
        self.files, self.transform = files, transform
        self.placeholder = torch.zeros(3, image_size, image_size)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        try:
            image = decode_rgb(self.files[index])
        except DECODE_ERRORS:
            return self.placeholder, -1 - index
        return self.transform(image), index

    def bad_image_path(self, target):
        return self.files[-1 - target]


def prediction_rows(dataset, first, items, probabilities, classes, labels):
    """predictions.jsonl's rows of one gathered batch, files `first`, `first + 1`, ... of `dataset` (docs/resnet.md).
    items (B,): the gathered items (index, or -1 - index); probabilities, classes (B, k): each image's top k. Items out
    of input order are an error."""
    positions = [_position(item) for item in items]
    if positions != list(range(first, first + len(items))):
        raise RuntimeError(f"predictions gathered for files {positions}, expected files {first} to "
                           f"{first + len(items) - 1} in input order")
    rows = []
    for item, scores, ids in zip(items, probabilities, classes):
        path = dataset.files[_position(item)]
        if item < 0:
            rows.append({"file": path, "skipped": f"unreadable image ({describe_bad_image(path)})"})
            continue
        topk = [{"label": labels[c], "score": p} for c, p in zip(ids, scores)]
        rows.append({"file": path, "label": topk[0]["label"], "score": topk[0]["score"], "topk": topk})
    return rows


def _position(item):
    return item if item >= 0 else -1 - item
