"""Nothing silently wrong between runs: checkpoints and exports never run code, a damaged or torn file and a full disk
are one line naming them, Ctrl-C is one line. All in this process (1 process); the 2-process faults are in
test_faults.py.

A planted pickle's `__reduce__` writes a marker file (what a crafted file in a checkpoint directory could do to the
machine it is resumed on); every loading path of both scripts meets one, and the marker must never appear."""
import errno
import json
import os
import shutil
import signal
import threading
import time

import pytest
import torch
from accelerate.state import AcceleratorState
from conftest import read_json, read_jsonl, run_here

from utils.checkpoint import check_checkpoint_files, fsync_files, latest_checkpoint
from utils.demo_data import write_digits_imagefolder
from utils.outputs import RunLog
from utils.runtime import UserError, write_failure

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


class Payload:
    """Unpickling it runs code: it writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('this ran')",)


def plant(path, marker):
    """A file that runs code when unpickled, written by torch.save as the real file would be."""
    torch.save(Payload(marker), path)
    return path


def cut_short(path):
    """What an interrupted copy between nodes leaves: the file's first half."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


class OneProcess:
    """The accelerator check_checkpoint_files needs on one process."""
    num_processes, process_index, is_main_process = 1, 0, True


def test_the_planted_file_really_runs_code(tmp_path):
    """The payload is live: without weights_only it writes the marker (so the tests below can fail)."""
    marker = tmp_path / "marker"
    torch.load(plant(tmp_path / "x.bin", marker), weights_only=False)
    assert marker.read_text() == "this ran"


# ---- the runs the tests below load from ----

def bert_args(data, out, *extra):
    return ["--cpu", "--train_file", data / "train.txt", "--validation_file", data / "val.txt",
            "--model_name_or_path", data / "model", "--from_scratch", "--max_seq_len", "32", "--train_batch_size",
            "16", "--eval_batch_size", "50", "--do_train", "--max_train_steps", "4", "--checkpointing_steps", "2",
            "--eval_steps", "2", "--logging_steps", "1", "--output_dir", out, *extra]


@pytest.fixture(scope="module")
def bert_run(text_data, tmp_path_factory):
    """A finished 4-step BERT run: checkpoints step_2 and step_4, best_model/."""
    out = tmp_path_factory.mktemp("bert") / "out"
    run_here("train_bert_cls.py", bert_args(text_data, out))
    return out


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """120 training images (3 batches of 40 per epoch), 40 validation images."""
    return write_digits_imagefolder(tmp_path_factory.mktemp("digits"), size=16, limit=160)


def resnet_args(data, out, *extra):
    # ShuffleNetV2 x0.5: 0.35 M parameters, so that the many runs below write and read little (ResNet-18 has 11 M)
    return ["--cpu", data, "-a", "shufflenet_v2_x0_5", "--image_size", "16", "--val_resize", "16", "-b", "40", "-j",
            "0", "--epochs", "1", "--checkpointing_steps", "2", "--output_dir", out, *extra]


EMA = ["--model_ema", "--model_ema_steps", "1"]


@pytest.fixture(scope="module")
def resnet_runs(digits, tmp_path_factory):
    """Two finished 3-step ResNet runs, without and with --model_ema: checkpoints/step_2 and the .pth exports."""
    runs = {}
    for name, extra in (("plain", []), ("ema", EMA)):
        out = tmp_path_factory.mktemp(name) / "out"
        run_here("train_resnet.py", resnet_args(digits, out, *extra))
        runs[name] = out
    return runs


# ---- every file a checkpoint holds is checked before anything is loaded ----

@pytest.mark.parametrize("name", ["custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", "scheduler.bin",
                                  "scaler.pt", "sampler.bin", "dl_state_dict.bin"])
