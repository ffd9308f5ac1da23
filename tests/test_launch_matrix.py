"""Every way of launching gives the same run: `python` on 1 process, accelerate + cpu_ddp.yaml, torchrun, two
"machines" with fp16 requested (BERT), and `accelerate config default`'s file with fp16 requested (ResNet); the CPU
trains fp16 in fp32. How a launch becomes processes, ranks and a precision is one mechanism both scripts go through
(utils/runtime.py's Accelerator), so each launch is run once, with BERT, and ResNet's own 2-process proof is the
default-config launch.

The equivalence check is the proof that gradients are really averaged across processes: the same
command with the same GLOBAL batch ends with the same weights on 1 and on 2 processes (BERT).
ResNet's BatchNorm normalises each process's share of the batch, and torch's SyncBatchNorm does not run
on CPU; so on CPU the proof is that 2 processes x 32 images equal 1 process x 32 images x 2 accumulation
steps (same BatchNorm batches, same averaged gradient). With GPUs, `--sync_bn` makes 1 and N processes equal.
Neither training set divides into global batches: BERT's 88 samples end each epoch with 8 (accelerate pads that
batch with repeated samples on 2 processes, which weigh nothing in the loss), ResNet's 336 images drop the last 16
(drop_last, the same ones on any number of processes).
"""
import signal
import subprocess

import pytest
import torch
from conftest import (ACCELERATE, ENV, FEW_DIGITS_TRAIN, FEW_DIGITS_VAL, HANG_S, ROOT, TORCHRUN, free_port, kill_job,
                      read_json, run, run_here)
from launch_options import default_config, launch_with_config
from safetensors.torch import load_file

from utils.demo_data import write_text_classification_data

STEPS = 6  # one epoch of 88 samples at a global batch of 16: the last step is the short batch of 8


def bert_args(data, out):
    # No dropout: its masks are drawn per process, so they legitimately differ between 1 and 2 processes.
    return ["train_bert_cls.py", "--cpu", "--data_dir", data, "--model_name_or_path", data / "model",
            "--from_scratch", "--config_overrides", "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0",
            "--do_train", "--do_eval", "--max_seq_len", "32", "--train_batch_size", "16", "--eval_batch_size", "16",
            "--learning_rate", "1e-3", "--max_train_steps", str(STEPS), "--checkpointing_steps", str(STEPS),
            "--logging_steps", "2", "--output_dir", out]


def final_weights(out):
    return load_file(out / "checkpoints" / f"step_{STEPS}" / "model.safetensors")


