"""`make demo`: train both scripts on built-in data through `accelerate launch`, offline, and print the results.

The data is written in the real on-disk formats (cnews `label<TAB>text` files; an ImageFolder of
scikit-learn's bundled real handwritten digits), so the demo runs the same code path as a real job.
On a CPU-only machine it runs 2 processes of gloo DDP (accelerate_configs/cpu_ddp.yaml + --cpu);
with GPUs present it uses all of them, in bf16 where the GPU supports it (fp16 otherwise).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from utils.demo_data import write_digits_imagefolder, write_text_classification_data

ROOT = Path(__file__).resolve().parent
DATA, OUT = ROOT / "demo_data", ROOT / "outputs"


def launcher():
    """The launch prefix for this machine, and the script flags it needs."""
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    gpus = torch.cuda.device_count()
    # bf16 where the GPU has it (Ampere and newer); fp16 with its loss scaler before that. A config file cannot
    # say "bf16 if supported", so the launcher's --mixed_precision overrides single_gpu.yaml's bf16 here.
    precision = ["--mixed_precision", "bf16" if gpus and torch.cuda.is_bf16_supported() else "fp16"]
    if gpus > 1:
        return [*accelerate, "--multi_gpu", "--num_processes", str(gpus), "--num_machines", "1", *precision,
                "--dynamo_backend", "no"], []
    if gpus == 1:
        return [*accelerate, "--config_file", str(ROOT / "accelerate_configs" / "single_gpu.yaml"), *precision], []
    return [*accelerate, "--config_file", str(ROOT / "accelerate_configs" / "cpu_ddp.yaml")], ["--cpu"]


def run(title, command):
    print(f"\n=== {title} ===\n$ {' '.join(map(str, command))}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run([str(c) for c in command], cwd=ROOT, env=env, check=True)
    return time.perf_counter() - start


def main():
    prefix, device_flags = launcher()
    text_dir = write_text_classification_data(DATA / "bert", n_train=2000, n_val=301, n_test=301)
    digits_dir = write_digits_imagefolder(DATA / "digits", size=32)
    bert_out, resnet_out = OUT / "bert_demo", OUT / "resnet_demo"
    bert_time = run("BERT news classification (small BERT from scratch, built-in headlines)", [
        *prefix, "train_bert_cls.py", *device_flags, "--data_dir", text_dir,
        "--model_name_or_path", text_dir / "model", "--from_scratch",
        "--do_train", "--do_eval", "--do_test", "--max_seq_len", "64", "--train_batch_size", "32",
        "--eval_batch_size", "64", "--learning_rate", "2e-3", "--num_train_epochs", "4", "--logging_steps", "20",
        "--output_dir", bert_out, "--overwrite_output_dir"])
    resnet_time = run("ResNet-18 on real handwritten digits (ImageFolder, 32x32)", [
        *prefix, "train_resnet.py", *device_flags, digits_dir, "--arch", "resnet18", "--epochs", "8",
        "--batch-size", "64", "--lr", "0.05", "--warmup_epochs", "1", "--lr_scheduler", "cosine",
        "--image_size", "32", "--val_resize", "32", "--crop_scale", "0.35", "--workers", "0",
        "--print-freq", "10", "--output_dir", resnet_out, "--overwrite_output_dir"])

    bert = json.loads((bert_out / "all_results.json").read_text())
    resnet = json.loads((resnet_out / "all_results.json").read_text())
    print("\n=== demo results ===")
    print(f"launch: {bert['num_processes']} process(es), {bert['distributed_type']}, "
          f"precision {bert['mixed_precision']}, device {bert['device']}")
    print(f"BERT   test accuracy {bert['test_accuracy']:.4f}  macro-F1 {bert['test_macro_f1']:.4f} "
          f"({bert['test_samples']} test samples, chance 0.10, {bert_time:.0f} s)  -> {bert_out}")
    print(f"ResNet val acc@1 {resnet['eval_acc1']:.2f}%  acc@5 {resnet['eval_acc5']:.2f}% "
          f"({resnet['eval_samples']} val images, chance 10%, {resnet_time:.0f} s)  -> {resnet_out}")
    print(f"Try the BERT model:\n  {try_command(bert_out / 'best_model')}")


def try_command(model_dir):
    """A shell command that loads the exported model with plain transformers, with the Python that has it."""
    python = os.path.relpath(sys.executable) if Path(sys.executable).is_relative_to(Path.cwd()) else sys.executable
    return (f"{python} -c \"import transformers; print(transformers.pipeline('text-classification', "
            f"model='{model_dir}')('球队比赛冠军'))\"")


if __name__ == "__main__":
    main()
