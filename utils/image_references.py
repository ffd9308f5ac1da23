"""What users bring from the scripts train_resnet.py replaces (pytorch/examples imagenet/main.py, torchvision's
references/classification/train.py): their flags (MAIN_PY_FLAGS, TORCHVISION_FLAGS, TIMM_FLAGS: one line says what
replaces each), the GLOBAL -b (BATCH_RULE), their checkpoint files, read and written in main.py's layout with
torchvision's keys, and model_card.md (docs/code.md#image_referencespy).
Neighbours: utils/image_optim.py, utils/export.py.
"""
import os
from pathlib import Path

import torch

from . import export, image_data, outputs, runtime

MAIN_PY_FLAGS = {
    "--multiprocessing-distributed": "accelerate launch --multi_gpu --num_processes N (config: distributed_type "
                                     "MULTI_GPU + num_processes, e.g. accelerate_configs/4gpu.yaml)",
    "--world-size": "accelerate launch --num_machines M (config: num_machines); --num_processes is the TOTAL number of "
                    "processes over all machines",
    "--rank": "accelerate launch --machine_rank R (config: machine_rank, accelerate_configs/multinode_node0.yaml and "
              "multinode_node1.yaml)",
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
    "--cache-dataset": "nothing: the ImageFolder is scanned in seconds; drop the flag",
    "--backend": "nothing: images are always decoded to tensors (torchvision's --backend tensor); drop it",
    "--use-v2": "nothing: transforms are always torchvision.transforms.v2; drop it",
    "--transformer-embedding-decay": "no separate decay of the position embeddings and class token of swin/vit models; "
                                     "--norm_weight_decay / --bias_weight_decay for the other groups",
}

# timm train.py flags with no counterpart here, or another meaning, and what to pass instead (its others are accepted
# under their own spelling, with timm's meaning: docs/resnet_recipes.md)
TIMM_FLAGS = {
    "--num-classes": "the classes are the folders of train/; drop --num-classes",
    "--output": "--output_dir DIR (the files go straight into DIR; timm's --output adds a folder per run)",
    "--torchcompile": "accelerate launch --dynamo_backend inductor ... (or --dynamo_backend in the accelerate config)",
    "--warmup-lr": "--lr_warmup_decay F (the warmup starts at F x --lr)",
    "--sched-on-updates": "nothing: the schedule is stepped every optimizer step here; drop it",
    "--amp-dtype": "--mixed_precision bf16|fp16",
}

BATCH_RULE = ("-b/--batch-size is the GLOBAL batch on any number of processes (main.py's total batch); torchvision's "
              "and timm's per-process -b N is --per_device_batch_size N")


def check_legacy_compatible(checkpoint, expected, path):
    """Fields a checkpoint records (arch, class_to_idx) must match this run's; main.py's lack class_to_idx."""
    for key, value in expected.items():
        if checkpoint.get(key) is not None and checkpoint[key] != value:
            raise runtime.UserError(f"{path}: checkpoint's {key}: {_describe(checkpoint[key])}; this run's: "
                                    f"{_describe(value)}")


def exported_step(path, steps_per_epoch):
    """The optimizer step model_best.pth at `path` holds (its `step`, else its epoch's last step); None without it."""
    if not Path(path).is_file():
        return None
    fields = export.load_torch_checkpoint(path)
    return fields.get("step", fields.get("epoch", 0) * steps_per_epoch)


def start_epoch_of(checkpoint, start_epoch):
    """Epochs done before this run: the file's `epoch` (it wins, main.py's rule), else --start-epoch."""
    return checkpoint.get("epoch", start_epoch) if checkpoint else start_epoch


def continuation_line(args, checkpoint, start_step, total_steps, lr):
    """One line for a run starting inside the schedule (--resume FILE.pth, --start-epoch): where, and what does not
    carry over (momentum, from a file without optimizer state; trained weights, with --start-epoch alone)."""
    epoch = start_epoch_of(checkpoint, args.start_epoch)
    done = "epoch 1 counts" if epoch == 1 else f"epochs 1-{epoch} count"
    where = (f"{done} as done: training starts at epoch {epoch + 1}, step {start_step} of {total_steps} of the "
             f"--lr_scheduler {args.lr_scheduler} schedule (lr {lr:.3g})")
    if checkpoint is None:
        return f"--start-epoch {epoch}: {where}, from the starting weights (no --resume file)"
    ignored = (f"; --start-epoch {args.start_epoch} ignored: the file records epoch {epoch}"
               if args.start_epoch and "epoch" in checkpoint and args.start_epoch != epoch else "")
    optimizer = ("weights and optimizer state (momentum) from the file" if "optimizer" in checkpoint else
                 "weights from the file, which holds no optimizer state: the optimizer's momentum starts afresh")
    return f"--resume {args.resume}: {where}; {optimizer}{ignored}"


def selection_from_file(checkpoint, selection):
    """The best value and epoch a file of this project records, for the run it continues; {} (select afresh) without."""
    if not checkpoint or checkpoint.get("best_epoch") is None or checkpoint.get(selection.best_key) is None:
        return {}
    return {selection.best_key: checkpoint[selection.best_key], selection.position_key: checkpoint["best_epoch"]}