def launch_two_machines(args):
    """Two `accelerate launch` invocations on 127.0.0.1, machine_rank 0 and 1 (--same_network), fp16 requested, as a
    GPU cluster's launch would: the CPU trains it in fp32, so the weights still equal the 1-process run's."""
    port = free_port()
    common = ["--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", port, "--same_network", "--mixed_precision", "fp16", "--dynamo_backend", "no"]
    node1 = subprocess.Popen([str(c) for c in [*ACCELERATE, *common, "--machine_rank", "1", *args]], cwd=ROOT,
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        proc = run([*ACCELERATE, *common, "--machine_rank", "0", *args])
        output, _ = node1.communicate(timeout=HANG_S)
    finally:  # a test that failed: end the whole job (its ranks run in sessions of their own)
        if node1.poll() is None:
            kill_job(node1, signal.SIGKILL)
    assert node1.returncode == 0, output[-4000:]
    return proc


# "1 process" is `python SCRIPT`, run in this process (run_here): the reference every launch is compared with, where a
# launcher would add only its start-up (accelerate launch of 1 process: tests/test_compile.py, the config-file runs).
LAUNCHES = {
    "1 process": lambda args: run_here(args[0], args[1:]),
    "accelerate cpu_ddp.yaml": lambda args: run([*ACCELERATE, "--config_file", "accelerate_configs/cpu_ddp.yaml",
                                                 "--main_process_port", free_port(), *args]),
    "torchrun": lambda args: run([*TORCHRUN, "--nproc_per_node", "2", "--master_port", free_port(), *args]),
    "two machines": launch_two_machines,
}


@pytest.fixture(scope="module")
def uneven_text_data(tmp_path_factory):
    return write_text_classification_data(tmp_path_factory.mktemp("text88"), n_train=88, n_val=99, n_test=99)


@pytest.fixture(scope="module")
def bert_runs(uneven_text_data, tmp_path_factory):
    outs = {}
    for name, start in LAUNCHES.items():
        out = tmp_path_factory.mktemp(name.replace(" ", "_").replace(".", "_"))
        proc = start(bert_args(uneven_text_data, out))
        out.with_suffix(".stdout").write_text(proc.stdout)  # what the launch printed, beside its output directory
        outs[name] = out
    return outs


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_bert_records_how_it_ran(bert_runs, name):
    results = read_json(bert_runs[name] / "all_results.json")
    expected_processes = 1 if name == "1 process" else 2
    assert results["num_processes"] == expected_processes
    assert results["distributed_type"] == ("NO" if expected_processes == 1 else "MULTI_CPU")
    assert results["global_batch_size"] == 16
    assert results["per_device_batch_size"] == 16 // expected_processes
    # Accelerate trains an fp16 request in fp32 on the CPU: the results say so, and do not pretend
    assert results["mixed_precision"] == "no"
    assert results["mixed_precision_requested"] == ("fp16" if name == "two machines" else "no")
    assert results["eval_samples"] == 99  # exactly the validation set, whatever the launch


@pytest.mark.parametrize("name", [n for n in LAUNCHES if n != "1 process"])
def test_bert_same_weights_on_1_and_2_processes(bert_runs, name):
    single, multi = final_weights(bert_runs["1 process"]), final_weights(bert_runs[name])
    worst = max((single[k] - multi[k]).abs().max().item() for k in single)
    assert worst < 1e-4, f"max abs weight difference {worst:.2e} after {STEPS} steps"
    # and the run really moved: the comparison is not between two untrained models
    assert read_json(bert_runs[name] / "all_results.json")["train_steps"] == STEPS
    # the launch says so, as its model has no dropout; the 1-process run, the reference, says nothing of it
    said = [line for line in bert_runs[name].with_suffix(".stdout").read_text().splitlines() if "as on 1 process" in line]
    assert said == ["on 2 processes: the same weights as on 1 process up to float rounding (the order of sums over "
                    "processes): the model has no dropout, drop path or per-process BatchNorm"]
    assert "as on 1 process" not in bert_runs["1 process"].with_suffix(".stdout").read_text()


RESNET_STEPS = FEW_DIGITS_TRAIN // 64  # one epoch of the few_digits fixture (336 training images, drop_last)


def resnet_args(data, out, *extra):
    return ["train_resnet.py", "--cpu", data, "--arch", "resnet18", "--image_size", "16", "--val_resize", "16",
            "-b", "64", "--lr", "0.05", "--momentum", "0.9", "-j", "0", "-p", "5", "--epochs", "1",
            "--output_dir", out, *extra]


def resnet_parameters(out):
    """Trainable weights of the exported model (BatchNorm running statistics are per process by design)."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(torch.load(out / "checkpoint.pth", weights_only=True)["state_dict"])
    return {name: p.detach() for name, p in model.named_parameters()}


# BERT's runs from `accelerate config default`'s file are in tests/test_metric_flag.py (bf16, 2 processes) and
# tests/test_hub_checkpoints.py (no mixed precision, 1 process).
FP16_DEFAULT_CONFIG = "accelerate config default fp16"
RESNET_LAUNCHES = ["1 process", FP16_DEFAULT_CONFIG]


@pytest.fixture(scope="module")
def resnet_runs(few_digits, tmp_path_factory):
    fp16_config = default_config(tmp_path_factory, "fp16")
    launches = {"1 process": LAUNCHES["1 process"],
                FP16_DEFAULT_CONFIG: lambda args: launch_with_config(fp16_config, args[0], args[2:], num_processes=2)}
    outs = {}
    for name, start in launches.items():
        out = tmp_path_factory.mktemp("resnet_" + name.replace(" ", "_").replace(".", "_"))
        args = resnet_args(few_digits, out)
        if name == "1 process":  # 32 images per micro-batch, as each of 2 processes sees them
            args = resnet_args(few_digits, out, "-b", "32", "--gradient_accumulation_steps", "2")
        start(args)
        outs[name] = out
    return outs


@pytest.mark.parametrize("name", RESNET_LAUNCHES)
def test_resnet_records_how_it_ran(resnet_runs, name, few_digits):
    results = read_json(resnet_runs[name] / "all_results.json")
    processes = 1 if name == "1 process" else 2
    assert results["num_processes"] == processes
    assert results["distributed_type"] == ("NO" if processes == 1 else "MULTI_CPU")
    assert results["global_batch_size"] == (32 if processes == 1 else 64)  # 1 process: 32 x 2 accumulation steps
    val_images = sum(1 for _ in (few_digits / "val").rglob("*.png"))
    assert results["eval_samples"] == val_images == FEW_DIGITS_VAL  # odd, counted exactly on 2 processes


@pytest.mark.parametrize("name", RESNET_LAUNCHES[1:])
def test_resnet_gradients_are_averaged_across_processes(resnet_runs, name):
    single, multi = resnet_parameters(resnet_runs["1 process"]), resnet_parameters(resnet_runs[name])
    worst = max((single[k] - multi[k]).abs().max().item() for k in single)
    assert worst < 1e-4, f"max abs weight difference {worst:.2e} after {RESNET_STEPS} steps"
    untrained = resnet_parameters_untrained()
    assert max((single[k] - untrained[k]).abs().max().item() for k in single) > 1e-2  # the weights did move


def resnet_parameters_untrained():
    import torchvision

    torch.manual_seed(42)  # the scripts' default --seed: the same initial weights
    return {name: p.detach() for name, p in torchvision.models.resnet18(num_classes=10).named_parameters()}


def test_resnet_fp16_two_processes_from_a_default_config_file(resnet_runs):
    """(Not bf16: ResNet-18 in CPU bf16 autocast turned NaN at random in 2 of 4 seeded runs on an AMD EPYC without
    AMX, on this tree and on the one before it: a CPU kernel's doing, not reproducible; BERT covers CPU bf16 in
    tests/test_metric_flag.py.)"""
    import torchvision

    out = resnet_runs[FP16_DEFAULT_CONFIG]
    results = read_json(out / "all_results.json")
    # fp16 on the CPU trains in fp32, and the results say so
    assert (results["num_processes"], results["mixed_precision"], results["mixed_precision_requested"]) == (
        2, "no", "fp16")
    assert results["eval_samples"] == FEW_DIGITS_VAL and torch.isfinite(torch.tensor(results["eval_loss"]))
    state_dict = torch.load(out / "model_best.pth", weights_only=True)["state_dict"]
    assert {w.dtype for w in state_dict.values() if w.is_floating_point()} == {torch.float32}
    torchvision.models.resnet18(num_classes=10).load_state_dict(state_dict)  # strict: every key, no prefix
