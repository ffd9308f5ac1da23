"""The image classifier's optimisation recipe, torchvision's references/classification/train.py: the optimizer and its
weight-decay groups (--opt, --norm_weight_decay, --bias_weight_decay), the learning-rate schedule (--lr_warmup_*,
--lr_min), stepped per optimizer step rather than per epoch, and the model EMA with torchvision's decay adjustment
computed on the GLOBAL batch (docs/code.md#image_optimpy).

Neighbours: utils/image_augment.py, utils/image_references.py.
"""
import importlib.util
import itertools
import math

import torch
from accelerate.utils import broadcast
from torch.optim.swa_utils import AveragedModel

from . import checkpoint, runtime

NORM_LAYERS = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm,
               torch.nn.modules.instancenorm._InstanceNorm, torch.nn.LocalResponseNorm)  # torchvision's list

# torchvision's names (steplr, cosineannealinglr, exponentiallr) and timm's (--sched step, cosine) of each schedule
SCHEDULERS = {"step": "step", "steplr": "step", "cosine": "cosine", "cosineannealinglr": "cosine",
              "exponential": "exponential", "exponentiallr": "exponential"}


@checkpoint.roles_beside("OPTIM_ROLES")
def add_optim_args(parser):
    group = parser.add_argument_group("optimisation (torchvision's names)")
    group.add_argument("--opt", type=str.lower, choices=["sgd", "sgd_nesterov", "adamw", "rmsprop", "rmsproptf"],
                       default="sgd", help="any case, as torchvision lower-cases it (--opt SGD); rmsproptf: timm's "
                       "TensorFlow-style RMSprop")
    # > 0: the cosine schedule is a fraction of --lr (lr_lambda), and a learning rate of 0 trains nothing
    group.add_argument("--lr", "--learning-rate", type=runtime.positive_float, default=0.1, help="peak learning rate")
    group.add_argument("--momentum", type=runtime.nonnegative_float, default=0.9, help="sgd, sgd_nesterov, rmsprop")
    group.add_argument("--wd", "--weight-decay", "--weight_decay", type=runtime.nonnegative_float, default=1e-4,
                       dest="weight_decay")
    group.add_argument("--norm_weight_decay", "--norm-weight-decay", type=runtime.nonnegative_float, default=None,
                       help="weight decay of normalisation layers' weights and biases (default: --wd)")
    group.add_argument("--bias_weight_decay", "--bias-weight-decay", type=runtime.nonnegative_float, default=None,
                       help="weight decay of every parameter named 'bias' (default: --wd)")
    group.add_argument("--lr_scheduler", "--lr-scheduler", "--sched", type=str.lower, choices=list(SCHEDULERS),
                       default="step", help="step|steplr: x--lr_gamma every --lr_step_epochs (main.py); "
                       "cosine|cosineannealinglr: to --lr_min at the last step; exponential|exponentiallr: x--lr_gamma "
                       "every epoch")
    group.add_argument("--lr_step_epochs", "--lr-step-size", "--decay-epochs", type=runtime.positive_int, default=30,
                       help="epochs between decays")
    group.add_argument("--lr_gamma", "--lr-gamma", "--decay-rate", type=float, default=0.1,
                       help="factor of each 'step' or 'exponential' decay")
    group.add_argument("--lr_min", "--lr-min", "--min-lr", type=runtime.nonnegative_float, default=0.0,
                       help="last learning rate of 'cosine'")
    group.add_argument("--warmup_epochs", "--lr_warmup_epochs", "--lr-warmup-epochs", "--warmup-epochs",
                       type=runtime.nonnegative_float,
                       default=0.0, dest="warmup_epochs", help="epochs of warmup")
    group.add_argument("--lr_warmup_method", "--lr-warmup-method", choices=["linear", "constant"], default="linear")
    group.add_argument("--lr_warmup_decay", "--lr-warmup-decay", type=float, default=0.01,
                       help="warmup starts at this fraction of --lr (torchvision's default)")
    group.add_argument("--clip_grad_norm", "--clip-grad-norm", "--clip-grad", type=runtime.positive_float, default=None,
                       help="largest global L2 norm of the gradients")
    return group


