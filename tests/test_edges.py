"""Nothing lost at the edges: nodes without a shared disk, going back to an earlier checkpoint, changed settings on
resume, short accumulation windows, FSDP/DeepSpeed configs that cannot apply, finished runs."""
import json
import shutil
import signal
import subprocess
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from conftest import (ACCELERATE, ENV, HANG_S, ROOT, TORCHRUN, free_port, kill_job, launch, read_json, read_jsonl, run,
                      run_here)
from safetensors.torch import load_file
from test_data_cache import BUILT, entries
from test_resnet import main_here

from utils.checkpoint import check_precision
from utils.outputs import merge_results, read_results
from utils.demo_data import write_digits_imagefolder, write_text_classification_data
from utils.runtime import UserError

SCRIPT = "train_bert_cls.py"
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


@pytest.fixture(scope="module")
def uneven_text(tmp_path_factory):
    """88 training samples: 5 full global batches of 16 and a last one of 8, which does not divide."""
    return write_text_classification_data(tmp_path_factory.mktemp("uneven"), n_train=88, n_val=40, n_test=40)


def bert_args(data, out, *extra):
    # No dropout: 1 and 2 processes draw different masks.
    return ["--model_name_or_path", data / "model", "--from_scratch", "--config_overrides",
            "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0", "--max_seq_len", "32",
            "--train_batch_size", "16", "--eval_batch_size", "16", "--learning_rate", "1e-3", "--logging_steps", "1",
            "--output_dir", out, *extra]


