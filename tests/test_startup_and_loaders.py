"""Start-up cost and feeding the device: the [UNK]-rate check, DataLoader settings, throughput bookkeeping."""
import argparse
import os
import signal
import time

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from conftest import HANG_S, launch, run
from datasets import Dataset
from PIL import Image
from torch.utils.data import DataLoader
from transformers import AutoTokenizer

from utils.demo_data import write_small_bert
from utils.runtime import UserError
import train_resnet
from utils.image_data import RGBImageFolder
from utils.runtime import ignore_stop_signals, loader_settings
from utils.loop import PreemptionGuard
from utils.runtime import add_runtime_args, build_accelerator, loader_generator
from utils.loop import Throughput
from utils.text_model import check_unk_rate, unk_rate


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Tests here build an Accelerator (or PartialState) in this process: leave none behind for the next test."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_small_bert(tmp_path_factory.mktemp("bert")))


def tokenised(tokenizer, texts, **kwargs):
    return Dataset.from_dict({"text": texts}).map(lambda b: tokenizer(b["text"], **kwargs), batched=True,
                                                   remove_columns=["text"])


def reference_unk_rate(tokenizer, rows):
    """The definition, token by token: [UNK] among the tokens that are not [CLS], [SEP], [PAD], [MASK]."""
    others = set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}
    real = [i for row in rows for i in row if i not in others]
    return sum(i == tokenizer.unk_token_id for i in real) / max(1, len(real))


def test_unk_rate_counts_unknown_characters_and_not_special_tokens(tokenizer):
    # 比赛 and 球队 are in the demo vocabulary; 龘 and 靐 are not. Padding adds [PAD]s that must not count.
    dataset = tokenised(tokenizer, ["比赛龘", "球队靐龘比赛", "[MASK]比赛"], padding="max_length", max_length=12)
    # real tokens per row: 比 赛 [UNK] | 球 队 [UNK] [UNK] 比 赛 | 比 赛 ([CLS], [SEP], [MASK] and [PAD] left out)
    assert unk_rate(tokenizer, dataset) == pytest.approx(3 / 11)
    assert unk_rate(tokenizer, dataset) == pytest.approx(reference_unk_rate(tokenizer, dataset["input_ids"]))


def test_unk_rate_matches_the_definition_on_random_ids(tokenizer):
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, len(tokenizer), size=rng.integers(0, 40)).tolist() for _ in range(300)]
    dataset = Dataset.from_dict({"input_ids": rows})
    assert unk_rate(tokenizer, dataset) == pytest.approx(reference_unk_rate(tokenizer, rows))
    assert unk_rate(tokenizer, Dataset.from_dict({"input_ids": [[], []]})) == 0.0
    chosen = dataset.select(range(0, 300, 7))  # a selection counts its own rows, not the table under it
    assert unk_rate(tokenizer, chosen) == pytest.approx(reference_unk_rate(tokenizer, rows[::7]))


def test_check_unk_rate_returns_the_rate_and_refuses_a_vocabulary_that_does_not_fit(tokenizer):
    assert check_unk_rate(unk_rate(tokenizer, tokenised(tokenizer, ["比赛球队"])), "model") == 0.0
    with pytest.raises(UserError, match=r"^model: the tokenizer maps 67% of the training text to \[UNK\]"):
        check_unk_rate(unk_rate(tokenizer, tokenised(tokenizer, ["龘靐比"])), "model")


def test_unk_check_stops_every_process_with_one_line(text_data, tmp_path):
    """A vocabulary big enough to pass the size check but without the text's characters: both ranks stop at once,
    the verdict printed once (by the first rank to meet it), before anything is written."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((text_data / "model" / "config.json").read_text().replace(
        '"vocab_size": ', '"vocab_size": 300, "unused": '))
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"word{i}" for i in range(200))]
    (model / "vocab.txt").write_text("".join(t + "\n" for t in tokens))
    (model / "tokenizer_config.json").write_text((text_data / "model" / "tokenizer_config.json").read_text())
    proc = launch("train_bert_cls.py", ["--data_dir", text_data, "--model_name_or_path", model, "--from_scratch",
                                        "--do_train", "--max_train_steps", "1", "--output_dir", tmp_path / "o"],
                  num_processes=2, check=False)
    assert proc.returncode != 0
    line = f"error: {model}: the tokenizer maps 100% of the training text to [UNK]"
    assert line in proc.stderr, proc.stderr[-3000:]
    assert 'train_bert_cls.py", line' not in proc.stderr  # no traceback from our code on either rank
    # printed once (not once per process), and repeated by the launcher's failure summary, its last words
    assert [text.startswith(line) for text in proc.stderr.splitlines()].count(True) == 1, proc.stderr[-3000:]
    assert line in "\n".join(proc.stderr.splitlines()[-12:]), proc.stderr[-3000:]
    assert not (tmp_path / "o").exists()


def test_the_first_rank_to_meet_a_users_error_prints_it_whichever_rank_it_is(monkeypatch):
    """The launcher ends the other ranks as soon as one exits: the rank that prints the line is the first to fail,
    rank 1 here, and the ones after it stay silent; a launch without a store prints from each machine's first
    process."""
    from utils.runtime import RollCall

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setattr(RollCall, "_store", None)
    monkeypatch.setattr(RollCall, "_gone", False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "first_to_fail")
    monkeypatch.setenv("WORLD_SIZE", "2")
    answers = []
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        RollCall._store = None  # a process of its own
        answers.append(RollCall.first_to_fail())
    assert answers == [True, False]
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # no launcher's store
    RollCall._store = None
    printed = []
    for local_rank in ("1", "0"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        printed.append(RollCall.first_to_fail())
    assert printed == [False, True]


def test_a_lost_peer_line_calls_frozen_only_a_stopped_process_and_ends_only_that_one(monkeypatch):
    """After a failed collective, the survivor names each rank that missed the roll call by what its process is
    doing: a stopped one is frozen and ended; one that runs (busy, or waiting in a collective of its own) is left to
    the launcher; one that exited is said to have exited; another machine's is unknown from here."""
    import json
    import socket
    import subprocess

    from utils.runtime import RollCall, _process_start, lost_peer_line

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(store.port)),
                        ("TORCHELASTIC_RUN_ID", "lost_peer"), ("WORLD_SIZE", "5"), ("RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(RollCall, "_store", None)
    monkeypatch.setattr(RollCall, "_gone", False)
    monkeypatch.setattr(RollCall, "ANSWER_SECONDS", 0.5)
    frozen, running, exited = (subprocess.Popen(["sleep", "600"]) for _ in range(3))
    exited.kill()
    exited.wait()
    try:
        frozen.send_signal(signal.SIGSTOP)
        for rank, (host, process) in enumerate([(socket.gethostname(), None), (socket.gethostname(), frozen),
                                                (socket.gethostname(), running), (socket.gethostname(), exited),
                                                ("another-host", running)]):
            pid = process.pid if process else os.getpid()
            start = _process_start(pid) if process is not exited else 12345
            RollCall.store().set(f"process/{rank}", json.dumps({"host": host, "pid": pid, "pid_start": start}))
        line = lost_peer_line(RuntimeError("Connection closed by peer"), 15)
        assert line.startswith("rank 0: rank 1 stopped answering: frozen (a stopped process on this machine), ended "
                               "here; rank 3 exited; rank 2 did not answer the roll call within 0.5 s but runs on "
                               "this machine"), line
        assert "rank 4 stopped answering (on another machine" in line and "(its connection closed)" in line, line
        assert frozen.wait(timeout=HANG_S) == -signal.SIGKILL  # the frozen one was ended
        assert running.poll() is None  # the running one was not
    finally:
        for process in (frozen, running):
            process.kill()
            process.wait()


def test_a_lost_peer_whose_launchers_store_is_gone_is_one_line_without_cpp_frames(monkeypatch, capfd):
    """Rank 0's machine gone with its launcher's store: torch's store client prints a warning with its C++ stack
    frames when its server is gone; the survivor asks quietly, once, and its line says the store is gone too."""
    import subprocess
    import sys

    from utils.runtime import RollCall, lost_peer_line

    server = subprocess.Popen([sys.executable, "-c", "import sys, time, torch; s = torch.distributed.TCPStore("
                               "'127.0.0.1', 0, is_master=True, wait_for_workers=False); print(s.port, flush=True); "
                               "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port), ("TORCHELASTIC_RUN_ID", "gone"),
                            ("WORLD_SIZE", "2"), ("RANK", "1")):
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(RollCall, "_store", None)
        monkeypatch.setattr(RollCall, "_gone", False)
        RollCall.enter()
    finally:
        server.kill()
        server.wait()
    capfd.readouterr()
    line = lost_peer_line(RuntimeError("Connection closed by peer"), 30)
    assert line == ("rank 1: another rank stopped answering (its connection closed); the launcher's store cannot be "
                    "reached either: the machine that holds it (rank 0's) is gone or its launcher ended; the job ends "
                    "here: continue from its latest checkpoint"), line
    assert "frame #" not in capfd.readouterr().err


# what each way of leaving is met with, and the exit status it leaves with
LEAVING = {
    "a user's error": (UserError("--train_batch_size 15 is the GLOBAL batch"), 2),
    "an op without a deterministic kernel": (RuntimeError(
        "max_unpooling2d_forward_out does not have a deterministic implementation, but you set "
        "'torch.use_deterministic_algorithms(True)'"), 2),
    "Ctrl-C": (KeyboardInterrupt(), 130),
}


@pytest.mark.parametrize("met", LEAVING)
def test_the_launchers_sigterm_to_a_rank_leaving_on_an_error_changes_nothing(met, monkeypatch, capsys):
    """Once one rank exits, the launcher sends SIGTERM to the others; a rank that is leaving on the same error at that
    moment (asking the launcher's store whether it met it first), or on Ctrl-C (telling the store it leaves), still
    leaves with its exit status and at most its one line: no traceback of the error it was leaving on. The SIGTERM
    is sent from inside that very call, the moment a busy machine can deliver it."""
    from utils.runtime import RollCall, run_cli

    def sigterm_now():
        os.kill(os.getpid(), signal.SIGTERM)
        return True

    monkeypatch.setattr(RollCall, "first_to_fail", staticmethod(sigterm_now))
    monkeypatch.setattr(RollCall, "leave_on_ctrl_c", staticmethod(sigterm_now))
    error, code = LEAVING[met]

    def main(args):
        raise error

    with pytest.raises(SystemExit) as exit_:
        run_cli(main, argparse.Namespace(use_deterministic_algorithms=True))
    assert exit_.value.code == code
    printed = capsys.readouterr().err
    assert len(printed.splitlines()) == 1 and "Traceback" not in printed, printed


def runtime_args(*argv):
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    return parser.parse_args(["--cpu", *argv])


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """An ImageFolder of 8 distinct 24x24 pictures whose random crops differ from epoch to epoch."""
    root = tmp_path_factory.mktemp("pictures")
    rng = np.random.default_rng(0)
    for i in range(8):
        (root / str(i % 2)).mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(root / str(i % 2) / f"{i}.png")
    return root


def epochs_of_crops(accelerator, root, num_workers, epochs=2, skip=0):
    """Each epoch's training batches through the prepared loader, as the training script makes them."""
    transform = train_resnet.train_transform(train_resnet.parse_args(["--dummy", "--image_size", "8"]))
    dataset = RGBImageFolder(root, transform, 8, seed=3)
    loader = accelerator.prepare(DataLoader(dataset, batch_size=2, shuffle=True, generator=loader_generator(3),
                                            **loader_settings(num_workers)))
    crops = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        dataset.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip and epoch == epochs - 1 else loader
        crops.append(torch.cat([images for images, _ in batches]))
    return crops


def test_persistent_workers_see_each_epoch_and_resume_exactly(pictures, tmp_path):
    accelerator = build_accelerator(runtime_args(), tmp_path)
    assert loader_settings(2) == {"num_workers": 2, "pin_memory": False, "persistent_workers": True,
                                  "worker_init_fn": ignore_stop_signals}  # workers leave stopping to their parent
    assert loader_settings(0)["persistent_workers"] is False  # torch refuses persistent workers without workers
    in_process = epochs_of_crops(accelerator, pictures, num_workers=0)
    persistent = epochs_of_crops(accelerator, pictures, num_workers=2)
    assert not torch.equal(persistent[0], persistent[1])  # epoch 2's crops are not epoch 1's again
    for ours, reference in zip(persistent, in_process):
        assert torch.equal(ours, reference)  # the epoch reached the workers started in epoch 1
    resumed = epochs_of_crops(accelerator, pictures, num_workers=2, skip=1)  # mid-epoch resume of epoch 2
    assert torch.equal(resumed[1], in_process[1][2:])


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_window_keeps_evaluation_and_epoch_start_out_of_the_speed():
    clock = FakeClock()
    window = Throughput(clock=clock, process_clock=lambda: 12.5)
    batches = iter([1, 2, 3, 4])

    class SlowStart:  # a loader whose workers take 3 s to deliver the first batch
        def __iter__(self):
            clock.now += 3.0
            return batches

    seen = []
    for batch in window.epoch(SlowStart()):
        clock.now += 0.5  # the step
        window.step(samples=64)
        seen.append(batch)
        if batch == 2:
            with window.pause("eval") as evaluation:
                clock.now += 10.0
            assert evaluation.seconds == 10.0
    assert seen == [1, 2, 3, 4]
    values = window.read()
    # 4 steps of 0.5 s: 128 samples/s, 500 ms/step, as if neither the eval nor the slow start had happened
    assert values == {"ms_per_step": 500.0, "samples_per_second": 128.0, "eval_seconds": 10.0,
                      "epoch_start_seconds": 3.0, "startup_seconds": 12.5}
    clock.now += 1.0
    window.step(samples=64)
    assert window.read() == {"ms_per_step": 1000.0, "samples_per_second": 64.0}  # a fresh window, startup once
    assert window.startup_seconds == 12.5


def test_window_reports_the_data_wait_as_part_of_training_time():
    clock = FakeClock()

    def slow_batches():  # the first batch after 3 s (workers starting), each later one after 0.25 s
        clock.now += 3.0
        yield "a"
        for batch in ("b", "c", None):  # a batch may be anything
            clock.now += 0.25
            yield batch

    window = Throughput(clock=clock, process_clock=lambda: 1.0, data_wait=True)
    seen = []
    for batch in window.epoch(slow_batches()):
        clock.now += 0.75  # the step
        window.step(samples=32)
        seen.append(batch)
    assert seen == ["a", "b", "c", None]
    # 4 steps in 3.75 s of training (the 3 s start apart): 0.75 s of it waiting for batches
    assert window.read() == {"ms_per_step": 937.5, "data_ms_per_step": 187.5, "samples_per_second": 128 / 3.75,
                             "epoch_start_seconds": 3.0, "startup_seconds": 1.0}
    assert "data_ms_per_step" not in Throughput(clock=clock).read()  # BERT's log line is unchanged


def test_startup_seconds_counts_from_the_process_start():
    """Time spent before the module is imported (here a 1 s sleep; in a script the imports of torch) is counted."""
    started = time.monotonic()
    proc = run(["python", "-c", "import time; time.sleep(1.0); from utils.loop import seconds_since_process_start "
                "as s; print(s())"])
    # counted from the process's start, not from anything earlier (psutil's start times rest on the boot time, which
    # the kernel gives in whole seconds)
    assert 1.0 <= float(proc.stdout) <= time.monotonic() - started + 1.0


def test_one_process_checks_for_preemption_without_a_collective(monkeypatch):
    class OneProcess:
        num_processes = 1

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: pytest.fail("a collective on 1 process"))
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        guard = PreemptionGuard(OneProcess())
        assert guard.should_stop() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.should_stop() is True
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def test_sigterm_after_the_training_steps_stops_the_run_at_once_and_none_is_lost():
    """PreemptionGuard.close hands SIGTERM back to run_cli's handler (Stopped: one line, exit 143) when the training
    steps end: a SIGTERM received after the last check is delivered again then, not dropped; a run the signal
    already stopped (preempted) writes its results, and only a later SIGTERM stops it."""
    from utils.runtime import Stopped, stop_at_once

    class OneProcess:
        num_processes = 1

    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGTERM, stop_at_once)
        guard = PreemptionGuard(OneProcess())
        os.kill(os.getpid(), signal.SIGTERM)  # after the last should_stop: the loop never saw it
        with pytest.raises(Stopped):
            guard.close(preempted=False)
        guard = PreemptionGuard(OneProcess())
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.should_stop() is True
        guard.close(preempted=True)  # acted on: the preempted run goes on to write its results
        assert signal.getsignal(signal.SIGTERM) is stop_at_once
        with pytest.raises(Stopped):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


@pytest.mark.parametrize("started_with", [signal.SIG_DFL, signal.SIG_IGN])
def test_a_process_started_with_sigterm_ignored_keeps_it_ignored_outside_the_training_steps(started_with, monkeypatch):
    """slurm/node_launch.sh starts the ranks with SIGTERM ignored and forwards a stop to each one once it handles
    SIGTERM, i.e. once its training steps can save: such a process must not stop at once on SIGTERM outside them
    (start-up, after the training steps). A process started the usual way stops at once there (exit 143)."""
    from utils import runtime
    from utils.runtime import run_cli

    monkeypatch.setattr(runtime, "_outside_training", runtime._outside_training)  # run_cli's choice, undone after

    class OneProcess:
        num_processes = 1

    def main(args):
        os.kill(os.getpid(), signal.SIGTERM)  # during start-up
        guard = PreemptionGuard(OneProcess())
        os.kill(os.getpid(), signal.SIGTERM)  # during the training steps: the guard takes it
        assert guard.should_stop() is True
        guard.close(preempted=True)
        os.kill(os.getpid(), signal.SIGTERM)  # while the results are written
        return "finished"

    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGTERM, started_with)
        if started_with == signal.SIG_IGN:
            assert run_cli(main, None) == "finished"
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        else:
            with pytest.raises(SystemExit) as stopped:
                run_cli(main, None)
            assert stopped.value.code == 143
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
