"""MixUp / CutMix on training batches (torchvision.transforms.v2), seeded so that any number of processes
and any resume mix exactly the same images with the same lambdas.

torchvision mixes each process's whole batch with one lambda (what a run gets depends on the process count).
Here the batch is cut into groups at fixed positions of the GLOBAL batch, and each group is mixed on its own,
its randomness drawn from (seed, epoch, batch, position of the group): timm's `--mixup-mode pair` (groups of 2,
the default, exact for every process count) or `batch` (the whole share of a process, torchvision's; exact
only for the same process count). With both alphas set, v2.RandomChoice picks MixUp or CutMix per group.

Unreadable-image placeholders (target < 0) are never mixed into anything: a group holding one stays unmixed,
and the placeholder's target row is all zeros, which the loss and the accuracy skip.
"""
import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from .errors import UserError


def add_mixing_args(parser):
    group = parser.add_argument_group("batch mixing (torchvision's MixUp/CutMix; timm's names in the docs)")
    group.add_argument("--mixup_alpha", "--mixup-alpha", "--mixup", type=float, default=0.0,
                       help="MixUp Beta(alpha, alpha); 0: off")
    group.add_argument("--cutmix_alpha", "--cutmix-alpha", "--cutmix", type=float, default=0.0,
                       help="CutMix Beta(alpha, alpha); 0: off. Both set: one of the two per group")
    group.add_argument("--mixup_mode", "--mixup-mode", choices=["pair", "batch"], default="pair",
                       help="pair: each 2 images mixed together (exact for any process count); batch: each "
                            "process's share together (torchvision's)")
    return group


def build_mixer(args, num_classes, per_process_batch):
    """The BatchMixer of --mixup_alpha/--cutmix_alpha, or None; an odd per-process batch cannot be paired."""
    if args.mixup_alpha <= 0 and args.cutmix_alpha <= 0:
        return None
    if args.mixup_mode == "pair" and per_process_batch % 2:
        raise UserError(f"--mixup_mode pair mixes pairs of images: the per-process batch ({per_process_batch}) must "
                        "be even (change -b, or pass --mixup_mode batch)")
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
            if (targets[group] < 0).any():
                continue
            with torch.random.fork_rng(devices=[]):  # v2's Beta, randint and choice draw from the CPU generator
                torch.default_generator.manual_seed(hash((self.seed, epoch, batch, offset + start)))
                mixed_inputs[group], mixed_targets[group] = self.mix(inputs[group], targets[group])
        return mixed_inputs, mixed_targets


def soft_cross_entropy(logits, soft_targets, label_smoothing=0.0):
    """Mean cross-entropy over rows whose target weights sum to > 0 (placeholders are all-zero rows)."""
    losses = F.cross_entropy(logits, soft_targets, label_smoothing=label_smoothing, reduction="none")
    readable = (soft_targets.sum(dim=1) > 0).float()
    return (losses * readable).sum() / readable.sum().clamp(min=1)


def dominant_labels(soft_targets, targets):
    """What the training accuracy is measured against: each row's largest-weight label (torchvision's
    utils.accuracy does the same with mixed targets); placeholders keep their negative target."""
    return torch.where(targets >= 0, soft_targets.argmax(dim=1), targets)
