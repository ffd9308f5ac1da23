"""The image classifier train_resnet.py trains: a torchvision or timm model, the weights it starts from (--pretrained
[PATH], --weights NAME|PATH: torchvision's by name, timm's default, or a local file loaded strictly and without
running code), a new head for the data's classes (matched by class name where the file names them), regularisation
inside the model (--drop_path, --drop) and gradient checkpointing that leaves BatchNorm's running statistics as
without it (docs/code.md#image_modelpy).

Neighbours: utils/image_references.py (main.py's .pth files), utils/export.py (reading PyTorch files safely).
"""
import functools
from pathlib import Path

import torch
import torch.utils.checkpoint
import torchvision

from . import checkpoint, export, runtime

WEIGHT_FILE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".tar")
AUX_HEAD_MODELS = ("googlenet", "inception_v3")  # their auxiliary heads make training return a tuple


# add_model_args' flags (utils/checkpoint.py Role): the starting weights matter to a fresh run only; the drop rates
# add no weights, and apply from the resumed step on
MODEL_ROLES = {"--pretrained": checkpoint.FRESH_START, "--weights": checkpoint.FRESH_START,
               "--drop_path": checkpoint.MAY_CHANGE, "--drop": checkpoint.MAY_CHANGE}


@checkpoint.roles_beside("MODEL_ROLES")
def add_model_args(group):
    group.add_argument("--pretrained", nargs="?", const="DEFAULT", default=None, metavar="PATH",
                       help="start from pretrained weights: torchvision's ImageNet ones, timm's default ones (from the "
                       "Hugging Face cache), or a .safetensors/.pth file's; a new head for other classes")
    group.add_argument("--weights", "--initial-checkpoint", default=None, metavar="NAME|PATH",
                       help="torchvision weights by name, e.g. ResNet50_Weights.IMAGENET1K_V2, or a weights file")
    group.add_argument("--drop_path", "--drop-path", type=float, default=None,
                       help="stochastic depth rate (timm's drop_path_rate, torchvision's stochastic_depth_prob)")
    group.add_argument("--drop", "--drop_rate", type=float, default=None,
                       help="dropout rate before the classifier (timm's drop_rate, torchvision's dropout)")


def is_weights_file(value):
    """Whether a --weights/--pretrained value names a file (by its suffix, or because it is one), not an enum name."""
    return str(value).lower().endswith(WEIGHT_FILE_SUFFIXES) or (value != "DEFAULT" and Path(value).is_file())


def timm_name(arch):
    return arch[len("timm:"):]


def check_model_args(parser, args):
    """The model flags' parser errors, before anything starts; sets args.weights from --pretrained. Without -a (-e: the
    evaluated model's), check_arch waits until the architecture is known."""
    if args.pretrained and args.weights:
        parser.error("--pretrained [PATH] and --weights both name the starting weights: pass one of them")
    if args.pretrained not in (None, "DEFAULT") and not is_weights_file(args.pretrained):
        parser.error(f"--pretrained {args.pretrained}: PATH is a weights file ({', '.join(WEIGHT_FILE_SUFFIXES)})")
    for flag, rate in (("--drop_path", args.drop_path), ("--drop", args.drop)):
        if rate is not None and not 0 <= rate < 1:  # a probability; timm and torchvision take any float silently
            parser.error(f"{flag} {rate}: must be in [0, 1)")
    args.weights = args.pretrained or args.weights
    if args.arch is not None:
        try:
            check_arch(args)
        except runtime.UserError as err:
            parser.error(str(err))


def check_arch(args):
    """A one-line UserError where -a cannot take the other model flags (timm's models and weights, gradient
    checkpointing, --drop_path/--drop)."""
    weights_file = args.weights is not None and is_weights_file(args.weights)
    if args.arch.startswith("timm:"):
        try:
            import timm
        except ImportError:
            raise runtime.UserError(f"-a {args.arch}: timm is not installed (pip install timm)") from None
        if not timm.is_model(timm_name(args.arch)):
            raise runtime.UserError(f"-a {args.arch}: not a timm model (timm.list_models())")
        if args.weights not in (None, "DEFAULT") and not weights_file:
            raise runtime.UserError(f"-a {args.arch}: --weights {args.weights} names torchvision weights; for a timm "
                                    f"model pass --pretrained (timm's default weights) or a weights file")
        return
    if args.gradient_checkpointing and not builder(args.arch).__module__.endswith(".resnet"):
        raise runtime.UserError(f"--gradient_checkpointing: covers torchvision's ResNet family (resnet*, resnext*, "
                                f"wide_resnet*) and timm models, not {args.arch}")
    wanted = regularisation_kwargs(args)
    try:  # on the meta device: nothing is allocated or initialised
        if wanted:
            export.on_meta_device(lambda: torchvision.models.get_model(args.arch, **wanted))
    except TypeError:
        raise runtime.UserError(f"-a {args.arch}: torchvision's {args.arch} takes no {' or '.join(wanted)} "
                                f"(--drop_path, --drop); timm models take both (-a timm:NAME)") from None


