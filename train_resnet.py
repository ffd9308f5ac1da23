"""ImageNet classification (pytorch/examples imagenet/main.py) on Hugging Face Accelerate.

main.py's model-placement branches (DataParallel, DDP with and without --gpu, mp.spawn, CPU) are one code
path here; the hardware comes from the launcher and accelerate_configs/*.yaml:
    python train_resnet.py /data/imagenet -a resnet50                      # one GPU, or the CPU
    accelerate launch --config_file accelerate_configs/4gpu.yaml train_resnet.py /data/imagenet -a resnet50
    python train_resnet.py /data/imagenet -a resnet50 -e --resume outputs/resnet/model_best.pth
    python train_resnet.py /data/imagenet -a resnet50 --resume latest     # exact resume, even mid-epoch
    python train_resnet.py --predict photos/ --resume outputs/resnet/model_best.pth --topk 5  # predictions.jsonl
A tiny CPU run on scikit-learn's real handwritten digits written as an ImageFolder (2 processes of gloo DDP, under
half a minute on 2 cores; the test suite runs these two commands as printed and expects a top-1 accuracy above 50%,
chance being 10%; its 2 epochs of 21 steps reach about 70%):
    python -c "from utils.demo_data import write_digits_imagefolder as w; w('demo_data/digits_tiny', size=16)"
    OMP_NUM_THREADS=1 accelerate launch --config_file accelerate_configs/cpu_ddp.yaml train_resnet.py --cpu \
        demo_data/digits_tiny --image_size 16 --val_resize 16 --hflip 0 --crop_scale 0.5 -b 64 --lr 0.2 \
        --momentum 0 --lr_scheduler cosine --epochs 2 -j 0 --output_dir outputs/resnet_tiny --overwrite_output_dir
To adapt it (another model, a transform, a loss term, other numbers from the validation), change the functions of its
ADAPTATION SECTION, right below the imports: nothing else names a model class, a transform or a metric's computation.
-b is the GLOBAL batch (main.py's "total batch size of all GPUs"): the same command trains the same way on any
number of processes. main.py's --world-size, --rank, --dist-url, --dist-backend, --multiprocessing-distributed
and --gpu are the launcher's business now: pass one to see what replaces it.
torchvision's references/classification recipe flags and dashed spellings, and timm:NAME: docs/resnet_recipes.md.
Outputs: model_best.pth / checkpoint.pth (main.py's layout, plain torchvision state_dict, torchvision's references'
keys, the recorded flags), model_card.md (how to load model_best.pth, its metrics), checkpoints/step_N (exact
resume), metrics.jsonl, all_results.json and all_results_settings.json (eval_results*.json with -e),
training_curves.png; with --predict, predictions.jsonl alone (docs/resnet.md).
"""
import argparse
import difflib
import functools
import gc
import importlib.util
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

# Start-up creates nearly 400,000 long-lived objects (torch, torchvision, matplotlib) and little garbage; at
# Python's default thresholds the collector walks all of them several times meanwhile, about 0.4 s of CPU per process.
# Full collections become rare; young objects are collected as before.
gc.set_threshold(700, 10, 1000)

import torch
import torch.nn.functional as F
import torchvision
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from torchvision.models.resnet import BasicBlock, Bottleneck
from torchvision.transforms import v2

from utils import (checkpoint, export, flags, image_augment, image_data, image_device_decode, image_model, image_optim,
                   image_references, loop, onnx_export, outputs, runtime)

MODEL_NAMES = sorted(torchvision.models.list_models(module=torchvision.models))  # classification models only
TIMM_METRIC_NAMES = {"top1": "acc1", "top5": "acc5"}  # timm's --eval-metric spellings of evaluate()'s names


def unknown_arch(arch):
    """The one line for an --arch that torchvision does not have: the closest torchvision names, and timm:NAME
    where timm has the model (timm's --model seresnet34 is -a timm:seresnet34 here)."""
    close = difflib.get_close_matches(arch, MODEL_NAMES, n=3)
    line = f"--arch {arch}: not a torchvision classification model"
    if importlib.util.find_spec("timm") is not None:
        import timm
        if timm.is_model(arch):
            return f"{line}; timm's {arch} is -a timm:{arch}"
    return line + (f" (did you mean {', '.join(close)}?)" if close else f"; choose from {', '.join(MODEL_NAMES)}")


# ---------------------------------------------------------------------------------------------------------------------
# Adaptation: the functions to change to adapt this script. The rest of it and utils/ take what these return and never
# name a model class, a transform or a metric's computation.
#   build_model / empty_model   the model (-a, its starting weights, a head for the data's classes), and its twin on
#                               the meta device whose parameter names the exports must have; a trained one is loaded
#                               back strictly into build_model's model (-e, --predict, --resume FILE, exported_model)
#                               or by accelerate's load_state (checkpoints/step_N). A flag that shapes the model gets
#                               a `.recorded()` role in FLAG_ROLES: the exports record it and those rebuild with it
#   train_transform /           the training and validation pipelines, torchvision transforms.v2 steps on a (3, H, W)
#   val_transform               uint8 image: each image's random draws are seeded by (seed, epoch, image), so a new
#                               random step resumes exactly; --decode_on_device replays the steps on the device and
#                               refuses at start-up, in one line, a step it cannot replay, saying how to make it
#                               replayable (utils/image_device_decode.py; v2.RandomApply: its ReplayableRandomApply)
#   train_sampler               the training images' order: None (shuffled) or one global order from (seed, epoch)
#   training_loss               the loss of one (micro-)batch: a mean over its readable images
#   evaluate                    the validation's numbers, {name: number} (`samples`: the images counted), each
#                               printed in the console's line after each epoch, logged (metrics.jsonl's `eval`
#                               events, the trackers), recorded (all_results.json's and model_card.md's `eval_NAME`,
#                               `ema_NAME` for the EMA's; model_best.pth's and checkpoint.pth's NAME), a choice of
#                               --metric_for_best_model / --eval-metric that selects model_best.pth, and, a fraction,
#                               plotted in training_curves.png: a number added here is all of that, with no other list
#                               to edit (a run that trains calls evaluate once on one validation batch before its first
#                               step to learn the names: utils/loop.py validation_names)
# ---------------------------------------------------------------------------------------------------------------------
CHECKPOINTED_BLOCKS = (BasicBlock, Bottleneck)  # --gradient_checkpointing recomputes each (timm models: their own)


def build_model(args, num_classes, print_fn=print, class_to_idx=None):
    """A torchvision (or timm) model: its starting weights (--weights, --pretrained) with, for another class count or
    other class names, a new head (rows reordered for the same names in another order), and --drop_path/--drop
    (utils/image_model.py)."""
    return image_model.build(args, num_classes, print_fn, class_to_idx)


def empty_model(args, num_classes):
    """build_model's model without weights (no download, no memory): the parameter names plain torchvision loads."""
    no_weights = argparse.Namespace(**{**vars(args), "pretrained": False, "weights": None})
    return export.on_meta_device(lambda: build_model(no_weights, num_classes))


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
    elif args.auto_augment in image_augment.AUTO_AUGMENT:
        steps.append(v2.AutoAugment(v2.AutoAugmentPolicy(args.auto_augment), interpolation=mode))
    elif args.auto_augment:  # timm's --aa strings, with timm's own transforms
        steps.append(image_augment.timm_auto_augment(args.auto_augment, args.train_crop_size, args.interpolation))
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(image_data.IMAGENET_MEAN, image_data.IMAGENET_STD)]
    if args.random_erase > 0:
        steps.append(image_augment.random_erasing(args.random_erase, args.random_erase_mode))
    return v2.Compose(steps)


