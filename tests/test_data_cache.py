"""The BERT data are tokenised once (utils/text_cache.py): a second start reads the cache without tokenising, any
input of the cache key (file content, tokenizer, --max_seq_len, --labels_file, the long-text cut) makes a new entry,
2 processes tokenise once in all (tests/test_edges.py, in its 2-process accumulation run; nodes with their own disks
once per node and read it again on a second start: its two-machine job), and a bad line stops every rank with one
line. What else a run keeps on disk stays bounded: a finished run rotates the checkpoints a rollback set aside."""
import os
import shutil

import pytest
from conftest import launch, needs_whole_windows, read_json, run_here

SCRIPT = "train_bert_cls.py"
BUILT = "tokenising the data into"  # said by the process that fills the data cache


def small_args(data, out, cache, *extra):
    return ["--cpu", "--data_dir", data, "--model_name_or_path", data / "model", "--from_scratch", "--config_overrides",
            "num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64", "--max_seq_len", "32",
            "--train_batch_size", "16", "--eval_batch_size", "16", "--max_train_steps", "2", "--checkpointing_steps",
            "2", "--do_train", "--do_eval", "--data_cache_dir", cache, "--output_dir", out, "--overwrite_output_dir",
            *extra]


def entries(cache):
    """The data cache's entries (one per tokenised input), without the hidden temporary ones."""
    return sorted(path.name for path in cache.iterdir() if not path.name.startswith("."))


def arrow_times(cache):
    return {path.name: path.stat().st_mtime_ns for path in cache.glob("*/*.arrow")}


@pytest.fixture
def data(text_data, tmp_path):
    """A private copy of the session's text data: the tests here change its files."""
    return shutil.copytree(text_data, tmp_path / "data")


def test_second_start_reads_the_cache_without_tokenising(data, tmp_path):
    cache = tmp_path / "cache"
    first = run_here(SCRIPT, small_args(data, tmp_path / "a", cache))
    assert first.stdout.count(BUILT) == 1
    times = arrow_times(cache)
    assert sorted(times) == ["train.arrow", "validation.arrow"] and len(entries(cache)) == 1
    second = run_here(SCRIPT, small_args(data, tmp_path / "b", cache))
    assert BUILT not in second.stdout
    assert arrow_times(cache) == times  # read, never rewritten
    assert "--data_dir" in second.stdout  # what was read for what is said on every start
    results = [read_json(tmp_path / out / "all_results.json") for out in ("a", "b")]
    for key in ("train_unk_rate", "eval_accuracy", "eval_loss", "train_steps"):
        assert results[0][key] == results[1][key]
    saved = [read_json(tmp_path / out / "checkpoints" / "step_2" / "training_state.json") for out in ("a", "b")]
    assert saved[0]["training_data"] == saved[1]["training_data"]
    assert saved[0]["training_data"]["examples"] == 800


def pairs_multi_label(data):
    """A JSON-lines sentence-pair, multi-label version of the headlines (labels as lists)."""
    import json
    for split, name in (("train", "train.txt"), ("val", "val.txt")):
        rows = [line.split("\t", 1) for line in (data / name).read_text(encoding="utf-8").splitlines()]
        (data / f"{split}.jsonl").write_text("".join(
            json.dumps({"text": text[:12], "text_pair": text[12:] or text, "label": sorted({label, rows[i - 1][0]})},
                       ensure_ascii=False) + "\n" for i, (label, text) in enumerate(rows)), encoding="utf-8")
        (data / name).unlink()
    return ["--text_pair_column", "text_pair", "--multi_label"]


@pytest.mark.parametrize("layout", [pytest.param("cnews, shuffled, cut, windows", marks=needs_whole_windows),
                                    "pairs, multi-label"])