def test_a_pickle_planted_in_a_checkpoint_is_refused_unread(bert_run, tmp_path, name):
    checkpoint = shutil.copytree(bert_run / "checkpoints" / "step_4", tmp_path / "step_4")
    marker = tmp_path / "marker"
    planted = plant(checkpoint / name, marker)
    with pytest.raises(UserError) as refused:
        check_checkpoint_files(OneProcess(), checkpoint)
    assert str(refused.value).startswith(f"{planted}: holds a pickle"), refused.value
    assert "\n" not in str(refused.value) and not marker.exists()


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"])
def test_a_checkpoint_file_cut_short_is_named(bert_run, tmp_path, name):
    checkpoint = shutil.copytree(bert_run / "checkpoints" / "step_4", tmp_path / "step_4")
    check_checkpoint_files(OneProcess(), checkpoint)  # whole, it passes
    damaged = cut_short(checkpoint / name)
    with pytest.raises(UserError, match=rf"^{damaged}: damaged or incomplete \(a copy or a save cut short\?\): "):
        check_checkpoint_files(OneProcess(), checkpoint)


def test_another_ranks_random_state_is_not_this_ranks_business(bert_run, tmp_path):
    """Each rank reads only its own RNG state: rank 0 does not stop at rank 1's file (rank 1 does)."""
    checkpoint = shutil.copytree(bert_run / "checkpoints" / "step_4", tmp_path / "step_4")
    plant(checkpoint / "random_states_1.pkl", tmp_path / "marker")
    check_checkpoint_files(OneProcess(), checkpoint)

    class SecondRank(OneProcess):
        process_index = 1
    with pytest.raises(UserError, match=r"random_states_1.pkl: holds a pickle"):
        check_checkpoint_files(SecondRank(), checkpoint)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_fsdp_sharded_state_dicts_are_checked_item_by_item(tmp_path):
    """accelerate_configs/fsdp.yaml's SHARDED_STATE_DICT is written by torch.distributed.checkpoint, whose reader
    unpickles .metadata with pickle.load and every non-tensor item with weights_only=False."""
    import pickle

    import torch.distributed.checkpoint as dcp
    marker = tmp_path / "marker"
    checkpoint = tmp_path / "step_2"
    dcp.save({"weight": torch.ones(2), "step": 3}, checkpoint_id=checkpoint / "pytorch_model_fsdp_0")
    dcp.save({"weight": torch.ones(2), "step": Payload(marker)}, checkpoint_id=checkpoint / "optimizer_0")
    with pytest.raises(UserError, match=rf"^{checkpoint / 'optimizer_0'}/__0_0.distcp: holds a pickled \S*exec"
                                        r", .* \(item step\)$"):
        check_checkpoint_files(OneProcess(), checkpoint)
    assert not marker.exists()
    dcp.load({"weight": torch.zeros(2), "step": 0}, checkpoint_id=checkpoint / "optimizer_0")  # torch's own reader
    assert marker.exists(), "the planted item did not run: this test would prove nothing"
    shutil.rmtree(checkpoint / "optimizer_0")
    check_checkpoint_files(OneProcess(), checkpoint)  # a plain one passes
    with open(checkpoint / "pytorch_model_fsdp_0" / ".metadata", "wb") as f:
        pickle.dump(Payload(tmp_path / "metadata_marker"), f)
    with pytest.raises(UserError, match=r"pytorch_model_fsdp_0/.metadata: holds a pickled \S*exec"):
        check_checkpoint_files(OneProcess(), checkpoint)
    assert not (tmp_path / "metadata_marker").exists()


# ---- every loading path of both scripts, with a planted pickle or a file cut short ----

