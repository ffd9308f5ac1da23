"""Launching as users configure it: a file from `accelerate config default`."""
import json
import sys

from conftest import ACCELERATE, free_port, run, shared_dir

PRECISIONS = ("no", "fp16", "bf16")


def write_default_configs(directory):
    """`accelerate config default`'s file on this machine (JSON, use_cpu: true when no GPU), run once, and the same
    file for each other --mixed_precision: the command writes that one field differently and nothing else."""
    written = directory / "no.json"
    run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default", "--config_file", written,
         "--mixed_precision", "no"])
    config = json.loads(written.read_text())
    for precision in PRECISIONS[1:]:
        (directory / f"{precision}.json").write_text(json.dumps({**config, "mixed_precision": precision}, indent=2))


def default_config(tmp_path_factory, mixed_precision="no"):
    """What `accelerate config default --mixed_precision PRECISION` writes on this machine, made once per test session
    (conftest.shared_dir): the command's start-up is seconds of CPU."""
    return shared_dir(tmp_path_factory, "accelerate_default_config", write_default_configs) / f"{mixed_precision}.json"


def launch_with_config(config, script, args, num_processes=1, **kwargs):
    """`accelerate launch --config_file config`; 2 processes add --multi_gpu (real gloo DDP with the script's --cpu)."""
    head = [*ACCELERATE, "--config_file", config]
    if num_processes > 1:
        head += ["--multi_gpu", "--num_processes", num_processes, "--main_process_port", free_port()]
    return run([*head, script, "--cpu", *args], **kwargs)

