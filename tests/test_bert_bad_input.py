"""Bad input to train_bert_cls.py: one line naming the file (and line), exit code 2, no traceback, nothing overwritten.

The first test runs `python train_bert_cls.py` as users do; the other 1-process cases run the same command line in
this process (conftest.run_here: the script's run_cli(main, parse_args()), without a fresh interpreter's start-up)."""
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import ACCELERATE, FAKE_GPU, assert_one_line_error, free_port, launch, run, run_here

import train_bert_cls
from utils.export import on_meta_device
from utils.runtime import UserError, check_launch
from utils.text_model import position_limit

SCRIPT = "train_bert_cls.py"


def small_args(data, out, *extra):
    return ["--model_name_or_path", data / "model", "--from_scratch", "--max_seq_len", "32",
            "--train_batch_size", "16", "--eval_batch_size", "16", "--max_train_steps", "2",
            "--output_dir", out, *extra]


@pytest.fixture
def data(text_data, tmp_path):
    """A private copy of the fixture that a test may corrupt."""
    copy = tmp_path / "data"
    shutil.copytree(text_data, copy)
    return copy


@pytest.fixture
def previous_run(tmp_path):
    """An output directory holding another run's results, which must survive every refused command."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "all_results.json").write_text('{"test_accuracy": 0.97}')
    return out


def test_line_without_tab(data, previous_run):
    lines = (data / "train.txt").read_text(encoding="utf-8").splitlines()
    lines[6] = lines[6].replace("\t", " ")
    (data / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    proc = run_here(SCRIPT, ["--cpu", "--data_dir", data, "--do_train",
                             *small_args(data, previous_run, "--overwrite_output_dir")], check=False)
    assert_one_line_error(proc, f"{data / 'train.txt'}:7:", "no TAB")
    assert (previous_run / "all_results.json").read_text() == '{"test_accuracy": 0.97}'


def test_unknown_label_in_validation(data, tmp_path):
    with open(data / "val.txt", "a", encoding="utf-8") as f:
        f.write("汽车\t新车上市\n")
    proc = run_here(SCRIPT, ["--cpu", "--data_dir", data, "--do_train", *small_args(data, tmp_path / "o")],
                    check=False)
    assert_one_line_error(proc, f"{data / 'val.txt'}:100:", "'汽车'")
    assert not (tmp_path / "o").exists()


def test_empty_and_undecodable_and_missing_files(data, tmp_path):
    (data / "test.txt").write_text("")
    proc = run_here(SCRIPT, ["--cpu", "--data_dir", data, "--do_train", "--do_test",
                             *small_args(data, tmp_path / "o")], check=False)
    assert_one_line_error(proc, str(data / "test.txt"), "empty")
    (data / "bad.txt").write_bytes("体育\t球队\n".encode("gbk"))
    proc = run_here(SCRIPT, ["--cpu", "--train_file", data / "bad.txt", "--do_train",
                             *small_args(data, tmp_path / "o")], check=False)
    assert_one_line_error(proc, f"{data / 'bad.txt'}:1:", "UTF-8")
    proc = run_here(SCRIPT, ["--cpu", "--train_file", data / "nope.txt", "--do_train",
                             *small_args(data, tmp_path / "o")], check=False)
    assert_one_line_error(proc, str(data / "nope.txt"), "not found")


def test_refuses_to_overwrite_another_run(data, previous_run):
    proc = run_here(SCRIPT, ["--cpu", "--data_dir", data, "--do_train", *small_args(data, previous_run)],
                    check=False)
    assert_one_line_error(proc, str(previous_run), "--overwrite_output_dir")
    assert (previous_run / "all_results.json").read_text() == '{"test_accuracy": 0.97}'


def test_model_directory_without_weights(data, tmp_path):
    args = [a for a in small_args(data, tmp_path / "o") if a != "--from_scratch"]
    proc = run_here(SCRIPT, ["--cpu", "--data_dir", data, "--do_train", *args], check=False)
    assert_one_line_error(proc, str(data / "model"), "--from_scratch")


def test_tokenizer_that_lost_its_vocabulary(data, tmp_path):
    # The transformers 5 pitfall: a vocabulary of only the special tokens maps all Chinese to [UNK].
    (data / "model" / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    proc = run_here(SCRIPT, ["--cpu", "--data_dir", data, "--do_train", *small_args(data, tmp_path / "o")],
                    check=False)
    assert_one_line_error(proc, str(data / "model"), "vocab")


def test_labels_file_that_disagrees_with_the_model(text_data, tmp_path):
    out = tmp_path / "trained"
    run_here(SCRIPT, ["--cpu", "--data_dir", text_data, "--do_train", *small_args(text_data, out)])
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(reversed((out / "labels.txt").read_text().split())) + "\n")
    proc = run_here(SCRIPT, ["--cpu", "--data_dir", text_data, "--do_test", "--labels_file", labels,
                             "--model_name_or_path", out / "best_model", "--output_dir", tmp_path / "t"], check=False)
    assert_one_line_error(proc, str(labels), "disagree")


def test_global_batch_must_divide_over_processes(text_data, tmp_path):
    proc = launch(SCRIPT, ["--data_dir", text_data, "--do_train",
                           *small_args(text_data, tmp_path / "o", "--train_batch_size", "15")],
                  num_processes=2, check=False)
    assert proc.returncode != 0
    assert "--train_batch_size 15 is the GLOBAL batch and must divide evenly over 2 processes" in proc.stderr
    assert 'train_bert_cls.py", line' not in proc.stderr  # the launcher reports the exit; our code has no traceback


def test_multi_process_launch_without_cpu_flag_on_a_1_gpu_machine(text_data, tmp_path):
    """The 4-GPU config on a 1-GPU box, without --cpu: refused in one line before anything is written."""
    proc = run([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", free_port(), SCRIPT,
                "--data_dir", text_data, "--do_train", *small_args(text_data, tmp_path / "o")], check=False,
               env=FAKE_GPU)
    assert proc.returncode != 0
    # local rank 0 prints the line; when rank 1 fails first, the launcher ends rank 0 and its summary carries rank 1's
    assert re.search(r"^(error: |\s*traceback : error: )2 processes were launched on this machine, which has 1 GPU "
                     r"visible: each process trains on a GPU of its own\. Launch at most 1 per machine",
                     proc.stderr, re.MULTILINE), proc.stderr[-3000:]
    assert 'train_bert_cls.py", line' not in proc.stderr  # the launcher reports the exit; our code has no traceback
    assert not (tmp_path / "o").exists()


def test_launches_each_machine_can_serve(monkeypatch):
    """Processes per machine against its GPUs (LOCAL_WORLD_SIZE, set by torchrun and accelerate launch)."""
    def check(world, here, gpus, cpu=False):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(here))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        check_launch(SimpleNamespace(cpu=cpu, data_parallel=False))

    check(world=2, here=1, gpus=1)  # two machines of one GPU each
    check(world=8, here=4, gpus=8)  # fewer processes than GPUs: the rest stay free
    check(world=2, here=2, gpus=0, cpu=True)  # gloo DDP on the CPU
    check(world=2, here=2, gpus=1, cpu=True)
    with pytest.raises(UserError, match=r"^2 processes were launched on a machine without a GPU but without --cpu"):
        check(world=2, here=2, gpus=0)  # each would train on its own
    with pytest.raises(UserError, match=r"^4 processes were launched on this machine, which has 2 GPUs visible: .* "
                                        r"Launch at most 2 per machine"):
        check(world=8, here=4, gpus=2)


@pytest.mark.parametrize("flag,value", [("--logging_steps", "0"), ("--gradient_accumulation_steps", "0"),
                                        ("--max_seq_len", "0"), ("--train_batch_size", "0"), ("--eval_steps", "0"),
                                        ("--checkpointing_steps", "0"), ("--num_train_epochs", "0"),
                                        ("--max_train_steps", "-3"), ("--save_total_limit", "-1"),
                                        ("--num_workers", "-1"), ("--learning_rate", "0"), ("--pad_to_multiple_of", "0"),
                                        ("--max_grad_norm", "nan")])
def test_counts_and_intervals_are_checked_by_the_parser(text_data, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_bert_cls.parse_args(["--model_name_or_path", str(text_data / "model"), "--do_train", flag, value])
    assert exit_info.value.code == 2
    assert re.search(rf"error: argument {flag}(/\S+)?: must be ", capsys.readouterr().err)


def empty_model(config):
    """The script's model for `config`, on the meta device, as it reads the position table from it."""
    return on_meta_device(lambda: train_bert_cls.new_model(config))


