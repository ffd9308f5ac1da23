"""benchmarks/gpu_bench.py (`make gpu-bench`): its dry mode end to end on the CPU, so that the GPU run works the first
time; its scheduler against a budget on a stand-in clock; its record appended to RESULTS.md."""
import hashlib
import json
import sys

import pytest

from conftest import ROOT, run

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_bench  # noqa: E402

PROBE_MISSING = f"{gpu_bench.PROBE.relative_to(ROOT)} is missing: the steady-step and 2-process parts cannot run"


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run (the CPU, tiny fixtures it makes itself) as `make gpu-bench` would start it, with RESULTS.md's
    digest before and after. Its budget and command limits are an hour: minutes of work on a loaded machine."""
    out = tmp_path_factory.mktemp("gpu_bench")
    before = digest(gpu_bench.RESULTS_MD)
    proc = run(["python", "benchmarks/gpu_bench.py", "--device", "cpu", "--output", out / "results.json",
                "--markdown", out / "record.md"], env={"CUDA_VISIBLE_DEVICES": ""}, timeout=4000)
    return {"stdout": proc.stdout, "results": json.loads((out / "results.json").read_text()),
            "record": (out / "record.md").read_text(), "results_md_unchanged": digest(gpu_bench.RESULTS_MD) == before}


def table_rows(record):
    """The record's table: one list of cells per row, the header's first."""
    lines = [line for line in record.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def planned_arms():
    """(part, arm) of every row the dry run's plan has, in table order: the plan itself, built on stand-in fixtures."""
    class Stand:
        sizes, dry, work = gpu_bench.DRY, True, None
        train_files, val_file, bert_model, jpegs = {gpu_bench.DRY.bert_batches[0]: "train"}, "val", "model", "jpegs"
        device = gpu_bench.torch.device("cpu")
        args = type("Args", (), {"only": None})()
    return [(part.name, arm.name) for tier in gpu_bench.plan(Stand()) for part in tier for arm in part.arms]


# The dry run's tests are `long` (make test-long, which .ci/run runs too): minutes of launches, one module fixture.
@pytest.mark.long
def test_dry_run_has_one_row_per_planned_arm(dry_run):
    rows = table_rows(dry_run["record"])
    assert rows[0] == gpu_bench.TABLE_HEADERS
    assert [tuple(row[:2]) for row in rows[1:]] == planned_arms()
    assert all(len(row) == len(gpu_bench.TABLE_HEADERS) for row in rows)
    parts = dry_run["results"]["parts"]
    assert [(part, arm) for part, p in parts.items() for arm in p["arms"]] == planned_arms()


@pytest.mark.long
@pytest.mark.parametrize("part, arm", [pair for pair in planned_arms() if not pair[0].startswith(("steady", "2 proc"))])
def test_dry_run_every_timed_arm_has_a_figure(dry_run, part, arm):
    """Every BERT and ResNet arm ran its round and has a rate, in the results JSON and in its row of the table."""
    figures = dry_run["results"]["parts"][part]["arms"][arm]
    assert figures["problem"] == "" and len(figures["rounds"]) == 1
    assert figures["rounds"][0]["rate"] > 0
    row = next(row for row in table_rows(dry_run["record"]) if row[:2] == [part, arm])
    assert row[2].endswith(("samples/s", "images/s")) and row[7] == "1", row
    if part.startswith("BERT") and arm != "bare model step":  # whole commands: their seconds and accuracy
        assert float(row[5]) > 0 and 0 <= float(row[6]) <= 1, row
        assert figures["rounds"][0]["train_steps"] == gpu_bench.DRY.bert_steps
        assert figures["rounds"][0]["wall_seconds"] > figures["rounds"][0]["startup_seconds"] > 0
    if arm == "train_bert_cls.py":
        assert "x Trainer" in row[3] and "x bare step" in row[3] and "?" not in row[3], row


@pytest.mark.long
@pytest.mark.skipif(not gpu_bench.PROBE.is_file(), reason=PROBE_MISSING)
def test_dry_run_probes_the_steady_steps_and_two_processes(dry_run):
    """The step probe's parts: each script's steady steps counted (sync_debug needs CUDA), and the 2-process run on
    either path, the probe confirming which one each arm took by the collectives of its steady steps."""
    parts = dry_run["results"]["parts"]
    for arm, figures in parts["steady steps without syncs"]["arms"].items():
        assert figures["problem"] == "", (arm, figures)
        check = figures["rounds"][0]
        assert check["steady_steps"] > 0 and check["sync_debug"] is False and check["host_reads"] >= 0
    arms = parts["2 processes, one GPU (gloo)"]["arms"]
    host, device = arms["host channel"], arms["device agreement (before)"]
    assert host["problem"] == device["problem"] == ""
    on_host, on_device = (arm["rounds"][0]["collectives_per_steady_step"] for arm in (host, device))
    # the stop decision: on the host channel about once a second, off the step (under one all-reduce a step), or
    # not on the host at all
    assert on_host["host"] < 1 and host["rounds"][0]["host_collectives_in_run"] > 0 and on_device["host"] == 0
    assert on_device["training"] >= on_host["training"] + 1  # ... but on the training group, as before it
    assert host["rounds"][0]["ms_per_step"] > 0 and device["rounds"][0]["ms_per_step"] > 0
    rows = {tuple(row[:2]): row for row in table_rows(dry_run["record"])}
    assert "x the device agreement's rate" in rows["2 processes, one GPU (gloo)", "host channel"][3]


