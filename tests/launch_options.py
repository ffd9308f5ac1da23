"""Launching as users configure it: a file from `accelerate config default`, and other launcher flags."""
import sys

from conftest import ACCELERATE, free_port, run


def default_config(path, mixed_precision="no"):
    """What `accelerate config default` writes on this machine (JSON, use_cpu: true when no GPU)."""
    run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default", "--config_file", path,
         "--mixed_precision", mixed_precision])
    return path


def launch_with_config(config, script, args, num_processes=1, **kwargs):
    """`accelerate launch --config_file config`; 2 processes add --multi_gpu (real gloo DDP with the script's --cpu)."""
    head = [*ACCELERATE, "--config_file", config]
    if num_processes > 1:
        head += ["--multi_gpu", "--num_processes", num_processes, "--main_process_port", free_port()]
    return run([*head, script, "--cpu", *args], **kwargs)


def launch_with_precision(precision, script, args, num_processes=1, **kwargs):
    """conftest.launch's command with another --mixed_precision."""
    from conftest import launch_cmd

    cmd = launch_cmd(script, args, num_processes)
    cmd[cmd.index("--mixed_precision") + 1] = precision
    return run(cmd, **kwargs)
