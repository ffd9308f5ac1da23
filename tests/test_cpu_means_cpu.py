"""`--cpu` is CPU on any machine, and a bf16 run on a CPU without AMX says what it costs.

Every `launch` in the suite already runs on a simulated 1-GPU machine (conftest.FAKE_GPU), so the learning tests
of both scripts prove 2-process gloo DDP under --cpu there. The tests here prove the simulation reproduces the
failure seen on a real 1-GPU box, and what utils.runtime.hide_gpus_under_cpu does about it.
"""
import re
import textwrap

import pytest

from conftest import REAL_GPUS, ROOT, pythonpath, run
from utils.runtime import cpu_bf16_note, CPU_BF16_WITHOUT_AMX, cpu_has_amx

BARRIER = """
    import os, argparse, torch, torch.distributed as dist
    from utils.runtime import hide_gpus_under_cpu
    {before}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    dist.barrier(device_ids=[0])  # what accelerator.wait_for_everyone() calls under gloo
    wrapped = torch.nn.DataParallel(torch.nn.Linear(2, 2))
    print("barrier ok; DataParallel devices", wrapped.device_ids, "; output on", wrapped(torch.ones(1, 2)).device)
"""


def barrier_on_fake_gpu(before, tmp_path):
    from conftest import free_port
    script = tmp_path / "barrier.py"
    script.write_text(textwrap.dedent(BARRIER.format(before=before, port=free_port())))
    return run(["python", script], env=pythonpath(ROOT / "tests" / "fake_gpu", "."), check=False)


@pytest.mark.skipif(REAL_GPUS > 0, reason="a real GPU would serve the barrier: the simulation is for "
                    "CPU-only machines; on a GPU machine the suite's own 2-process --cpu runs are the proof")
def test_the_simulated_gpu_machine_sends_an_unhidden_barrier_to_cuda(tmp_path):
    proc = barrier_on_fake_gpu("", tmp_path)
    assert proc.returncode != 0 and "barrier ok" not in proc.stdout
    assert "NVIDIA" in proc.stderr or "fake GPU" in proc.stderr, proc.stderr[-2000:]


def test_cpu_hides_the_gpu_from_barriers_and_data_parallel(tmp_path):
    proc = barrier_on_fake_gpu("hide_gpus_under_cpu(argparse.Namespace(cpu=True, data_parallel=True))", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "barrier ok; DataParallel devices [] ; output on cpu" in proc.stdout
    assert "--data_parallel under --cpu: no GPU is used" in proc.stderr


def test_cuda_queried_before_hiding_is_an_error_where_it_matters(tmp_path):
    proc = barrier_on_fake_gpu("torch.cuda.is_available(); os.environ['WORLD_SIZE'] = '2'; "
                               "hide_gpus_under_cpu(argparse.Namespace(cpu=True, data_parallel=False))", tmp_path)
    assert proc.returncode != 0 and "--cpu could not hide the GPUs" in proc.stderr


def cpuinfo(tmp_path, flags):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx512f {flags}\n\n"
                    f"processor\t: 1\nflags\t\t: fpu sse2 avx512f {flags}\n")
    return path


@pytest.mark.parametrize("flags, amx", [("avx512_bf16", False), ("avx512_bf16 amx_bf16 amx_tile", True), ("", False)])
def test_amx_is_read_from_the_cpu_flags(tmp_path, flags, amx):
    assert cpu_has_amx(cpuinfo(tmp_path, flags)) is amx


def test_bf16_on_a_cpu_without_amx_prints_a_note_pointing_to_the_measurements(tmp_path):
    (tmp_path / "amx").mkdir()
    no_amx, amx = cpuinfo(tmp_path, "avx512_bf16"), cpuinfo(tmp_path / "amx", "avx512_bf16 amx_bf16 amx_tile")
    assert cpu_bf16_note("cpu", "bf16", no_amx) == CPU_BF16_WITHOUT_AMX
    assert "no AMX" in CPU_BF16_WITHOUT_AMX and "slower than fp32" in CPU_BF16_WITHOUT_AMX
    page, anchor = re.search(r"(docs/\w+\.md)#([\w-]+)", CPU_BF16_WITHOUT_AMX).groups()  # the measurements: there
    assert f"## {anchor.replace('-', ' ')}" in (ROOT / page).read_text().lower()
    assert cpu_bf16_note("cpu", "bf16", amx) is None
    assert cpu_bf16_note("cpu", "no", no_amx) is None
    assert cpu_bf16_note("cuda", "bf16", no_amx) is None
    assert cpu_bf16_note("cpu", "bf16", tmp_path / "missing") is None  # not Linux: nothing is claimed
