"""Training and validation transforms under the user's control (torchvision's ClassificationPresetTrain/Eval
names and order), and the repeated-augmentation sampler (DeiT's / torchvision's RASampler) in a form that
splits over any number of processes.

Randomness: RGBImageFolder seeds every sample from (seed, epoch, index[, repeat]) before these transforms run,
so flips, crops, auto-augment and erasing are the same for any number of processes, workers or resumes.
"""
import torch
from torch.utils.data import Sampler
from torchvision.transforms import v2

from .errors import UserError
from .image_data import IMAGENET_MEAN, IMAGENET_STD

AUTO_AUGMENT = ("ta_wide", "ra", "augmix", "imagenet", "cifar10", "svhn")  # the last three: AutoAugment policies


def add_augment_args(parser):
    """Augmentation flags, with torchvision's dashed spellings beside ours."""
    group = parser.add_argument_group("augmentation (torchvision's presets; timm's names in docs/resnet_recipes.md)")
    group.add_argument("--image_size", type=int, default=224,
                       help="pixels: default of --train_crop_size and --val_crop_size")
    group.add_argument("--train_crop_size", "--train-crop-size", type=int, default=None,
                       help="pixels: RandomResizedCrop output (default --image_size)")
    group.add_argument("--val_crop_size", "--val-crop-size", type=int, default=None,
                       help="pixels: validation center crop (default --image_size)")
    group.add_argument("--val_resize", "--val_resize_size", "--val-resize-size", type=int, default=256,
                       dest="val_resize", help="pixels: shorter side before the validation center crop")
    group.add_argument("--crop_scale", type=float, default=0.08,
                       help="smallest fraction of the image area a training crop covers (timm's --scale)")
    group.add_argument("--crop_ratio", type=float, nargs=2, default=(3 / 4, 4 / 3), metavar=("MIN", "MAX"),
                       help="aspect-ratio range of a training crop (timm's --ratio)")
    group.add_argument("--hflip", type=float, default=0.5, help="probability of a horizontal flip; 0 for digits/text")
    group.add_argument("--auto_augment", "--auto-augment", choices=AUTO_AUGMENT, default=None,
                       help="ta_wide: TrivialAugmentWide, ra: RandAugment, augmix: AugMix, imagenet/cifar10/svhn: "
                            "AutoAugment with that policy")
    group.add_argument("--ra_magnitude", "--ra-magnitude", type=int, default=9, help="RandAugment magnitude")
    group.add_argument("--augmix_severity", "--augmix-severity", type=int, default=3, help="AugMix severity")
    group.add_argument("--random_erase", "--random-erase", type=float, default=0.0,
                       help="probability of RandomErasing (after normalisation)")
    group.add_argument("--interpolation", choices=["bilinear", "bicubic", "nearest"], default="bilinear",
                       help="resampling of crops and resizes (auto-augment's rotations and shears: bilinear "
                            "for bicubic)")
    group.add_argument("--ra_sampler", "--ra-sampler", action="store_true",
                       help="repeated augmentation: each image --ra_reps times per batch, differently augmented")
    group.add_argument("--ra_reps", "--ra-reps", type=int, default=3, help="copies per image with --ra_sampler")
    return group


def resolve_augment_args(args):
    """Fill the crop sizes from --image_size and check ranges (before anything starts)."""
    args.train_crop_size = args.train_crop_size or args.image_size
    args.val_crop_size = args.val_crop_size or args.image_size
    for name in ("hflip", "random_erase"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise UserError(f"--{name} {getattr(args, name)}: a probability, between 0 and 1")
    if not 0.0 < args.crop_scale <= 1.0 or not 0.0 < args.crop_ratio[0] <= args.crop_ratio[1]:
        raise UserError(f"--crop_scale {args.crop_scale} / --crop_ratio {args.crop_ratio}: need 0 < scale <= 1 "
                        "and 0 < MIN <= MAX")
    if args.ra_sampler and args.ra_reps < 1:
        raise UserError(f"--ra_reps {args.ra_reps}: at least 1")


def train_transform(args):
    """(3, H, W) uint8 -> (3, crop, crop) float, normalised: torchvision's ClassificationPresetTrain order."""
    mode = v2.InterpolationMode(args.interpolation)
    steps = [v2.RandomResizedCrop(args.train_crop_size, scale=(args.crop_scale, 1.0), ratio=tuple(args.crop_ratio),
                                  interpolation=mode, antialias=True)]
    # on tensors, rotations and shears resample with nearest or bilinear only (torchvision raises for bicubic)
    mode = mode if mode != v2.InterpolationMode.BICUBIC else v2.InterpolationMode.BILINEAR
    if args.hflip > 0:
        steps.append(v2.RandomHorizontalFlip(args.hflip))
    if args.auto_augment == "ta_wide":
        steps.append(v2.TrivialAugmentWide(interpolation=mode))
    elif args.auto_augment == "ra":
        steps.append(v2.RandAugment(magnitude=args.ra_magnitude, interpolation=mode))
    elif args.auto_augment == "augmix":
        steps.append(v2.AugMix(severity=args.augmix_severity, interpolation=mode))
    elif args.auto_augment:
        steps.append(v2.AutoAugment(v2.AutoAugmentPolicy(args.auto_augment), interpolation=mode))
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if args.random_erase > 0:
        steps.append(v2.RandomErasing(p=args.random_erase))
    return v2.Compose(steps)


def val_transform(args):
    """Resize the shorter side, center crop, normalise: torchvision's ClassificationPresetEval."""
    return v2.Compose([v2.Resize(args.val_resize, interpolation=v2.InterpolationMode(args.interpolation),
                                 antialias=True),
                       v2.CenterCrop(args.val_crop_size), v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


class RepeatedAugmentationSampler(Sampler):
    """torchvision's RASampler as ONE global order that accelerate splits over the processes (split_batches).

    Each global batch holds batch_size / reps distinct images, each `reps` times, laid out copy-major
    ([a0 b0 c0 .. a1 b1 c1 ..]) so that, as in torchvision, the copies of an image land on different processes
    whenever there are at most `reps` of them. An epoch is len(dataset) samples, as torchvision's (it drops the
    rest), so it sees len(dataset) / reps distinct images. Items are (index, repeat): the dataset seeds each copy
    differently. The order depends on (seed, epoch) only, so resuming and any process count give the same run.
    """

    def __init__(self, dataset, batch_size, reps, seed):
        if batch_size % reps:
            raise UserError(f"--ra_reps {reps}: must divide the global batch (-b {batch_size}), so that every "
                            "batch holds whole groups of copies")
        self.dataset, self.batch_size, self.reps, self.seed, self.epoch = dataset, batch_size, reps, seed, 0

    def set_epoch(self, epoch):  # accelerate's prepared loader forwards its set_epoch here
        self.epoch = epoch

    def __len__(self):
        return len(self.dataset) // self.batch_size * self.batch_size

    def __iter__(self):
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        per_batch = self.batch_size // self.reps
        for start in range(0, len(self) // self.reps, per_batch):
            images = order[start:start + per_batch].tolist()
            yield from ((index, repeat) for repeat in range(self.reps) for index in images)