def val_transform(args):
    """Resize the shorter side, center crop, normalise: torchvision's ClassificationPresetEval."""
    return v2.Compose([v2.Resize(args.val_resize, interpolation=v2.InterpolationMode(args.interpolation),
                                 antialias=True),
                       v2.CenterCrop(args.val_crop_size), v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(image_data.IMAGENET_MEAN, image_data.IMAGENET_STD)])


def train_sampler(args, train_set):
    """The training images' order, or None for accelerate's seedable shuffling. A sampler here yields ONE global
    order (split over the processes), drawn from --seed and the epoch of set_epoch(epoch) alone; len(): the samples
    of an epoch; items: indices, or (index, repeat) for an image drawn again (docs/resnet.md#the-training-sampler)."""
    if args.ra_sampler:
        return image_augment.RepeatedAugmentationSampler(train_set, args.batch_size, args.ra_reps, args.seed)
    return None


def classification_loss(logits, targets, label_smoothing=0.0, class_weights=None):
    """Mean cross-entropy over the readable images (target >= 0); 0, not NaN, for a batch with none. class_weights
    (C,): each image's cross-entropy times its class's weight, still averaged over the images (utils/loop.py
    ClassWeights)."""
    losses = F.cross_entropy(logits, targets.clamp(min=0), weight=class_weights, label_smoothing=label_smoothing,
                             reduction="none")
    readable = (targets >= 0).float()
    return (losses * readable).sum() / readable.sum().clamp(min=1)


def training_loss(logits, labels, soft_labels, args, class_weights=None):
    """The loss of this process's (micro-)batch, logits (b, C): against MixUp/CutMix's soft targets (b, C) where the
    batch was mixed (soft_labels not None), else against the labels (b,)."""
    if soft_labels is not None:
        return image_augment.soft_cross_entropy(logits, soft_labels, args.label_smoothing, class_weights)
    return classification_loss(logits, labels, args.label_smoothing, class_weights)


@torch.no_grad()
def evaluate(accelerator, model, loader, args, guard=None):
    """Top-1/top-5 accuracy (%) and mean loss over exactly the validation images, on any number of processes;
    `guard`: a training run's PreemptionGuard, which abandons the evaluation on a stop."""
    model.eval()
    images = 0
    top1 = 0
    top5 = 0
    skipped = 0
    loss_sum = 0.0
    batches = guard.batches(loader) if guard else loader
    for inputs, targets in image_device_decode.decode_on_device(outputs.progress(accelerator, batches,
                                                                                 desc="validation", leave=False,
                                                                                 total=len(loader)),
                                                                accelerator.device):
        if args.channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        logits = model(inputs).float()  # (B, C)
        # every rank gets the same full batch, minus the duplicates padded onto the last one
        logits, targets = accelerator.gather_for_metrics((logits, targets))
        readable = targets >= 0
        if not args.skip_bad_images and not readable.all():
            raise image_data.bad_image_error(loader.dataset, targets.min().item())
        correct = image_data.topk_hits(logits[readable], targets[readable], ks=(1, 5)).tolist()
        images += int(readable.sum())
        top1 += correct[0]
        top5 += correct[1]
        skipped += int((~readable).sum())
        loss_sum += F.cross_entropy(logits[readable], targets[readable], reduction="sum").item()
    model.train()
    n = max(images, 1)
    return {"acc1": 100.0 * top1 / n, "acc5": 100.0 * top5 / n, "loss": loss_sum / n, "samples": images,
            "skipped_images": skipped}
# --------------------------------------------------------------------------- end of the adaptation section -----------


