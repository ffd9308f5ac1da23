"""How a run is launched and executed, the same in both scripts: the Accelerator, the launches refused because they
would go wrong silently, the DataLoader settings, the command-line look, and user-facing errors.

What the hardware is (CPU, 1 GPU, N GPUs, N machines, precision) comes from the launcher and
accelerate_configs/*.yaml; the flags here only cover what a config file cannot say.

Errors: a problem with the user's input is a `UserError`, which `run_cli` turns into one line on stderr and exit
status 2, no traceback. Under a multi-process launch every rank usually meets the same bad input: the line is
printed once, by each machine's first process, and every rank writes it into the error file torch's elastic agent
gives it (TORCHELASTIC_ERROR_FILE), so that the launcher's failure summary, the last thing `accelerate launch` and
`torchrun` print, ends with this line instead of "To enable traceback see ...". The launcher's own traceback above
that summary is its business: it exits 1 there, the processes exit 2.

DataLoaders: pin_memory on CUDA (batches land in page-locked memory, so the copy to the GPU overlaps compute; the
Accelerator's `non_blocking=True` needs it), and persistent workers (started once per loader, not again every
epoch and every evaluation). A dataset whose samples depend on the epoch must then carry the epoch to the workers
itself (vision/data.py EpochValue): each worker holds its own copy of the dataset, made when the workers started.

Neighbours: common/loop.py (the training loop's bookkeeping), common/checkpoint.py, common/export.py,
common/outputs.py.
"""
import argparse
import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (DataLoaderConfiguration, DistributedType, InitProcessGroupKwargs, ProjectConfiguration,
                              parse_flag_from_env)
from tqdm.auto import tqdm


class UserError(Exception):
    """A problem with the user's input or command line, not a bug in this code."""


def run_cli(main, args):
    """Call `main(args)`; turn a UserError into one line on stderr and exit status 2."""
    try:
        return main(args)
    except UserError as err:
        line = f"error: {err}"
        if os.environ.get("LOCAL_RANK", "0") == "0":
            tqdm.write(line, file=sys.stderr)  # on its own line even under a progress bar
        record_for_launcher(line)
        sys.exit(2)


def record_for_launcher(line):
    """Write `line` where torch's elastic agent reads a failed worker's error (its summary prints it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary then says less; the line is on stderr already


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the module docstring's layout (its commands) and shows every flag's default."""


def hf_bool(value):
    """A boolean flag's value as transformers' HfArgumentParser takes it (`--flag`, `--flag True`, `--flag no`), for
    the flags of transformers' example scripts; use with nargs="?", const=True."""
    if value.lower() in ("true", "yes", "1"):
        return True
    if value.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r}: expected true or false")

DATA_PARALLEL_WARNING = (
    "--data_parallel uses legacy single-process nn.DataParallel; multi-process DDP is several times faster "
    "(docs/launching.md): prefer `accelerate launch --config_file accelerate_configs/4gpu.yaml ...`"
)

CPU_BF16_WITHOUT_AMX = (
    "note: this CPU has no AMX (no amx_bf16 flag in /proc/cpuinfo), and bf16 autocast without it is usually slower "
    "than fp32 (docs/gpu.md#precision-defaults); drop --mixed_precision bf16 here for speed"
)


