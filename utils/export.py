"""Model weights in and out of a run, the same under DDP, FSDP and DeepSpeed: the exports under the model's own
parameter names (`full_state_dict`), the best weights kept in memory for the end of training (`BestWeights`), an
export read back on every rank, PyTorch checkpoint files read without running code and checked whole first
(`check_torch_file`, `safetensors_problem`, `check_dcp_checkpoint`), and the settings an export carries into a later
evaluation (`settings_from_model`). Every function that gathers or broadcasts weights runs on every process.
Why: docs/code.md#exportpy. Neighbours: utils/checkpoint.py (resumable checkpoints), utils/image_references.py
(main.py's .pth layout), utils/text_model.py (the Hugging Face export's loading).
"""
import argparse
import io
import json
import pickle
import re
import struct
import zipfile
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from accelerate.utils import load as accelerate_load
from safetensors import SafetensorError, safe_open

from . import runtime

COMPILE_PREFIX = "_orig_mod."


def full_state_dict(accelerator, model, reference):
    """The full state dict of the prepared `model` under the names of `reference` (a freshly built model). A
    collective: under FSDP/DeepSpeed the main process gets the weights, the others an empty dict."""
    # get_state_dict gathers shards and strips DDP/FSDP/DeepSpeed, but unwraps with keep_torch_compile=True
    # (accelerate 1.15); the compiled wrapper's name is not part of the model, so it goes here.
    state_dict = accelerator.get_state_dict(model)
    state_dict = {key.replace(COMPILE_PREFIX, ""): value for key, value in state_dict.items()}
    if state_dict:
        check_same_keys(state_dict, reference)
    return state_dict


def check_same_keys(state_dict, reference):
    """Raise unless `state_dict` has exactly the keys of `reference`'s state dict (nothing would load as random)."""
    expected = set(reference.state_dict())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise RuntimeError(f"refusing to export weights a fresh {type(reference).__name__} would not load: "
                           f"{len(missing)} missing (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. "
                           f"{unexpected[:2]})")


def on_meta_device(build):
    """build() without allocating or initialising weights: the reference only lends its parameter names."""
    with torch.device("meta"):
        return build()


def _local(tensor):
    """This rank's own part of a parameter: an FSDP2 DTensor's shard, a DeepSpeed ZeRO-3 partition, or itself."""
    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _tensors(model):
    return [*model.named_parameters(), *model.named_buffers()]


class BestWeights:
    """The best weights so far, copied to CPU memory on every rank (its own shard when sharded): no file to reload."""

    def __init__(self):
        self.tensors = None

    def keep(self, model):
        self.tensors = {name: _local(t).detach().to("cpu", copy=True) for name, t in _tensors(model)}

    def restore(self, model):
        with torch.no_grad():
            for name, t in _tensors(model):
                _local(t).copy_(self.tensors[name])

    @property
    def held(self):
        return self.tensors is not None


def load_full_weights(accelerator, model, path):
    """A safetensors file on the main process's disk into the prepared model on every rank: read there, broadcast."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = getattr(model, "_orig_mod", model)  # under torch.compile: the export's names carry no `_orig_mod.`
    if accelerator.num_processes == 1:
        accelerator.unwrap_model(model).load_state_dict(load_file(path))
        return
    state_dict = load_file(path) if accelerator.is_main_process else {}
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


SELECTION_FILE = "best_step.json"


def mark_selection(best_dir, step):
    """Which step's weights an export holds (main process), so a resumed run can check it reloads the right ones."""
    (Path(best_dir) / SELECTION_FILE).write_text(json.dumps({"step": step}) + "\n")