def build_parser():
    """Every flag (utils/flags.py Parser: one-line errors, the other tools' spellings); each one's role for a resume
    and the export is declared in FLAG_ROLES below."""
    parser = flags.Parser(description=__doc__, roles=FLAG_ROLES, roles_in=f"FLAG_ROLES in {Path(__file__).name}")
    parser.refuse("pytorch/examples imagenet/main.py", image_references.MAIN_PY_FLAGS)
    parser.refuse("torchvision's references/classification/train.py", image_references.TORCHVISION_FLAGS)
    parser.refuse("timm's train.py", image_references.TIMM_FLAGS)
    data = parser.add_argument_group("data")
    data.add_argument("data", nargs="?", type=Path, help="ImageFolder root holding train/<class>/ and val/<class>/")
    data.add_argument("--data-path", "--data_path", "--data-dir", type=Path, dest="data_path",
                      help="torchvision's --data-path, timm's --data-dir: the same")
    data.add_argument("-j", "--workers", type=runtime.nonnegative_int, default=4, help="DataLoader workers per process")
    data.add_argument("--dummy", nargs="?", type=runtime.positive_int, const=image_data.IMAGENET_TRAIN_IMAGES,
                      metavar="TRAIN_IMAGES",
                      help="random images instead of data (main.py's FakeData); default: ImageNet's count")
    data.add_argument("--skip_bad_images", action="store_true", help="skip and count unreadable images, not stop")
    data.add_argument("--decode_on_device", "--decode-on-device", action="store_true",
                      help="workers only read the files; JPEG decoding and augmentation run on the training device, "
                      "a batch at a time (utils/image_device_decode.py)")
    model = parser.add_argument_group("model")
    model.add_argument("-a", "--arch", "--model", default=None,
                       help="any torchvision classification model name, or timm:NAME for a timm model (default: "
                       "resnet18; -e, --predict: the model's)")
    image_model.add_model_args(model)  # --pretrained [PATH], --weights NAME|PATH, --drop_path, --drop
    model.add_argument("--sync_bn", "--sync-bn", action="store_true", help="BatchNorm statistics over all processes")
    model.add_argument("--channels_last", "--channels-last", action="store_true",
                       help="NHWC memory format (faster on tensor cores)")
    train = parser.add_argument_group("training")
    train.add_argument("--epochs", type=runtime.positive_int, default=90)
    train.add_argument("--start-epoch", type=runtime.nonnegative_int, default=0,
                       help="epochs done (the schedule starts there)")
    train.add_argument("-b", "--batch-size", "--batch_size", type=runtime.positive_int, default=256,
                       help=f"GLOBAL images per step, split over the processes: {image_references.BATCH_RULE}")
    train.add_argument("--per_device_batch_size", type=runtime.positive_int, action=flags.PerDevice, dest="batch_size",
                       metavar="N",
                       global_flag="-b", help="images per process per step (torchvision's and timm's -b): times the "
                       "processes = -b")
    train.add_argument("--label_smoothing", "--label-smoothing", "--smoothing", type=float, default=0.0,
                       help="training loss only")
    train.add_argument("--class_weights", default=None, metavar="balanced|FILE", help=loop.CLASS_WEIGHTS_HELP)
    train.add_argument("--gradient_accumulation_steps", "--grad-accum-steps", type=runtime.positive_int, default=1,
                       help="batches per optimizer step")
    train.add_argument("--seed", type=int, default=42, help="model init, shuffling and augmentation")
    output = parser.add_argument_group("output")
    output.add_argument("--output_dir", "--output-dir", type=Path, default=Path("outputs/resnet"))
    output.add_argument("--overwrite_output_dir", action="store_true")
    output.add_argument("-p", "--print-freq", "--log-interval", type=runtime.positive_int, default=10,
                        help="optimizer steps between log lines")
    output.add_argument("--log_sample_indices", action="store_true",
                        help="write each optimizer step's sample indices, per process, to OUTPUT_DIR/sample_indices/: "
                        "to check that 1 and N processes, or a resumed run, train the same samples in the same order")
    output.add_argument("--checkpointing_steps", type=runtime.positive_int, default=None,
                        help="optimizer steps between resumable checkpoints; default: end of each epoch")
    output.add_argument("--save_total_limit", type=runtime.nonnegative_int, default=2, help="checkpoints kept (0: all)")
    output.add_argument("--resume", "--resume_from_checkpoint", default=None, metavar="PATH",
                        help="'latest' or checkpoints/step_N (exact resume), or a .pth/.pth.tar file (main.py's, "
                        "or our model_best.pth / checkpoint.pth: weights, optimizer if there, epoch)")
    output.add_argument("-e", "--evaluate", "--test-only", "--test_only", action="store_true",
                        help="evaluate --resume's (or --weights) weights on val/, no training, at the model's sizes")
    checkpoint.add_allow_data_change(output)
    predict = parser.add_argument_group("prediction (no labels needed; the model's sizes and classes)")
    predict.add_argument("--predict", nargs="+", type=Path, metavar="PATH",
                         help="label images with --resume's export (model_best.pth): folders (searched recursively), "
                         "image files, or .txt files listing image paths; writes predictions.jsonl")
    predict.add_argument("--topk", type=runtime.positive_int, default=5, help="classes per image in predictions.jsonl")
    for add_group in (image_augment.add_augment_args, image_augment.add_mixing_args, image_optim.add_ema_args,
                      image_optim.add_optim_args, onnx_export.add_onnx_args,
                      runtime.add_runtime_args):
        add_group(parser)
    loop.add_selection_args(parser, "acc1, main.py's (timm's top1 and top5 name acc1 and acc5)",
                            ("--eval-metric", "--eval_metric"))
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)  # a flag without a role (FLAG_ROLES) stops here in one line, before anything starts
    if (args.data is None and args.dummy is None and args.pretrained not in (None, "DEFAULT")
        and not image_model.is_weights_file(args.pretrained)):  # main.py's `--pretrained DATA`: DATA is the data
        args.data, args.pretrained = Path(args.pretrained), "DEFAULT"
    if args.data and args.data_path and args.data != args.data_path:
        parser.error(f"two data paths: {args.data} and --data-path {args.data_path}; pass one")
    args.data = args.data or args.data_path
    onnx_export.check_onnx_args(parser, args)
    if args.export_onnx and (args.predict or args.decode_on_device):
        parser.error("--export_onnx exports the trained or -e's evaluated model, checked on decoded validation images: "
                     "not with --predict or --decode_on_device")
    if args.predict:
        check_predict_args(parser, args)
    elif args.data is None and args.dummy is None:
        parser.error("pass the data directory (an ImageFolder root with train/ and val/) or --dummy")
    try:
        image_augment.resolve_augment_args(args, sizes_from_model=args.evaluate or bool(args.predict))
        image_augment.resolve_mixup_mode(args)
    except runtime.UserError as err:
        parser.error(str(err))
    if not (args.evaluate or args.predict):  # -e and --predict take the recorded flags from the model, in main
        for dest, default in flag_roles().exported().items():
            setattr(args, dest, default if getattr(args, dest) is None else getattr(args, dest))
    if args.predict:  # the architecture, when not given, and the sizes come from the export
        return args
    args.arch = args.arch or (None if args.evaluate else "resnet18")  # -e: the evaluated model's, read in main
    if args.arch and not args.arch.startswith("timm:") and args.arch not in MODEL_NAMES:
        parser.error(unknown_arch(args.arch))
    image_model.check_model_args(parser, args)  # and --weights from --pretrained
    if args.evaluate and args.model_ema:
        parser.error("--evaluate/--test-only evaluates one model: for the EMA, --resume checkpoint_ema.pth or "
                     "model_best_ema.pth (its own export), without --model_ema")
    if args.evaluate and not (args.resume or args.weights):
        parser.error("--evaluate needs weights: --resume PATH, --weights NAME or --pretrained")
    if args.evaluate and args.class_weights:
        parser.error("--class_weights weighs the training loss; --evaluate does not train (its loss is unweighted)")
    loop.check_selection_args(parser, args, not args.evaluate)
    return args


def check_predict_args(parser, args):
    """--predict labels images with a trained export, and does nothing else."""
    if args.data or args.dummy:
        parser.error("--predict labels the images it names; it takes no data directory or --dummy")
    if args.evaluate:
        parser.error("--predict and -e/--evaluate: one at a time (-e measures accuracy on a labelled val/)")
    if not args.resume:
        parser.error("--predict needs the trained model's export: --resume FILE (model_best.pth or checkpoint.pth)")
    if args.weights or args.pretrained:
        parser.error("--predict takes the weights from --resume FILE; drop --weights/--pretrained")
    if args.arch and not args.arch.startswith("timm:") and args.arch not in MODEL_NAMES:
        parser.error(unknown_arch(args.arch))


# Each flag's role (utils/checkpoint.py ROLE_MEANINGS; the shared helpers' flags beside their add_*_args):
# MAY_CHANGE on resume (named, then applied), MUST_KEEP (refused otherwise; keep_as: recorded under that name,
# kept_by: through the must_match entry main computes from it), THIS_LAUNCH, FRESH_START;
# `.recorded()`: the exports record it (model_best.pth's image settings). Every option of build_parser() has exactly
# one entry (a shared helper's, in its *_ROLES spread here): otherwise every command stops with one line naming the
# flag; --help shows each flag's role. The optimizer's flags come first: the order of the "resumed with changed
# settings" line.
FLAG_ROLES = {
    **image_optim.OPTIM_ROLES, "--epochs": checkpoint.MAY_CHANGE,  # the schedule is recomputed at the restored step
    # data: the training images are part of the checkpoint (their list's fingerprint)
    "data": checkpoint.kept_by(checkpoint.DATA_KEY), "--data-path": checkpoint.kept_by(checkpoint.DATA_KEY),
    "--dummy": checkpoint.kept_by(checkpoint.DATA_KEY),
    **checkpoint.this_launch("-j", "--skip_bad_images", "--decode_on_device"),
    # model: the architecture must match; the starting weights matter to a fresh run only
    "-a": checkpoint.keep_as("arch"), **image_model.MODEL_ROLES, "--sync_bn": checkpoint.MAY_CHANGE,
    "--channels_last": checkpoint.THIS_LAUNCH,
    # training: the global batch, its accumulation and the seed decide which images (and augmentations) each step
    # sees; the loss's smoothing applies from the resumed step on
    "--start-epoch": checkpoint.FRESH_START, "-b": checkpoint.keep_as("global_batch_size"),
    "--per_device_batch_size": checkpoint.keep_as("global_batch_size"), "--label_smoothing": checkpoint.MAY_CHANGE,
    "--class_weights": checkpoint.kept_by("class_weights"), "--gradient_accumulation_steps": checkpoint.MUST_KEEP,
    "--seed": checkpoint.MUST_KEEP,
    **checkpoint.this_launch("--output_dir", "--overwrite_output_dir", "-p", "--checkpointing_steps",
                             "--save_total_limit",
                             "--resume", "-e", "--allow_data_change", "--predict", "--topk"),
    "--log_sample_indices": checkpoint.THIS_LAUNCH,  # a record of what each step trains on, which it does not change
    **image_augment.AUGMENT_ROLES, **image_augment.MIXING_ROLES, **image_optim.EMA_ROLES,
    **onnx_export.ONNX_ROLES,
    **checkpoint.this_launch("--cpu", "--mixed_precision", "--fp16", "--bf16", "--dist_backend", "--ddp_timeout",
                             "--data_parallel", "--report_to", "--with_tracking", "--gradient_checkpointing",
                             "--auto_find_batch_size"),
    # which kernels compute each step, not what is trained: a resume may add or drop it (bitwise equality with an
    # uninterrupted run needs it in every launch of both, on a GPU)
    "--use_deterministic_algorithms": checkpoint.THIS_LAUNCH,
    **loop.SELECTION_ROLES,
}


