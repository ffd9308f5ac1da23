"""Between runs: a run continued from main.py-style files (--resume FILE.pth, --start-epoch) goes on with its schedule,
and a finished run can be extended."""
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, assert_same_weights, launch, read_json, read_jsonl, run_here
from huggingface_hub import ModelCard
from PIL import Image
from safetensors.torch import load_file, save_file

import train_bert_cls

from utils.demo_data import write_digits_imagefolder
from utils.export import selected_step
from utils.image_data import IMAGE_EXTENSIONS, MACOS_METADATA, RGBImageFolder
from utils.loop import read_class_weights_file
from utils.outputs import NOT_METRICS, number_entries

RESNET = "train_resnet.py"
BERT = "train_bert_cls.py"
LR = 0.05
STEPS_PER_EPOCH = 3  # 120 training images at -b 40
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """120 train / 40 val images of all 10 digits."""
    return write_digits_imagefolder(tmp_path_factory.mktemp("digits") / "d", size=16, limit=160)


def resnet_args(data, out, epochs, *extra):
    """A cosine schedule (to 0 at the last step) logged every step: each step's learning rate says where the
    schedule is."""
    return [data, "--image_size", "16", "--val_resize", "16", "-b", "40", "-j", "0", "-p", "1", "--lr", str(LR),
            "--lr_scheduler", "cosine", "--epochs", str(epochs), "--output_dir", out, *extra]


def cosine_lr(step, total_steps):
    return LR * 0.5 * (1 + math.cos(math.pi * step / total_steps))


def logged(out, event):
    return [e for e in read_jsonl(out / "metrics.jsonl") if e["event"] == event]


def assert_schedule_goes_on(out, first_step, total_steps):
    """The run's log from first_step to the end: one line per step, none repeated, each at the schedule's rate."""
    trained = [e for e in logged(out, "train") if e["step"] >= first_step]
    assert [e["step"] for e in trained] == list(range(first_step, total_steps + 1))
    for event in trained:
        assert event["lr"] == pytest.approx(cosine_lr(event["step"], total_steps), abs=1e-9), event


CHECKPOINTED = ["--checkpointing_steps", "3", "--save_total_limit", "0"]  # step_3 and step_6 kept


@pytest.fixture(scope="module")
def resnet_two_processes(digits, tmp_path_factory):
    """A finished 2-epoch run on 2 processes with a checkpoint each epoch, copied by each test that resumes it."""
    out = tmp_path_factory.mktemp("resnet_two_processes") / "run"
    proc = launch(RESNET, resnet_args(digits, out, 2, *CHECKPOINTED), num_processes=2)
    out.with_suffix(".stdout").write_text(proc.stdout)  # what the launch printed, beside its output directory
    return out


def test_a_finished_run_is_extended_from_its_checkpoint_pth(resnet_two_processes, digits, tmp_path):
    """main.py's way to train longer: `--resume OUT/checkpoint.pth --epochs 3` in the finished 2-epoch, 2-process run's
    own directory continues its log, schedule and best-model selection, and says that the momentum starts afresh (the
    extension on 1 process, in this process: the file is read the same on any number of processes, before they
    share anything)."""
    out = tmp_path / "run"
    shutil.copytree(resnet_two_processes, out)
    first = read_json(out / "all_results.json")
    proc = run_here(RESNET, ["--cpu", *resnet_args(digits, out, 3, *CHECKPOINTED, "--resume", out / "checkpoint.pth")])
    assert (f"--resume {out / 'checkpoint.pth'}: epochs 1-2 count as done: training starts at epoch 3, step 6 of 9 of "
            "the --lr_scheduler cosine schedule") in proc.stdout
    assert "the optimizer's momentum starts afresh" in proc.stdout
    # epochs 1 and 2's lines kept (a 2-epoch schedule's), epoch 3's follow on the 3-epoch schedule
    assert [e["step"] for e in logged(out, "train")] == list(range(1, 3 * STEPS_PER_EPOCH + 1))
    assert_schedule_goes_on(out, 2 * STEPS_PER_EPOCH + 1, 3 * STEPS_PER_EPOCH)
    assert [e["epoch"] for e in logged(out, "eval")] == [1, 2, 3]
    results = read_json(out / "all_results.json")
    assert results["train_steps"] == 3 * STEPS_PER_EPOCH
    best = torch.load(out / "model_best.pth", weights_only=True)
    assert results["best_epoch"] == best["epoch"] and results["best_metric"] == best["best_acc1"]
    if results["best_epoch"] < 3:  # epoch 3 did not beat the first run's best: the first run's file stands
        assert results["best_metric"] == first["best_metric"]
    assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] == 3