def selected_step(best_dir):
    """The step whose weights the export `best_dir` holds (mark_selection's), None when there is no such record."""
    selection = Path(best_dir) / SELECTION_FILE
    try:
        return json.loads(selection.read_text(encoding="utf-8-sig"))["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_selected_weights(accelerator, model, best_dir, step):
    """The best weights (of `step`) of a run that resumed after selecting them: load_full_weights of the export in
    `best_dir` once the main process checked it whole and of that step (every rank stops at once if not)."""
    problem = [None]
    weights = Path(best_dir) / "model.safetensors"
    if accelerator.is_main_process:
        selection = Path(best_dir) / SELECTION_FILE
        found = json.loads(selection.read_text())["step"] if selection.is_file() else step
        if not weights.is_file():
            problem = [f"{best_dir}: no model.safetensors, but the best model (step {step}) was saved there"]
        elif found != step:
            problem = [f"{best_dir}: holds the weights of step {found}, not those of the best step {step} of the "
                       f"checkpoint this run resumed from (an abandoned branch's?); resume from a later checkpoint or "
                       f"train again"]
        else:
            problem = [safetensors_problem(weights)]
    broadcast_object_list(problem)
    if problem[0]:
        raise runtime.UserError(problem[0])
    load_full_weights(accelerator, model, weights)


def prepare_for_inference(accelerator, model, loaders):
    """(model, {split: loader}) prepared together, as DeepSpeed needs (it sizes its engine from a dataloader)."""
    splits = [split for split in loaders if split != "train"]
    model, *prepared = accelerator.prepare(model, *(loaders[split] for split in splits))
    return model, dict(zip(splits, prepared))


def load_torch_checkpoint(path):
    """A main.py-style checkpoint (or torchvision's, or a bare state_dict) as a dict with a prefix-free `state_dict`."""
    path = Path(path)
    try:
        # torchvision's checkpoint.pth records its command line as an argparse.Namespace: plain values, allowed
        # alone beside the tensors and containers weights_only allows
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # unpickling objects runs code
    except FileNotFoundError:
        raise runtime.UserError(f"{path}: no such checkpoint file") from None
    except Exception as err:
        raise runtime.UserError(torch_load_problem(path, err)) from None
    if isinstance(checkpoint, dict) and checkpoint and all(torch.is_tensor(v) for v in checkpoint.values()):
        checkpoint = {"state_dict": checkpoint}  # a bare state_dict, as torch.save(model.state_dict()) writes
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("model"), dict) and "state_dict" not in checkpoint:
        checkpoint = from_torchvision_layout(checkpoint)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise runtime.UserError(f"{path}: no 'state_dict' in this checkpoint (expected main.py's keys state_dict, "
                                f"optimizer, epoch, best_acc1, torchvision's model, optimizer, epoch, args, or a bare "
                                f"state_dict)")
    checkpoint["state_dict"] = strip_module_prefix(checkpoint["state_dict"])
    checkpoint.pop("model", None)  # this project's exports: torchvision's name for the same dict
    if isinstance(checkpoint.get("model_ema"), dict):
        checkpoint["model_ema"] = averaged_weights(checkpoint["model_ema"])
    if torch.is_tensor(checkpoint.get("best_acc1")):  # main.py stores a (CUDA) tensor
        checkpoint["best_acc1"] = checkpoint["best_acc1"].item()
    return checkpoint


# torchvision's train.py arguments that are recorded image settings here (utils/image_augment.py AUGMENT_ROLES)
TORCHVISION_IMAGE_ARGS = {"train_crop_size": "train_crop_size", "val_resize_size": "val_resize",
                          "val_crop_size": "val_crop_size", "interpolation": "interpolation"}


def from_torchvision_layout(checkpoint):
    """torchvision's references/classification checkpoint.pth ({model, optimizer, lr_scheduler, epoch, args,
    model_ema, scaler}) in main.py's layout (docs/code.md#exportpy)."""
    args = vars(checkpoint["args"]) if isinstance(checkpoint.get("args"), argparse.Namespace) else {}
    converted = {"state_dict": checkpoint["model"], "arch": args.get("model"),
                 **{ours: args[theirs] for theirs, ours in TORCHVISION_IMAGE_ARGS.items() if args.get(theirs)}}
    if isinstance(checkpoint.get("epoch"), int):
        converted["epoch"] = checkpoint["epoch"] + 1
    if isinstance(checkpoint.get("optimizer"), dict):
        converted["optimizer"] = checkpoint["optimizer"]
    if isinstance(checkpoint.get("model_ema"), dict):
        converted["model_ema"] = checkpoint["model_ema"]
    return {key: value for key, value in converted.items() if value is not None}


def averaged_weights(ema_state):
    """The averaged model's weights, prefix-free, from torchvision's ExponentialMovingAverage or a plain state dict."""
    return strip_module_prefix({key: value for key, value in ema_state.items() if key != "n_averaged"})


DAMAGED = "damaged or incomplete (a copy or a save cut short?)"
_LOAD_ERRORS = (pickle.UnpicklingError, OSError, RuntimeError, EOFError, ValueError, struct.error)


def torch_load_problem(path, err):
    """One line for what torch.load(weights_only=True) raised on `path`; the error itself if it is none of those."""
    if not isinstance(err, _LOAD_ERRORS):
        raise err
    # torch's wordings: "Unsupported global: GLOBAL x.y", and for a blocked module "unsupported GLOBAL posix.system"
    refused = re.search(r"[Uu]nsupported (?:global: )?GLOBAL (\S+)", str(err))
    if refused:
        return (f"{path}: holds a pickled {refused.group(1)}, which torch.load(weights_only=True) refuses; only "
                f"tensors and plain values are loaded from checkpoints")
    if path.stat().st_size == 0 or "central directory" in str(err) or isinstance(err, EOFError) or (
            _starts_as_zip(path) and not zipfile.is_zipfile(path)):  # torch.save writes a zip: its end is lost
        return f"{path}: {DAMAGED}: {str(err).strip().splitlines()[0][:160]}"
    if isinstance(err, pickle.UnpicklingError):  # random bytes fail the same way
        reason = str(err).split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
        return f"{path}: not a PyTorch checkpoint (unpickling failed: {reason})"
    return f"{path}: not a PyTorch checkpoint ({type(err).__name__}: {err})".splitlines()[0]