@functools.cache
def flag_roles():
    """FLAG_ROLES checked against build_parser() (RoleError if a flag has no role) and resolved to args attributes."""
    return build_parser().flag_roles()


def trained_with(args):
    """What the exports record beside the weights: every flag FLAG_ROLES marks .recorded() (image sizes, a head's
    shape), which -e, --predict and exported_model rebuild and evaluate the model with."""
    return flag_roles().exported_settings(args)


def evaluation_settings(args):
    """The recorded settings a validation's numbers depend on, recorded with them (`eval_settings`)."""
    return {dest: getattr(args, dest) for dest in flag_roles().evaluation().values()}


def model_flags(args):
    """{flag: value} of the recorded flags beyond the image settings: how build_model shaped the model (none in this
    script as it ships; a flag a user adds for a head, say), which plain torchvision cannot rebuild (model_card)."""
    roles = flag_roles()
    return {flag: getattr(args, roles.dests[flag]) for flag, role in roles.table.items()
            if role.exported and roles.dests[flag] not in image_augment.IMAGE_DEFAULTS}


def exported_model(path, args=None, say=print):
    """(model, export): build_model's model with the weights of this script's export `path` (model_best.pth,
    checkpoint.pth), rebuilt from the file alone: its architecture, classes and recorded flags (trained_with), where
    `args` (a parsed command line; None: the parser's defaults) does not give them; the image sizes end up in `args`."""
    args = args or build_parser().parse_args([])
    saved = export.load_torch_checkpoint(path)
    class_to_idx = saved.get("class_to_idx")
    if not class_to_idx:
        raise runtime.UserError(f"{path}: records no class names (a main.py or torchvision file?); the model is "
                                f"rebuilt from this script's export, model_best.pth or checkpoint.pth")
    use_trained_settings(args, saved, path, say)
    model = build_model(args, len(class_to_idx), say)
    export.load_weights(model, saved["state_dict"], path)
    return model, saved


def use_trained_settings(args, record, source, say):
    """-e, --predict, exported_model: the architecture and every .recorded() flag from the trained model's `record`
    (an export's fields, a checkpoint's training_state.json) where the command line gives none; an -a that differs is
    refused naming both, other sizes are used and named (docs/resnet.md#evaluating-later). Returns the results tag."""
    image_references.check_legacy_compatible(record, {"arch": args.arch} if args.arch else {}, source)
    args.arch = args.arch or record.get("arch") or "resnet18"
    image_model.check_arch(args)
    return image_augment.use_recorded_settings(args, flag_roles(), record, source, say)


@dataclass
class ImageData:
    """The datasets and their (unprepared) loaders; batch size = GLOBAL batch."""
    train_set: torch.utils.data.Dataset
    val_set: torch.utils.data.Dataset
    train_loader: DataLoader
    val_loader: DataLoader


def build_dataloaders(accelerator, args):
    """Train and val ImageFolders of args.data (or --dummy data) and their loaders."""
    train_steps = train_transform(args)
    val_steps = val_transform(args)
    image_device_decode.check_decode_on_device(args, (train_steps, val_steps))
    if args.dummy is not None:
        train_set, val_set = image_data.build_dummy_datasets(args.dummy, args.train_crop_size, args.val_crop_size)
    else:
        transforms = (train_steps, val_steps, args.train_crop_size, args.val_crop_size)
        folder = image_device_decode.EncodedImageFolder if args.decode_on_device else image_data.RGBImageFolder
        train_set, val_set = image_data.build_datasets(args.data, args.seed, transforms, folder, accelerator.print)
    common = dict(batch_size=args.batch_size, **runtime.loader_settings(args.workers))
    sampler = train_sampler(args, train_set)
    # None: shuffled by accelerate's seedable sampler
    order = dict(shuffle=True) if sampler is None else dict(sampler=sampler)
    # drop_last: a last batch of 1 image per process breaks BatchNorm at small resolutions (timm drops it too)
    train_loader = DataLoader(train_set, drop_last=True, generator=runtime.loader_generator(args.seed), **order,
                              **common,
                              collate_fn=image_device_decode.collate_for(train_set))
    if len(train_loader) == 0 and not args.evaluate:
        raise runtime.UserError(f"{args.data or '--dummy'}: {len(train_set)} training images, fewer than one batch (-b "
                                f"{args.batch_size})")
    return ImageData(train_set, val_set, train_loader, DataLoader(val_set, **common,
                                                                  collate_fn=image_device_decode.collate_for(val_set)))


def best_model_selection(accelerator, args, model, val_loader):
    """Which validation metric selects model_best.pth: --metric_for_best_model or timm's --eval-metric (default acc1,
    main.py's best_acc1), one of the numbers evaluate() returns, whose names one evaluation of a validation batch
    gives before training (a mistyped one stops the run there, in one line naming them); -e selects nothing."""
    names = None if args.evaluate else loop.validation_names(accelerator, model, val_loader, lambda batches: evaluate(
        accelerator, model, batches, args))
    loop.resolve_selection(args, names, TIMM_METRIC_NAMES, default="acc1")
    return loop.Selection.from_args(args, position="epoch")


def place_model(model, args):
    """What main.py did by hand before DDP, done before accelerator.prepare."""
    if args.sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.gradient_checkpointing:  # after SyncBatchNorm replaced the BatchNorm layers that it adjusts
        image_model.enable_gradient_checkpointing(model, args.arch, CHECKPOINTED_BLOCKS)
    return runtime.maybe_data_parallel(model, args)


@torch.no_grad()
def predicted_rows(accelerator, model, loader, dataset, labels, topk, tally):
    """predictions.jsonl's rows in input order, a batch at a time: every rank runs its part of each batch, the batch's
    top-k is gathered, and the main process makes its rows (only one batch's are held). `tally` counts the images and
    the unreadable files among them, on every rank."""
    model.eval()
    for inputs, items in outputs.progress(accelerator, loader, desc="predict", leave=False):
        probabilities = model(inputs).float().softmax(dim=-1)  # (B, C)
        top = probabilities.topk(topk, dim=-1)  # (B, k) each
        # every rank gets the whole batch, minus the duplicates padded onto the last one
        items, scores, classes = (t.tolist() for t in accelerator.gather_for_metrics((items, top.values, top.indices)))
        if accelerator.is_main_process:
            yield from image_data.prediction_rows(dataset, tally["images"], items, scores, classes, labels)
        tally["images"] += len(items)
        tally["skipped"] += sum(item < 0 for item in items)
    if tally["images"] != len(dataset):
        raise RuntimeError(f"{tally['images']} predictions gathered for {len(dataset)} files")


