"""What users bring from the scripts these ones replace: their flags and their checkpoint files.

pytorch/examples imagenet/main.py:
- its distribution flags are replaced by the launcher; passing one prints what replaces it (MAIN_PY_FLAGS);
- its `.pth.tar` checkpoints ({state_dict, optimizer, epoch, best_acc1, arch}, with or without the
  `module.` prefix of DataParallel/DDP) load with `weights_only=True`, and the exports written here have
  the same layout minus the prefix, so main.py, torchvision and this project read each other's files.
"""
import argparse
import os
import pickle
import re
import struct
from pathlib import Path

import torch

from .errors import UserError
from .export import check_same_keys, export_state_dict

MAIN_PY_FLAGS = {
    "--multiprocessing-distributed": "accelerate launch --multi_gpu --num_processes N (config: distributed_type "
                                     "MULTI_GPU + num_processes, e.g. accelerate_configs/4gpu.yaml)",
    "--world-size": "accelerate launch --num_machines M (config: num_machines); --num_processes is the TOTAL "
                    "number of processes over all machines",
    "--rank": "accelerate launch --machine_rank R (config: machine_rank, accelerate_configs/multinode_node0.yaml "
              "and multinode_node1.yaml)",
    "--dist-url": "accelerate launch --main_process_ip HOST --main_process_port PORT (config: main_process_ip, "
                  "main_process_port), or --rdzv_backend c10d (accelerate_configs/multinode_c10d.yaml)",
    "--dist-backend": "nothing: nccl on GPUs, gloo on CPU; override with this script's --dist_backend",
    "--gpu": "accelerate launch --gpu_ids I --num_processes 1 (or CUDA_VISIBLE_DEVICES=I; "
             "accelerate_configs/single_gpu.yaml)",
}


# torchvision references/classification/train.py flags that have no counterpart here, and what to do instead
# (its other flags are accepted under their own spelling: docs/resnet_recipes.md).
TORCHVISION_FLAGS = {
    "--device": "the launcher and accelerate_configs/*.yaml choose the device (--cpu forces the CPU)",
    "--amp": "accelerate launch --mixed_precision bf16|fp16 (or this script's --mixed_precision)",
    "--cache-dataset": "nothing: the ImageFolder is scanned in seconds; drop the flag",
    "--use-deterministic-algorithms": "nothing: runs are already reproducible per (seed, epoch, image); drop it",
    "--backend": "nothing: images are always decoded to tensors (torchvision's --backend tensor); drop it",
    "--use-v2": "nothing: transforms are always torchvision.transforms.v2; drop it",
    "--transformer-embedding-decay": "not supported for ResNets; use --norm_weight_decay / --bias_weight_decay",
}


class _ReplacedFlag(argparse.Action):
    """A flag that no longer exists: print what replaces it, and every other one, then exit 2."""

    def __init__(self, option_strings, dest, replacements, source, **kwargs):
        self.replacements, self.source = replacements, source
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        width = max(map(len, self.replacements))
        table = "\n".join(f"  {flag:<{width}}  ->  {text}" for flag, text in self.replacements.items())
        parser.exit(2, f"error: {option_string} is a {self.source} flag; here it is replaced by:\n"
                       f"  {option_string}  ->  {self.replacements[option_string]}\n"
                       f"All of {self.source}'s flags of this kind and what replaces them:\n{table}\n")


def add_replaced_flags(parser, replacements=MAIN_PY_FLAGS, source="pytorch/examples imagenet/main.py"):
    """Accept the old flags only to explain them (the parser needs allow_abbrev=False to tell
    main.py's --dist-backend from our --dist_backend)."""
    for flag in replacements:
        parser.add_argument(flag, action=_ReplacedFlag, replacements=replacements, source=source)


def torchvision_batch_size(argv, parsed_batch_size, world_size):
    """(global batch, note or None). torchvision's -b/--batch-size is PER PROCESS, main.py's and ours GLOBAL.

    The command decides: one that names torchvision's --model or --data-path is a torchvision command, and its
    -b/--batch-size is multiplied by the number of processes (and said so at start). --batch_size (underscore)
    is always global; a command mixing it with a per-process -b/--batch-size is refused.
    """
    flags = {arg.split("=")[0] for arg in argv if arg.startswith("-")}
    flags |= {"-b" for arg in argv if arg.startswith("-b") and not arg.startswith("--")}  # -b64
    if not flags & {"-b", "--batch-size"} or not flags & {"--model", "--data-path"}:
        return parsed_batch_size, None
    if "--batch_size" in flags:
        raise UserError("-b/--batch-size (torchvision's, per process, in a command with --model/--data-path) and "
                        "--batch_size (global) both given; pass one of them")
    total = parsed_batch_size * world_size
    return total, (f"-b/--batch-size {parsed_batch_size} is torchvision's per-process batch (the command uses "
                   f"--model/--data-path): global batch {parsed_batch_size} x {world_size} processes = {total}; "
                   "--batch_size sets the global batch directly")


def strip_module_prefix(state_dict):
    """Keys as a plain model has them: drop the `module.` that DataParallel/DDP (even nested) put in front."""
    while state_dict and all(key.startswith("module.") for key in state_dict):
        state_dict = {key[len("module."):]: value for key, value in state_dict.items()}
    return state_dict