def add_runtime_args(parser):
    """Flags both scripts share for how the run is executed (not what it trains)."""
    group = parser.add_argument_group("runtime")
    group.add_argument("--cpu", action="store_true",
                       help="CPU only, whatever the machine holds (GPUs are hidden from the process); needed for "
                            "multi-process CPU (gloo) DDP")
    group.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                       help="default: whatever the launcher / accelerate config says")
    group.add_argument("--dist_backend", choices=["nccl", "gloo"], default=None,
                       help="process-group backend; default nccl on GPU, gloo on CPU and on Windows")
    group.add_argument("--ddp_timeout", type=float, default=300.0,
                       help="seconds a collective waits for a missing rank before the job fails")
    group.add_argument("--data_parallel", action="store_true",
                       help="legacy single-process nn.DataParallel over all visible GPUs (slower than DDP)")
    group.add_argument("--with_tracking", action="store_true", help="log to TensorBoard under output_dir/runs")
    memory = parser.add_argument_group("memory (what is trained stays the same with or without these)")
    memory.add_argument("--gradient_checkpointing", "--grad_checkpointing", "--grad-checkpointing", action="store_true",
                        help="keep fewer activations and recompute them in the backward pass: less device memory, "
                             "about one more forward pass of compute (the Trainer's and timm's flag)")
    memory.add_argument("--auto_find_batch_size", action="store_true",
                        help="on an out-of-memory error, train again with half the per-device micro-batch and twice "
                             "the accumulation: the same global batch, samples and steps (common/loop.py)")
    return group


