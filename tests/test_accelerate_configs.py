"""The accelerate config files load with accelerate's own parser and launch what their headers say.

Parsing tests take milliseconds. The launch tests start real `accelerate launch` runs of a tiny
inline script on CPU (2 gloo processes, a few seconds each) and time out instead of hanging.
"""

import json
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType
from conftest import ENV, FAKE_GPU, HANG_S, kill_job

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "accelerate_configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.yaml"))
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]

# Prints what each rank sees, as JSON, one file per rank. `--cpu` mirrors the training scripts' flag.
PROBE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    if "--cpu" in sys.argv:  # CPU on any machine, as utils.runtime.hide_gpus_under_cpu does for the scripts
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch.distributed as dist
    from accelerate import Accelerator

    accelerator = Accelerator(cpu="--cpu" in sys.argv)
    info = {
        "process_index": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "world_size": dist.get_world_size() if dist.is_initialized() else None,
    }
    Path(sys.argv[1], f"rank{accelerator.process_index}.json").write_text(json.dumps(info))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    os._exit(0)  # as the scripts leave a launched process (utils/runtime.py leave_process): no finalization
    """
)


def load(name):
    return load_config_from_file(str(CONFIG_DIR / name))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env():
    """The caller's environment without distributed/accelerate variables that would leak into the run."""
    leaked = ("ACCELERATE_", "MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_")
    env = {k: v for k, v in ENV.items() if not k.startswith(leaked)}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **FAKE_GPU)  # on a simulated 1-GPU machine, as `launch`
    return env


def write_probe(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    return script, out


def read_ranks(out):
    return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["process_index"])