def builder(arch):
    return torchvision.models.get_model_builder(arch)


def regularisation_kwargs(args):
    """--drop_path / --drop as the torchvision model's own arguments (stochastic_depth_prob, dropout), where given."""
    return {name: value for name, value in (("stochastic_depth_prob", args.drop_path), ("dropout", args.drop))
            if value is not None}


def build(args, num_classes, print_fn=print, class_to_idx=None):
    """The model of -a, with the weights of --weights/--pretrained, a head for `num_classes` classes matched with
    `class_to_idx` by name (classes_by_name), and --drop_path/--drop; `print_fn` says when the head starts new."""
    if args.arch.startswith("timm:"):
        return timm_model(args, num_classes, print_fn, class_to_idx)
    return torchvision_model(args, num_classes, print_fn, class_to_idx)


def timm_model(args, num_classes, print_fn, class_to_idx=None):
    import timm
    name, pretrained = timm_name(args.arch), args.weights == "DEFAULT"
    cfg = timm.models.get_pretrained_cfg(name) if pretrained else None  # NAME.TAG's, or the default tag's
    if cfg is not None:  # None: no weights for NAME, which create_model says
        check_new_head("--pretrained", cfg.num_classes, num_classes, args.evaluate, print_fn)
    try:
        model = timm.create_model(name, pretrained=pretrained, num_classes=num_classes, drop_rate=args.drop,
                                  drop_path_rate=args.drop_path)
    except TypeError as err:
        raise runtime.UserError(f"-a {args.arch}: {err}") from None
    except (OSError, RuntimeError, ValueError) as err:  # offline and not cached; no weights for this model
        if not pretrained:
            raise
        from huggingface_hub.constants import HF_HUB_CACHE
        raise runtime.UserError(f"--pretrained: cannot get timm's {name} weights ({str(err).splitlines()[0]}); timm "
                                f"reads them from the Hugging Face cache {HF_HUB_CACHE} (HF_HUB_CACHE), where they are "
                                f"downloaded once, which needs the network; or pass --pretrained PATH, a weights file") from None
    if args.weights is not None and not pretrained:
        load_weights_file(model, args.weights, timm_heads(model), num_classes, args.evaluate, print_fn, class_to_idx)
    return model


def timm_heads(model):
    """The classifier module names of a timm model (its pretrained_cfg's `classifier`: one, or a few for DeiT's)."""
    heads = model.pretrained_cfg.get("classifier") or ()
    return (heads,) if isinstance(heads, str) else tuple(heads)


def torchvision_model(args, num_classes, print_fn, class_to_idx=None):
    kwargs = {**({"aux_logits": False} if args.arch in AUX_HEAD_MODELS else {}), **regularisation_kwargs(args)}
    if args.weights is None or is_weights_file(args.weights):
        model = torchvision.models.get_model(args.arch, num_classes=num_classes, **kwargs)
        if args.weights is not None:
            load_weights_file(model, args.weights, (last_linear(model)[0],), num_classes, args.evaluate, print_fn,
                              class_to_idx)
        return model
    flag = "--pretrained" if args.pretrained else f"--weights {args.weights}"
    try:
        model = torchvision.models.get_model(args.arch, weights=args.weights, **kwargs)
    except (KeyError, ValueError) as err:  # no such enum, or weights of another architecture
        raise runtime.UserError(f"{flag}: not weights of torchvision's {args.arch} ({err})") from None
    except (OSError, RuntimeError) as err:  # URLError offline, a broken file in the cache
        raise runtime.UserError(f"{flag}: cannot get torchvision's {args.arch} weights ({err}); they are downloaded "
                                f"once into {torch.hub.get_dir()}/checkpoints, which needs the network") from None
    head_name, head = last_linear(model)
    if head.out_features != num_classes:
        check_new_head(flag, head.out_features, num_classes, args.evaluate, print_fn)
        model.set_submodule(head_name, torch.nn.Linear(head.in_features, num_classes))
    return model