@pytest.mark.long
def test_dry_run_says_its_figures_mean_nothing_and_leaves_results_md_alone(dry_run):
    assert dry_run["stdout"].count(gpu_bench.CPU_FIGURES_WARNING) >= 2  # at the start and after the table
    assert gpu_bench.CPU_FIGURES_WARNING in dry_run["record"]
    assert dry_run["results"]["dry"] is True
    assert dry_run["results_md_unchanged"]
    assert "appended to" not in dry_run["stdout"]


# ---- the scheduler, on a stand-in clock -----------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def stand_in(clock, name, seconds, calls, limit=None, fails=False):
    """An arm that takes `seconds` of the stand-in clock (cut at its limit, as a command is killed) and notes its
    calls."""
    def measure(limit_given, round_index):
        calls.append((name, round_index))
        if seconds > limit_given:
            clock.now += limit_given
            raise gpu_bench.Cut()
        clock.now += seconds
        if fails:
            raise RuntimeError("went wrong")
        return {"rate": 1.0}
    return gpu_bench.Arm(name, measure, limit)


def part(name, *arms, rounds=None):
    return gpu_bench.Part(name, list(arms), cells=lambda arm: {}, rounds=rounds)


def test_scheduler_interleaves_rounds_and_cuts_what_the_budget_cannot_hold():
    """Budget 100: tier 1 round 1 takes 70 (A 2x10, B 50); round 2 runs A (20 fits in 30) but not B (50 > 10); tier 2's
    C starts with 10 left and is cut while it runs; D is never reached. A failing arm is reported; the others run."""
    clock, calls = Clock(), []
    a = part("A", stand_in(clock, "a1", 10, calls), stand_in(clock, "a2", 10, calls, fails=True))
    b = part("B", stand_in(clock, "b", 50, calls, limit=60))
    c = part("C", stand_in(clock, "c", 30, calls, limit=60))
    d = part("D", stand_in(clock, "d", 1, calls))
    gpu_bench.run_plan([[a, b], [c, d]], 2, gpu_bench.Budget(100, clock), log=lambda line: None)
    assert calls == [("a1", 0), ("a2", 0), ("b", 0), ("a2", 1), ("a1", 1), ("c", 0)]
    assert a.arms[0].rounds == [{"rate": 1.0}] * 2 and a.arms[1].problem == "failed: RuntimeError: went wrong"
    assert b.arms[0].rounds == [{"rate": 1.0}]
    assert b.cut == "rounds from 2 on cut: 10 s of the budget left, the last round took 50 s"
    assert c.arms[0].problem == "cut: the 100 s budget ran out while it ran" and c.arms[0].rounds == [None]
    assert d.cut == d.arms[0].problem == "cut: no budget left" and d.arms[0].rounds == []


def test_a_command_past_its_own_limit_is_cut_and_the_next_arm_runs():
    clock, calls = Clock(), []
    checks = part("P", stand_in(clock, "slow", 90, calls, limit=30), stand_in(clock, "next", 5, calls), rounds=1)
    gpu_bench.run_plan([[checks]], 3, gpu_bench.Budget(1000, clock), log=lambda line: None)
    assert calls == [("slow", 0), ("next", 0)]  # one round: the part's own limit
    assert checks.arms[0].problem == "cut: past its 30 s limit" and checks.arms[1].rounds == [{"rate": 1.0}]
    assert clock.now == 35


# ---- the record -----------------------------------------------------------------------------------------------------

def test_the_record_goes_at_the_end_of_its_section(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## 12. Start-up\n\ntext\n")
    gpu_bench.append_to_results(results, "### run 1\n\n| a |\n")
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\n## 12. Start-up\n\ntext\n\n" + gpu_bench.RESULTS_SECTION)
    assert text.endswith("### run 1\n\n| a |\n")
    results.write_text(text + "\n## 14. Later\n\nmore\n")  # a section added after it: runs still go into their own
    gpu_bench.append_to_results(results, "### run 2\n")
    text = results.read_text()
    assert text.index("### run 1") < text.index("### run 2") < text.index("## 14. Later")
    assert text.endswith("### run 2\n\n## 14. Later\n\nmore\n")


def test_dry_mode_refuses_flags_it_would_ignore(capsys):
    for flags in (["--data_root", "data"], ["--peak_tflops", "989"]):
        with pytest.raises(SystemExit) as exit_info:
            gpu_bench.parse_args(["--device", "cpu", *flags])
        assert exit_info.value.code == 2
        assert f"{flags[0]}: the dry mode" in capsys.readouterr().err


def test_make_gpu_bench_runs_with_the_project_venv_and_says_no_gpu():
    """`make gpu-bench` with the project's .venv (here this test's Python) on a machine without a GPU: one line, exit 0
    (`run` fails on any other exit status)."""
    proc = run(["make", "--no-print-directory", "gpu-bench", f"PY={sys.executable}", "GPU_READY="],
               env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert f"{sys.executable} benchmarks/gpu_bench.py" in proc.stdout
    assert "no GPU visible here, nothing to measure" in proc.stdout


def test_a_gpu_run_without_the_data_stops_at_once_naming_it(tmp_path):
    """Before any model or GPU work: the missing files named in one UserError (one line on stderr from run_cli)."""
    args = gpu_bench.parse_args(["--data_root", str(tmp_path / "none")])
    with pytest.raises(gpu_bench.harness.UserError) as error:
        gpu_bench.Bench(args, gpu_bench.GPU, tmp_path)
    assert str(error.value).startswith(f"{tmp_path / 'none' / 'thucnews_titles' / 'train.txt'}, ")
    assert "bert-base-chinese/vocab.txt: not found" in str(error.value) and "\n" not in str(error.value)