LOADS = {  # id: (script, run, file in the run's output dir, what is done to it, the script's loading flags)
    "resnet resume latest --model_ema": ("resnet", "ema", "checkpoints/step_2/custom_checkpoint_0.pkl", plant,
                                         [*EMA, "--resume", "latest"]),
    "resnet resume DIR --model_ema": ("resnet", "ema", "checkpoints/step_2/ema.safetensors", cut_short,
                                      [*EMA, "--resume", "{out}/checkpoints/step_2"]),
    "resnet resume latest": ("resnet", "plain", "checkpoints/step_2/random_states_0.pkl", plant,
                             ["--resume", "latest"]),
    "resnet resume DIR": ("resnet", "plain", "checkpoints/step_2/optimizer.bin", plant,
                          ["--resume", "{out}/checkpoints/step_2"]),
    "resnet -e --resume DIR": ("resnet", "plain", "checkpoints/step_2/custom_checkpoint_0.pkl", plant,
                               ["-e", "--resume", "{out}/checkpoints/step_2"]),
    "resnet -e --resume DIR cut": ("resnet", "plain", "checkpoints/step_2/model.safetensors", cut_short,
                                   ["-e", "--resume", "{out}/checkpoints/step_2"]),
    "resnet -e --resume FILE.pth": ("resnet", "plain", "model_best.pth", plant,
                                    ["-e", "--resume", "{out}/model_best.pth"]),
    "resnet -e --resume FILE.pth cut": ("resnet", "plain", "model_best.pth", cut_short,
                                        ["-e", "--resume", "{out}/model_best.pth"]),
    "resnet resume FILE.pth --model_ema": ("resnet", "ema", "checkpoint.pth", plant,
                                           [*EMA, "--resume", "{out}/checkpoint.pth", "--output_dir", "{new}"]),
    "bert resume latest": ("bert", None, "checkpoints/step_4/scheduler.bin", plant,
                           ["--resume_from_checkpoint", "latest"]),
    "bert resume DIR": ("bert", None, "checkpoints/step_2/custom_checkpoint_0.pkl", plant,
                        ["--resume_from_checkpoint", "{out}/checkpoints/step_2"]),
    "bert resume latest cut": ("bert", None, "checkpoints/step_4/model.safetensors", cut_short,
                               ["--resume_from_checkpoint", "latest"]),
    "bert --init_from_legacy": ("bert", None, "best.pt", plant,
                                ["--init_from_legacy", "{out}/best.pt", "--output_dir", "{new}"]),
    "bert evaluate best_model cut": ("bert", None, "best_model/model.safetensors", cut_short, None),
}


@pytest.mark.parametrize("case", list(LOADS))
def test_every_loading_path_stops_at_a_planted_pickle_or_a_damaged_file(case, bert_run, resnet_runs, digits,
                                                                         text_data, tmp_path):
    script, run, name, damage, flags = LOADS[case]
    out = shutil.copytree(bert_run if script == "bert" else resnet_runs[run], tmp_path / "out")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")}
    marker = tmp_path / "marker"
    target = damage(out / name, marker) if damage is plant else damage(out / name)
    flags = flags and [flag.format(out=out, new=tmp_path / "new") for flag in flags]
    if script == "resnet":
        args = resnet_args(digits, out, *flags)
    elif flags is None:  # an evaluation of the exported model
        args = ["--cpu", "--model_name_or_path", out / "best_model", "--validation_file", text_data / "val.txt",
                "--do_eval", "--max_seq_len", "32", "--eval_batch_size", "50", "--output_dir", out]
    else:
        args = bert_args(text_data, out, *flags)
    proc = run_here(f"train_{'resnet' if script == 'resnet' else 'bert_cls'}.py", args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {target}: "), proc.stderr[-3000:]
    expected = "damaged or incomplete" if damage is cut_short else "pickle"
    assert expected in errors[0], errors[0]
    assert not marker.exists(), "the planted pickle ran"
    assert {p: p.read_bytes() for p in before} == before  # nothing written over


# ---- a torn metrics.jsonl ----

def test_a_torn_last_line_of_metrics_jsonl_is_dropped_on_resume(bert_run, text_data, tmp_path):
    out = shutil.copytree(bert_run, tmp_path / "out")
    shutil.rmtree(out / "checkpoints" / "step_4")
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines) + '\n{"event": "train", "step": 5, "lo')  # a crash in the middle of a write
    proc = run_here("train_bert_cls.py", bert_args(text_data, out, "--resume_from_checkpoint", "latest"))
    assert f"note: {metrics}:{len(lines) + 1}: the last line is cut short" in proc.stdout
    events = read_jsonl(metrics)
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2, 3, 4]  # nothing repeated or lost
    assert read_json(out / "all_results.json")["train_steps"] == 4