def predict_images(accelerator, args):
    """--predict: predictions.jsonl, one row per image in input order, from --resume's export (model_best.pth), at
    the architecture, classes and image sizes it records; an unreadable file's row says why."""
    if not Path(args.resume).is_file():
        raise runtime.UserError(f"--resume {args.resume}: no such file; --predict needs the trained model's export (an "
                                f"output directory's model_best.pth or checkpoint.pth)")
    model, saved = exported_model(args.resume, args, accelerator.print)  # and the image sizes into args
    class_to_idx = saved["class_to_idx"]
    dataset = image_data.PredictImages(image_data.files_to_predict(args.predict), val_transform(args),
                                       args.val_crop_size)
    loader = DataLoader(dataset, batch_size=args.batch_size, **runtime.loader_settings(args.workers))
    model, loader = accelerator.prepare(model, loader)
    labels = sorted(class_to_idx, key=class_to_idx.get)
    log = outputs.RunLog(accelerator, args.output_dir)
    tally = Counter()
    # write_jsonl consumes the rows on every rank as they come: the main process's, none on the others
    log.write_jsonl("predictions.jsonl", predicted_rows(accelerator, model, loader, dataset, labels,
                                                        min(args.topk, len(class_to_idx)), tally))
    skipped = tally["skipped"]
    accelerator.print(f"wrote {len(dataset) - skipped} predictions and {skipped} rows for unreadable files to "
                      f"{args.output_dir / 'predictions.jsonl'}, one row per input image in input order")
    results = {**runtime.run_info(accelerator, args.batch_size), "predict_images": len(dataset),
               "predict_skipped": skipped}
    log.end()
    return results


def log_values(epoch, accuracy, loss, lr, speed):
    """One log line's values (metrics.jsonl's `train` event): ImageCounts.read()'s accuracy, the window's mean loss,
    and Throughput.read()'s speed as main.py's times, in seconds per step."""
    return {"epoch": epoch, "loss": loss, "acc1": accuracy["acc1"], "acc5": accuracy["acc5"], "lr": lr,
            "step_time": speed["ms_per_step"] / 1000, "data_time": speed["data_ms_per_step"] / 1000,
            "images_per_second": speed["samples_per_second"], "skipped_images": accuracy["skipped_images"]}


def train_line(epoch, batch, num_batches, v):
    """main.py's progress line, with units and throughput; v: the window's values."""
    return (f"Epoch: [{epoch}][{batch:>{len(str(num_batches))}}/{num_batches}] | Time {v['step_time']:.3f} s/step | "
            f"Data {v['data_time']:.3f} s/step | Loss {v['loss']:.4f} | Acc@1 {v['acc1']:6.2f} | Acc@5 "
            f"{v['acc5']:6.2f} | lr {v['lr']:.2e} | {v['images_per_second']:,.0f} images/s")


def export_weights(accelerator, model, args, fields, is_best, ema_state=None, suffix=""):
    """checkpoint.pth every epoch, model_best.pth when best: main.py's layout with torchvision's keys, loadable by
    plain torchvision, with `fields` beside the state dict (arch, class_to_idx, epoch, the epoch's validation numbers:
    acc1, ..., best_<metric>: best_acc1 by default, what the model was trained with). checkpoint.pth also holds the
    EMA's state (torchvision's `model_ema` key); suffix "_ema": the EMA's own files."""
    fresh = empty_model(args, len(fields["class_to_idx"]))
    image_references.export_main_py_checkpoints(accelerator, model, fresh, args.output_dir, is_best, fields, ema_state,
                                                suffix)


def validate(accelerator, model, ema, val_loader, args, guard=None):
    """The model's validation metrics and, with --model_ema, the EMA's beside them (keys prefixed `ema_`)."""
    metrics = evaluate(accelerator, model, val_loader, args, guard)
    ema_metrics = evaluate(accelerator, ema.module, val_loader, args, guard) if ema else {}
    return {**metrics, **{f"ema_{k}": v for k, v in ema_metrics.items()}}


def end_of_epoch(accelerator, training, args, log, epoch, completed_steps, class_to_idx, guard):
    """main.py validates and exports after every epoch; the EMA is validated and exported beside the model. A stop
    during the validation abandons it (EvaluationAbandoned), leaving it due at this step (VALIDATION_DUE)."""
    state = training.state
    ema = training.ema
    selection = training.selection
    state[checkpoint.VALIDATION_DUE] = True
    metrics = validate(accelerator, training.model, ema, training.val_loader, args, guard)
    state[checkpoint.VALIDATION_DUE] = False
    # the same gathered metrics on every rank: every rank exports (a collective) and stops at the same epoch
    is_best = selection.update(state, metrics, epoch)
    ema_best = ema and selection.update_ema(state, metrics)
    log.log("eval", completed_steps,
            {"epoch": epoch, **metrics, "train_seconds": time.perf_counter() - state["start_time"]})
    best = selection.best(state) if state["best_epoch"] else float("nan")
    log.console(f" * Epoch {epoch} | {outputs.format_numbers(metrics)} | best {selection.metric} {best:.4f} (epoch "
                f"{state['best_epoch']})")
    own, averaged = split_ema(metrics)
    # best_epoch: a run continued from the file (--resume checkpoint.pth) knows which epoch model_best.pth holds
    fields = dict(arch=args.arch, class_to_idx=class_to_idx, epoch=epoch, step=completed_steps,
                  best_epoch=state["best_epoch"], **trained_with(args))
    best_key = selection.best_key
    export_weights(accelerator, training.model, args, {**own, **fields, best_key: selection.best(state)}, is_best,
                   ema.state_dict() if ema else None)
    if is_best:  # model_card.md describes model_best.pth
        log.write_model_card(args.output_dir / "model_card.md", {
            **selection.results(state), **{f"eval_{k}": v for k, v in own.items()},
            "launches": training.checkpoints.launches})
    if ema:
        export_weights(accelerator, ema.module, args,
                       {**averaged, **fields, best_key: state.get(f"best_ema_{selection.metric}")}, ema_best,
                       suffix="_ema")
    return metrics


def split_ema(metrics):
    """validate()'s numbers as (the model's, the EMA's without their `ema_` prefix)."""
    numbers = outputs.number_entries(metrics)
    return ({k: v for k, v in numbers.items() if not k.startswith("ema_")},
            {k[len("ema_"):]: v for k, v in numbers.items() if k.startswith("ema_")})


def export_selected_onnx(accelerator, args, model, val_loader, class_to_idx):
    """--export_onnx: `model` (-e's evaluated one; None after training: model_best.pth's weights) as
    OUT/onnx/model.onnx, checked on the first --onnx_check_samples validation images (utils/onnx_export.py), with
    config.json beside it (onnx_config); its onnx_* results. Every rank calls it; the main process exports."""
    results = {}
    with runtime.writing(accelerator, args.output_dir / "onnx"):
        if accelerator.is_main_process:
            model = model or load_best_model(args)
            images = (({"pixel_values": inputs}, targets) for inputs, targets in val_loader)
            batches = onnx_export.check_batches(images, args.onnx_check_samples)
            results = onnx_export.export_and_check(model, batches, args.output_dir / "onnx", args.onnx_int8,
                                                   sequence_axis=False, say=accelerator.print)
            (args.output_dir / "onnx" / "config.json").write_text(json.dumps(onnx_config(args, class_to_idx),
                                                                             indent=2, ensure_ascii=False) + "\n")
    return results