def test_continues_from_model_best_pth(digits, tmp_path):
    """`--resume OUT/model_best.pth` goes on from the best epoch: the log after it is replaced, and the file's best
    is the one to beat."""
    out = tmp_path / "run"
    run_here(RESNET, ["--cpu", *resnet_args(digits, out, 1)])
    proc = run_here(RESNET, ["--cpu", *resnet_args(digits, out, 3, "--resume", out / "model_best.pth")])
    assert "training starts at epoch 2, step 3 of 9" in proc.stdout
    assert [e["step"] for e in logged(out, "train")] == list(range(1, 3 * STEPS_PER_EPOCH + 1))
    assert_schedule_goes_on(out, STEPS_PER_EPOCH + 1, 3 * STEPS_PER_EPOCH)
    assert [e["epoch"] for e in logged(out, "eval")] == [1, 2, 3]
    results = read_json(out / "all_results.json")
    assert results["best_epoch"] == torch.load(out / "model_best.pth", weights_only=True)["epoch"]


def test_start_epoch_starts_inside_the_schedule(digits, tmp_path):
    """main.py's --start-epoch: the epochs before it count as done, the schedule starts after them, said in one
    line."""
    out = tmp_path / "run"
    proc = run_here(RESNET, ["--cpu", *resnet_args(digits, out, 2, "--start-epoch", "1")])
    assert ("--start-epoch 1: epoch 1 counts as done: training starts at epoch 2, step 3 of 6 of the --lr_scheduler "
            "cosine schedule") in proc.stdout
    assert "from the starting weights" in proc.stdout
    assert_schedule_goes_on(out, 4, 2 * STEPS_PER_EPOCH)
    assert [e["step"] for e in logged(out, "train")][0] == 4
    assert read_json(out / "all_results.json")["train_steps"] == 2 * STEPS_PER_EPOCH


# ---- a kill between a best-model export and the next checkpoint, then a resume with another learning rate ----


def test_resnet_best_model_from_after_the_checkpoint_goes_aside(resnet_two_processes, digits, tmp_path):
    """A 2-process run killed after exporting epoch 2 as model_best.pth, before checkpointing step 6, resumed from step
    3 (on 1 process, in this process: what is under test is what the resume finds on disk) with another --lr: the dead
    run's model_best.pth and card go aside, and model_best.pth, its card and all_results.json then name the resumed
    run's one selected epoch."""
    out = tmp_path / "run"
    shutil.copytree(resnet_two_processes, out)
    dead = torch.load(out / "checkpoint.pth", weights_only=True)  # epoch 2, as the dead run exported it as the best
    torch.save({**dead, "best_acc1": dead["acc1"], "best_epoch": 2}, out / "model_best.pth")
    shutil.rmtree(out / "checkpoints" / "step_6")
    (out / "all_results.json").unlink()
    proc = run_here(RESNET, ["--cpu", *resnet_args(digits, out, 2, *CHECKPOINTED, "--resume", "latest", "--lr",
                                                   "0.01")])
    assert ("the best model was exported at step 6, after this checkpoint (step 3): model_best.pth, model_card.md "
            "moved aside (*.abandoned_on_resume_from_step_3)") in proc.stdout
    aside = torch.load(out / "model_best.pth.abandoned_on_resume_from_step_3", weights_only=True)
    assert aside["step"] == 6 and (out / "model_card.md.abandoned_on_resume_from_step_3").is_file()
    results = read_json(out / "all_results.json")
    best = torch.load(out / "model_best.pth", weights_only=True)
    [evaluation] = [e for e in logged(out, "eval") if e["step"] == 6]
    assert results["best_epoch"] == best["epoch"] == 2 and best["step"] == 6  # the resumed run's only validation
    assert results["best_metric"] == best["best_acc1"] == evaluation["acc1"]
    assert_same_weights(best["state_dict"], torch.load(out / "checkpoint.pth", weights_only=True)["state_dict"])
    assert not all(torch.equal(best["state_dict"][k], aside["state_dict"][k]) for k in best["state_dict"])
    card = ModelCard.load(out / "model_card.md")
    names = [k for k in number_entries(evaluation) if f"eval_{k}" in results and k not in NOT_METRICS]  # evaluate()'s
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == {k: evaluation[k] for k in names}


def bert_args(data, out, *extra):
    return ["--cpu", "--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch", "--do_train",
            "--do_eval", "--max_seq_len", "32", "--train_batch_size", "16", "--eval_batch_size", "32",
            "--learning_rate", "1e-3", "--max_train_steps", "30", "--checkpointing_steps", "10", "--eval_steps", "10",
            "--logging_steps", "10", "--save_total_limit", "0", "--output_dir", out, *extra]


@pytest.fixture(scope="module")
def bert_two_processes(text_data, tmp_path_factory):
    """A finished 30-step run on 2 processes (checkpoints step_10 to step_30), copied by each test that resumes it."""
    out = tmp_path_factory.mktemp("bert_two_processes") / "run"
    proc = launch(BERT, bert_args(text_data, out)[1:], num_processes=2)
    out.with_suffix(".stdout").write_text(proc.stdout)  # what the launch printed, beside its output directory
    return out


def test_bert_best_model_from_after_the_checkpoint_goes_aside(bert_two_processes, text_data, tmp_path):
    """A run killed after exporting step 30's weights as best_model/, before checkpointing step 30, resumed from step
    20 (on 1 process) with another --learning_rate: the dead run's best_model/ goes aside, and the resumed run ends
    (instead of stopping on a best_model/ of the wrong step) with best_model/, its card and all_results.json naming
    one step."""
    out = tmp_path / "run"
    shutil.copytree(bert_two_processes, out)
    best = out / "best_model"
    shutil.copy(out / "checkpoints" / "step_30" / "model.safetensors", best / "model.safetensors")
    (best / "best_step.json").write_text('{"step": 30}\n')  # as the dead run exported it
    shutil.rmtree(out / "checkpoints" / "step_30")
    (out / "all_results.json").unlink()
    proc = run_here(BERT, bert_args(text_data, out, "--resume_from_checkpoint", "latest", "--learning_rate", "5e-4"))
    assert ("the best model was exported at step 30, after this checkpoint (step 20): best_model moved aside "
            "(*.abandoned_on_resume_from_step_20)") in proc.stdout
    assert selected_step(out / "best_model.abandoned_on_resume_from_step_20") == 30
    results = read_json(out / "all_results.json")
    assert results["best_step"] == selected_step(best) == 30  # the resumed run's only validation
    [evaluation] = [e for e in logged(out, "eval") if e["step"] == 30]
    assert results["best_metric"] == evaluation[results["metric_for_best_model"]]
    assert f"at step {results['best_step']}" in (best / "README.md").read_text()
    assert_same_weights(load_file(best / "model.safetensors"),
                        load_file(out / "checkpoints" / "step_30" / "model.safetensors"))


# ---- a resume on another number of processes or in another precision ----

@pytest.mark.parametrize("run, line", [
    ("bert_two_processes", "on 2 processes: the same training as on 1 process in distribution, not bitwise: dropout "
                           "masks are drawn from each process's own random stream (the same weights need a model "
                           "without dropout or drop path)"),
    ("resnet_two_processes", "on 2 processes: not the training of 1 process: BatchNorm statistics are computed per "
                             "process, over its share of each batch (SyncBatchNorm computes them over the global "
                             "batch)")])
