"""tools/gpu_check.py (`make gpu-check`): its harness in dry mode on CPU, so it cannot rot between GPU runs."""
import sys
import time
from types import SimpleNamespace

import pytest

from conftest import ROOT, run

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_gpu import datasheet_peak_tflops  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 121.0), ("NVIDIA L40S", None),
    ("NVIDIA GeForce RTX 4090", 165.2), ("Tesla V100-SXM2-32GB", None),
])
def test_datasheet_peak_by_device_name(name, peak):
    assert datasheet_peak_tflops(name) == peak


def test_make_gpu_check_runs_with_the_project_venv_and_says_no_gpu():
    """`make gpu-check` as a user with the project's .venv runs it (here: this test's Python as the venv's) on a
    machine without a GPU: no wheels needed, one line, exit 0 (`run` fails on any other exit status)."""
    proc = run(["make", "--no-print-directory", "gpu-check", f"PY={sys.executable}", "GPU_READY="],
               env={"CUDA_VISIBLE_DEVICES": ""})
    assert f"{sys.executable} tools/gpu_check.py" in proc.stdout
    assert "no GPU visible here, nothing to check" in proc.stdout


@pytest.mark.long  # a GPU tool's end-to-end dry run: minutes of launches
def test_dry_mode_runs_every_check_on_cpu(tmp_path):
    """The budget is for a hang only: dry mode's checks take about a minute of CPU in all, and have no time limits
    of their own there."""
    report = tmp_path / "report.md"
    proc = run(["python", "tools/gpu_check.py", "--device", "cpu", "--budget", "1800", "--report", report],
               env={"CUDA_VISIBLE_DEVICES": ""}, timeout=2400)
    out = proc.stdout
    for check in ("bench_gpu.py", "BERT bf16, compile off", "ResNet fp32 channels_last, compile off",
                  "exact resume after SIGKILL mid-epoch", "--data_parallel over every visible GPU"):
        assert f"PASSED  {check}" in out, out[-3000:]
    assert "bitwise identical to the uninterrupted run" in out
    assert "export reloads: test accuracy" in out and "export reloads: val acc@1" in out
    assert "SKIPPED --sync_bn + 2-process NCCL" in out and "needs at least 2 GPUs (0 visible)" in out
    assert "5 passed, 0 failed, 1 skipped" in out
    text = report.read_text()
    assert "| exact resume after SIGKILL mid-epoch (latest) | passed |" in text
    assert "| bench_gpu.py (quiet GPU first) | resnet50 bf16 channels_last, compile off |" in text
    assert "images/s" in text and "samples/s" in text
    # the input arms (CPU loader vs --decode_on_device): on the CPU the two paths' images are the same, bitwise
    assert "| bench_gpu.py (quiet GPU first) | resnet50 step fed by device decode |" in text
    assert "| device decode vs CPU loader, mean abs difference | 0 | levels |" in text


def test_only_the_named_checks_run_and_one_the_budget_leaves_no_time_for_is_skipped(tmp_path):
    """--only runs just the checks it names, and a check the run's --budget leaves no time to start is reported
    skipped, with the budget named; the run exits 0, since nothing failed (`run` fails on any other exit status).
    A budget of 0 s has run out before the first check, however fast the machine."""
    report = tmp_path / "report.md"
    proc = run(["python", "tools/gpu_check.py", "--device", "cpu", "--only", "data_parallel", "--budget", "0",
                "--report", report], env={"CUDA_VISIBLE_DEVICES": ""})
    assert "0 passed, 0 failed, 1 skipped" in proc.stdout, proc.stdout
    rows = [line for line in report.read_text().splitlines() if line.startswith("| ") and "| skipped |" in line]
    assert rows == ["| --data_parallel over every visible GPU | skipped | 0 | out of the 0 s budget |"], rows


NEVER_ENDS = """
import time
time.sleep(3600)
"""


def test_a_check_the_budget_ends_while_it_runs_is_skipped(tmp_path):
    """A check whose launch is still running when the run's budget ends is reported skipped, not failed: it was cut
    short, it did not fail. The launched script never ends, so the budget is what ends it on a machine of any speed;
    the budget only has to outlast the two statements between setting the deadline and starting the check."""
    script = tmp_path / "never_ends.py"
    script.write_text(NEVER_ENDS)
    harness = gpu_check.Harness.__new__(gpu_check.Harness)  # no fixtures: the check launches its own script
    harness.args, harness.cpu = SimpleNamespace(budget=2), True
    harness.deadline = time.monotonic() + harness.args.budget
    result = gpu_check.run_check("never ends", lambda: harness.launch(script, [], tmp_path / "out", limit=3600),
                                 harness)
    assert (result.status, result.detail) == ("skipped", "out of the 2 s budget before it ended")