# add_optim_args' flags (utils/checkpoint.py Role): the command line's learning rate, decay and momentum win over
# the restored optimizer's, and the schedule is recomputed at the restored step; --opt and the norm/bias decays
# decide the optimizer's state and parameter groups, which the checkpoint must fit
OPTIM_ROLES = {"--opt": checkpoint.MUST_KEEP, "--lr": checkpoint.MAY_CHANGE, "--momentum": checkpoint.MAY_CHANGE,
               "--wd": checkpoint.MAY_CHANGE,
               "--norm_weight_decay": checkpoint.MUST_KEEP, "--bias_weight_decay": checkpoint.MUST_KEEP,
               "--lr_scheduler": checkpoint.MAY_CHANGE,
               "--lr_step_epochs": checkpoint.MAY_CHANGE, "--lr_gamma": checkpoint.MAY_CHANGE,
               "--lr_min": checkpoint.MAY_CHANGE,
               "--warmup_epochs": checkpoint.MAY_CHANGE, "--lr_warmup_method": checkpoint.MAY_CHANGE,
               "--lr_warmup_decay": checkpoint.MAY_CHANGE,
               "--clip_grad_norm": checkpoint.MAY_CHANGE}
# add_ema_args' flags: a checkpoint's EMA must be restored into an EMA; its cadence and decay apply from there on
EMA_ROLES = {"--model_ema": checkpoint.keep_as("model_ema"), "--model_ema_steps": checkpoint.MAY_CHANGE,
             "--model_ema_decay": checkpoint.MAY_CHANGE}


def parameter_groups(model, weight_decay, norm_weight_decay=None, bias_weight_decay=None):
    """torchvision's utils.set_weight_decay: groups 'other', 'norm' (if set), 'bias' (if set), empty ones left out."""
    groups = {"other": [], "norm": [], "bias": []}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            if bias_weight_decay is not None and name == "bias":
                groups["bias"].append(param)
            elif norm_weight_decay is not None and isinstance(module, NORM_LAYERS):
                groups["norm"].append(param)
            else:
                groups["other"].append(param)
    decay = {"other": weight_decay, "norm": norm_weight_decay, "bias": bias_weight_decay}
    return [{"params": params, "weight_decay": decay[key]} for key, params in groups.items() if params]


def build_optimizer(model, args):
    groups = parameter_groups(model, args.weight_decay, args.norm_weight_decay, args.bias_weight_decay)
    if args.opt in ("sgd", "sgd_nesterov"):
        return torch.optim.SGD(groups, args.lr, momentum=args.momentum, nesterov=args.opt == "sgd_nesterov")
    if args.opt == "rmsprop":  # torchvision's eps and alpha (TF's RMSProp)
        return torch.optim.RMSprop(groups, args.lr, momentum=args.momentum, eps=0.0316, alpha=0.9)
    if args.opt == "rmsproptf":  # timm's --opt rmsproptf, as timm.optim.create_optimizer_v2 builds it
        if importlib.util.find_spec("timm") is None:
            raise runtime.UserError("--opt rmsproptf is timm's optimizer: pip install timm")
        from timm.optim import RMSpropTF
        return RMSpropTF(groups, args.lr, alpha=0.9, momentum=args.momentum)
    return torch.optim.AdamW(groups, args.lr)


def load_optimizer_state(optimizer, state, source):
    """A legacy checkpoint's optimizer state (momentum buffers); the command line keeps its hyperparameters."""
    hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as err:
        raise runtime.UserError(f"{source}: optimizer state does not fit this model and --opt ({err})") from None
    for group, chosen in zip(optimizer.param_groups, hyperparameters):
        group.update(chosen, initial_lr=chosen["lr"])


