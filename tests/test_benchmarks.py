"""The benchmarks' command lines: --help shows every flag benchmarks/README.md promises, with defaults, and a
missing data root is one line on stderr and exit status 2, not a traceback. Every CPU benchmark but the three that run
whole training commands (bench_memory, bench_vs_trainer, bench_startup) also runs --quick end to end on the suite's tiny data laid
out like the real data (bench_checkpointing on its built-in models): each arm must report a rate (its size is not
checked: nothing here is a measurement)."""
import importlib
import json
import subprocess
import sys

import pytest
import torch
from accelerate.state import AcceleratorState

from conftest import ACCELERATE, ENV, ROOT, free_port, read_json, run

BENCHMARKS = ROOT / "benchmarks"
# name -> does it read real data (--data_root) and run interleaved rounds (--rounds); benchmarks/README.md's table
FLAGS = {"bench_bert_input": True, "bench_overhead": True, "bench_ddp_scaling": True, "bench_cpu_precision": True,
         "bench_memory": False, "bench_checkpointing": False, "bench_startup": True, "bench_scale": False}


def benchmark(name):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


@pytest.mark.parametrize("name", FLAGS)
def test_help_lists_the_common_flags_with_defaults(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark(name).main(["--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    flags = ["--quick", "--threads", "--output"] + (["--rounds", "--data_root"] if FLAGS[name] else [])
    for flag in flags:
        assert flag in help_text, f"{name} --help lacks {flag}"
    assert "--threads THREADS torch intra-op threads per process (default: 1)" in help_text
    if FLAGS[name]:
        assert f"(default: {ROOT / 'data'})" in help_text  # where docs/data.md puts the data in a clone
    else:
        assert "--data_root" not in help_text


@pytest.mark.parametrize("name", [n for n, data in FLAGS.items() if data])
def test_missing_data_root_is_one_line(name, tmp_path, capsys):
    """All common flags parse; the run stops at the data check, before any model or process group is built."""
    missing = tmp_path / "no_data"
    argv = ["--quick", "--rounds", "1", "--threads", "1", "--output", str(tmp_path / "r.json"), "--data_root", str(missing)]
    with pytest.raises(SystemExit) as exit_info:
        benchmark(name).harness.run_cli(benchmark(name).main, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {missing}/") and "not found" in err[0], err
    assert "--data_root" in err[0] and "docs/data.md" in err[0]
    assert not (tmp_path / "r.json").exists()


def test_missing_data_root_from_the_command_line(tmp_path):
    """A missing data directory, as a user meets it: no traceback, exit status 2, the path named."""
    proc = run(["python", "benchmarks/bench_bert_input.py", "--quick", "--data_root", tmp_path / "none"], check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert f"{tmp_path / 'none' / 'thucnews_titles' / 'train.txt'}" in proc.stderr


@pytest.mark.parametrize("script", ["bench_vs_trainer.py"])
def test_missing_data_root_of_the_newer_benchmarks(script, tmp_path):
    """Without --quick they need the real data: a missing --data_root is one line and exit 2, never a silent switch
    to generated text."""
    proc = run(["python", f"benchmarks/{script}", "--data_root", tmp_path / "none"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert f"{tmp_path / 'none' / 'thucnews_titles' / 'train.txt'}" in proc.stderr


@pytest.fixture(scope="module")
def data_root(tmp_path_factory, text_data):
    """The real data's layout (docs/data.md), filled with the suite's tiny built-in headlines and model."""
    root = tmp_path_factory.mktemp("data_root")
    for folder in ("thucnews_titles", "cnews_sample"):
        (root / folder).mkdir()
    for name in ("train.txt", "val.txt"):
        (root / "thucnews_titles" / name).symlink_to(text_data / name)
    (root / "cnews_sample" / "cnews_1000.txt").symlink_to(text_data / "train.txt")
    (root / "bert-base-chinese").symlink_to(text_data / "model")
    return root


def median_rates(results):
    """Every arm's median rate in a results JSON, wherever the benchmark nests its arms."""
    if isinstance(results, dict):
        found = [results["median_rate"]] if "median_rate" in results else []
        return found + [rate for value in results.values() for rate in median_rates(value)]
    return []


TINY_BERT = "num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64"
# name -> (extra flags, median rates its results JSON holds: one per arm). One round, the smallest settings.
QUICK = {"bench_bert_input": (["--quick_samples", "200"], 4), "bench_overhead": ([], 2),
         "bench_cpu_precision": (["--bert_config", TINY_BERT], 5)}


@pytest.mark.long  # a benchmark's quick run: every arm trains
@pytest.mark.parametrize("name", QUICK)
def test_quick_run_on_tiny_data(name, data_root, tmp_path):
    """--quick end to end on tiny data laid out like the real data: every arm trains and lands in the results JSON
    with a rate. In this process (the command line is tested above): a subprocess would spend more time importing."""
    flags, arms = QUICK[name]
    output, threads = tmp_path / "r.json", torch.get_num_threads()
    try:
        benchmark(name).main(["--quick", "--rounds", "1", "--data_root", str(data_root), "--output", str(output),
                              *flags])
    finally:  # leave no Accelerator and no thread setting behind for the next test
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.set_num_threads(threads)
    rates = median_rates(read_json(output))
    assert len(rates) == arms and all(rate > 0 for rate in rates), rates


@pytest.mark.long  # a benchmark's quick run, launched on 2 processes
def test_ddp_scaling_quick_on_two_processes(data_root, tmp_path):
    """2-process gloo DDP: the DDP arm's gradient equals the 1-process one up to float summation order."""
    output = tmp_path / "r.json"
    run([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no", "--main_process_port", free_port(), "benchmarks/bench_ddp_scaling.py", "--cpu",
         "--quick", "--samples_per_round", "64", "--train_samples", "256", "--data_root", data_root,
         "--output", output])
    arms = read_json(output)["arms"]
    assert list(arms) == ["1p g64", "2p g64 DDP defaults (bucket 25 MB)"]
    ddp = arms["2p g64 DDP defaults (bucket 25 MB)"]
    assert ddp["gradient_relative_error"] < 1e-5 and ddp["efficiency"] > 0


@pytest.mark.long  # a benchmark's quick run
def test_checkpointing_quick(tmp_path):
    """Both workloads, both arms: a rate each, and a peak memory of a step from the profiler's memory timeline. The
    tiny BERT's step needs less with checkpointing (allocated bytes are counted, not timed: the same on every run)."""
    output, threads = tmp_path / "r.json", torch.get_num_threads()
    try:
        benchmark("bench_checkpointing").main(["--quick", "--output", str(output)])
    finally:
        torch.set_num_threads(threads)
    workloads = read_json(output)["workloads"]
    assert len(workloads) == 2 and len(median_rates(workloads)) == 4 and all(r > 0 for r in median_rates(workloads))
    peaks = [w["peak_step_bytes"] for w in workloads.values()]
    assert all(peak["plain"] > 0 and peak["--gradient_checkpointing"] > 0 for peak in peaks)
    assert peaks[0]["--gradient_checkpointing"] < peaks[0]["plain"]


@pytest.mark.long  # a benchmark's quick run: launches of 2 and 4 processes
def test_scale_quick_on_2_and_4_processes(tmp_path):
    """Each launch measures the run's own agreement and the ring, and one more gloo group costs each process a file
    per other process and 4 of its own; the model's rows are there."""
    output = tmp_path / "r.json"
    run([sys.executable, "benchmarks/bench_scale.py", "--quick", "--output", output])
    record = read_json(output)
    measured = {m["processes"]: m for m in record["measured"]}
    assert sorted(measured) == [2, 4]
    for processes, m in measured.items():
        assert m["open_files_per_process"] == processes + 3, m
        assert m["ring_ms"] > 0 and m["agreement_ms_per_step"] > 0 and m["blocking_ms_per_step"] > 0
    assert [row["processes"] for row in record["model"]] == [128, 1024]


def test_a_record_names_uncommitted_changes_in_any_shared_module(tmp_path):
    """A benchmark record's revision says '+uncommitted changes' when anything the scripts import from this
    repository is changed: every repository module the scripts load lies under harness.MEASURED_CODE."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    probe = ("import sys, json; sys.path.insert(0, 'benchmarks'); import harness, train_bert_cls, train_resnet; "
             "repo = [m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None) and "
             "m.__file__.startswith(str(harness.REPO) + '/')]; "
             "print(json.dumps({'revision': harness.provenance()['git_revision'], 'measured': harness.MEASURED_CODE, "
             "'modules': [str(__import__('pathlib').Path(f).relative_to(harness.REPO)) for f in repo]}))")
    clean = json.loads(subprocess.run([sys.executable, "-c", probe], cwd=clone, env=ENV, capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1])
    assert not clean["revision"].endswith("+uncommitted changes")
    unmeasured = [m for m in clean["modules"] if not m.startswith(tuple(clean["measured"]))]
    assert not unmeasured, f"modules outside harness.MEASURED_CODE: {unmeasured}"
    loop = clone / "utils" / "loop.py"
    loop.write_text(loop.read_text() + "\n")
    revision = ("import sys; sys.path.insert(0, 'benchmarks'); import harness; "
                "print(harness.provenance()['git_revision'])")  # what the scripts load is known by now
    dirty = subprocess.run([sys.executable, "-c", revision], cwd=clone, env=ENV, capture_output=True, text=True,
                           check=True).stdout.splitlines()[-1]
    assert dirty.endswith("+uncommitted changes")