def test_max_seq_len_above_the_models_positions_is_refused_before_training(text_data, tmp_path):
    proc = run_here(SCRIPT, ["--cpu", "--data_dir", text_data, "--do_train",
                             *small_args(text_data, tmp_path / "o", "--max_seq_len", "600")], check=False)
    assert_one_line_error(proc, "--max_seq_len 600:", str(text_data / "model"), "takes at most 512 tokens")
    assert not (tmp_path / "o").exists()
    # RoBERTa numbers its positions after the padding index: 514 rows take 512 tokens; rotary positions have no limit
    from transformers import ModernBertConfig, RobertaConfig

    tiny = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    assert position_limit(empty_model(RobertaConfig(max_position_embeddings=514, pad_token_id=1, **tiny))) == 512
    assert position_limit(empty_model(ModernBertConfig(**tiny))) is None


def test_do_test_with_a_base_model_asks_for_a_labels_file(text_data, tmp_path):
    proc = run_here(SCRIPT, ["--cpu", "--model_name_or_path", text_data / "model", "--data_dir", text_data, "--do_test",
                             "--output_dir", tmp_path / "o"], check=False)
    assert_one_line_error(proc, str(text_data / "model"), "no label mapping", "pass --labels_file")
    assert not (tmp_path / "o").exists()