def test_files_stream_into_the_cache_as_they_are_read(data, tmp_path, monkeypatch, layout):
    """The cache's build reads each file into an Arrow table as it goes (memory flat in the file's size) and gets what
    reading it into a list of examples gets: the same labels, fingerprint, first text, [UNK] rate and tokenised
    splits; the tables are gone once the splits are tokenised."""
    import utils.text_data
    from train_bert_cls import parse_args, tokenised_data, tokenizer_and_length
    extra = (["--shuffle_train_dataset", "--max_train_samples", "300", "--doc_stride", "8", "--max_seq_len", "16"]
             if layout.startswith("cnews") else pairs_multi_label(data))
    argv = [str(a) for a in small_args(data, tmp_path / "o", tmp_path / "cache", *extra)]
    quiet = []
    tokenizer = tokenizer_and_length(parse_args(argv), quiet.append)
    in_memory_notes, built_notes = [], []
    expected = tokenised_data(parse_args(argv), tokenizer, None, in_memory_notes.append)

    def no_lists(*args, **kwargs):
        raise AssertionError("a file read into a list while the cache is built")
    monkeypatch.setattr(utils.text_data, "read_examples", no_lists)
    entry = tmp_path / "entry"
    entry.mkdir()
    built = tokenised_data(parse_args(argv), tokenizer, None, built_notes.append, entry)
    assert (built.labels, built.fingerprint, built.first_text, built.unk_rate) == (
        expected.labels, expected.fingerprint, expected.first_text, expected.unk_rate)
    assert built_notes == in_memory_notes
    assert list(built.datasets) == list(expected.datasets) == ["train", "validation"]
    for split, dataset in built.datasets.items():
        assert dataset.to_dict() == expected.datasets[split].to_dict(), split
    assert sorted(path.name for path in entry.iterdir()) == ["train.arrow", "validation.arrow"]
    if layout.startswith("cnews"):
        assert len(built.datasets["train"]) > built.fingerprint["examples"] == 300  # windows of 300 texts
        assert "doc" in built.datasets["validation"].column_names
    else:
        assert len(built.labels) == 10 and "token_type_ids" in built.datasets["train"].column_names


def test_each_input_of_the_key_makes_a_new_entry(data, tmp_path):
    cache = tmp_path / "cache"

    def start(*extra, model=None):
        args = small_args(data, tmp_path / "o", cache, *extra)
        if model is not None:
            args[args.index("--model_name_or_path") + 1] = model
        return run_here(SCRIPT, args).stdout

    assert BUILT in start()
    same_tokenizer = shutil.copytree(data / "model", tmp_path / "copy_of_model")
    assert BUILT not in start(model=same_tokenizer)  # the tokenizer's content decides, not its path
    assert len(entries(cache)) == 1

    train = data / "train.txt"
    stat, lines = train.stat(), train.read_text(encoding="utf-8").splitlines(keepends=True)
    train.write_text("".join([lines[1], lines[0], *lines[2:]]), encoding="utf-8")  # same size, other content
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same modification time
    assert BUILT in start()
    assert len(entries(cache)) == 2

    vocab = tmp_path / "other_vocab"
    shutil.copytree(data / "model", vocab)
    words = (vocab / "vocab.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    (vocab / "vocab.txt").write_text("".join([*words[:-2], words[-1], words[-2]]), encoding="utf-8")
    assert BUILT in start(model=vocab)
    assert BUILT in start("--max_seq_len", "24")
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"{label}\n" for label in reversed((tmp_path / "o" / "labels.txt").read_text().split())))
    assert BUILT in start("--labels_file", labels)
    assert (tmp_path / "o" / "labels.txt").read_text() == labels.read_text()
    assert len(entries(cache)) == 5


