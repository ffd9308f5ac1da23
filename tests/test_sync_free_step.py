"""A training step that never waits for the device, counted on real launches of both scripts: tools/step_probe
(first on the launched processes' PYTHONPATH, before the simulated GPU's sitecustomize) records, per optimizer step,
every torch.distributed call made from Python, by group, and every Python-level read of a device tensor back to the
host (Tensor.item, .cpu(), .tolist(), .numpy(), bool/int/float(tensor)).

In the steady steps (past each process's first two; neither the step nor the one before logged, validated or saved)
of a 2-process run there is no such read at all, and no collective of ours on the training group: the stop decision
is an all-reduce started on the host channel about once a second, at most once a step (utils/runtime.py
HostChannel, a gloo group whose flag stays in host memory; utils/loop.py PreemptionGuard). What DDP itself still does there: its gradient all-reduce, which runs in C++ from autograd hooks and is not
seen at the Python level, and, for ResNet only, its broadcast of rank 0's buffers before every forward pass
(`_broadcast_coalesced`): BatchNorm's running statistics rely on it, or each rank's would drift apart. BERT's
buffers are constants, and its run turns that broadcast off. On 1 process no step runs any collective: BERT's run
shows it (the host channel and the stop decision are shared code, utils/runtime.py, so one script's 1-process run
proves it for both; the ResNet step's own reads are counted on its 2-process run).

The device-agreement arm (STEP_PROBE_DEVICE_AGREEMENT=1) agrees the way accelerate's check_trigger does: at every
check, the flag all-reduced on the training device and read with `.item()`. The same count then shows exactly that
collective and that read in every steady step: the counter sees what it is meant to see. The runs never race the
clock: what is counted is what ran, step by step. On a GPU, STEP_PROBE=sync_debug turns any synchronisation inside a
steady step into an error (docs/testing.md)."""
import json
import math

import pytest
from conftest import FEW_DIGITS_TRAIN, ROOT, launch, pythonpath, run