def onnx_config(args, class_to_idx):
    """config.json beside model.onnx, what running it needs with nothing else: the class of each output (id2label,
    label2id, as transformers' configs name them), the input's preprocessing (val_transform's: shorter side resized
    to val_resize, center crop, scaled to [0, 1], normalised) and what the model was trained with."""
    labels = sorted(class_to_idx, key=class_to_idx.get)
    return {"arch": args.arch, "num_labels": len(labels), "id2label": dict(enumerate(labels)),
            "label2id": {label: index for index, label in enumerate(labels)},
            "preprocessing": {"input": "pixel_values (batch, 3, height, width), RGB", "resize": args.val_resize,
                              "center_crop": args.val_crop_size, "interpolation": args.interpolation,
                              "rescale_factor": 1 / 255, "mean": list(image_data.IMAGENET_MEAN),
                              "std": list(image_data.IMAGENET_STD)},
            "output": "logits (batch, num_labels)", "trained_with": trained_with(args)}


def load_best_model(args):
    """A fresh model with model_best.pth's weights."""
    best = export.load_torch_checkpoint(args.output_dir / "model_best.pth")
    model = build_model(argparse.Namespace(**{**vars(args), "pretrained": False, "weights": None}),
                        len(best["class_to_idx"]))
    export.load_weights(model, best["state_dict"], args.output_dir / "model_best.pth")
    return model


def validate_and_stop(accelerator, training, args, log, task, guard, epoch, completed_steps):
    """The epoch's validation and exports, then whether the run stops there: (metrics, the step of an early stop or
    None, whether a SIGTERM stops it). A stop during the validation abandons it: (None, None, True)."""
    guard.step = completed_steps  # the step an abandoned validation names
    try:
        metrics = end_of_epoch(accelerator, training, args, log, epoch, completed_steps,
                               task.must_match["class_to_idx"], guard)
    except loop.EvaluationAbandoned as abandoned:
        accelerator.print(f"{abandoned}: the checkpoint keeps it due, and the resumed run validates first")
        return None, None, True
    accelerator.on_main_process(plot_curves)(log, args, training.cadence.steps_per_epoch, split_ema(metrics)[0])
    stopped_at = completed_steps if training.selection.should_stop(training.state) else None
    return metrics, stopped_at, guard.should_stop(completed_steps) and stopped_at is None  # an early stop: no resume


def plot_curves(log, args, steps_per_epoch, numbers):
    """training_curves.png from metrics.jsonl: per epoch, each fraction among the validation's `numbers` (acc1,
    loss, ...: not the counts), beside training's where its log lines measure it too (main process)."""
    curves = [(name, name) for name, value in numbers.items() if not isinstance(value, Integral)]
    outputs.plot_training_curves(log.read_events("train"), log.read_events("eval"),
                                 args.output_dir / "training_curves.png",
                                 steps_per_epoch, curves, title=f"{args.arch} on {args.data or 'dummy data'}")


@dataclass
class Task:
    """What main resolved before training that the loop needs."""
    must_match: dict  # what a resumed checkpoint must agree with
    selection: loop.Selection  # the validation metric that selects model_best.pth, and early stopping
    class_weights: torch.Tensor | None  # (C,) --class_weights
    legacy: dict | None  # a main.py-layout checkpoint (--resume FILE) to start from
    continues_run: bool  # --resume FILE lies in --output_dir: the run there goes on (its log, its best model)


@dataclass
class Training:
    """What the training loop works with, prepared for this launch (prepare_training)."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: torch.nn.Module | None  # --model_ema's average of the weights
    mixer: object | None  # --mixup_alpha/--cutmix_alpha's BatchMixer
    train_loader: DataLoader
    val_loader: DataLoader
    checkpoints: checkpoint.Checkpoints
    state: dict  # where the run starts (a checkpoint's position) and what it selected so far (best_*)
    cadence: loop.Cadence
    selection: loop.Selection  # which validation metric selects model_best.pth, and early stopping


def prepare_training(args, accelerator, model, data, log, task, resume_dir):
    """Optimizer, schedule, EMA and batch mixing, prepared, then restored from `resume_dir` (--resume's checkpoint, or
    one an earlier attempt of this launch saved) or started at a main.py checkpoint's epoch; prints the run summary."""
    legacy, must_match, selection = task.legacy if resume_dir is None else None, task.must_match, task.selection
    steps_per_epoch = math.ceil(len(data.train_loader) / args.gradient_accumulation_steps)
    total_steps = args.epochs * steps_per_epoch
    start_epoch = image_references.start_epoch_of(legacy, args.start_epoch)  # main.py: epochs done
    optimizer = image_optim.build_optimizer(model, args)
    if legacy and "optimizer" in legacy:
        image_optim.load_optimizer_state(optimizer, legacy["optimizer"], args.resume)  # brings the momentum buffers
    # Per optimizer step, sized from the UNprepared loader; with split_batches the prepared one steps once per step.
    scheduler = image_optim.schedule_from(optimizer, image_optim.lr_lambda(args, steps_per_epoch, total_steps),
                                          start_epoch * steps_per_epoch)
    if resume_dir is None and (legacy or start_epoch):
        accelerator.print(image_references.continuation_line(args, legacy, start_epoch * steps_per_epoch, total_steps,
                                                             scheduler.get_last_lr()[0]))
    ema = image_optim.build_ema(args, model, accelerator.device, args.batch_size * args.gradient_accumulation_steps)
    if ema and legacy and "model_ema" in legacy:  # our checkpoint.pth carries the average on
        export.load_weights(ema.module, legacy["model_ema"], args.resume)  # load_torch_checkpoint's averaged weights
        ema.n_averaged.fill_(1)  # an average, not a fresh copy: the next update moves it
    mixer = image_augment.build_mixer(args, len(must_match["class_to_idx"]),
                                      args.batch_size // accelerator.num_processes)
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, data.train_loader, data.val_loader, scheduler)

    checkpoints = checkpoint.Checkpoints(accelerator, args.output_dir, args.save_total_limit, must_match,
                                         checkpoint.resume_settings(args, flag_roles().resumable()),
                                         exports=["model_best.pth", "model_card.md", "model_best_ema.pth",
                                                  "checkpoint_ema.pth"],
                                         modules={"ema": ema} if ema else None,  # ema.safetensors in every checkpoint
                                         allow_data_change=args.allow_data_change,
                                         best_export_step=lambda: image_references.exported_step(
                                             args.output_dir / "model_best.pth", steps_per_epoch),
                                         per_process=checkpoint.per_process_differences(model), say=log.console)
    # Another run's file: its best was measured elsewhere, model_best.pth is the best of this run. This directory's
    # own file (the run goes on): the best it records stays the one to beat.
    fresh = {"completed_steps": start_epoch * steps_per_epoch, "epoch": start_epoch, "batches_in_epoch": 0,
             **selection.fresh_state(),
             **(image_references.selection_from_file(legacy, selection) if task.continues_run else {})}
    state = checkpoints.restore(resume_dir, fresh, len(train_loader), optimizer, scheduler)
    log.open(resume_step=state["completed_steps"] if resume_dir or task.continues_run else None, state=state)
    runtime.print_run_summary(accelerator, "Running training", {
        **runtime.run_info(accelerator, args.batch_size), "arch": args.arch, "classes": len(must_match["class_to_idx"]),
        "train_images": len(data.train_set), "val_images": len(data.val_set),
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "images_per_optimizer_step": args.batch_size * args.gradient_accumulation_steps,
        "steps_per_epoch": steps_per_epoch, "epochs": args.epochs, "total_steps": total_steps,
        "start_step": state["completed_steps"],
        "checkpoints_resume_on": checkpoint.resumable_process_counts(args.batch_size),
        "mixing": f"mixup {args.mixup_alpha} cutmix {args.cutmix_alpha} ({args.mixup_mode})" if mixer else "off",
        "model_ema_decay": f"{ema.decay:.6g} every {args.model_ema_steps} steps" if ema else "off"})
    checkpoint.say_processes(accelerator.print, accelerator.num_processes, checkpoints.per_process)
    # main.py's cadence: a log line every -p steps, validation and exports at each epoch's end
    cadence = loop.Cadence(total_steps, steps_per_epoch, len(train_loader), log_every=args.print_freq,
                           checkpoint_every=args.checkpointing_steps)
    return Training(model, optimizer, scheduler, ema, mixer, train_loader, val_loader, checkpoints, state, cadence,
                    selection)


