"""Model weights the same way under DDP, FSDP and DeepSpeed: the best weights kept for the end of training,
weights read from an export, a model made ready for evaluation, and configs that cannot apply refused.

Every function here runs on every process (they hold collectives under FSDP/DeepSpeed).
"""
import json
import os
from pathlib import Path

import torch
from accelerate.utils import DistributedType, broadcast_object_list

from .errors import UserError


def check_sharding_applies(accelerator):
    """An accelerate config asking for FSDP or DeepSpeed that accelerate did not apply (it ignores both with
    cpu=True) would train as plain DDP without a word: refuse it."""
    for variable, wanted in (("ACCELERATE_USE_FSDP", DistributedType.FSDP),
                             ("ACCELERATE_USE_DEEPSPEED", DistributedType.DEEPSPEED)):
        if os.environ.get(variable, "false").lower() == "true" and accelerator.distributed_type != wanted:
            got = str(accelerator.distributed_type).split(".")[-1]
            raise UserError(f"the accelerate config asks for {wanted.value} (distributed_type: {wanted.value}), "
                            f"which does not run {'on CPU (--cpu)' if accelerator.device.type == 'cpu' else 'here'}: "
                            f"this run would be plain {got}. Use accelerate_configs/cpu_ddp.yaml on CPU, or GPUs")


def _local(tensor):
    """This rank's own part of a parameter: an FSDP2 DTensor's shard, a DeepSpeed ZeRO-3 partition, or itself."""
    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _tensors(model):
    return [*model.named_parameters(), *model.named_buffers()]


class BestWeights:
    """The best weights so far, copied to CPU memory on every rank (each rank its own shard when sharded).

    Reloading them at the end needs no file: nothing is read from a disk another node wrote, whatever the
    export's key names or the FSDP/DeepSpeed checkpoint layout. Costs one copy of the (local) weights in RAM.
    """

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
    """Weights exported by the main process (a safetensors file on ITS disk) into the prepared model on every
    rank: read on the main process only and broadcast, which works for DDP, FSDP and plain models alike."""
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


def load_selected_weights(accelerator, model, best_dir, step):
    """The best weights of a run that resumed after selecting them: from the main process's export, after
    checking (there) that it holds that step, every rank stopping at once if not."""
    problem = [None]
    if accelerator.is_main_process:
        selection = Path(best_dir) / SELECTION_FILE
        found = json.loads(selection.read_text())["step"] if selection.is_file() else step
        if not (Path(best_dir) / "model.safetensors").is_file():
            problem = [f"{best_dir}: no model.safetensors, but the best model (step {step}) was saved there"]
        elif found != step:
            problem = [f"{best_dir}: holds the weights of step {found}, not those of the best step {step} of the "
                       "checkpoint this run resumed from (an abandoned branch's?); resume from a later checkpoint "
                       "or train again"]
    broadcast_object_list(problem)
    if problem[0]:
        raise UserError(problem[0])
    load_full_weights(accelerator, model, Path(best_dir) / "model.safetensors")


def prepare_for_inference(accelerator, model, loaders):
    """`prepare(model)` alone is refused under DeepSpeed (it sizes its engine from a dataloader): prepare the
    model together with every loader it will run on. Returns (model, {split: prepared loader})."""
    splits = [split for split in loaders if split != "train"]
    model, *prepared = accelerator.prepare(model, *(loaders[split] for split in splits))
    return model, dict(zip(splits, prepared))


class _Ignored:
    """Stands in for an object the checkpoint's run registered for checkpointing (the EMA) and this one does not."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def load_checkpoint_weights(accelerator, path):
    """A resumable checkpoint's model weights into the prepared model for evaluation, in whatever layout
    save_state wrote them (DDP, FSDP, DeepSpeed): through load_state, which also reads what else the run registered
    (its EMA), here into stand-ins: the model is what is evaluated."""
    for _ in Path(path).glob("custom_checkpoint_*.pkl"):
        accelerator.register_for_checkpointing(_Ignored())
    accelerator.load_state(str(path))

