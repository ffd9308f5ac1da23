"""The augmentation flags and image sizes of train_resnet.py's transforms (its adaptation section builds the
pipelines, in torchvision's ClassificationPresetTrain/Eval order), the sizes -e and --predict take from the model
they evaluate, the repeated-augmentation sampler (torchvision's RASampler) as one global order, and MixUp / CutMix
mixed in groups at fixed positions of the GLOBAL batch, so that any process count trains alike
(docs/code.md#image_augmentpy).
Neighbours: utils/image_data.py (seeds each sample's augmentation), utils/image_optim.py.
"""
import argparse
import importlib.util
import random

import numpy as np
import torch
from PIL import ImageOps
import torch.nn.functional as F
from torch.utils.data import Sampler
from torchvision.transforms import v2

from . import checkpoint, export, image_data, runtime

AUTO_AUGMENT = ("ta_wide", "ra", "augmix", "imagenet", "cifar10", "svhn")  # the last three: AutoAugment policies
# the first word of timm's --aa strings (timm.data.auto_augment): rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, v0, original
TIMM_AUTO_AUGMENT = ("rand", "augmix", "original", "originalr", "v0", "v0r", "3a")
ERASE_MODES = ("const", "pixel", "rand")  # timm's --remode: zeros, per-pixel normal values, per-channel normal values


def augment_policy(text):
    """argparse type of --auto_augment / timm's --aa: torchvision's policy names, or timm's policy strings."""
    if text in AUTO_AUGMENT or text.split("-")[0] in TIMM_AUTO_AUGMENT:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a torchvision policy ({', '.join(AUTO_AUGMENT)}) nor timm's "
                                     f"(a string starting {', '.join(TIMM_AUTO_AUGMENT)}, e.g. rand-m9-mstd0.5-inc1)")


class TimmErasing(argparse.Action):
    """timm's --reprob: the probability, and timm's --remode pixel unless --random_erase_mode says otherwise."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.timm_erasing = option_string


@checkpoint.roles_beside("AUGMENT_ROLES")
def add_augment_args(parser):
    """Augmentation flags, with torchvision's dashed spellings beside ours."""
    group = parser.add_argument_group("augmentation (torchvision's presets; timm's names in docs/resnet_recipes.md)")
    group.add_argument("--image_size", "--img-size", type=runtime.positive_int, default=None,
                       help="pixels: default of --train_crop_size and --val_crop_size (default: 224; -e: the model's)")
    group.add_argument("--train_crop_size", "--train-crop-size", type=runtime.positive_int, default=None,
                       help="pixels: RandomResizedCrop output (default --image_size)")
    group.add_argument("--val_crop_size", "--val-crop-size", type=runtime.positive_int, default=None,
                       help="pixels: validation center crop (default --image_size)")
    group.add_argument("--val_resize", "--val_resize_size", "--val-resize-size", type=runtime.positive_int,
                       default=None,
                       dest="val_resize", help="pixels: shorter side before the validation center crop (default: 256; "
                       "-e: the model's)")
    group.add_argument("--crop_scale", type=float, default=0.08,
                       help="smallest fraction of the image area a training crop covers (timm's --scale)")
    group.add_argument("--crop_ratio", type=float, nargs=2, default=(3 / 4, 4 / 3), metavar=("MIN", "MAX"),
                       help="aspect-ratio range of a training crop (timm's --ratio)")
    group.add_argument("--hflip", type=float, default=0.5, help="probability of a horizontal flip; 0 for digits/text")
    group.add_argument("--auto_augment", "--auto-augment", "--aa", type=augment_policy, default=None,
                       help="ta_wide: TrivialAugmentWide, ra: RandAugment, augmix: AugMix, imagenet/cifar10/svhn: "
                       "AutoAugment with that policy (torchvision's); timm's strings (rand-m9-mstd0.5-inc1, augmix-m5, "
                       "v0, original) with timm's own transforms, if timm is installed")
    group.add_argument("--ra_magnitude", "--ra-magnitude", type=int, default=9, help="RandAugment magnitude")
    group.add_argument("--augmix_severity", "--augmix-severity", type=int, default=3, help="AugMix severity")
    group.add_argument("--random_erase", "--random-erase", type=float, default=0.0,
                       help="probability of RandomErasing (after normalisation)")
    group.add_argument("--reprob", type=float, dest="random_erase", action=TimmErasing,
                       help="timm's: --random_erase with timm's --remode pixel (unless --random_erase_mode is given)")
    group.add_argument("--random_erase_mode", "--remode", choices=ERASE_MODES, default=None,
                       help="what erased pixels become: const zeros (torchvision's), pixel: a normal value per "
                       "pixel, rand: one per channel (timm's); default const, pixel with timm's --reprob")
    group.add_argument("--interpolation", choices=["bilinear", "bicubic", "nearest"], default=None,
                       help="resampling of crops and resizes (auto-augment's rotations and shears: bilinear "
                       "for bicubic); default: bilinear; -e: the model's")
    group.add_argument("--ra_sampler", "--ra-sampler", action="store_true",
                       help="repeated augmentation: each image --ra_reps times per batch, differently augmented")
    group.add_argument("--ra_reps", "--ra-reps", type=runtime.positive_int, default=3,
                       help="copies per image with --ra_sampler")
    return group


# add_augment_args' flags (utils/checkpoint.py Role). The exports record the image sizes and resampling, with
# torchvision's defaults where neither the command line nor the model gives one; the validation's part of them may
# change on resume and is recorded with the results. Which images a step sees depends on the repeated-augmentation
# sampler; the other augmentations apply from the resumed step on.
AUGMENT_ROLES = {"--image_size": checkpoint.kept_by("--train_crop_size"),
                 "--train_crop_size": checkpoint.MUST_KEEP.recorded(224, evaluation=False),
                 "--val_crop_size": checkpoint.MAY_CHANGE.recorded(224),
                 "--val_resize": checkpoint.MAY_CHANGE.recorded(256),
                 "--interpolation": checkpoint.MAY_CHANGE.recorded("bilinear"), "--crop_scale": checkpoint.MAY_CHANGE,
                 "--crop_ratio": checkpoint.MAY_CHANGE, "--hflip": checkpoint.MAY_CHANGE,
                 "--auto_augment": checkpoint.MAY_CHANGE,
                 "--ra_magnitude": checkpoint.MAY_CHANGE, "--augmix_severity": checkpoint.MAY_CHANGE,
                 "--random_erase": checkpoint.MAY_CHANGE,
                 "--reprob": checkpoint.MAY_CHANGE, "--random_erase_mode": checkpoint.MAY_CHANGE,
                 "--ra_sampler": checkpoint.MUST_KEEP, "--ra_reps": checkpoint.MUST_KEEP}
IMAGE_ROLES = checkpoint.FlagRoles.of(add_augment_args, AUGMENT_ROLES)
IMAGE_DEFAULTS = IMAGE_ROLES.exported()  # {args attribute: default} of the image settings a model's exports record
EVAL_IMAGE_FLAGS = IMAGE_ROLES.evaluation()  # {flag: args attribute}: the validation's part, recorded with results