def _starts_as_zip(path):
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def check_torch_file(path):
    """Raise a one-line UserError unless `path` loads with torch.load(weights_only=True)."""
    path = Path(path)
    try:  # accelerate's load allows the numpy types its RNG states hold; mapped, not read: it costs little
        accelerate_load(path, map_location="cpu", mmap=zipfile.is_zipfile(path))
    except Exception as err:
        raise runtime.UserError(torch_load_problem(path, err)) from None


def _dcp_class_allowed(module, name):
    """What a torch.distributed.checkpoint .metadata file pickles: its dataclasses, sizes, dtypes, layouts, paths."""
    if module == "torch.distributed.checkpoint.metadata":
        return True
    return (module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                              ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "WindowsPath"), ("collections", "OrderedDict")} or (
        module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if not _dcp_class_allowed(module, name):
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return super().find_class(module, name)


def check_dcp_checkpoint(directory):
    """Raise a one-line UserError unless a torch.distributed.checkpoint directory (FSDP's sharded state dicts) is
    data only (docs/faults_and_resume.md#fsdp-and-deepspeed)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata_path = Path(directory) / ".metadata"
    try:
        with open(metadata_path, "rb") as f:
            metadata = _DcpMetadataUnpickler(f).load()
    except Exception as err:
        raise runtime.UserError(torch_load_problem(metadata_path, err)) from None
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue  # a tensor: torch reads it with weights_only=True
        path = Path(directory) / info.relative_path
        if getattr(info, "transform_descriptors", None):
            raise runtime.UserError(f"{path}: item {index.fqn} is stored transformed ({info.transform_descriptors}), "
                                    f"which is not checked here; only plain torch.distributed.checkpoint files are "
                                    f"loaded")
        with open(path, "rb") as f:
            f.seek(info.offset)
            item = f.read(info.length)
        try:
            torch.load(io.BytesIO(item), map_location="cpu", weights_only=True)
        except Exception as err:
            problem = torch_load_problem(path, err) if len(item) == info.length else f"{path}: {DAMAGED}"
            raise runtime.UserError(f"{problem} (item {index.fqn})") from None


def safetensors_problem(path):
    """None if `path` is a whole safetensors file (its header read, its length checked against it), else one line."""
    try:
        with safe_open(path, framework="pt"):
            return None
    except (SafetensorError, OSError) as err:
        return f"{path}: {DAMAGED}: {str(err).strip().splitlines()[0]}"


def strip_module_prefix(state_dict):
    """Keys as a plain model has them: drop the `module.` that DataParallel/DDP (even nested) put in front."""
    while state_dict and all(key.startswith("module.") for key in state_dict):
        state_dict = {key[len("module."):]: value for key, value in state_dict.items()}
    return state_dict


def load_weights(model, state_dict, source):
    """Load `state_dict` into `model` (strict), or stop with one line naming `source` and the first mismatch."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as err:  # "Error(s) in loading state_dict for ResNet:\n\tsize mismatch for fc.weight ..."
        detail = " ".join(line.strip() for line in str(err).splitlines()[1:2])
        raise runtime.UserError(f"{source}: weights do not fit this model ({detail})") from None


def settings_from_model(args, defaults, recorded, source, say, flags=None):
    """Sets each `dest` of `defaults` (None in the parser) to the command line's value, else the one the model
    `recorded`, else the default; says which, and returns the tag of the given values that differ from the model's
    ("_max_seq_len_64", ""), for the results' names. `flags`: {dest: the flag as given}, else `--dest`."""
    differ, taken = [], []
    for dest, default in defaults.items():
        given, trained = getattr(args, dest), recorded.get(dest)
        flag = (flags or {}).get(dest, f"--{dest}")
        if given is None:
            setattr(args, dest, trained if trained is not None else default)
            if trained is not None:
                taken.append(f"{flag} {trained}")
        elif trained is not None and given != trained:
            differ.append((dest, flag, given, trained))
    if taken:
        say(f"{source} was trained with {', '.join(taken)}: evaluating with the same")
    if differ:
        say("; ".join(f"{flag} {given} differs from the model's {trained} (trained with): evaluating with {given}"
                      for _, flag, given, trained in differ))
    return "".join(f"_{dest}_{given}" for dest, _, given, _ in differ)
