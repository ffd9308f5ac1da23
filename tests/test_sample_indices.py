"""--log_sample_indices: each optimizer step's samples per process, as accelerate's own prepared loaders yield them
(split over 2 processes, an epoch's short last batch padded, a resumed epoch skipped, loader workers running ahead);
a resumed run logs what the uninterrupted run did, and the flag changes nothing trained. That 1 and 4 processes log
the same global sequence per step, and every exact resume the same as its uninterrupted run, is checked on the runs
of tests/test_bert_resume.py and tests/test_resnet.py, which log their samples."""
import shutil
from types import SimpleNamespace

import pytest
import torch
from accelerate.data_loader import prepare_data_loader, skip_first_batches
from conftest import assert_same_weights, read_jsonl, run_here
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from utils.export import load_torch_checkpoint
from utils.loop import LossScale
from utils.outputs import SampleLog, read_sample_indices
from utils.runtime import UserError
from utils.text_data import LengthGroupedSampler

SAMPLES, BATCH, WINDOW = 90, 16, 2  # 6 batches an epoch, the last of 10 samples: on 2 processes 8 + 2 real, 6 padded


def sampled_loader(kind, num_processes, process_index, workers=0):
    """A training loader over the dataset 0..SAMPLES-1 (each sample its own index) as accelerator.prepare makes it."""
    order = (dict(sampler=LengthGroupedSampler([i % 7 for i in range(SAMPLES)], BATCH, seed=3)) if kind == "grouped"
             else dict(shuffle=True, generator=torch.Generator().manual_seed(3)))
    loader = DataLoader(list(range(SAMPLES)), batch_size=BATCH, num_workers=workers, **order)
    return prepare_data_loader(loader, num_processes=num_processes, process_index=process_index, split_batches=True,
                               put_on_device=False, use_seedable_sampler=True)


def logged_epochs(tmp_path, kind, num_processes, process_index, workers=0, resume_at=2):
    """The lines SampleLog writes over 2 epochs (the second resumed after `resume_at` batches, as epoch_batches does),
    and the real samples of each batch the loader yielded (LossScale's count, the loss's weights)."""
    process = SimpleNamespace(num_processes=num_processes, process_index=process_index)
    loader = sampled_loader(kind, num_processes, process_index, workers)
    samples = SampleLog(process, tmp_path, loader, WINDOW)
    real, step = LossScale(process, SAMPLES, BATCH, WINDOW), 0
    yielded = []
    for epoch in (0, 1):
        skip = resume_at if epoch == 1 else 0
        loader.set_epoch(epoch)
        for index, batch in enumerate(skip_first_batches(loader, skip) if skip else loader, start=skip):
            yielded.append(batch[:real.local_real(index, len(batch))].tolist())
            if (index + 1) % WINDOW == 0 or index + 1 == len(loader):
                step += 1
                samples.step(step, epoch, index + 1)
    return read_jsonl(tmp_path / "sample_indices" / f"process_{process_index}.jsonl"), yielded


@pytest.mark.parametrize("kind, workers", [("shuffled", 0), ("shuffled", 2), ("grouped", 0)])
def test_each_process_logs_the_real_samples_its_loader_yields(tmp_path, kind, workers):
    single, single_batches = logged_epochs(tmp_path / "one", kind, 1, 0, workers)
    assert [len(line["batches"]) for line in single] == [2, 2, 2, 2, 2]  # 3 steps, then 2 after skipping 2 batches
    assert [line["epoch"] for line in single] == [1, 1, 1, 2, 2]
    assert [batch for line in single for batch in line["batches"]] == single_batches
    assert sorted(i for line in single[:3] for batch in line["batches"] for i in batch) == list(range(SAMPLES))
    halves = [logged_epochs(tmp_path / "two", kind, 2, rank, workers) for rank in (0, 1)]
    for rank, (lines, yielded) in enumerate(halves):
        assert [batch for line in lines for batch in line["batches"]] == yielded, rank  # padding left out
        assert {line["process"] for line in lines} == {rank}
    assert halves[1][0][2]["batches"][1] == single[2]["batches"][1][8:] != []  # the short batch: 2 real of 8
    assert read_sample_indices(tmp_path / "two") == read_sample_indices(tmp_path / "one") == {
        line["step"]: line["batches"] for line in single}


def test_off_it_leaves_the_loader_alone(tmp_path):
    loader = sampled_loader("shuffled", 1, 0)
    sampler = loader.batch_sampler.sampler
    SampleLog(SimpleNamespace(num_processes=1, process_index=0), tmp_path, loader, 1, enabled=False).step(1, 0, 1)
    assert loader.batch_sampler.sampler is sampler and not (tmp_path / "sample_indices").exists()