def resolve_augment_args(args, sizes_from_model=False):
    """Fill the image sizes from --image_size and the defaults, unless `sizes_from_model` (-e: resolve_image_sizes
    does it once the model is known), and check ranges (before anything starts)."""
    if not sizes_from_model:
        args.image_size = args.image_size or IMAGE_DEFAULTS["train_crop_size"]
        for key, default in IMAGE_DEFAULTS.items():
            setattr(args, key, getattr(args, key) or (args.image_size if key.endswith("crop_size") else default))
    for name in ("hflip", "random_erase"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise runtime.UserError(f"--{name} {getattr(args, name)}: a probability, between 0 and 1")
    resolve_erase_mode(args)
    if args.auto_augment and args.auto_augment not in AUTO_AUGMENT:
        timm_auto_augment(args.auto_augment, 224, "bilinear")  # a policy timm cannot read stops here, in one line
    if not 0.0 < args.crop_scale <= 1.0 or not 0.0 < args.crop_ratio[0] <= args.crop_ratio[1]:
        raise runtime.UserError(f"--crop_scale {args.crop_scale} / --crop_ratio {args.crop_ratio}: need 0 < scale <= 1 "
                                f"and 0 < MIN <= MAX")


def resolve_erase_mode(args):
    """--random_erase_mode as given; else timm's pixel for a command with timm's --reprob (said), else const."""
    if args.random_erase_mode is None:
        timm_flag = getattr(args, "timm_erasing", None)
        args.random_erase_mode = "pixel" if timm_flag else "const"
        if timm_flag:
            args.command_notes = (*args.command_notes, f"{timm_flag}: timm's per-pixel noise = --random_erase_mode "
                                  f"pixel")


def random_erasing(probability, mode):
    """torchvision's RandomErasing filling with timm's --remode: const zeros, pixel normal values per pixel, rand
    normal values per channel. Erased area and aspect ratio: timm's and torchvision's defaults, which agree."""
    if mode == "rand":
        return ChannelNoiseErasing(p=probability, value="random")
    return v2.RandomErasing(p=probability, value="random" if mode == "pixel" else 0)


class ChannelNoiseErasing(v2.RandomErasing):
    """RandomErasing whose rectangle is one normal value per channel (timm's --remode rand)."""

    def make_params(self, flat_inputs):
        params = super().make_params(flat_inputs)
        if params["v"] is not None:
            params["v"] = torch.empty((params["v"].shape[0], 1, 1), dtype=torch.float32).normal_()  # (C, 1, 1)
        return params


def timm_auto_augment(policy, image_size, interpolation):
    """timm's --aa `policy` as timm's transforms_imagenet_train builds it (timm.data.auto_augment), on the uint8
    tensors of this pipeline; a one-line UserError without timm or for a string timm does not read."""
    if importlib.util.find_spec("timm") is None:
        raise runtime.UserError(f"--aa {policy}: timm's policy strings need timm (pip install timm); without it, "
                                f"--auto_augment {'|'.join(AUTO_AUGMENT)}")
    from timm.data import auto_augment
    from timm.data.transforms import str_to_pil_interp
    hparams = {"translate_const": int(image_size * 0.45), "interpolation": str_to_pil_interp(interpolation),
               "img_mean": tuple(min(255, round(255 * x)) for x in image_data.IMAGENET_MEAN)}
    try:
        if policy.startswith("rand"):
            op = auto_augment.rand_augment_transform(policy, hparams)
        elif policy.startswith("augmix"):
            op = auto_augment.augment_and_mix_transform(policy, {**hparams, "translate_pct": 0.3})
        else:
            op = auto_augment.auto_augment_transform(policy, hparams)
    except (AssertionError, KeyError, ValueError) as err:
        raise runtime.UserError(f"--aa {policy}: timm does not read it ({err or type(err).__name__})") from None
    for step in getattr(op, "ops", []) + [step for sub_policy in getattr(op, "policy", []) for step in sub_policy]:
        if step.aug_fn is auto_augment.posterize:
            step.aug_fn = posterize_any_bits
    return TimmAugment(op)


def posterize_any_bits(image, bits_to_keep, **_):
    """timm's posterize, keeping 0 bits too: timm's strongest posterize levels keep 0 bits, a black image in the
    Pillow timm was written for, which Pillow >= 12 refuses (ValueError)."""
    if bits_to_keep >= 8:
        return image
    if bits_to_keep <= 0:
        return ImageOps.posterize(image, 1).point(lambda _: 0)
    return ImageOps.posterize(image, bits_to_keep)


class TimmAugment(torch.nn.Module):
    """A timm auto-augment op (PIL, Python's and numpy's generators) on a (3, H, W) uint8 tensor, its draws seeded from
    torch's generator, which the dataset seeds per image: the same for any number of processes, workers or resumes."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, image):
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
        python_state, numpy_state = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed)
        try:
            return v2.functional.pil_to_tensor(self.op(v2.functional.to_pil_image(image)))
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)

    def extra_repr(self):
        return repr(self.op)


def resolve_image_sizes(args, recorded, source, say, others=None, flags=None):
    """-e, --predict: each validation size, the resampling and `others` ({args attribute: default}; `flags` names them)
    as given, else as the model `recorded` them, else defaults. Returns the results tag of those given that differ."""
    flags = {**(flags or {}), "val_crop_size": "--val_crop_size" if args.val_crop_size else "--image_size"}
    args.val_crop_size = args.val_crop_size or args.image_size
    defaults = {**{key: IMAGE_DEFAULTS[key] for key in EVAL_IMAGE_FLAGS.values()}, **(others or {})}
    tag = export.settings_from_model(args, defaults, recorded, source, say, flags)
    args.train_crop_size = args.train_crop_size or args.image_size or recorded.get("train_crop_size",
                                                                                   args.val_crop_size)
    args.image_size = args.image_size or args.val_crop_size
    return tag


def use_recorded_settings(args, roles, record, source, say):
    """-e, --predict: every flag `roles` marks .recorded() as given, else as the trained model's `record` holds it,
    else its default, named in one line (docs/resnet.md#evaluating-later). Returns the results tag."""
    recorded = roles.recorded_in(record)
    flags = {dest: flag for flag, dest in roles.dests.items() if roles.table[flag].exported}
    absent = [dest for dest in flags if dest not in recorded and getattr(args, dest) is None
              and not (args.image_size and dest.endswith("crop_size"))]  # --image_size gives the crop sizes
    others = {dest: default for dest, default in roles.exported().items() if dest not in IMAGE_DEFAULTS}
    tag = resolve_image_sizes(args, recorded, source, say, others, flags)
    if recorded and absent:
        say(f"{source} records no {', '.join(flags[dest] for dest in absent)} (exported before the script recorded "
            f"it): using the default{'s' if len(absent) > 1 else ''}, "
            + ", ".join(f"{flags[dest]} {getattr(args, dest)}" for dest in absent))
    return tag


class RepeatedAugmentationSampler(Sampler):
    """torchvision's RASampler as ONE global order from (seed, epoch), which accelerate splits over the processes;
    items (index, repeat), copy-major so copies land on different processes (docs/code.md#image_augmentpy)."""

    def __init__(self, dataset, batch_size, reps, seed):
        if batch_size % reps:
            raise runtime.UserError(f"--ra_reps {reps}: must divide the global batch (-b {batch_size}), so that every "
                                    f"batch holds whole groups of copies")
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


# add_mixing_args' flags: each group's mixing is drawn from (seed, epoch, batch, group), so they apply from the
# resumed step on
MIXING_ROLES = {"--mixup_alpha": checkpoint.MAY_CHANGE, "--cutmix_alpha": checkpoint.MAY_CHANGE,
                "--mixup": checkpoint.MAY_CHANGE, "--cutmix": checkpoint.MAY_CHANGE,
                "--mixup_mode": checkpoint.MAY_CHANGE}


@checkpoint.roles_beside("MIXING_ROLES")
def add_mixing_args(parser):
    group = parser.add_argument_group("batch mixing (torchvision's MixUp/CutMix; timm's names in the docs)")
    group.add_argument("--mixup_alpha", "--mixup-alpha", type=runtime.nonnegative_float, default=0.0,
                       help="MixUp Beta(alpha, alpha); 0: off")
    group.add_argument("--cutmix_alpha", "--cutmix-alpha", type=runtime.nonnegative_float, default=0.0,
                       help="CutMix Beta(alpha, alpha); 0: off. Both set: one of the two per group")
    group.add_argument("--mixup", type=runtime.nonnegative_float, dest="mixup_alpha", action=TimmMixing,
                       help="timm's: --mixup_alpha with timm's --mixup-mode batch (unless --mixup_mode is given)")
    group.add_argument("--cutmix", type=runtime.nonnegative_float, dest="cutmix_alpha", action=TimmMixing,
                       help="timm's: --cutmix_alpha with timm's --mixup-mode batch (unless --mixup_mode is given)")
    group.add_argument("--mixup_mode", "--mixup-mode", choices=["pair", "batch"], default=None,
                       help="pair: each 2 images mixed together (exact for any process count); batch: each "
                       "process's share together (torchvision's); default pair, batch with timm's --mixup/--cutmix")
    return group


class TimmMixing(argparse.Action):
    """timm's --mixup / --cutmix: the alpha, and timm's batch mode unless --mixup_mode says otherwise."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.timm_mixing = option_string


def resolve_mixup_mode(args):
    """--mixup_mode as given; else timm's batch for a command with timm's --mixup/--cutmix (said), else pair."""
    if args.mixup_mode is None:
        timm_flag = getattr(args, "timm_mixing", None)
        args.mixup_mode = "batch" if timm_flag else "pair"
        if timm_flag:
            args.command_notes = (*args.command_notes, f"{timm_flag}: timm's whole-batch mixing = --mixup_mode batch")


def build_mixer(args, num_classes, per_process_batch):
    """The BatchMixer of --mixup_alpha/--cutmix_alpha, or None; an odd per-process batch cannot be paired."""
    if args.mixup_alpha <= 0 and args.cutmix_alpha <= 0:
        return None
    if args.mixup_mode == "pair" and per_process_batch % 2:
        raise runtime.UserError(f"--mixup_mode pair mixes pairs of images: the per-process batch ({per_process_batch}) "
                                f"must be even (change -b, or pass --mixup_mode batch)")
    return BatchMixer(args.mixup_alpha, args.cutmix_alpha, num_classes, args.seed, args.mixup_mode)


class BatchMixer:
    """Called on every process with its share of the global batch; returns mixed inputs and soft targets."""

    def __init__(self, mixup_alpha, cutmix_alpha, num_classes, seed, mode="pair"):
        ops = ([v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha > 0 else []) + \
              ([v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha > 0 else [])
        self.mix = ops[0] if len(ops) == 1 else v2.RandomChoice(ops)
        self.num_classes, self.seed, self.mode = num_classes, seed, mode

    def __call__(self, accelerator, inputs, targets, epoch, batch):
        """inputs (B, 3, H, W), targets (B,) -> inputs (B, 3, H, W), targets (B, num_classes), rows summing to
        1 (0 for placeholders). `batch`: the loader batch's index in the epoch."""
        size = 2 if self.mode == "pair" else inputs.shape[0]
        offset = accelerator.process_index * inputs.shape[0]  # this share's place in the global batch
        soft = F.one_hot(targets.clamp(min=0), self.num_classes).float() * (targets >= 0)[:, None]
        mixed_inputs, mixed_targets = inputs.clone(), soft
        for start in range(0, inputs.shape[0], size):
            group = slice(start, start + size)
            with torch.random.fork_rng(devices=[]):  # v2's Beta, randint and choice draw from the CPU generator
                torch.default_generator.manual_seed(hash((self.seed, epoch, batch, offset + start)))
                images, labels = self.mix(inputs[group], targets[group].clamp(min=0))
            # a group holding an unreadable image stays unmixed, chosen on the device: no read of the targets here
            readable = (targets[group] >= 0).all()  # ()
            mixed_inputs[group] = torch.where(readable, images, inputs[group])
            mixed_targets[group] = torch.where(readable, labels, soft[group])
        return mixed_inputs, mixed_targets


def soft_cross_entropy(logits, soft_targets, label_smoothing=0.0, class_weights=None):
    """Mean cross-entropy over rows whose target weights sum to > 0 (placeholders: all-zero rows); class_weights
    (C,): -sum_c w_c * t_c * log p_c, torch's weighting of soft targets: a mixed row weighs its classes by share."""
    losses = F.cross_entropy(logits, soft_targets, weight=class_weights, label_smoothing=label_smoothing,
                             reduction="none")
    readable = (soft_targets.sum(dim=1) > 0).float()
    return (losses * readable).sum() / readable.sum().clamp(min=1)


def dominant_labels(soft_targets, targets):
    """What the training accuracy is measured against: each row's largest-weight label (torchvision's
    utils.accuracy does the same with mixed targets); placeholders keep their negative target."""
    return torch.where(targets >= 0, soft_targets.argmax(dim=1), targets)