PROBE = ROOT / "tools" / "step_probe"
BERT_STEPS, BERT_LOG_EVERY = 10, 5  # steady: 3, 4 and 7 to 9
RESNET_BATCH, RESNET_WINDOW = 16, 2  # batches per optimizer step: the stop is checked after each batch
RESNET_STEPS = math.ceil(FEW_DIGITS_TRAIN // RESNET_BATCH / RESNET_WINDOW)  # 21 batches: 11 steps (the last: 1 batch)


def bert_args(data, out):
    return ["--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch", "--do_train",
            "--max_seq_len", "16", "--train_batch_size", "16", "--max_train_steps", str(BERT_STEPS),
            "--logging_steps", str(BERT_LOG_EVERY), "--output_dir", out]


def resnet_args(data, out):
    # steady: 3, 4 and 7 to 9
    return [data, "--arch", "resnet18", "--image_size", "16", "--val_resize", "16", "-j", "0", "-b", str(RESNET_BATCH),
            "--gradient_accumulation_steps", str(RESNET_WINDOW), "--epochs", "1", "-p", "5", "--output_dir", out]


RUNS = {  # name: (script, arguments, processes, device agreement)
    "bert": ("train_bert_cls.py", bert_args, 2, False),
    "resnet": ("train_resnet.py", resnet_args, 2, False),
    "bert_one_process": ("train_bert_cls.py", bert_args, 1, False),
    "bert_device_agreement": ("train_bert_cls.py", bert_args, 2, True),
}


@pytest.fixture(scope="module")
def probed(text_data, few_digits, tmp_path_factory):
    """{run name: each rank's report (rank<R>.json), in rank order}: one launch per run, counted by the probe."""
    reports = {}
    for name, (script, args, processes, device_agreement) in RUNS.items():
        out = tmp_path_factory.mktemp(name)
        env = {**pythonpath(PROBE, ROOT / "tests" / "fake_gpu"), "STEP_PROBE": "count",
               "STEP_PROBE_OUT": str(out / "probe"), "STEP_PROBE_DEVICE_AGREEMENT": str(int(device_agreement))}
        data = text_data if script == "train_bert_cls.py" else few_digits
        if processes == 1:  # the script alone: a launcher's start-up is seconds of CPU that prove nothing here
            run(["python", script, "--cpu", *args(data, out / "run")], env=env)
        else:
            launch(script, args(data, out / "run"), processes, env=env)
        reports[name] = [json.loads((out / "probe" / f"rank{rank}.json").read_text()) for rank in range(processes)]
    return reports


def steady(report):
    return [step for step in report["steps"] if step["steady"]]


def counts(calls):
    """{name: count} without the names never called: what a step is compared with."""
    return {name: count for name, count in calls.items() if count}


@pytest.mark.parametrize("name", list(RUNS))
def test_the_probe_saw_every_step_of_the_run(name, probed):
    """Each process recorded each optimizer step once, in order, after the simulated GPU's sitecustomize ran; both
    ranks agree on which steps are steady; a logging step reads the loss (Tensor.item): the counter counts."""
    total = BERT_STEPS if name.startswith("bert") else RESNET_STEPS
    for report in probed[name]:
        assert report["next_sitecustomize"] == str(ROOT / "tests" / "fake_gpu" / "sitecustomize.py")
        assert [step["step"] for step in report["steps"]] == list(range(1, total + 1))
        assert len(steady(report)) >= 5
        logged = next(step for step in report["steps"] if step["logged"])
        assert logged["syncs"].get("Tensor.item", 0) >= 1, logged
    assert len({tuple(step["step"] for step in steady(report)) for report in probed[name]}) == 1


@pytest.mark.parametrize("name, ddp_broadcasts", [
    ("bert", 0),  # BERT's buffers are constants: no broadcast
    ("resnet", 1),  # DDP broadcasts the buffers in the forward pass whose gradients it all-reduces
])
def test_a_steady_step_on_two_processes_reads_nothing_back_and_agrees_on_the_host(name, ddp_broadcasts, probed):
    """The stop agreement is started on the host channel at most once a step (about once a second), never on
    the training group."""
    for report in probed[name]:
        for step in steady(report):
            assert counts(step["syncs"]) == {}, step["sync_sites"]
            assert counts(step["collectives"]["training"]) == counts({"_broadcast_coalesced": ddp_broadcasts}), \
                step["collective_sites"]
            assert set(counts(step["collectives"]["host"])) <= {"all_reduce"}, step["collective_sites"]
            assert step["collectives"]["host"].get("all_reduce", 0) <= 1, step["collective_sites"]
            assert counts(step["collectives"]["other"]) == {}, step["collective_sites"]
        started = sum(step["collectives"]["host"].get("all_reduce", 0) for step in report["steps"])
        assert started >= 1  # the first check starts one: the counter sees the host channel


def test_one_process_runs_no_collective_and_reads_nothing_back_in_a_steady_step(probed):
    (report,) = probed["bert_one_process"]
    for step in report["steps"]:
        assert all(counts(calls) == {} for calls in step["collectives"].values()), step["collective_sites"]
    for step in steady(report):
        assert counts(step["syncs"]) == {}, step["sync_sites"]


def test_the_counter_catches_an_agreement_on_the_device(probed):
    """The step as it was: one all-reduce on the training group and one `.item()` more per steady step, and nothing
    on the host channel."""
    for report in probed["bert_device_agreement"]:
        assert report["device_agreement"]
        for step in steady(report):
            assert counts(step["collectives"]["training"]) == {"all_reduce": 1}, step["collective_sites"]
            assert counts(step["collectives"]["host"]) == {}
            assert counts(step["syncs"]) == {"Tensor.item": 1}, step["sync_sites"]
            assert all("any_on_the_device" in site for site in step["sync_sites"]), step["sync_sites"]


def test_the_probe_refuses_an_unknown_mode_in_one_line(tmp_path):
    proc = run(["python", "-c", "pass"], check=False, env={**pythonpath(PROBE), "STEP_PROBE": "count,everything",
                                                          "STEP_PROBE_OUT": str(tmp_path)})
    assert proc.returncode == 2 and proc.stderr == "error: STEP_PROBE=count,everything: the modes are count and " \
                                                   "sync_debug\n", proc.stderr


def test_a_host_channel_that_cannot_connect_is_one_line_naming_the_setting(monkeypatch):
    """Machines whose names resolve to a loopback address, or several interfaces with only NCCL told which: gloo
    cannot connect its group, and the run says which variable to set instead of a gloo traceback."""
    import types

    import torch

    from utils.runtime import HostChannel, UserError

    def unreachable(**kwargs):
        raise RuntimeError("[enforce fail at gloo/transport/tcp/pair.cc:446] Gloo connectFullMesh failed with ...\n"
                           "more lines of gloo's")

    monkeypatch.setattr(torch.distributed, "new_group", unreachable)
    with pytest.raises(UserError, match=r"\(\[enforce fail at gloo/transport/tcp/pair.cc:446\] Gloo connectFullMesh "
                                        r"failed with \.\.\.\): set GLOO_SOCKET_IFNAME to the network interface"):
        HostChannel.open(types.SimpleNamespace(num_processes=2), timeout=None)
    assert HostChannel.open(types.SimpleNamespace(num_processes=1), timeout=None).any(True)