def last_linear(model):
    """(name, module) of the model's last Linear layer: torchvision's classification head."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)][-1]


def check_new_head(source, trained_classes, num_classes, evaluate, print_fn):
    """A head trained for another class count is replaced (said in one line); evaluating it would be random."""
    if trained_classes == num_classes:
        return
    if evaluate:
        raise runtime.UserError(f"{source}: its head predicts {trained_classes} classes, the data has {num_classes}; a "
                                f"new head would be random: evaluate a model trained on these classes (--resume PATH)")
    print_fn(f"{source}: its head predicts {trained_classes} classes, the data has {num_classes}: the head starts new "
             f"(random), every other weight from these weights")


def read_weights_file(path):
    """A state dict from .safetensors or a PyTorch file (weights_only; main.py's layout too, `module.` dropped)."""
    if not Path(path).is_file():
        raise runtime.UserError(f"{path}: no such weights file")
    if str(path).endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(path)
        except (SafetensorError, OSError) as err:
            raise runtime.UserError(f"{path}: not a safetensors file ({err})") from None
    return export.load_torch_checkpoint(path)["state_dict"]


def weights_file_fields(weights):
    """What a PyTorch weights file records beside its weights (an export's image sizes, which -e repeats), else {}."""
    if weights is None or not is_weights_file(weights) or str(weights).endswith(".safetensors"):
        return {}
    return export.load_torch_checkpoint(weights) if Path(weights).is_file() else {}  # a missing one: build_model's error


def load_weights_file(model, path, heads, num_classes, evaluate, print_fn, class_to_idx=None):
    """The weights of `path` into `model`, strictly but for the `heads` (module names) of a file trained for another
    class count: those keep the new head. A file that names its classes has its head reordered by classes_by_name."""
    state_dict, own = read_weights_file(path), model.state_dict()
    head_keys = [key for head in heads for key in (f"{head}.weight", f"{head}.bias") if key in own]
    different = [key for key in head_keys if key in state_dict and state_dict[key].shape != own[key].shape]
    if different:
        check_new_head(path, state_dict[different[0]].shape[0], num_classes, evaluate, print_fn)
        state_dict = {**state_dict, **{key: own[key] for key in head_keys}}
    elif class_to_idx:
        rows = classes_by_name(path, weights_file_fields(path).get("class_to_idx"), class_to_idx, evaluate, print_fn)
        state_dict = {**state_dict, **{key: own[key] if rows is None else state_dict[key][rows] for key in head_keys}}
    export.load_weights(model, state_dict, path)


def classes_by_name(path, trained, class_to_idx, evaluate, print_fn):
    """The head rows of a file trained on `trained` ({name: index}, None: unnamed) in `class_to_idx`'s order: identity,
    the rows reordered (the same names), or None (other names: a new head; -e refuses it)."""
    identity = list(range(len(class_to_idx)))
    if not trained or trained == class_to_idx:
        return identity
    names = sorted(class_to_idx, key=class_to_idx.get)
    if set(trained) == set(class_to_idx):
        print_fn(f"{path}: its head lists the same {len(names)} classes in another order: its rows are reordered to "
                 f"the data's classes, matched by name")
        return [trained[name] for name in names]
    ours, theirs = sorted(set(class_to_idx) - set(trained)), sorted(set(trained) - set(class_to_idx))
    what = f"classes {', '.join(ours[:4])} of the data are not among its classes (it has {', '.join(theirs[:4])})"
    if evaluate:
        raise runtime.UserError(f"{path}: {what}; evaluating by position would score one class as another: evaluate on "
                                f"a folder whose class folders carry the model's class names")
    print_fn(f"{path}: {what}: the head starts new (random), every other weight from the file")
    return None


def enable_gradient_checkpointing(model, arch, blocks):
    """Checkpointed blocks (timm's own, or each module of one of the classes `blocks`, the script's choice) and
    BatchNorm layers that leave their running statistics alone when recomputed."""
    if arch.startswith("timm:"):
        try:
            model.set_grad_checkpointing(True)
        except (AttributeError, AssertionError, NotImplementedError) as err:
            raise runtime.UserError(f"--gradient_checkpointing: timm's {timm_name(arch)} does not support it ({err})") from None
    else:
        for block in model.modules():
            if isinstance(block, blocks):
                block.forward = functools.partial(checkpointed_forward, block, type(block).forward)
    for norm in model.modules():
        if isinstance(norm, torch.nn.modules.batchnorm._BatchNorm):
            norm.register_forward_pre_hook(_batchnorm_recomputed_pre)
            norm.register_forward_hook(_batchnorm_recomputed_post, always_call=True)


def checkpointed_forward(block, forward, x):
    """`forward(block, x)` recomputed in the backward pass; the block's parameter names stay as they are."""
    return torch.utils.checkpoint.checkpoint(forward, block, x, use_reentrant=False)


def _in_backward_pass():
    """Whether autograd runs a backward pass now (module_tracker's `is_bw`): a checkpointed block is recomputed."""
    return torch._C._current_graph_task_id() != -1


BATCHNORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def _batchnorm_recomputed_pre(norm, args):
    """A recomputed BatchNorm uses the batch's statistics but updates copies of its running ones (updated once)."""
    if norm.training and norm.track_running_stats and _in_backward_pass():
        norm.kept_statistics = {name: getattr(norm, name) for name in BATCHNORM_STATISTICS}
        for name, buffer in norm.kept_statistics.items():
            setattr(norm, name, buffer.clone())


def _batchnorm_recomputed_post(norm, args, output):
    for name, buffer in norm.__dict__.pop("kept_statistics", {}).items():
        setattr(norm, name, buffer)
