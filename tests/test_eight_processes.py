"""Both scripts on 8 processes of gloo on this host (one thread each, tiny models): an uninterrupted run; SIGTERM to
every process mid-epoch saves one checkpoint, at one step, for all ranks; `--resume latest` on 8 ends with bitwise
the uninterrupted run's weights; and BERT without dropout ends with the weights of 1 process up to float rounding.
About 1.3 GB a process: `make test-long` runs this file alone, after the rest (marker `alone`), so that no other
launch runs beside an 8-process one."""
import signal

import pytest
from conftest import (FEW_DIGITS_TRAIN, assert_job_left_in_grace, assert_same_curve, assert_same_weights, descendants,
                      end_all, launch, launch_cmd, read_json, run_here, start, stop_job, wait_for)
from safetensors.torch import load_file

pytestmark = [pytest.mark.long, pytest.mark.alone]

N = 8
BERT_STEPS = 100  # two epochs of 800 headlines at 16: a stop after step 10 lands well before the end
RESNET_EPOCHS = 12  # 5 steps an epoch (336 digits at 64, drop_last): 60 steps


def bert_args(data, out, *extra):
    return ["--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch", "--config_overrides",
            "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0", "--do_train", "--max_seq_len", "32",
            "--train_batch_size", "16", "--eval_batch_size", "16", "--learning_rate", "1e-3", "--max_train_steps",
            str(BERT_STEPS), "--checkpointing_steps", "10", "--logging_steps", "5", "--save_total_limit", "0",
            "--output_dir", out, *extra]


def resnet_args(data, out, *extra):
    return [data, "--arch", "resnet18", "--image_size", "16", "--val_resize", "16", "-b", "64", "--lr", "0.05", "-j",
            "0", "--epochs", str(RESNET_EPOCHS), "--checkpointing_steps", "3", "-p", "3", "--save_total_limit", "0",
            "--output_dir", out, *extra]


CASES = {  # script, arguments, resume flag, steps, the first checkpoint's step
    "bert": ("train_bert_cls.py", bert_args, "--resume_from_checkpoint", BERT_STEPS, 10),
    "resnet": ("train_resnet.py", resnet_args, "--resume", RESNET_EPOCHS * (FEW_DIGITS_TRAIN // 64), 3)}


def weights(out, step):
    return load_file(out / "checkpoints" / f"step_{step}" / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(text_data, few_digits, tmp_path_factory):
    """The uninterrupted 8-process run of each script, every checkpoint kept."""
    runs = {}
    for name, (script, args, *_) in CASES.items():
        runs[name] = tmp_path_factory.mktemp(f"{name}_on_{N}") / "out"
        launch(script, args(text_data if name == "bert" else few_digits, runs[name]), num_processes=N)
    return runs


@pytest.mark.parametrize("name", list(CASES))
def test_a_sigterm_to_every_rank_of_8_saves_one_checkpoint_and_resumes_bitwise(name, uninterrupted, text_data,
                                                                               few_digits, tmp_path):
    script, args, resume, steps, first = CASES[name]
    data, reference = text_data if name == "bert" else few_digits, uninterrupted[name]
    out = tmp_path / "preempted"
    job = start(launch_cmd(script, args(data, out), num_processes=N), tmp_path / "job.log")
    processes = []
    try:
        wait_for(lambda: (out / "checkpoints" / f"step_{first}" / "training_state.json").exists(), job)
        processes = [job.pid, *descendants(job.pid)]
        _, ended = stop_job(job, processes, signal.SIGTERM)  # Slurm's scancel: every process at once
    finally:
        end_all([job.pid, *processes])
    log = (tmp_path / "job.log").read_text()
    assert_job_left_in_grace(log, script, ended)
    results = read_json(out / "all_results.json")
    stopped = results["train_steps"]
    assert results["preempted"] is True and stopped < steps, results
    saved = out / "checkpoints" / f"step_{stopped}"
    assert sorted(p.name for p in saved.glob("random_states_*.pkl")) == [f"random_states_{r}.pkl" for r in range(N)]
    assert log.count(f"saved checkpoint {saved}") == 1, log[-3000:]  # once, by the one process that wrote it
    launch(script, args(data, out, resume, "latest"), num_processes=N)
    assert_same_weights(weights(reference, steps), weights(out, steps))
    assert_same_curve(reference, out, ("loss", "lr"), stopped_at=stopped)


def test_bert_without_dropout_trains_on_8_processes_as_on_1(uninterrupted, text_data, tmp_path):
    """The global batch of 16 is 2 samples on each of 8 processes: the averaged gradient is the 1-process one up to
    the order of the sums (compared after 20 steps: rounding differences grow with the steps)."""
    single = tmp_path / "on_1"
    run_here("train_bert_cls.py", ["--cpu", *bert_args(text_data, single)])
    one, eight = weights(single, 20), weights(uninterrupted["bert"], 20)
    worst = max((one[k] - eight[k]).abs().max().item() for k in one)
    moved = max((one[k] - weights(single, 10)[k]).abs().max().item() for k in one)
    assert worst < 1e-4 < moved, (worst, moved)  # equal up to rounding, and the weights did move
    assert read_json(uninterrupted["bert"] / "all_results.json")["num_processes"] == N