def test_a_failed_write_is_one_line(tmp_path):
    process = SimpleNamespace(num_processes=1, process_index=0)
    samples = SampleLog(process, tmp_path, sampled_loader("shuffled", 1, 0), 1)
    (tmp_path / "sample_indices" / "process_0.jsonl").mkdir()  # what the file cannot be written as
    next(iter(samples.batches))
    with pytest.raises(UserError, match=rf"^{tmp_path / 'sample_indices'}: cannot write \(Is a directory: "):
        samples.step(1, 0, 1)


BERT = "train_bert_cls.py"


def bert_args(data, out, *extra):
    """6 steps of 2 batches of 16 on 90 texts (3 steps an epoch, the last window's second batch short), no
    validation; checkpoints at steps 4 (mid-epoch) and 6."""
    return ["--train_file", data / "train.txt", "--model_name_or_path", data / "model", "--from_scratch", "--do_train",
            "--max_seq_len", "16", "--train_batch_size", str(BATCH), "--max_train_samples", str(SAMPLES),
            "--gradient_accumulation_steps", str(WINDOW), "--num_train_epochs", "2", "--checkpointing_steps", "2",
            "--logging_steps", "2", "--output_dir", out, *extra]


@pytest.fixture(scope="module")
def bert_runs(text_data, tmp_path_factory):
    runs = {name: tmp_path_factory.mktemp(f"bert_{name}") for name in ("one", "without")}
    run_here(BERT, ["--cpu", *bert_args(text_data, runs["one"], "--log_sample_indices")])
    run_here(BERT, ["--cpu", *bert_args(text_data, runs["without"])])
    return runs


def test_bert_logs_each_sample_once_an_epoch_and_trains_the_same(bert_runs):
    one = read_sample_indices(bert_runs["one"])
    assert list(one) == [1, 2, 3, 4, 5, 6]
    assert [len(batch) for batch in one[3]] == [BATCH, SAMPLES % BATCH]
    assert sorted(i for step in (1, 2, 3) for batch in one[step] for i in batch) == list(range(SAMPLES))
    assert not (bert_runs["without"] / "sample_indices").exists()
    assert_same_weights(load_file(bert_runs["one"] / "checkpoints" / "step_6" / "model.safetensors"),
                        load_file(bert_runs["without"] / "checkpoints" / "step_6" / "model.safetensors"))


def test_bert_resumed_mid_epoch_logs_what_the_uninterrupted_run_did(bert_runs, text_data, tmp_path):
    """What a kill after step 5, in the middle of writing step 6's line, leaves, resumed from step_4 (its second
    epoch's batch 2): the file is cut back to step 4 (the torn line dropped with a note) and goes on, line for line as
    the uninterrupted run's; the weights end bitwise the same."""
    out = tmp_path / "resumed"
    shutil.copytree(bert_runs["one"], out)
    shutil.rmtree(out / "checkpoints" / "step_6")
    log = out / "sample_indices" / "process_0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:5]) + lines[5][:40])
    proc = run_here(BERT, ["--cpu", *bert_args(text_data, out, "--log_sample_indices", "--resume_from_checkpoint",
                                               out / "checkpoints" / "step_4")])
    assert f"note: {log}:6: the last line is cut short" in proc.stdout
    assert read_jsonl(log) == read_jsonl(bert_runs["one"] / "sample_indices" / "process_0.jsonl")
    assert_same_weights(load_file(bert_runs["one"] / "checkpoints" / "step_6" / "model.safetensors"),
                        load_file(out / "checkpoints" / "step_6" / "model.safetensors"))


RESNET = "train_resnet.py"


def resnet_args(data, out, *extra):
    """1 epoch of repeated augmentation on the 336 few_digits: 5 batches of 64 ([index, copy] pairs), 3 steps of 2
    batches (the last window 1 batch)."""
    return [data, "--arch", "resnet18", "--image_size", "16", "--val_resize", "16", "-b", "64", "-j", "0",
            "--ra_sampler", "--ra_reps", "2", "--gradient_accumulation_steps", str(WINDOW), "--epochs", "1",
            "--output_dir", out, *extra]


def test_resnet_logs_each_image_twice_a_batch_and_trains_the_same(few_digits, tmp_path):
    runs = {name: tmp_path / name for name in ("one", "without")}
    run_here(RESNET, ["--cpu", *resnet_args(few_digits, runs["one"], "--log_sample_indices")])
    run_here(RESNET, ["--cpu", *resnet_args(few_digits, runs["without"])])
    one = read_sample_indices(runs["one"])
    assert [len(one[step]) for step in (1, 2, 3)] == [2, 2, 1] and all(len(b) == 64 for s in one.values() for b in s)
    pairs = [tuple(pair) for batch in one[1] for pair in batch]
    assert len(set(pairs)) == 128 and {copy for _, copy in pairs} == {0, 1}  # 32 images a batch, each twice
    assert_same_weights(load_torch_checkpoint(runs["one"] / "checkpoint.pth")["state_dict"],
                        load_torch_checkpoint(runs["without"] / "checkpoint.pth")["state_dict"])