def test_a_launch_on_two_processes_says_what_it_trains_compared_with_one(request, run, line):
    """A model that draws dropout masks or BatchNorm statistics per process does not end with the weights of 1
    process, and the launch says which in one line (BERT's fixture keeps its dropout of 0.1)."""
    printed = request.getfixturevalue(run).with_suffix(".stdout").read_text().splitlines()
    assert [said for said in printed if said.startswith("on 2 processes:")] == [line]


def test_each_per_process_clause_carries_its_own_note():
    """A model with BatchNorm and drop path: the note on SyncBatchNorm stays with the BatchNorm statistics, not with
    the dropout masks that follow them."""
    from torchvision.ops import StochasticDepth

    from utils.checkpoint import per_process_differences, say_processes

    said = []
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), StochasticDepth(0.1, "row"))
    say_processes(said.append, 2, per_process_differences(model))
    assert said == ["on 2 processes: not the training of 1 process: BatchNorm statistics are computed per process, "
                    "over its share of each batch (SyncBatchNorm computes them over the global batch); dropout masks "
                    "are drawn from each process's own random stream"]


def assert_launches_named(proc, out, per_process, precision):
    """The lines of a resume from 2 fp32 processes on 1 in `precision`, and all_results_settings.json's record of
    both launches."""
    assert ("resumed on 1 process from a checkpoint of 2 processes: the global batch and the sample order are the "
            f"same; {per_process}; sums over the processes add up in another order: training goes on as on 1 process, "
            "not bit for bit as on 2") in proc.stdout
    assert "identically" not in proc.stdout
    expected = f"resumed in {precision} from a checkpoint trained in fp32: the steps from here compute in {precision}"
    changed = [line for line in proc.stdout.splitlines() if line.startswith("resumed in ")]
    assert changed == ([] if precision == "fp32" else [expected]), changed
    assert read_json(out / "all_results_settings.json")["launches"] == [
        {"processes": 2, "mixed_precision": "no", "resume_step": None},
        {"processes": 1, "mixed_precision": "no" if precision == "fp32" else precision,
         "resume_step": 20 if "dropout" in per_process else 3}]


def assert_card_names_launches(card, resume_step):
    """The model card of a run resumed on 1 process in bf16 from 2 in fp32 names both launches, not only the last."""
    text = card.read_text()
    assert "| launch | from step | processes | mixed_precision |" in text, text
    assert "| 1 | 0 | 2 | no |" in text and f"| 2 | {resume_step} | 1 | bf16 |" in text, text


def test_resnet_resume_on_other_processes_says_what_changes(resnet_two_processes, digits, tmp_path):
    """2 processes, resumed on 1: one line names what a process computes on its own (BatchNorm statistics);
    all_results.json records both launches. (In fp32: ResNet-18 in CPU bf16 autocast turns NaN at random on a CPU
    without AMX, a kernel's doing; the precision line is utils/checkpoint.py's, for both scripts, proven by BERT's
    test below.)"""
    out = tmp_path / "run"
    shutil.copytree(resnet_two_processes, out)
    shutil.rmtree(out / "checkpoints" / "step_6")
    proc = run_here(RESNET, ["--cpu", *resnet_args(digits, out, 2, *CHECKPOINTED, "--resume", "latest")])
    assert_launches_named(proc, out, "BatchNorm statistics are computed per process, over its share of each batch",
                          "fp32")


def test_bert_resume_on_other_processes_and_precision_says_what_changes(bert_two_processes, text_data, tmp_path):
    """The same for BERT, whose dropout masks come from each process's own random stream."""
    out = tmp_path / "run"
    shutil.copytree(bert_two_processes, out)
    shutil.rmtree(out / "checkpoints" / "step_30")
    proc = run_here(BERT, bert_args(text_data, out, "--resume_from_checkpoint", "latest", "--mixed_precision", "bf16"))
    assert_launches_named(proc, out, "dropout masks are drawn from each process's own random stream", "bf16")
    assert_card_names_launches(out / "best_model" / "README.md", 20)