def load_legacy_checkpoint(path):
    """A main.py-style checkpoint (or a bare state_dict) as a dict with a prefix-free `state_dict`.

    `weights_only=True`: a checkpoint is data, and unpickling arbitrary objects runs arbitrary code.
    """
    path = Path(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: no such checkpoint file") from None
    except pickle.UnpicklingError as err:
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if refused is None:  # random bytes fail the same way
            reason = str(err).split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
            raise UserError(f"{path}: not a PyTorch checkpoint (unpickling failed: {reason})") from None
        raise UserError(f"{path}: holds a pickled {refused.group(1)}, which torch.load(weights_only=True) refuses; "
                        "only tensors and plain values are loaded from checkpoints") from None
    except (OSError, RuntimeError, EOFError, ValueError, struct.error) as err:
        raise UserError(f"{path}: not a PyTorch checkpoint ({type(err).__name__}: {err})".splitlines()[0]) from None
    if isinstance(checkpoint, dict) and checkpoint and all(torch.is_tensor(v) for v in checkpoint.values()):
        checkpoint = {"state_dict": checkpoint}  # a bare state_dict, as torch.save(model.state_dict()) writes
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise UserError(f"{path}: no 'state_dict' in this checkpoint (expected main.py's keys state_dict, "
                        "optimizer, epoch, best_acc1, or a bare state_dict)")
    checkpoint["state_dict"] = strip_module_prefix(checkpoint["state_dict"])
    if torch.is_tensor(checkpoint.get("best_acc1")):  # main.py stores a (CUDA) tensor
        checkpoint["best_acc1"] = checkpoint["best_acc1"].item()
    return checkpoint


def check_legacy_compatible(checkpoint, expected, path):
    """Fields a checkpoint records (arch, class_to_idx) must match this run's; main.py's lack class_to_idx."""
    for key, value in expected.items():
        if checkpoint.get(key) is not None and checkpoint[key] != value:
            raise UserError(f"{path}: checkpoint's {key}: {_describe(checkpoint[key])}; this run's: {_describe(value)}")


def _describe(value):
    if isinstance(value, dict):  # class_to_idx
        names = list(value)
        return f"{len(names)} classes [{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}]"
    return repr(value)


def save_exported_checkpoint(path, state_dict, **fields):
    """main.py's layout ({state_dict, **fields}) with CPU tensors and no prefix, swapped in atomically."""
    path = Path(path)
    state_dict = {key: value.detach().cpu().contiguous() for key, value in strip_module_prefix(state_dict).items()}
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"state_dict": state_dict, **fields}, tmp)
    os.replace(tmp, path)


def export_main_py_checkpoints(accelerator, model, fresh, output_dir, is_best, fields, ema_state=None, suffix=""):
    """checkpoint{suffix}.pth, and model_best{suffix}.pth when `is_best`, in main.py's layout ({state_dict, **fields});
    checkpoint.pth also holds `ema_state` (torchvision's `model_ema` key). `fresh`: a model of the architecture (on
    the meta device) whose names the weights must have, so that plain torchvision loads them. Every rank calls it:
    under FSDP/DeepSpeed, gathering the weights is a collective."""
    state_dict = export_state_dict(accelerator, model, fresh)
    if ema_state is not None:
        ema_state = strip_module_prefix(ema_state)
        check_same_keys(ema_state, fresh)
    extra = {"model_ema": ema_state} if ema_state is not None else {}
    for name in ("checkpoint", "model_best") if is_best else ("checkpoint",):
        accelerator.on_main_process(save_exported_checkpoint)(Path(output_dir) / f"{name}{suffix}.pth", state_dict,
                                                              **fields, **(extra if name == "checkpoint" else {}))


def load_weights(model, state_dict, source):
    """Load `state_dict` into `model` (strict), or stop with one line naming `source` and the first mismatch."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as err:  # "Error(s) in loading state_dict for ResNet:\n\tsize mismatch for fc.weight ..."
        detail = " ".join(line.strip() for line in str(err).splitlines()[1:2])
        raise UserError(f"{source}: weights do not fit this model ({detail})") from None



# The reference BERT cnews repository saved `best.pt` as {"state_dict": model.state_dict(), ...} for a module
# holding `self.bert = BertModel(...)` and a `self.linear` head, `module.`-prefixed when trained under
# DataParallel. Its label order came from a Python set: pass the order it used with --labels_file.
LEGACY_BERT_HEADS = ("linear.", "fc.", "classifier.")


def load_legacy_bert(path, model):
    """Load the reference repo's best.pt into a Hugging Face *ForSequenceClassification model, or say why not."""
    state_dict = load_legacy_checkpoint(path)["state_dict"]
    renamed = {}
    for key, value in state_dict.items():
        head = next((h for h in LEGACY_BERT_HEADS if key.startswith(h)), None)
        key = "classifier." + key[len(head):] if head else key
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if not key.startswith(("bert.", "classifier.")):
            key = "bert." + key  # a bare BertModel state_dict
        if not key.endswith("position_ids"):  # a buffer, rebuilt by the model
            renamed[key] = value
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith("position_ids")}
    unknown = sorted(set(renamed) - set(expected))
    missing = sorted(set(expected) - set(renamed))
    if unknown or missing:
        raise UserError(f"{path}: does not fit {type(model).__name__}: "
                        + (f"unknown key(s) {', '.join(unknown[:3])}" if unknown else "")
                        + ("; " if unknown and missing else "")
                        + (f"missing key(s) {', '.join(missing[:3])}" if missing else ""))
    for key, value in renamed.items():
        if value.shape != expected[key].shape and key.startswith("classifier."):
            raise UserError(f"{path}: its head predicts {value.shape[0]} classes, this run has "
                            f"{expected[key].shape[0]} labels (check --labels_file)")
        if value.shape != expected[key].shape:
            raise UserError(f"{path}: {key} has shape {tuple(value.shape)}, this model {tuple(expected[key].shape)} "
                            "(check --model_name_or_path / --config_overrides)")
    model.load_state_dict(renamed, strict=False)
    return model