def _describe(value):
    if isinstance(value, dict):  # class_to_idx
        names = list(value)
        return f"{len(names)} classes [{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}]"
    return repr(value)


def save_exported_checkpoint(path, state_dict, **fields):
    """main.py's layout ({state_dict, **fields}; CPU tensors, no prefix) with torchvision's `model` key for the same
    dict (pickled once), swapped in atomically."""
    path = Path(path)
    state_dict = cpu_tensors(export.strip_module_prefix(state_dict))
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save({"state_dict": state_dict, "model": state_dict, **fields}, tmp)
        os.replace(tmp, path)
    except BaseException:  # a full disk, a kill: the previous file stays, without the partial one beside it
        tmp.unlink(missing_ok=True)
        raise


def cpu_tensors(state_dict):
    return {key: value.detach().cpu().contiguous() for key, value in state_dict.items()}


def export_main_py_checkpoints(accelerator, model, fresh, output_dir, is_best, fields, ema_state=None, suffix=""):
    """checkpoint{suffix}.pth, and model_best{suffix}.pth when `is_best`, in main.py's layout with torchvision's keys
    (docs/code.md#image_referencespy); `fresh`: a meta-device model whose names the weights must have. A collective: a
    failure to write stops every rank with one line, the previous files kept."""
    state_dict = export.full_state_dict(accelerator, model, fresh)
    if ema_state is not None:
        export.check_same_keys(export.averaged_weights(ema_state), fresh)
        ema_state = cpu_tensors(ema_state)
    extra = {"model_ema": ema_state} if ema_state is not None else {}
    with runtime.writing(accelerator, output_dir):
        for name in ("checkpoint", "model_best") if is_best else ("checkpoint",):
            accelerator.on_main_process(save_exported_checkpoint)(Path(output_dir) / f"{name}{suffix}.pth",
                                                                  state_dict, **fields,
                                                                  **(extra if name == "checkpoint" else {}))


def model_card(args, class_to_idx, train_set, val_set, run, script, model_flags):
    """model_card.md's fixed part for model_best.pth (utils/outputs.py ModelCard): classes, settings (`run`), folders,
    how to load and evaluate it; through `script`'s exported_model where `model_flags` ({flag: value}) shape it."""
    best = Path(args.output_dir) / "model_best.pth"
    timm_name = args.arch[len("timm:"):] if args.arch.startswith("timm:") else None
    build = (f"timm.create_model({timm_name!r}, num_classes={len(class_to_idx)})" if timm_name else
             f"torchvision.models.get_model({args.arch!r}, num_classes={len(class_to_idx)})")
    data = str(args.data) if args.data else f"--dummy {args.dummy}"
    script = Path(script).resolve()
    shown = script.name if script.parent == Path.cwd().resolve() else str(script)  # as a command line would give it
    flags = " ".join(f"{flag} {value}" for flag, value in model_flags.items())
    load = (["import sys", "", "import torch", "from torchvision.transforms import v2", "",
             f"sys.path.insert(0, {str(script.parent)!r})  # the folder of {script.name}",
             f"from {script.stem} import exported_model", "",
             f"# {script.name}'s build_model, with what the file records ({flags})",
             f"model, export = exported_model({str(best)!r})"] if model_flags else
            ["import torch", "import torchvision" if not timm_name else "import timm",
             "from torchvision.transforms import v2", "", f"model = {build}",
             f"model.load_state_dict(torch.load({str(best)!r}, weights_only=True)[\"state_dict\"])"])
    usage = "\n".join([
        "```python", *load, "model.eval()",
        "# the validation transform of the training, for an RGB PIL image or a (3, H, W) uint8 tensor",
        f"preprocess = v2.Compose([v2.ToImage(), v2.Resize({args.val_resize}, "
        f"interpolation=v2.InterpolationMode.{args.interpolation.upper()}, antialias=True), "
        f"v2.CenterCrop({args.val_crop_size}), v2.ToDtype(torch.float32, scale=True), "
        f"v2.Normalize({list(image_data.IMAGENET_MEAN)}, {list(image_data.IMAGENET_STD)})])",
        "```", "", "Evaluated on the validation images by this script, at the settings the file records:", "",
        "```bash", f"python {shown} {data} -a {args.arch} -e --resume {best} --output_dir "
        f"{Path(args.output_dir) / 'model_best_eval'}", "```"])
    settings = {"arch": args.arch, "weights": args.weights, "train_crop_size": args.train_crop_size,
                "val_resize": args.val_resize, "val_crop_size": args.val_crop_size, "interpolation": args.interpolation,
                "batch_size (global)": args.batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps, "lr": args.lr, "epochs": args.epochs,
                "seed": args.seed, "model_ema": args.model_ema, "mixed_precision": run["mixed_precision"],
                "processes": run["num_processes"], **model_flags}
    folders = (Path(data) / "train", Path(data) / "val") if args.data else (data, data)
    return outputs.ModelCard(
        title=str(best), labels=sorted(class_to_idx, key=class_to_idx.get), settings=settings, usage=usage,
        metadata={"library_name": "timm" if timm_name else "pytorch", "pipeline_tag": "image-classification",
                  "tags": ["image-classification", "torchvision", script.name], "model_name": args.arch},
        command=outputs.command_line(),
        data_files={"train": (folders[0], len(train_set)), "validation": (folders[1], len(val_set))})