def run_launchers(commands, tmp_path, env):
    """Start one `accelerate launch` per command at once; return (returncode, log text) for each.

    Output goes to files (pipes could fill up and block); each launcher gets its own process group
    so that a hang is cleaned up together with its workers.
    """
    procs, logs = [], []
    for i, cmd in enumerate(commands):
        logs.append(tmp_path / f"launch{i}.log")
        with open(logs[-1], "w") as log:
            procs.append(
                subprocess.Popen(
                    LAUNCH + cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    try:
        return [(p.wait(timeout=HANG_S), log.read_text()) for p, log in zip(procs, logs)]
    finally:
        for p in procs:
            if p.poll() is None:  # a test that failed: end the whole job (its ranks run in sessions of their own)
                kill_job(p, signal.SIGKILL)
                p.wait()


def resolve_launch_args(argv):
    """What `accelerate launch argv...` resolves to, without starting anything."""
    args = launch_command_parser().parse_args(argv)
    args, _, _ = _validate_launch_command(args)
    return args


# ---- every file parses --------------------------------------------------------------------------


def test_config_dir_is_not_empty():
    assert len(CONFIG_FILES) >= 13, CONFIG_FILES


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_loads_with_accelerates_parser(path):
    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig)
    assert config.num_processes >= 1, "num_processes is required for every type but 'NO'"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_nested_keys_are_known_launch_options(path):
    """The loader checks top-level keys only; a typo inside fsdp_config/deepspeed_config would be dropped silently."""
    known = {action.dest for action in launch_command_parser()._actions}
    raw = yaml.safe_load(path.read_text())
    for section, prefix in (("fsdp_config", "fsdp_"), ("deepspeed_config", "")):
        for key in raw.get(section) or {}:
            option = key if key.startswith(prefix) else prefix + key
            assert option in known, f"{path.name}: {section}.{key} is not an `accelerate launch` option"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_header_gives_the_launch_command_for_this_file(path):
    header = path.read_text().split("\ncompute_environment:")[0]
    assert f"accelerate launch --config_file accelerate_configs/{path.name}" in header


def test_unknown_key_is_rejected(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_process: 4\n")
    with pytest.raises(ValueError, match="num_process"):
        load_config_from_file(str(bad))


# ---- what the files say -------------------------------------------------------------------------

EXPECTED = {
    # file: (distributed_type, num_processes, mixed_precision, use_cpu)
    "single_gpu.yaml": (DistributedType.NO, 1, "bf16", False),
    "single_gpu_fp16.yaml": (DistributedType.NO, 1, "fp16", False),
    "4gpu.yaml": (DistributedType.MULTI_GPU, 4, "no", False),
    "4gpu_fp16.yaml": (DistributedType.MULTI_GPU, 4, "fp16", False),
    "4gpu_bf16.yaml": (DistributedType.MULTI_GPU, 4, "bf16", False),
    "gpu_subset.yaml": (DistributedType.MULTI_GPU, 3, "no", False),
    "multinode_node0.yaml": (DistributedType.MULTI_GPU, 16, "no", False),
    "multinode_node1.yaml": (DistributedType.MULTI_GPU, 16, "no", False),
    "multinode_c10d.yaml": (DistributedType.MULTI_GPU, 16, "no", False),
    "fsdp.yaml": (DistributedType.FSDP, 4, "bf16", False),
    "deepspeed_zero2.yaml": (DistributedType.DEEPSPEED, 4, "bf16", False),
    "cpu.yaml": (DistributedType.NO, 1, "no", True),
    "cpu_ddp.yaml": (DistributedType.MULTI_GPU, 2, "no", True),
    "single_gpu_compile.yaml": (DistributedType.NO, 1, "bf16", False),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_values(name):
    config = load(name)
    distributed_type, num_processes, mixed_precision, use_cpu = EXPECTED[name]
    assert config.distributed_type == distributed_type
    assert config.num_processes == num_processes
    assert config.mixed_precision == mixed_precision
    assert config.use_cpu is use_cpu
    assert config.compute_environment.value == "LOCAL_MACHINE"


def test_compile_config_reaches_the_launcher_as_inductor_with_dynamic_shapes():
    """The dynamo section must survive accelerate's parsing: a typo in it would quietly train uncompiled."""
    args = resolve_launch_args(["--config_file", str(CONFIG_DIR / "single_gpu_compile.yaml"), "x.py"])
    assert (args.dynamo_backend, args.dynamo_use_dynamic, args.mixed_precision) == ("INDUCTOR", True, "bf16")


def test_gpu_subset_has_one_process_per_listed_gpu():
    config = load("gpu_subset.yaml")
    assert config.gpu_ids == "0,1,3"
    assert config.num_processes == len(config.gpu_ids.split(","))


def test_multinode_pair_differs_only_in_machine_rank():
    node0, node1 = vars(load("multinode_node0.yaml")), vars(load("multinode_node1.yaml"))
    assert (node0.pop("machine_rank"), node1.pop("machine_rank")) == (0, 1)
    assert node0 == node1


@pytest.mark.parametrize("name", ["multinode_node0.yaml", "multinode_node1.yaml", "multinode_c10d.yaml"])
def test_multinode_num_processes_is_the_total(name):
    config = load(name)
    gpus_per_machine = 8
    assert config.num_machines == 2
    assert config.num_processes == config.num_machines * gpus_per_machine
    assert config.main_process_ip and config.main_process_port


def test_multinode_rendezvous_settings():
    assert load("multinode_node0.yaml").same_network is True
    c10d = load("multinode_c10d.yaml")
    assert (c10d.rdzv_backend, c10d.same_network) == ("c10d", False)


def test_deepspeed_leaves_gradient_accumulation_to_the_script():
    """Set in the config, the launcher exports it and it overrides Accelerator(gradient_accumulation_steps=...)."""
    deepspeed = load("deepspeed_zero2.yaml").deepspeed_config
    assert deepspeed["zero_stage"] == 2
    assert "gradient_accumulation_steps" not in deepspeed


def test_accelerate_ignores_same_network_and_rdzv_backend_in_config_files():
    """Why the headers and docs/launching.md make users type --same_network / --rdzv_backend c10d.

    accelerate 1.15 copies a config value only when the command-line value is None; these two have
    non-None CLI defaults (False, "static"). If this fails after an upgrade, the typed flags can go.
    """
    from_file = resolve_launch_args(["--config_file", str(CONFIG_DIR / "multinode_node0.yaml"), "x.py"])
    assert (from_file.same_network, from_file.rdzv_backend) == (False, "static")
    from_file = resolve_launch_args(["--config_file", str(CONFIG_DIR / "multinode_c10d.yaml"), "x.py"])
    assert from_file.rdzv_backend == "static"


def test_documented_multinode_commands_resolve_as_intended():
    args = resolve_launch_args(["--config_file", str(CONFIG_DIR / "multinode_node1.yaml"), "--same_network", "x.py"])
    assert (args.multi_gpu, args.num_machines, args.num_processes, args.machine_rank) == (True, 2, 16, 1)
    assert args.same_network is True
    args = resolve_launch_args(
        ["--config_file", str(CONFIG_DIR / "multinode_c10d.yaml"), "--rdzv_backend", "c10d", "--machine_rank", "1",
         "--rdzv_conf", "is_host=0", "--max_restarts", "2", "x.py"]
    )
    assert (args.rdzv_backend, args.same_network, args.machine_rank) == ("c10d", False, 1)
    # machine 1 connects to machine 0's rendezvous store and never hosts it; elastic restarts
    assert (args.rdzv_conf, args.max_restarts) == ("is_host=0", 2)


def test_slurm_script_syntax():
    for script in ("multinode.sbatch", "node_launch.sh"):  # run on a real Slurm by `make test-slurm`
        subprocess.run(["bash", "-n", str(REPO / "slurm" / script)], check=True)


# ---- real launches on CPU -----------------------------------------------------------------------


def test_cpu_ddp_config_starts_two_gloo_processes(tmp_path):
    """The documented command: cpu_ddp.yaml plus the script's --cpu (the yaml's use_cpu alone gives no process group)."""
    script, out = write_probe(tmp_path)
    cmd = ["--config_file", str(CONFIG_DIR / "cpu_ddp.yaml"), "--main_process_port", str(free_port())]
    [(returncode, output)] = run_launchers([cmd + [str(script), str(out), "--cpu"]], tmp_path, launch_env())
    assert returncode == 0, output[-3000:]
    ranks = read_ranks(out)
    assert [r["process_index"] for r in ranks] == [0, 1]
    for r in ranks:
        assert (r["num_processes"], r["world_size"], r["backend"]) == (2, 2, "gloo")
        assert r["distributed_type"] == str(DistributedType.MULTI_CPU)


def test_multinode_pair_forms_one_process_group_on_localhost(tmp_path):
    """Both multinode files, as two 'machines' with one process each on 127.0.0.1, with the documented --same_network."""
    script, out = write_probe(tmp_path)
    port = free_port()
    commands = []
    for rank in (0, 1):
        raw = yaml.safe_load((CONFIG_DIR / f"multinode_node{rank}.yaml").read_text())
        raw.update(main_process_ip="127.0.0.1", main_process_port=port, num_processes=2)
        config = tmp_path / f"node{rank}.yaml"
        config.write_text(yaml.safe_dump(raw))
        commands.append(["--config_file", str(config), "--same_network", str(script), str(out), "--cpu"])
    for returncode, output in run_launchers(commands, tmp_path, launch_env()):
        assert returncode == 0, output[-3000:]
    ranks = read_ranks(out)
    assert [r["process_index"] for r in ranks] == [0, 1]
    assert all((r["world_size"], r["backend"]) == (2, "gloo") for r in ranks)


def test_launch_with_unknown_key_fails_naming_it(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text(
        (CONFIG_DIR / "cpu_ddp.yaml").read_text().replace("num_processes: 2", "num_processes: 2\nnum_proceses: 2")
    )
    script, out = write_probe(tmp_path)
    [(returncode, output)] = run_launchers([["--config_file", str(bad), str(script), str(out), "--cpu"]], tmp_path, launch_env())
    assert returncode != 0
    assert "num_proceses" in output
    assert not list(out.iterdir()), "the training script must not have started"