@dataclass
class TrainResult:
    model: torch.nn.Module  # the last model (main.py's; model_best.pth holds the best)
    metrics: dict | None  # the last validation's metrics (None when preempted before one)
    results: dict  # all_results.json's training entries
    preempted: bool  # stopped on SIGTERM after saving a checkpoint


def train(args, accelerator, model, data, log, task, attempt):
    """The training loop; `attempt`: micro-batches and the checkpoint to start from (OutOfMemoryRetry)."""
    training = prepare_training(args, accelerator, model, data, log, task, attempt.resume)
    samples = outputs.SampleLog(accelerator, args.output_dir, training.train_loader, args.gradient_accumulation_steps,
                                enabled=args.log_sample_indices)
    model, optimizer, scheduler, state = training.model, training.optimizer, training.scheduler, training.state
    ema, mixer, cadence = training.ema, training.mixer, training.cadence
    guard = loop.PreemptionGuard(accelerator, training.checkpoints.latest)
    meter = loop.LossMeter(accelerator.device)
    speed = loop.Throughput(data_wait=True)  # images/s of training alone: evaluation and epoch starts apart
    counts = image_data.ImageCounts(accelerator, data.train_set, args.skip_bad_images)  # top-1/top-5, unreadable
    health = loop.HealthCheck(accelerator, meter, model, training.checkpoints.latest, "--lr",
                              also=[counts.check_unreadable])
    # every batch is full: only an epoch's last accumulation window is short
    loss_scale = loop.LossScale(accelerator, len(data.train_loader.sampler), args.batch_size,
                                args.gradient_accumulation_steps, drop_last=True)
    completed_steps = state["completed_steps"]
    images_seen = 0
    preempted = False
    last_metrics = None  # the last validation's
    stopped_at = None  # the step of an early stop
    bar = outputs.progress(accelerator, total=cadence.total_steps, initial=completed_steps)
    state["start_time"] = time.perf_counter()
    model.train()
    if state[checkpoint.VALIDATION_DUE]:  # a stop abandoned the validation of the epoch this checkpoint ends
        last_metrics, stopped_at, preempted = validate_and_stop(accelerator, training, args, log, task, guard,
                                                                state["epoch"], completed_steps)
    for epoch in range(state["epoch"], args.epochs):
        if preempted or stopped_at is not None:
            break
        data.train_set.set_epoch(epoch)  # the random crops and flips depend on seed + epoch + image only
        batches, batches_in_epoch = loop.epoch_batches(accelerator, training.train_loader, epoch, state)
        window = None  # where the accumulation window began, what a stop inside it goes back to
        for inputs, targets in speed.epoch(image_device_decode.decode_on_device(batches, accelerator.device)):
            window = window or guard.start_window(batches_in_epoch, model)
            if mixer:  # soft targets (B, classes); accuracy against each row's largest-weight label
                inputs, soft_targets = mixer(accelerator, inputs, targets, epoch, batches_in_epoch)
                targets = image_augment.dominant_labels(soft_targets, targets)
            if args.channels_last:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            with accelerator.accumulate(model):
                for _, (images, labels, soft_labels) in attempt.micro_batches(  # the batch, or its micro-batches
                        model, (inputs, targets, soft_targets if mixer else None)):
                    logits = model(images)  # (b, C), b = this process's share of the batch, or a micro-batch of it
                    loss = training_loss(logits, labels, soft_labels, args, task.class_weights)
                    # accelerate divides by the full accumulation count, also in an epoch's shorter last window
                    accelerator.backward(loss * loss_scale.window_scale(batches_in_epoch) * len(labels) / len(targets))
                    meter.update(loss, counts.add(logits, labels))  # the loss is a mean over the readable images
                if args.clip_grad_norm and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            batches_in_epoch += 1
            images_seen += args.batch_size
            if not accelerator.sync_gradients:
                if guard.stops_inside_window(completed_steps, window, model):
                    preempted, batches_in_epoch = True, window.first_batch
                    with speed.pause("save"):
                        training.checkpoints.save(completed_steps, state, epoch, batches_in_epoch)
                    break
                continue
            window = None
            completed_steps += 1
            samples.step(completed_steps, epoch, batches_in_epoch)
            step_in_epoch = completed_steps - 1 - epoch * cadence.steps_per_epoch
            image_optim.update_ema(ema, accelerator.unwrap_model(model), step_in_epoch, epoch, args, accelerator)
            speed.step(args.batch_size * loss_scale.window_batches(batches_in_epoch - 1))
            bar.update(1)
            due = cadence.after_step(completed_steps, batches_in_epoch)
            if due.log:
                health.check(completed_steps)
                values = log_values(epoch + 1, counts.read(), meter.mean(accelerator), scheduler.get_last_lr()[0],
                                    speed.read())
                log.console(train_line(epoch + 1, batches_in_epoch, len(training.train_loader), values))
                log.log("train", completed_steps, values)
            if due.evaluate:  # at each epoch's end
                health.check(completed_steps, parameters=True)
                with speed.pause("eval"):
                    last_metrics, stopped_at, preempted = validate_and_stop(accelerator, training, args, log, task,
                                                                            guard, epoch + 1, completed_steps)
            else:
                preempted = guard.should_stop(completed_steps)
            if (due.checkpoint and stopped_at is None) or preempted:
                health.check(completed_steps, parameters=True)
                with speed.pause("save"):
                    training.checkpoints.save(completed_steps, state, epoch, batches_in_epoch)
            if preempted or stopped_at is not None:
                break
    bar.close()
    guard.close(preempted)  # from here on, SIGTERM stops the run at once
    if not preempted:  # trained to its end: the abandoned branches are rotated
        training.checkpoints.finish()
    if last_metrics is None and not preempted:  # resumed with no epoch left to train
        last_metrics = validate(accelerator, model, ema, training.val_loader, args)
    results = train_results(training, speed, counts, completed_steps, images_seen, stopped_at)
    return TrainResult(model, last_metrics, results, preempted)


