"""Model EMA exactly as torchvision's references/classification (utils.ExponentialMovingAverage and the
decay adjustment in train.py), with this project's GLOBAL batch.

torchvision: adjust = world_size * batch_size_per_gpu * model_ema_steps / epochs;
alpha = min(1, (1 - model_ema_decay) * adjust); the average moves by alpha every model_ema_steps
steps; during warmup epochs it copies the weights instead. world_size * batch_size_per_gpu is our global
batch (times --gradient_accumulation_steps: the images behind one optimizer step).
"""
import torch
from accelerate.utils import broadcast
from torch.optim.swa_utils import AveragedModel

from .errors import UserError


def add_ema_args(parser):
    group = parser.add_argument_group("model EMA (torchvision's --model-ema; timm's --model-ema too)")
    group.add_argument("--model_ema", "--model-ema", action="store_true",
                       help="keep an exponential moving average of the weights, evaluated and exported beside them")
    group.add_argument("--model_ema_steps", "--model-ema-steps", type=int, default=32,
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


def adjusted_decay(decay, images_per_step, ema_steps, epochs):
    """torchvision's decay adjustment, images_per_step = world_size * batch_size (per GPU)."""
    alpha = min(1.0, (1.0 - decay) * images_per_step * ema_steps / epochs)
    return 1.0 - alpha


def build_ema(args, model, device, images_per_step):
    """The EMA of `model` (unprepared), or None without --model_ema."""
    if not args.model_ema:
        return None
    if args.model_ema_steps < 1 or not 0.0 <= args.model_ema_decay <= 1.0:
        raise UserError(f"--model_ema_steps {args.model_ema_steps} / --model_ema_decay {args.model_ema_decay}: "
                        "need steps >= 1 and 0 <= decay <= 1")
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