def launched_world_size():
    """Processes the launcher started (torchrun / accelerate launch set WORLD_SIZE), before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_launch(args):
    """Refuse the launches that would silently train the wrong thing."""
    world_size = launched_world_size()
    if world_size > 1 and not args.cpu and not torch.cuda.is_available():
        raise UserError(
            f"{world_size} processes were launched on a machine without a GPU but without --cpu: each would train "
            "on its own (duplicate, independent runs). Add --cpu to the script's arguments for gloo DDP on CPU."
        )
    if args.data_parallel and world_size > 1:
        raise UserError(
            "--data_parallel (single-process nn.DataParallel) cannot be combined with a multi-process launch "
            f"({world_size} processes): drop --data_parallel, the launch already does DDP."
        )


def hide_gpus_under_cpu(args):
    """`--cpu` means CPU on any machine: hide every GPU from this process before anything initialises CUDA.

    Accelerator(cpu=True) alone is not enough on a machine with a GPU: torch.distributed.barrier picks its device
    from the machine's accelerator (cuda) and accelerate passes device_ids=[local_rank], so gloo rank 1 of a
    2-process CPU run dies in the first barrier with "invalid device ordinal" on a 1-GPU box; and nn.DataParallel
    spreads over whatever GPUs it sees. CUDA reads CUDA_VISIBLE_DEVICES once, when it is first asked how many
    devices there are, so this must run before anything asks. A config file's `use_cpu: true` (which reaches the
    process as ACCELERATE_USE_CPU) means the same.
    """
    if not (args.cpu or parse_flag_from_env("ACCELERATE_USE_CPU")):
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    still_visible = torch.cuda.is_available()
    if still_visible and (launched_world_size() > 1 or args.data_parallel):
        raise RuntimeError("--cpu could not hide the GPUs: CUDA was queried before build_accelerator ran, and a "
                           "multi-process or --data_parallel CPU run would then use them; call build_accelerator first")
    if args.data_parallel:
        # nn.DataParallel over no GPU is a pass-through: the run stays one CPU replica
        print("--data_parallel under --cpu: no GPU is used, nn.DataParallel runs the model as one CPU replica",
              file=sys.stderr, flush=True)


def build_accelerator(args, output_dir, gradient_accumulation_steps=1):
    """The one Accelerator both scripts use: GLOBAL batch sizes, reproducible sampling, bounded collectives."""
    hide_gpus_under_cpu(args)
    check_launch(args)
    backend = args.dist_backend or ("gloo" if sys.platform == "win32" else None)
    timeout = datetime.timedelta(seconds=args.ddp_timeout)
    # backend=None lets accelerate choose (nccl on GPU, gloo on CPU)
    handlers = [InitProcessGroupKwargs(backend=backend, timeout=timeout) if backend else InitProcessGroupKwargs(timeout=timeout)]
    dataloader_config = DataLoaderConfiguration(
        split_batches=True,  # the loader's batch size is the GLOBAL batch, divided among processes
        use_seedable_sampler=True,  # shuffling order depends only on seed+epoch: exact mid-epoch resume
        non_blocking=True,  # host-to-GPU copies overlap compute; needs pinned memory (common/runtime.py)
    )
    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
        dataloader_config=dataloader_config,
        kwargs_handlers=handlers,
        log_with="tensorboard" if args.with_tracking else None,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=os.path.join(output_dir, "runs")),
    )
    check_sharding_applies(accelerator)
    if effective_precision(accelerator) != accelerator.mixed_precision:
        accelerator.print("warning: fp16 mixed precision is not applied on CPU; this run trains in fp32 "
                          "(use bf16 for CPU autocast)")
    note = cpu_bf16_note(accelerator.device, effective_precision(accelerator))
    if note:
        accelerator.print(note)
    return accelerator


def cpuinfo_field(name, cpuinfo="/proc/cpuinfo"):
    """The first `name : value` of the Linux cpuinfo file, or None where there is none."""
    try:
        return next((line.split(":", 1)[1].strip() for line in Path(cpuinfo).read_text().splitlines()
                     if line.startswith(name)), None)
    except OSError:
        return None


def cpu_has_amx(cpuinfo="/proc/cpuinfo"):
    """Whether the CPU has AMX bf16 tiles, from the Linux cpuinfo flags; None where they cannot be read."""
    flags = cpuinfo_field("flags", cpuinfo)
    return None if flags is None else "amx_bf16" in flags.split()


def cpu_bf16_note(device, precision, cpuinfo="/proc/cpuinfo"):
    """The one line a bf16 run on a CPU without AMX prints, else None."""
    if torch.device(device).type == "cpu" and precision == "bf16" and cpu_has_amx(cpuinfo) is False:
        return CPU_BF16_WITHOUT_AMX
    return None


def check_global_batch(accelerator, global_batch_size, flag):
    """A GLOBAL batch is split evenly over the processes; one that does not divide is an error."""
    if global_batch_size < 1 or global_batch_size % accelerator.num_processes:
        raise UserError(
            f"{flag} {global_batch_size} is the GLOBAL batch and must divide evenly over "
            f"{accelerator.num_processes} processes (try {max(1, global_batch_size // accelerator.num_processes) * accelerator.num_processes})"
        )
    return global_batch_size // accelerator.num_processes


def maybe_data_parallel(model, args):
    """Wrap in nn.DataParallel before `prepare` when asked for (legacy single-process multi-GPU)."""
    if not args.data_parallel:
        return model
    warnings.warn(DATA_PARALLEL_WARNING, stacklevel=2)
    return torch.nn.DataParallel(model)


def loader_generator(seed):
    """A training DataLoader's own generator: creating an iterator then draws its worker base seed from here,
    not from the global RNG that dropout uses, so a resumed run's dropout masks match the uninterrupted run's."""
    return torch.Generator().manual_seed(seed)


def effective_precision(accelerator):
    """What the run really computes in: Accelerate trains fp16 requests on CPU in fp32 (no autocast, no scaler)."""
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        return "no"
    return accelerator.mixed_precision


def run_info(accelerator, global_batch_size):
    """How this run was launched, recorded with the results so a launch mistake is visible there."""
    return {
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "mixed_precision": effective_precision(accelerator),
        "mixed_precision_requested": accelerator.mixed_precision,
        "device": str(accelerator.device),
        "global_batch_size": global_batch_size,
        "per_device_batch_size": global_batch_size // accelerator.num_processes,
    }


def print_run_summary(accelerator, title, rows):
    """The resolved run, printed once at start-up."""
    width = max(len(key) for key in rows)
    lines = [f"***** {title} *****"] + [f"  {key:<{width}} : {value}" for key, value in rows.items()]
    accelerator.print("\n".join(lines), flush=True)


def loader_settings(num_workers):
    """DataLoader keyword arguments for `num_workers` worker processes on the device this run trains on."""
    return {"num_workers": num_workers, "pin_memory": PartialState().device.type == "cuda",
            "persistent_workers": num_workers > 0}


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