def train_results(training, speed, counts, completed_steps, images_seen, stopped_at):
    """all_results.json's training entries: start-up and training time, steps, images/s, the launches, what the
    selection of model_best.pth (and early stopping) recorded."""
    seconds = time.perf_counter() - training.state["start_time"]
    selection, state = training.selection, training.state
    return {"startup_seconds": speed.startup_seconds, "train_runtime": seconds, "train_steps": completed_steps,
            "launches": training.checkpoints.launches, "train_images_per_second": images_seen / seconds,
            "train_skipped_images": counts.skipped_total, selection.best_key: selection.best(state),
            **selection.results(state, stopped_at, ema=bool(training.ema))}


def main(args):
    accelerator = runtime.build_accelerator(args, args.output_dir, args.gradient_accumulation_steps,
                                            loader_workers=2 * args.workers)  # the train and validation loaders
    flags.say_command(accelerator.print, args, flags.batch_line("-b", args.batch_size, accelerator.num_processes,
                                                                image_references.BATCH_RULE))
    runtime.hold_output_dir(accelerator, args.output_dir)
    set_seed(args.seed)
    if args.predict:
        checkpoint.check_global_batches(accelerator, {"-b": args.batch_size})
        return predict_images(accelerator, args)
    if args.sync_bn and accelerator.num_processes > 1 and accelerator.device.type == "cpu":
        raise runtime.UserError("--sync_bn: torch's SyncBatchNorm runs on GPUs only; drop it for multi-process CPU runs")
    if args.resume not in (None, "latest") and not Path(args.resume).exists():
        raise runtime.UserError(f"--resume {args.resume}: no such file or directory")
    legacy_file = args.resume is not None and Path(args.resume).is_file()
    resume_dir = None if legacy_file else checkpoint.agree_on_resume(accelerator, args.resume,
                                                                     args.output_dir / "checkpoints",
                                                                     modules=["ema"] if args.model_ema else [])
    if args.evaluate and args.resume and not legacy_file and resume_dir is None:
        raise runtime.UserError(f"--resume {args.resume}: no checkpoint in {args.output_dir / 'checkpoints'}")
    # a training resume keeps the checkpoint's global batch; an evaluation may use another
    per_device_batch = checkpoint.check_global_batches(accelerator, {"-b": args.batch_size},
                                                       None if args.evaluate else resume_dir,
                                                       saved_as="global_batch_size")
    resuming = resume_dir is not None or args.resume == "latest"
    continues_run = legacy_file and Path(args.resume).resolve().parent == args.output_dir.resolve()
    if not args.evaluate:
        outputs.check_output_dir(args.output_dir, args.overwrite_output_dir,
                                 args.resume if resuming or continues_run else None)
    legacy = export.load_torch_checkpoint(args.resume) if legacy_file else None
    if args.evaluate:  # the model as it was trained, unless given; the tag names other sizes
        fields = legacy or (checkpoint.read_training_state(resume_dir) if resume_dir
                            else image_model.weights_file_fields(args.weights))
        results_tag = use_trained_settings(args, fields, args.resume if legacy_file else resume_dir or args.weights,
                                           accelerator.print)
    data = build_dataloaders(accelerator, args)
    class_to_idx = data.train_set.class_to_idx
    class_weights = loop.load_class_weights(args.class_weights, list(class_to_idx), getattr(data.train_set, "targets",
                                                                                            None))
    if class_weights:
        accelerator.print(class_weights.line())
    model = build_model(args, len(class_to_idx), accelerator.print, class_to_idx)
    selection = best_model_selection(accelerator, args, model, data.val_loader)
    # what a resumed run must share with its checkpoint: what main computes from the flags kept_by it, and the
    # MUST_KEEP flags' values (FLAG_ROLES)
    must_match = flag_roles().must_match(args, {
        "class_to_idx": class_to_idx,
        "class_weights": class_weights and class_weights.by_label,  # a resumed run keeps its loss
        checkpoint.DATA_KEY: image_data.fingerprint_images(data.train_set), **selection.must_match()})
    if legacy_file:
        image_references.check_legacy_compatible(legacy, {"arch": args.arch, "class_to_idx": class_to_idx}, args.resume)
        export.load_weights(model, legacy["state_dict"], args.resume)
        accelerator.print(f"Loaded {args.resume} (epoch {legacy.get('epoch')}, best_acc1 {legacy.get('best_acc1')})")
    elif args.evaluate and resume_dir is not None:  # loaded by load_state once prepared (any FSDP/DeepSpeed layout)
        checkpoint.check_compatible(checkpoint.read_training_state(resume_dir), {"arch": args.arch,
                                                                                 "class_to_idx": class_to_idx},
                                    resume_dir)
    model = place_model(model, args)
    retry = loop.OutOfMemoryRetry(accelerator, model, per_device_batch, args.gradient_accumulation_steps,
                                  args.output_dir / "checkpoints", args.auto_find_batch_size and not args.evaluate)
    log = outputs.RunLog(accelerator, args.output_dir)
    results = runtime.run_info(accelerator, args.batch_size)
    if args.evaluate:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        model, val_loader = accelerator.prepare(model, data.val_loader)  # with a loader: DeepSpeed wants one
        if resume_dir is not None:
            checkpoint.load_weights(accelerator, resume_dir)
        metrics = evaluate(accelerator, model, val_loader, args)
        prefix = "eval" + results_tag
        results.update({f"{prefix}_{k}": v for k, v in metrics.items()},
                       **{f"{prefix}_settings": evaluation_settings(args)})
        if args.export_onnx:
            results.update(export_selected_onnx(accelerator, args, accelerator.unwrap_model(model), data.val_loader,
                                                class_to_idx))
        log.write_results(f"{prefix}_results.json", {**results, "weights": str(args.resume or args.weights)})
        log.merge_results(results, (f"{prefix}_",))
    else:
        log.start(args, "resnet", clear=args.overwrite_output_dir and not (resuming or continues_run),
                  card=image_references.model_card(args, class_to_idx, data.train_set, data.val_set, results,
                                                   Path(__file__),
                                                   model_flags(args)))
        task = Task(must_match, selection, class_weights and class_weights.tensor(accelerator.device), legacy,
                    continues_run)
        trained = retry.run(lambda attempt: train(args, accelerator, model, data, log, task, attempt),
                            resume=resume_dir)
        results.update(trained.results, **retry.results)
        if results["stopped_early"]:
            accelerator.print(f"stopped early at step {results['stopped_early_at_step']}: "
                              f"{results['stopped_early_reason']}")
        if trained.preempted:
            accelerator.print("stopped on SIGTERM after saving a checkpoint; continue with --resume latest")
            log.write_results("all_results.json", {**results, "preempted": True})
            log.end()
            return results
        results.update({f"eval_{k}": v for k, v in trained.metrics.items()}, eval_settings=evaluation_settings(args))
        if args.export_onnx:
            results.update(export_selected_onnx(accelerator, args, None, data.val_loader, class_to_idx))
        log.write_results("all_results.json", results)
    accelerator.print(json.dumps(results, indent=2))
    log.end()
    return results


if __name__ == "__main__":
    runtime.run_cli(main, parse_args())