@needs_whole_windows
def test_each_long_text_cut_makes_a_new_entry(data, tmp_path):
    cache = tmp_path / "cache"

    def start(*extra):
        out = tmp_path / "o"
        return run_here(SCRIPT, small_args(data, out, cache, "--max_seq_len", "12", *extra)).stdout, \
            read_json(out / "all_results.json")

    assert BUILT in start()[0]
    assert BUILT in start("--truncation", "tail")[0]
    assert BUILT in start("--truncation", "head_tail", "--head_tokens", "4")[0]
    assert BUILT in start("--truncation", "head_tail", "--head_tokens", "6")[0]
    stdout, windows = start("--doc_stride", "4")
    assert BUILT in stdout and windows["validation_windows"] > windows["eval_samples"]
    assert len(entries(cache)) == 5
    stdout, pooled_by_max = start("--doc_stride", "4", "--pool", "max")  # how windows are pooled: not the data
    assert BUILT not in stdout and len(entries(cache)) == 5
    assert pooled_by_max["validation_windows"] == windows["validation_windows"]
    assert pooled_by_max["eval_samples"] == windows["eval_samples"]


def test_a_bad_line_or_a_missing_file_stops_both_processes_with_one_line(data, tmp_path):
    with open(data / "train.txt", "a", encoding="utf-8") as f:
        f.write("a line without a tab\n")
    proc = launch(SCRIPT, small_args(data, tmp_path / "o", tmp_path / "cache"), num_processes=2, check=False)
    assert proc.returncode != 0
    line = f"error: {data / 'train.txt'}:801: expected 'label<TAB>text', found no TAB"
    assert line in proc.stderr, proc.stderr[-3000:]
    assert 'train_bert_cls.py", line' not in proc.stderr  # no traceback on either rank
    assert entries(tmp_path / "cache") == [] and not list((tmp_path / "cache").glob(".*tmp*"))
    missing = launch(SCRIPT, [*small_args(data, tmp_path / "o", tmp_path / "cache"), "--test_file",
                              tmp_path / "missing.txt", "--do_test"], num_processes=2, check=False)
    assert missing.returncode != 0  # found while the cache key is computed, by the main process, said by both
    assert f"error: {tmp_path / 'missing.txt'}: file not found" in missing.stderr, missing.stderr[-3000:]
    assert 'train_bert_cls.py", line' not in missing.stderr


def test_a_copy_of_the_data_elsewhere_is_read_from_its_own_files(data, tmp_path):
    """The same bytes in another directory: the lines said while reading name the files this run reads (the cache
    entry's notes are of the files it was built from), so such a copy is an entry of its own."""
    cache = tmp_path / "cache"
    copy = shutil.copytree(data, tmp_path / "copy")
    run_here(SCRIPT, small_args(data, tmp_path / "a", cache))
    second = run_here(SCRIPT, small_args(copy, tmp_path / "b", cache))
    assert f"train {copy / 'train.txt'}" in second.stdout and str(data / "train.txt") not in second.stdout
    assert len(entries(cache)) == 2


def test_a_finished_run_rotates_the_abandoned_checkpoints(text_data, tmp_path):
    """The later checkpoints a resume from an older one set aside are kept under --save_total_limit, the newest
    (by step) once the resumed run has finished: the disk they take stays bounded over any number of rollbacks."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    every_step = ["--max_train_steps", "3", "--checkpointing_steps", "1"]
    args = [a for a in small_args(text_data, out, cache) if a != "--overwrite_output_dir"]
    run_here(SCRIPT, [*args, *every_step, "--save_total_limit", "0"])
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2", "step_3"]
    proc = run_here(SCRIPT, [*args, *every_step, "--save_total_limit", "1", "--resume_from_checkpoint",
                             checkpoints / "step_1"])
    assert "starts a new branch: the later step_2, step_3, best_model moved aside" in proc.stdout
    assert ("abandoned checkpoints, rotated by --save_total_limit 1 now that the run has finished: removed "
            "step_2.abandoned_on_resume_from_step_1; kept step_3.abandoned_on_resume_from_step_1") in proc.stdout
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_3", "step_3.abandoned_on_resume_from_step_1"]