def schedule_from(optimizer, factor, start_step):
    """The LambdaLR of `factor` (lr_lambda's), positioned after `start_step` optimizer steps: a run continued from a
    .pth file or --start-epoch starts inside the schedule. LambdaLR takes the base learning rate from each group's
    `initial_lr`, which only a loaded optimizer state brings (load_optimizer_state): a fresh optimizer's --lr is it."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=start_step - 1)


def lr_lambda(args, steps_per_epoch, total_steps):
    """The factor of --lr after `step` optimizer steps: warmup, then step decay or cosine to --lr_min."""
    warmup_steps = round(args.warmup_epochs * steps_per_epoch)
    kind = SCHEDULERS[args.lr_scheduler]
    if kind != "cosine" and args.lr_min:
        raise runtime.UserError("--lr_min applies to --lr_scheduler cosine only")

    def factor(step):
        if step < warmup_steps:
            if args.lr_warmup_method == "constant":
                return args.lr_warmup_decay
            return args.lr_warmup_decay + (1 - args.lr_warmup_decay) * (step + 1) / warmup_steps
        if kind == "step":
            return args.lr_gamma ** (step // steps_per_epoch // args.lr_step_epochs)
        if kind == "exponential":  # torchvision's ExponentialLR, stepped once per epoch
            return args.lr_gamma ** (step // steps_per_epoch)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return (args.lr_min + (args.lr - args.lr_min) * 0.5 * (1 + math.cos(math.pi * progress))) / args.lr

    return factor


@checkpoint.roles_beside("EMA_ROLES")
def add_ema_args(parser):
    group = parser.add_argument_group("model EMA (torchvision's --model-ema; timm's --model-ema too)")
    group.add_argument("--model_ema", "--model-ema", action="store_true",
                       help="keep an exponential moving average of the weights, evaluated and exported beside them")
    group.add_argument("--model_ema_steps", "--model-ema-steps", type=runtime.positive_int, default=32,
                       help="optimizer steps between EMA updates")
    group.add_argument("--model_ema_decay", "--model-ema-decay", type=float, default=0.99998,
                       help="decay per update before torchvision's adjustment for batch, steps and epochs")
    return group


class ExponentialMovingAverage(AveragedModel):
    """torchvision's: avg = decay * avg + (1 - decay) * param, buffers (BatchNorm statistics) averaged too."""

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)
        self.decay = decay

    @torch.no_grad()
    def update_parameters(self, model):
        """AveragedModel's update with the same arithmetic, without reading its count on the host (its
        `if self.n_averaged == 0` is a device sync at every update): the first update copies the weights and buffers,
        each later one averages them, chosen on the device."""
        first = self.n_averaged == 0  # () bool, on the average's device
        for averaged, current in zip(itertools.chain(self.module.parameters(), self.module.buffers()),
                                     itertools.chain(model.parameters(), model.buffers()), strict=True):
            current = current.detach().to(averaged.device)
            averaged.copy_(torch.where(first, current, self.avg_fn(averaged, current, self.n_averaged)))
        self.n_averaged += 1


def adjusted_decay(decay, images_per_step, ema_steps, epochs):
    """torchvision's decay adjustment, images_per_step = world_size * batch_size (per GPU)."""
    alpha = min(1.0, (1.0 - decay) * images_per_step * ema_steps / epochs)
    return 1.0 - alpha


def build_ema(args, model, device, images_per_step):
    """The EMA of `model` (unprepared), or None without --model_ema."""
    if not args.model_ema:
        return None
    if args.model_ema_steps < 1 or not 0.0 <= args.model_ema_decay <= 1.0:
        raise runtime.UserError(f"--model_ema_steps {args.model_ema_steps} / --model_ema_decay {args.model_ema_decay}: "
                                f"need steps >= 1 and 0 <= decay <= 1")
    decay = adjusted_decay(args.model_ema_decay, images_per_step, args.model_ema_steps, args.epochs)
    return ExponentialMovingAverage(model, decay, device=device)


@torch.no_grad()
def update_ema(ema, model, step_in_epoch, epoch, args, accelerator=None):
    """torchvision's train_one_epoch: update every model_ema_steps batches of the epoch (the first included),
    and reset to a copy of the weights while the epoch is a warmup epoch."""
    if ema is None or step_in_epoch % args.model_ema_steps:
        return
    ema.update_parameters(model)
    if epoch < args.warmup_epochs:
        ema.n_averaged.fill_(0)  # torchvision: "keep copying weights during warmup period"
    if accelerator is not None and accelerator.num_processes > 1:
        # DDP keeps the weights equal on every process but not the BatchNorm statistics (each process updates them
        # from its own share until the next forward broadcasts rank 0's). Every process keeps rank 0's average,
        # the one saved in checkpoints: validation then uses one EMA, and a resumed run continues exactly.
        for buffer in ema.module.buffers():
            broadcast(buffer, from_process=0)