# ---- files handed from one run (or one editor) to the next: one line each, pointing the right way ----

@pytest.fixture(scope="module")
def bert_model(text_data, tmp_path_factory):
    """A trained best_model/ (30 steps), copied by each test that changes it."""
    out = tmp_path_factory.mktemp("bert") / "run"
    run_here(BERT, bert_args(text_data, out))
    return out / "best_model"


def test_model_json_files_re_saved_with_a_bom_or_cut_short(bert_model, text_data, tmp_path):
    """trained_with.json re-saved by Windows Notepad (a BOM) is read; config.json so saved, which transformers cannot
    read, and a file cut short are one line naming the file."""
    model = tmp_path / "model"
    shutil.copytree(bert_model, model)
    test = ["--cpu", "--model_name_or_path", model, "--data_dir", text_data, "--do_test", "--eval_batch_size", "32"]
    trained_with = model / "trained_with.json"
    trained_with.write_bytes(b"\xef\xbb\xbf" + trained_with.read_bytes())
    run_here(BERT, [*test, "--output_dir", tmp_path / "bom"])
    config = model / "config.json"
    original = config.read_bytes()
    config.write_bytes(b"\xef\xbb\xbf" + original)
    assert_one_line_error(run_here(BERT, [*test, "--output_dir", tmp_path / "a"], check=False),
                          f"{config}: starts with a UTF-8 byte-order mark", "save it as UTF-8 without a BOM")
    config.write_bytes(original[:len(original) // 2])
    assert_one_line_error(run_here(BERT, [*test, "--output_dir", tmp_path / "b"], check=False),
                          f"{config}: not a readable JSON file (cut short")
    config.write_bytes(original)
    trained_with.write_text(trained_with.read_text(encoding="utf-8-sig")[:20])
    assert_one_line_error(run_here(BERT, [*test, "--output_dir", tmp_path / "c"], check=False),
                          f"{trained_with}: not a readable JSON file (cut short")


def test_custom_code_model_asks_for_trust_remote_code(text_data, tmp_path):
    """A model whose type only its own code defines (config.json auto_map) needs --trust_remote_code: said so, not
    reported as a tokenizer that cannot load."""
    model = tmp_path / "model"
    shutil.copytree(text_data / "model", model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="custom_bert", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (model / "config.json").write_text(json.dumps(config))
    proc = run_here(BERT, [*bert_args(text_data, tmp_path / "out"), "--model_name_or_path", model], check=False)
    assert_one_line_error(proc, f"{model}: its", "is custom code in the model's files", "pass --trust_remote_code")


def test_utf16_text_file_is_named_utf16(text_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(text_data, data)
    (data / "train.txt").write_text((text_data / "train.txt").read_text(encoding="utf-8"), encoding="utf-16")
    proc = run_here(BERT, bert_args(data, tmp_path / "out"), check=False)
    line = assert_one_line_error(proc, f"{data / 'train.txt'}", "it is UTF-16", "save it as UTF-8")
    assert "gb18030" not in line


def test_class_weights_file_with_a_bom_is_read(tmp_path):
    path = tmp_path / "weights.json"
    path.write_text('{"cat": 1, "dog": 2.5}', encoding="utf-8-sig")
    assert read_class_weights_file(path, ["cat", "dog"]) == {"cat": 1.0, "dog": 2.5}


def test_a_pickle_that_runs_code_is_refused_as_such(digits, tmp_path):
    """-e --resume on a .pth whose pickle names os.system: refused as holding it, never with torch's advice to load
    it with weights_only=False."""
    class Planted:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    evil = tmp_path / "model_best.pth"
    torch.save({"state_dict": {}, "arch": "resnet18", "hook": Planted()}, evil)
    proc = run_here(RESNET, ["--cpu", digits, "--image_size", "16", "--val_resize", "16", "-j", "0", "-e",
                             "--resume", evil, "--output_dir", tmp_path / "out"], check=False)
    line = assert_one_line_error(proc, f"{evil}: holds a pickled posix.system", "refuses")
    assert "weights_only` set to `False`" not in line and not (tmp_path / "ran").exists()


def test_a_lock_that_is_a_dangling_symlink_is_named(digits, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").symlink_to(tmp_path / "gone")
    proc = run_here(RESNET, ["--cpu", *resnet_args(digits, out, 1)], check=False)
    line = assert_one_line_error(proc, f"{out / '.lock'}: a symbolic link to {tmp_path / 'gone'}", "remove it")
    assert "None" not in line


def test_dataset_name_on_a_directory_with_a_loading_script(text_data, tmp_path):
    data = tmp_path / "my_dataset"
    data.mkdir()
    (data / "my_dataset.py").write_text("import datasets\n")
    args = [a for a in bert_args(text_data, tmp_path / "out") if a != "--data_dir" and a != text_data]
    proc = run_here(BERT, [*args, "--dataset_name", data], check=False)
    assert_one_line_error(proc, f"--dataset_name {data}: holds a loading script (my_dataset.py)", "save_to_disk")


# ---- models handed to the next run: classes matched by name ----

@pytest.fixture(scope="module")
def resnet_best(digits, tmp_path_factory):
    """A 2-epoch model_best.pth of the digits and its -e top-1 on them."""
    out = tmp_path_factory.mktemp("resnet") / "run"
    run_here(RESNET, ["--cpu", *resnet_args(digits, out, 2)])
    evaluated = tmp_path_factory.mktemp("resnet") / "eval"
    run_here(RESNET, ["--cpu", digits, "-j", "0", "-e", "--weights", out / "model_best.pth", "--output_dir", evaluated])
    return out / "model_best.pth", read_json(evaluated / "eval_results.json")["eval_acc1"]


def test_evaluate_weights_matches_classes_by_name(resnet_best, digits, tmp_path):
    """-e --weights on a file whose head lists the classes in another order scores as the file in its own order;
    on a folder whose class names differ it is refused in one line (by position it would score one class as
    another)."""
    path, acc1 = resnet_best
    saved = torch.load(path, weights_only=True)
    names = sorted(saved["class_to_idx"], key=saved["class_to_idx"].get)[::-1]  # the same classes, reversed
    head = {k: v.flip(0) for k, v in saved["state_dict"].items() if k.startswith("fc.")}
    reordered = tmp_path / "reordered.pth"
    torch.save({**saved, "class_to_idx": {name: i for i, name in enumerate(names)},
                "state_dict": {**saved["state_dict"], **head}}, reordered)
    proc = run_here(RESNET, ["--cpu", digits, "-j", "0", "-e", "--weights", reordered, "--output_dir", tmp_path / "e"])
    assert "its head lists the same 10 classes in another order: its rows are reordered" in proc.stdout
    assert read_json(tmp_path / "e" / "eval_results.json")["eval_acc1"] == pytest.approx(acc1)
    renamed = tmp_path / "renamed"
    shutil.copytree(digits, renamed)
    for split in ("train", "val"):
        for folder in (renamed / split).iterdir():
            folder.rename(folder.with_name(f"digit_{folder.name}"))
    proc = run_here(RESNET, ["--cpu", renamed, "-j", "0", "-e", "--weights", path, "--output_dir", tmp_path / "r"],
                    check=False)
    assert_one_line_error(proc, f"{path}: classes digit_0, digit_1, digit_2, digit_3 of the data are not among its "
                                "classes (it has 0, 1, 2, 3)", "evaluating by position would score one class as another")
    proc = run_here(RESNET, ["--cpu", *resnet_args(renamed, tmp_path / "t", 1, "--weights", path)])
    assert f"{path}: classes digit_0" in proc.stdout and "the head starts new (random)" in proc.stdout


def test_bert_do_train_from_a_trained_model_matches_labels_by_name(bert_model, text_data, tmp_path):
    """--do_train from a best_model/ whose labels are in another order starts with its head rows reordered by name
    (the very weights of each label's row); from one trained for other labels it is refused in one line."""
    original = load_file(bert_model / "model.safetensors")
    config = json.loads((bert_model / "config.json").read_text())
    labels = [config["id2label"][str(i)] for i in range(len(config["id2label"]))]
    reversed_model = tmp_path / "reversed"
    shutil.copytree(bert_model, reversed_model)
    config.update(id2label={str(i): name for i, name in enumerate(labels[::-1])},
                  label2id={name: i for i, name in enumerate(labels[::-1])})
    (reversed_model / "config.json").write_text(json.dumps(config))
    save_file({k: v.flip(0) if k.startswith("classifier.") else v for k, v in original.items()},
              reversed_model / "model.safetensors")
    args = train_bert_cls.parse_args([str(a) for a in bert_args(text_data, tmp_path / "out")[1:]
                                      if a != "--from_scratch"] + ["--model_name_or_path", str(reversed_model)])
    said = []
    _, model = train_bert_cls.build_model(args, labels, said.append)
    assert said == [f"{reversed_model}: its head lists the same {len(labels)} labels in another order: its rows are "
                    "reordered to this run's labels, matched by name"]
    for key in ("classifier.weight", "classifier.bias"):
        assert torch.equal(model.state_dict()[key], original[key])
    renamed = tmp_path / "renamed"
    shutil.copytree(bert_model, renamed)
    config.update(id2label={str(i): f"x{i}" for i in range(len(labels))},
                  label2id={f"x{i}": i for i in range(len(labels))})
    (renamed / "config.json").write_text(json.dumps(config))
    proc = run_here(BERT, [a for a in bert_args(text_data, tmp_path / "r") if a != "--from_scratch"]
                    + ["--model_name_or_path", renamed], check=False)
    assert_one_line_error(proc, f"{renamed}: trained for other labels (x0, x1, x2, x3; the data has",
                          "by position each label would start as another's")


def test_macos_archive_metadata_skipped_and_every_readable_type_listed(digits, tmp_path):
    """A folder unzipped from a macOS archive (__MACOSX/ with AppleDouble ._* files, ._* beside the images) trains on
    its images alone, with one note; an AVIF image is read; a file of another type is named in a note."""
    data = tmp_path / "digits"
    shutil.copytree(digits, data)
    for split in ("train", "val"):
        for image in sorted((data / split).rglob("*.png"))[:3]:
            (data / split / MACOS_METADATA / image.parent.name).mkdir(parents=True, exist_ok=True)
            (data / split / MACOS_METADATA / image.parent.name / f"._{image.name}").write_bytes(b"\x00\x05\x16\x07")
            image.with_name(f"._{image.name}").write_bytes(b"\x00\x05\x16\x07")
    first = sorted((data / "train" / "3").glob("*.png"))[0]
    Image.open(first).save(first.with_suffix(".avif"))
    first.unlink()
    (data / "train" / "3" / "notes.txt").write_text("not an image")
    proc = run_here(RESNET, ["--cpu", *resnet_args(data, tmp_path / "out", 1)])
    assert (f"{data / 'train'}: 6 macOS archive metadata files (__MACOSX/, AppleDouble ._*) skipped: not images"
            in proc.stdout)
    assert f"{data / 'train'}: files of types no decoder here reads left out (1 .txt); read: " in proc.stdout
    assert ".avif" in IMAGE_EXTENSIONS
    folder = RGBImageFolder(data / "train", None, 16)
    assert list(folder.class_to_idx) == [str(d) for d in range(10)]
    assert len(folder) == len(RGBImageFolder(digits / "train", None, 16).samples)  # every image, the AVIF one too
    assert first.with_suffix(".avif") in {Path(path) for path, _ in folder.samples}
    assert read_json(tmp_path / "out" / "all_results.json")["train_skipped_images"] == 0  # the AVIF decoded