def test_a_broken_line_inside_metrics_jsonl_is_an_error_naming_it(tmp_path):
    class Main(OneProcess):
        log_with = None
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"event": "train", "step": 1}\n{"event": "tr\n{"event": "train", "step": 2}\n')
    with pytest.raises(UserError, match=rf"^{metrics}:2: not a JSON line"):
        RunLog(Main(), tmp_path).open(resume_step=2)
    assert metrics.read_text().count("\n") == 3  # left as it was


# ---- a full disk ----

def test_write_failures_are_recognised_with_the_free_space(tmp_path):
    """What a full disk raises in each writer: Python, torch.save's zip writer, safetensors."""
    from safetensors import SafetensorError
    for err in (OSError(errno.ENOSPC, "No space left on device"),
                RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
                SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")):
        line = write_failure(err, tmp_path)
        assert line.startswith(f"{tmp_path}: cannot write (") and line.endswith("free there"), line
    assert write_failure(RuntimeError("size mismatch for fc.weight"), tmp_path) is None  # a bug stays a traceback
    assert write_failure(ValueError("x"), tmp_path) is None


def injected(monkeypatch, where, name, error):
    """Make `where`'s torch.save (or safetensors writer) fail as a full disk does when it writes a file `name`."""
    real = getattr(where, "save")

    def failing(obj, path, *args, **kwargs):
        if os.path.basename(str(path)) == name or name in str(path):
            raise error
        return real(obj, path, *args, **kwargs)
    monkeypatch.setattr(where, "save", failing)


@pytest.mark.parametrize("target", ["checkpoint", "model_best.pth", "all_results.json"])
def test_a_full_disk_stops_the_run_with_one_line_and_keeps_what_was_saved(digits, tmp_path, monkeypatch, target):
    """Injected: torch.save's own error in a checkpoint (step 2 of 3) and an export; Python's in all_results.json."""
    out = tmp_path / "out"
    unexpected_pos = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    if target == "checkpoint":
        import accelerate.checkpointing
        injected(monkeypatch, accelerate.checkpointing.torch, ".tmp-step_2", unexpected_pos)
    elif target == "model_best.pth":
        import utils.image_references
        injected(monkeypatch, utils.image_references.torch, ".model_best.pth.tmp", unexpected_pos)
    else:
        import utils.outputs
        real = utils.outputs._write_atomically

        def full(path, text):
            if path.name == "all_results.json":
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(path, text)
        monkeypatch.setattr(utils.outputs, "_write_atomically", full)
    proc = run_here("train_resnet.py", resnet_args(digits, out, "--checkpointing_steps", "1"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "free there" in errors[0], proc.stderr[-3000:]
    if target == "checkpoint":
        assert errors[0].startswith(f"error: {out / 'checkpoints'}: cannot write (") and "unexpected pos" in errors[0]
        assert errors[0].endswith(f"checkpoint step_2 not saved; the latest complete checkpoint is still "
                                  f"{out / 'checkpoints' / 'step_1'}")
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]  # the debris removed
    elif target == "model_best.pth":
        assert errors[0].startswith(f"error: {out}: cannot write (") and not (out / "model_best.pth").exists()
        assert not list(out.glob(".*.tmp"))
    else:
        assert "No space left on device" in errors[0] and not (out / "all_results.json").exists()
    check_checkpoint_files(OneProcess(), latest_checkpoint(out / "checkpoints"))  # the latest one loads


def test_a_really_full_disk_keeps_the_previous_results_and_says_how_much_is_free(small_disk):
    class Main(OneProcess):
        log_with = None
    disk = small_disk("64k")
    log = RunLog(Main(), disk)
    log.write_json("all_results.json", {"eval_accuracy": 0.9})
    filler = disk / "filler"
    with pytest.raises(OSError):
        with open(filler, "wb") as f:
            f.write(b"\0" * 128 * 1024)
    with pytest.raises(UserError, match=rf"^{disk}: cannot write \(No space left on device\); 0 B free there$"):
        log.write_json("all_results.json", {"eval_accuracy": 0.1, "padding": "x" * 8192})
    assert read_json(disk / "all_results.json") == {"eval_accuracy": 0.9}  # not half-written
    with pytest.raises(UserError, match=rf"^{disk}: cannot write"):
        log.log("train", 1, {"loss": 2.3, "padding": "x" * 8192})


def test_a_full_disk_during_the_best_model_export(bert_run, text_data, tmp_path, monkeypatch):
    """safetensors' own error, where transformers' save_pretrained meets it: best_model/ stays the previous one."""
    import transformers.modeling_utils
    from safetensors import SafetensorError
    out = shutil.copytree(bert_run, tmp_path / "out")
    shutil.rmtree(out / "checkpoints" / "step_4")
    state = read_json(out / "checkpoints" / "step_2" / "training_state.json")
    state["best_macro_f1"] = None  # as before any validation: the resumed run's at step 4 is a new best, exported
    (out / "checkpoints" / "step_2" / "training_state.json").write_text(json.dumps(state))
    previous = (out / "best_model" / "model.safetensors").read_bytes()
    real = transformers.modeling_utils.safe_save_file

    def full(tensors, path, *args, **kwargs):
        if "best_model.tmp" in str(path):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, *args, **kwargs)
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    proc = run_here("train_bert_cls.py", bert_args(text_data, out, "--resume_from_checkpoint", "latest"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {out}: cannot write (Error while serializing: I/O "
                                                     "error: No space left on device (os error 28)); "), errors
    assert (out / "best_model" / "model.safetensors").read_bytes() == previous
    assert not (out / "best_model.tmp").exists()


# ---- Ctrl-C ----

def test_ctrl_c_is_one_line_and_exit_status_130(text_data, tmp_path):
    """One process (the 2-process launch: test_faults.py): a real SIGINT once a checkpoint exists."""
    out = tmp_path / "out"
    checkpoint = out / "checkpoints" / "step_2" / "training_state.json"

    ended = threading.Event()

    def press_ctrl_c():  # only while the run trains (it has 10,000 steps to go), never into pytest itself
        while not ended.is_set():
            if checkpoint.exists():
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)
    threading.Thread(target=press_ctrl_c, daemon=True).start()
    try:
        proc = run_here("train_bert_cls.py", bert_args(text_data, out, "--max_train_steps", "10000",
                                                      "--eval_steps", "10000"), check=False)
    except KeyboardInterrupt:  # not handled by the script: a failure of this test, not the end of the session
        pytest.fail("Ctrl-C escaped the script as KeyboardInterrupt")
    finally:
        ended.set()
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("Map")]  # datasets' bars
    assert len(lines) == 1 and lines[0].startswith("interrupted (Ctrl-C) after step "), lines
    last = latest_checkpoint(out / "checkpoints")
    assert lines[0].endswith(f"the last checkpoint, {last}, is complete: continue with "
                             "--resume_from_checkpoint latest")
    check_checkpoint_files(OneProcess(), last)
    assert not (out / ".lock").exists()  # the interrupted run let go of its output directory
    assert not AcceleratorState._shared_state  # run_here put everything back


def test_checkpoint_files_reach_the_disk_before_the_rename(digits, tmp_path, monkeypatch):
    """Every file of a checkpoint (accelerate's, the EMA's safetensors) is fsynced under its temporary name, and the
    directory after the rename: a power loss never leaves step_N naming empty files."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "out"
    run_here("train_resnet.py", resnet_args(digits, out, *EMA))
    tmp, final = str(out / "checkpoints" / ".tmp-step_2"), str(out / "checkpoints" / "step_2")
    renamed = events.index(("replace", tmp, final))
    synced = {os.path.basename(event[1]) for event in events[:renamed]
              if event[0] == "fsync" and event[1].startswith(tmp + "/")}
    assert {path.name for path in (out / "checkpoints" / "step_2").iterdir()} <= synced
    assert ("fsync", str(out / "checkpoints")) in events[renamed:]


def test_another_ranks_temporary_file_renamed_during_the_sync_is_not_a_write_failure(tmp_path, monkeypatch):
    """Every rank syncs the checkpoint's files while the others may still write theirs: safetensors writes through a
    temporary file (.tmpXXXXXX) and renames it, so a rank may list that file and find it gone when it opens it. That
    is no failure to write (it stopped a 2-process run at a checkpoint, one line on every rank); the files that are
    there are still synced."""
    (tmp_path / ".tmpIg73NJ").write_bytes(b"weights being written by the main process")
    (tmp_path / "random_states_1.pkl").write_bytes(b"this rank's part")
    real_open, synced = os.open, []

    def open_(path, flags, *args):
        if os.path.basename(path) == ".tmpIg73NJ":  # renamed to model.safetensors by its writer meanwhile
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        synced.append(os.path.basename(path))
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", open_)
    fsync_files(tmp_path)
    assert synced == ["random_states_1.pkl", tmp_path.name]
