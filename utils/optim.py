"""Optimizer, weight-decay groups and learning-rate schedule of torchvision's references/classification/train.py
(utils.set_weight_decay, --opt, --lr-warmup-*, --lr-min), stepped per optimizer step instead of per epoch.
"""
import math

import torch

from .errors import UserError

NORM_LAYERS = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm,
               torch.nn.modules.instancenorm._InstanceNorm, torch.nn.LocalResponseNorm)  # torchvision's list
SCHEDULERS = {"step": "step", "steplr": "step", "cosine": "cosine", "cosineannealinglr": "cosine"}


def add_optim_args(parser):
    group = parser.add_argument_group("optimisation (torchvision's names)")
    group.add_argument("--opt", choices=["sgd", "sgd_nesterov", "adamw", "rmsprop"], default="sgd")
    group.add_argument("--lr", "--learning-rate", type=float, default=0.1, help="peak learning rate")
    group.add_argument("--momentum", type=float, default=0.9, help="sgd, sgd_nesterov, rmsprop")
    group.add_argument("--wd", "--weight-decay", "--weight_decay", type=float, default=1e-4, dest="weight_decay")
    group.add_argument("--norm_weight_decay", "--norm-weight-decay", type=float, default=None,
                       help="weight decay of normalisation layers' weights and biases (default: --wd)")
    group.add_argument("--bias_weight_decay", "--bias-weight-decay", type=float, default=None,
                       help="weight decay of every parameter named 'bias' (default: --wd)")
    group.add_argument("--lr_scheduler", "--lr-scheduler", choices=list(SCHEDULERS), default="step",
                       help="step|steplr: x--lr_gamma every --lr_step_epochs (main.py); "
                            "cosine|cosineannealinglr: to --lr_min at the last step")
    group.add_argument("--lr_step_epochs", "--lr-step-size", type=int, default=30, help="epochs between decays")
    group.add_argument("--lr_gamma", "--lr-gamma", type=float, default=0.1, help="factor of each 'step' decay")
    group.add_argument("--lr_min", "--lr-min", type=float, default=0.0, help="last learning rate of 'cosine'")
    group.add_argument("--warmup_epochs", "--lr_warmup_epochs", "--lr-warmup-epochs", type=float, default=0.0,
                       dest="warmup_epochs", help="epochs of warmup")
    group.add_argument("--lr_warmup_method", "--lr-warmup-method", choices=["linear", "constant"], default="linear")
    group.add_argument("--lr_warmup_decay", "--lr-warmup-decay", type=float, default=0.01,
                       help="warmup starts at this fraction of --lr (torchvision's default)")
    group.add_argument("--clip_grad_norm", "--clip-grad-norm", type=float, default=None,
                       help="largest global L2 norm of the gradients")
    return group


def resume_settings(args):
    """add_optim_args' flags (and --epochs, the schedule's length) that a resumed run may change: every checkpoint
    records them, and a resumed run names the ones that differ and applies them from there on."""
    return {"--lr": args.lr, "--momentum": args.momentum, "--wd": args.weight_decay, "--epochs": args.epochs,
            "--lr_scheduler": args.lr_scheduler, "--lr_step_epochs": args.lr_step_epochs,
            "--warmup_epochs": args.warmup_epochs, "--lr_warmup_method": args.lr_warmup_method,
            "--lr_warmup_decay": args.lr_warmup_decay, "--lr_min": args.lr_min}


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
    return torch.optim.AdamW(groups, args.lr)


def load_optimizer_state(optimizer, state, source):
    """A legacy checkpoint's optimizer state (momentum buffers); the command line keeps its hyperparameters."""
    hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as err:
        raise UserError(f"{source}: optimizer state does not fit this model and --opt ({err})") from None
    for group, chosen in zip(optimizer.param_groups, hyperparameters):
        group.update(chosen, initial_lr=chosen["lr"])


def lr_lambda(args, steps_per_epoch, total_steps):
    """The factor of --lr after `step` optimizer steps: warmup, then step decay or cosine to --lr_min."""
    warmup_steps = round(args.warmup_epochs * steps_per_epoch)
    kind = SCHEDULERS[args.lr_scheduler]
    if kind == "step" and args.lr_min:
        raise UserError("--lr_min applies to --lr_scheduler cosine only")

    def factor(step):
        if step < warmup_steps:
            if args.lr_warmup_method == "constant":
                return args.lr_warmup_decay
            return args.lr_warmup_decay + (1 - args.lr_warmup_decay) * (step + 1) / warmup_steps
        if kind == "step":
            return args.lr_gamma ** (step // steps_per_epoch // args.lr_step_epochs)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return (args.lr_min + (args.lr - args.lr_min) * 0.5 * (1 + math.cos(math.pi * progress))) / args.lr

    return factor