def two_machines(node_args):
    """Two `accelerate launch` "machines" on 127.0.0.1, each with its own arguments (its own --output_dir)."""
    port = free_port()
    common = ["--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", port, "--same_network", "--mixed_precision", "no", "--dynamo_backend", "no"]
    procs = [subprocess.Popen([str(c) for c in [*ACCELERATE, *common, "--machine_rank", rank, SCRIPT, "--cpu", *args]],
                              cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, args in enumerate(node_args)]
    try:
        outputs = [proc.communicate(timeout=HANG_S)[0] for proc in procs]
    finally:
        for proc in procs:  # a test that failed: end the whole job (its ranks run in sessions of their own)
            if proc.poll() is None:
                kill_job(proc, signal.SIGKILL)
    return [proc.returncode for proc in procs], outputs


def test_nodes_with_their_own_disks_tokenise_train_resume_and_refuse_a_missing_checkpoint(uneven_text, tmp_path):
    """Each node has its own disk: its own --output_dir and its own --data_cache_dir, which it fills once and reads
    when the job starts again."""
    outs = [tmp_path / "node0", tmp_path / "node1"]
    caches = [tmp_path / "cache0", tmp_path / "cache1"]
    common = ["--data_dir", uneven_text, "--do_train", "--do_eval", "--eval_steps", "2", "--checkpointing_steps", "2"]
    codes, logs = two_machines([bert_args(uneven_text, out, *common, "--data_cache_dir", cache, "--max_train_steps",
                                          "4") for out, cache in zip(outs, caches)])
    assert codes == [0, 0], logs[1][-3000:]
    assert "--output_dir is not shared between the nodes" in logs[0]
    assert [log.count(BUILT) for log in logs] == [1, 1]  # once per node
    assert entries(caches[0]) == entries(caches[1]) and len(entries(caches[0])) == 1  # the same entry on each
    for rank, out in enumerate(outs):  # each node can resume on its own
        step = out / "checkpoints" / "step_4"
        assert (step / "training_state.json").is_file() and (step / "model.safetensors").is_file()
        assert (step / f"random_states_{rank}.pkl").is_file()
    # the best model was exported on the main node only, and node 1 never needed to read it
    assert not (outs[1] / "best_model").exists() and read_json(outs[0] / "all_results.json")["eval_samples"] == 40

    codes, logs = two_machines([bert_args(uneven_text, out, *common, "--data_cache_dir", cache, "--max_train_steps",
                                          "6", "--resume_from_checkpoint", "latest")
                                for out, cache in zip(outs, caches)])
    assert codes == [0, 0], logs[1][-3000:]
    assert f"Resumed from {outs[0] / 'checkpoints' / 'step_4'}" in logs[0]
    assert not any(BUILT in log for log in logs)  # each node read its own cache
    assert read_json(outs[0] / "all_results.json")["train_steps"] == 6

    shutil.rmtree(outs[1] / "checkpoints" / "step_6")  # node 1's disk lost the newest checkpoint
    codes, logs = two_machines([bert_args(uneven_text, out, *common, "--data_cache_dir", cache, "--max_train_steps",
                                          "8", "--ddp_timeout", "90", "--resume_from_checkpoint", "latest")
                                for out, cache in zip(outs, caches)])
    assert codes[0] != 0 and codes[1] != 0
    message = f"{outs[1] / 'checkpoints' / 'step_6'}: not on the disk of node"
    assert message in logs[0] and message in logs[1], logs[0][-3000:]
    # every rank stopped at once on the agreed refusal, none by waiting out a collective (--ddp_timeout 90)
    assert not any("stopped answering" in log for log in logs), logs[0][-3000:]


@pytest.fixture(scope="module")
def first_branch(uneven_text, tmp_path_factory):
    """8 steps on 1 process (in this process: what is under test is what a resume does with it), checkpoints at 3
    and 6 (none at the finished end: not asked for)."""
    out = tmp_path_factory.mktemp("branch")
    run_here(SCRIPT, ["--cpu", *bert_args(uneven_text, out, "--data_dir", uneven_text, "--do_train",
                                          "--max_train_steps", "8", "--checkpointing_steps", "3",
                                          "--save_total_limit", "5", "--warmup_ratio", "0")])
    return out


def test_a_resume_names_a_changed_label_smoothing_and_applies_it(first_branch, uneven_text, tmp_path):
    """--label_smoothing may change on resume (FLAG_ROLES: the training loss only): named in one line, and the loss
    of the next step is the smoothed one. (1 process, in this process: the flag's effect does not depend on the
    number of processes; the resume on more processes is the next test's.)"""
    out = tmp_path / "out"
    shutil.copytree(first_branch, out)
    proc = run_here(SCRIPT, ["--cpu", *bert_args(uneven_text, out, "--data_dir", uneven_text, "--do_train",
                                                 "--max_train_steps", "8", "--checkpointing_steps", "3",
                                                 "--save_total_limit", "5", "--warmup_ratio", "0",
                                                 "--label_smoothing", "0.2", "--resume_from_checkpoint",
                                                 "latest")])
    assert "resumed with changed settings (applied from here on): --label_smoothing 0.0 -> 0.2" in proc.stdout
    plain = {e["step"]: e["loss"] for e in read_jsonl(first_branch / "metrics.jsonl") if e["event"] == "train"}
    smoothed = {e["step"]: e["loss"] for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "train"}
    # this model still predicts nearly uniformly, where smoothing moves the loss little; a resume on the same process
    # count repeats the losses (docs/faults_and_resume.md), so a difference above 1e-5 is the smoothing's
    assert smoothed[6] == plain[6] and abs(smoothed[7] - plain[7]) > 1e-5


def test_rollback_with_a_lower_learning_rate_starts_a_new_branch_on_more_processes(first_branch, uneven_text,
                                                                                tmp_path):
    out = tmp_path / "out"
    shutil.copytree(first_branch, out)
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_3", "step_6"]  # no final step_8
    old_step_6 = load_file(checkpoints / "step_6" / "model.safetensors")
    proc = launch(SCRIPT, bert_args(uneven_text, out, "--data_dir", uneven_text, "--do_train", "--max_train_steps",
                                    "8", "--checkpointing_steps", "3", "--save_total_limit", "5", "--warmup_ratio",
                                    "0", "--learning_rate", "1e-4", "--resume_from_checkpoint", checkpoints / "step_3"),
                  num_processes=2)
    assert "resumed with changed settings (applied from here on): --learning_rate 0.001 -> 0.0001" in proc.stdout
    assert "starts a new branch: the later step_6" in proc.stdout
    assert "resumed on 2 processes from a checkpoint of 1 process" in proc.stdout
    assert "warning: ranks 1-1 have no saved random state" in proc.stderr
    abandoned = checkpoints / "step_6.abandoned_on_resume_from_step_3"
    assert_same(load_file(abandoned / "model.safetensors"), old_step_6)
    new_step_6 = load_file(checkpoints / "step_6" / "model.safetensors")
    assert any(not torch.equal(new_step_6[k], old_step_6[k]) for k in old_step_6)  # really this run's
    lrs = {e["step"]: e["lr"] for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "train"}
    assert lrs[4] == pytest.approx(1e-4 * (8 - 4) / 8)  # the new peak, on the schedule at the restored step
    assert lrs[2] == pytest.approx(1e-3 * (8 - 2) / 8)  # the log before the checkpoint is the first branch's


def assert_same(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_another_batch_layout_and_a_scale_less_fp16(first_branch, uneven_text, tmp_path):
    # (--gradient_accumulation_steps and --max_seq_len are checked the same way; ResNet's test below has one)
    proc = run_here(SCRIPT, ["--cpu", *bert_args(uneven_text, first_branch, "--data_dir", uneven_text,
                                                 "--do_train", "--max_train_steps", "12", "--train_batch_size",
                                                 "32", "--resume_from_checkpoint", "latest")], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: --train_batch_size 32: {first_branch / 'checkpoints' / 'step_6'} was trained with " \
           "--train_batch_size 16" in proc.stderr, proc.stderr[-2000:]
    fp16 = SimpleNamespace(scaler=object())  # an fp16 run on a GPU has a GradScaler; a bf16 checkpoint no scale
    with pytest.raises(UserError, match="--mixed_precision fp16: .* was not trained in fp16 .*no scaler.pt"):
        check_precision(fp16, first_branch / "checkpoints" / "step_6")


@pytest.fixture(scope="module")
def accumulated(uneven_text, tmp_path_factory):
    """The same 4 optimizer steps two ways: 2 processes x 4 micro-batches of 16, and 1 process x batches of 64.
    88 samples: each epoch ends with a window of 2 micro-batches (16 + 8 real samples) against a batch of 24. The
    1-process reference runs in this process (no launcher to test there)."""
    def args(name, *extra):
        # the final model is the exported one (no validation, or one only after the last step); no checkpoint is
        # asked for in 4 steps
        return bert_args(uneven_text, runs[name], "--train_file", uneven_text / "train.txt", "--do_train",
                         "--max_train_steps", "4", "--checkpointing_steps", "100", *extra)

    runs = {"micro": tmp_path_factory.mktemp("micro"), "whole": tmp_path_factory.mktemp("whole")}
    # the 2-process run also tokenises into a data cache of its own: once in all (tests/test_data_cache.py)
    runs["cache"] = tmp_path_factory.mktemp("cache")
    micro = launch(SCRIPT, args("micro", "--gradient_accumulation_steps", "4", "--data_cache_dir", runs["cache"]),
                   num_processes=2)
    runs["micro", "log"] = micro.stdout + micro.stderr
    runs["whole", "log"] = run_here(SCRIPT, ["--cpu", *args("whole", "--train_batch_size", "64",
                                                            "--validation_file", uneven_text / "val.txt",
                                                            "--do_eval", "--eval_steps", "100")]).stdout
    return runs


def test_short_accumulation_window_and_padded_batch_take_a_full_mean_step(accumulated):
    micro = load_file(accumulated["micro"] / "best_model" / "model.safetensors")
    whole = load_file(accumulated["whole"] / "best_model" / "model.safetensors")
    worst = max((micro[k] - whole[k]).abs().max().item() for k in micro)
    assert worst < 1e-5, f"max abs weight difference {worst:.2e}"  # 3e-3 when the short window is a quarter step
    assert read_json(accumulated["micro"] / "all_results.json")["train_steps"] == 4
    # its only validation was of the final weights: reused for eval_*, not run a second time
    assert "the best model is the last one evaluated (step 4): its validation results are reused" in \
        accumulated["whole", "log"]
    assert read_json(accumulated["whole"] / "all_results.json")["eval_samples"] == 40


def test_two_processes_tokenise_once(accumulated):
    """The BERT data cache (utils/text_cache.py) filled by one process of a 2-process job, the other waiting for it
    and reading it: one entry, no temporary directory left."""
    assert accumulated["micro", "log"].count(BUILT) == 1
    assert len(entries(accumulated["cache"])) == 1 and not list(accumulated["cache"].glob(".*tmp*"))


def test_finished_run_is_not_restarted_by_latest_and_test_only_results_merge(accumulated, uneven_text):
    out = accumulated["whole"]
    assert not (out / "checkpoints").exists()
    proc = run_here(SCRIPT, ["--cpu", *bert_args(uneven_text, out, "--train_file", uneven_text / "train.txt",
                                                 "--do_train", "--resume_from_checkpoint", "latest")],
                    check=False)
    assert proc.returncode == 2 and "holds a finished run (all_results.json)" in proc.stderr, proc.stderr[-2000:]
    assert "no checkpoint to resume from" in proc.stderr and "--overwrite_output_dir" in proc.stderr
    before = read_json(out / "all_results.json")
    run_here(SCRIPT, ["--cpu", "--model_name_or_path", out / "best_model", "--test_file", uneven_text / "test.txt",
                      "--do_test", "--max_seq_len", "32", "--eval_batch_size", "16", "--output_dir", out])
    after = read_json(out / "all_results.json")
    assert {k: after[k] for k in before} == before  # nothing dropped or replaced
    assert after["test_samples"] == 40 and read_json(out / "test_results.json")["test_samples"] == 40


def test_merged_results_keep_numbers_measured_with_other_settings(tmp_path):
    """all_results.json's eval_* numbers stay when an evaluation merged into it used other settings (its own numbers
    are in its results file); with the same settings they are replaced, as an evaluation of the same model is. The
    file stays flat, the settings in all_results_settings.json; one written with them nested inside is read too."""
    path = tmp_path / "all_results.json"
    training = {"train_steps": 63, "eval_acc1": 88.4, "eval_settings": {"val_crop_size": 16, "val_resize": 16}}
    path.write_text(json.dumps(training))  # as written before all_results_settings.json
    lines = merge_results(path, {"num_processes": 2, "eval_acc1": 8.7,
                                 "eval_settings": {"val_crop_size": 224, "val_resize": 256}})
    assert read_json(path) == {"train_steps": 63, "eval_acc1": 88.4}
    assert read_json(tmp_path / "all_results_settings.json") == {"eval_settings": training["eval_settings"]}
    assert lines == [f"{path}: keeps its eval_* numbers, measured with {training['eval_settings']} (this evaluation: "
                     "{'val_crop_size': 224, 'val_resize': 256}, in its own eval_results.json)"]
    assert merge_results(path, {"eval_acc1": 88.5, "eval_settings": training["eval_settings"]}) == []
    assert read_results(path) == {**training, "eval_acc1": 88.5}
    assert pd.read_json(path, typ="series").to_dict() == {"train_steps": 63, "eval_acc1": 88.5}


def test_fsdp_config_with_cpu_is_refused(uneven_text, tmp_path):
    """The shipped fsdp.yaml with --cpu, on 1 process (accelerate launches an FSDP config through its multi-process
    launcher on any count; one line from 2 processes is the other launch refusals' proof)."""
    proc = run([*ACCELERATE, "--config_file", "accelerate_configs/fsdp.yaml", "--num_processes", "1",
                "--main_process_port", free_port(), SCRIPT, "--cpu",
                *bert_args(uneven_text, tmp_path / "out", "--data_dir", uneven_text, "--do_train")], check=False)
    assert proc.returncode != 0
    assert "error: the accelerate config asks for FSDP (distributed_type: FSDP), which does not run on CPU" \
        in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


# ---- train_resnet.py: the same paths, in this process (1 process) ----

@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """120 training images: 3 batches of 40 per epoch."""
    return write_digits_imagefolder(tmp_path_factory.mktemp("digits"), size=16, limit=160)


def resnet_args(data, out, *extra):
    return ["--cpu", data, "--image_size", "16", "--val_resize", "16", "-b", "40", "-j", "0", "-p", "1", "--lr",
            "0.05", "--output_dir", out, *extra]


def test_resnet_rollback_changed_settings_and_finished_runs(digits, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    main_here(resnet_args(digits, out, "--epochs", "3", "--checkpointing_steps", "4", "--save_total_limit", "0"))
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_4", "step_8"]  # none at the finished step 9
    fewer = tmp_path / "fewer"  # one training image less: the checkpoint's place in its epoch means other images
    shutil.copytree(digits, fewer)
    sorted((fewer / "train" / "3").iterdir())[0].unlink()
    with pytest.raises(UserError, match=rf"{fewer / 'train'}: the training data differ from those of \S+step_8 "
                                        r"\(120 -> 119 examples\); .*Pass --allow_data_change"):
        main_here(resnet_args(fewer, out, "--epochs", "3", "--resume", "latest"))
    with pytest.raises(UserError, match=r"--gradient_accumulation_steps 3: \S+step_8 was trained with "
                                        r"--gradient_accumulation_steps 1"):
        main_here(resnet_args(digits, out, "--epochs", "3", "--resume", "latest", "--gradient_accumulation_steps", "3"))
    capsys.readouterr()
    main_here(resnet_args(digits, out, "--epochs", "4", "--lr", "0.01", "--resume", checkpoints / "step_4"))
    printed = capsys.readouterr().out
    assert "resumed with changed settings (applied from here on): --lr 0.05 -> 0.01, --epochs 3 -> 4" in printed
    assert (checkpoints / "step_8.abandoned_on_resume_from_step_4" / "training_state.json").is_file()
    lrs = {e["step"]: e["lr"] for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "train"}
    assert lrs[5] == pytest.approx(0.01) and lrs[4] == pytest.approx(0.05)  # step schedule: no decay yet
    assert read_json(out / "all_results.json")["train_steps"] == 12

    shutil.rmtree(checkpoints)  # a finished run without checkpoints: `latest` would start it again from scratch
    with pytest.raises(UserError, match=r"holds a finished run \(all_results.json\) but no checkpoint to resume from"):
        main_here(resnet_args(digits, out, "--epochs", "4", "--resume", "latest"))

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --config_file fsdp.yaml` sets
    with pytest.raises(UserError, match=r"asks for FSDP .*does not run on CPU \(--cpu\): this run would be plain NO"):
        main_here(resnet_args(digits, tmp_path / "fsdp", "--epochs", "1"))


def test_resnet_resume_names_a_changed_label_smoothing_and_refuses_another_seed(digits, tmp_path, capsys):
    """--label_smoothing may change on resume (FLAG_ROLES: the training loss only), --seed must be kept (the order
    of the images and their augmentations)."""
    out = tmp_path / "out"
    main_here(resnet_args(digits, out, "--epochs", "1", "--checkpointing_steps", "2"))
    step_2 = out / "checkpoints" / "step_2"
    with pytest.raises(UserError, match=r"--seed 7: \S+step_2 was trained with --seed 42; resume with the same value"):
        main_here(resnet_args(digits, out, "--epochs", "1", "--seed", "7", "--resume", step_2))
    capsys.readouterr()
    main_here(resnet_args(digits, out, "--epochs", "1", "--checkpointing_steps", "1", "--label_smoothing", "0.1",
                          "--resume", step_2))
    printed = capsys.readouterr().out
    assert "resumed with changed settings (applied from here on): --label_smoothing 0.0 -> 0.1" in printed
    assert read_json(out / "checkpoints" / "step_3" / "training_state.json")["settings"]["--label_smoothing"] == 0.1


def test_loss_scale_gives_every_real_sample_one_share_of_its_step():
    """88 samples, global batch 16 on 2 processes (8 each), 4 micro-batches per step: the second step of an epoch is
    batches 4 and 5 (16 + 8 real samples); rank 1's part of batch 5 is all padding."""
    from utils.loop import LossScale

    ranks = [LossScale(SimpleNamespace(num_processes=2, process_index=r), 88, 16, 4) for r in (0, 1)]
    assert ranks[0].batches_per_epoch == 6 and ranks[0].window_real(5) == 24 and ranks[0].window_real(0) == 64
    assert [w.local_real(5, 8) for w in ranks] == [8, 0] and [w.local_real(4, 8) for w in ranks] == [8, 8]
    losses = torch.ones(8)
    # DDP averages the 2 ranks, accelerate divides by 4: every real sample of the step weighs 1/24
    gradient_weight = sum(w.loss(losses, 5)[0] + w.loss(losses, 4)[0] for w in ranks) / 2 / 4
    assert gradient_weight.item() == pytest.approx(1.0)  # 24 real samples x 1/24
    assert ranks[0].window_scale(5) == 2.0 and ranks[0].window_scale(3) == 1.0


FSDP2_CHECK = """
import os
import sys
from types import SimpleNamespace

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU (gloo) on any machine, as --cpu makes a run
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, sys.argv[1])
from utils.export import BestWeights, load_full_weights

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
full = {k: v.clone() for k, v in model.state_dict().items()}
fully_shard(model[0])
fully_shard(model)
assert type(next(model.parameters())).__name__ == "DTensor"


def gathered():
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


best = BestWeights()
best.keep(model)
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
best.restore(model)
assert all(torch.equal(gathered()[k], full[k]) for k in full), "in-memory best weights"
if rank == 0:
    save_file(full, sys.argv[2])
dist.barrier()
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
load_full_weights(SimpleNamespace(num_processes=2, is_main_process=rank == 0), model, sys.argv[2])
assert all(torch.equal(gathered()[k], full[k]) for k in full), "export read on rank 0 and broadcast"
print(f"rank {rank} ok", flush=True)  # one write: the two ranks share the pipe
dist.destroy_process_group()
# After FSDP2's collectives on gloo, a torch thread can abort the interpreter's exit ("terminate called without an
# active exception", a few runs in a hundred on a busy machine), after everything above has passed: skip the exit.
os._exit(0)
"""


def test_best_weights_and_export_reload_work_on_fsdp2_shards(tmp_path):
    """accelerate turns every config into plain DDP with --cpu, but torch's FSDP2 itself runs on CPU (gloo): the
    best-model copy and the export reload, on real DTensor shards of 2 processes."""
    script = tmp_path / "fsdp2_check.py"
    script.write_text(FSDP2_CHECK)
    proc = run([*TORCHRUN, "--nproc_per_node", "2", "--master_port", free_port(), script, ROOT,
                tmp_path / "export.safetensors"])
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout
