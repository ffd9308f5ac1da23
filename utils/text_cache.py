"""The tokenised data cache of the text classifier: the training, validation and test files read, checked and
tokenised once, into memory-mapped Arrow files (`datasets`' format) that every rank and every later start reads: the
other ranks, a resume, a requeue, an elastic restart, the next run on the same files.

Where: --data_cache_dir, by default `text_classification/` in `datasets`' own cache (HF_DATASETS_CACHE, normally
~/.cache/huggingface/datasets), beside the cache of transformers' way (load_dataset + map), so that one variable
moves both and a second run in another --output_dir finds the data already tokenised.

An entry is a directory named by the SHA-256 of everything that determines its content (`DataCache.key` over
`inputs`): the SHA-256 of each file read (the training, validation and test files and --labels_file) and their paths
(the notes kept with an entry name them), the text format flags, the cuts (--max_*_samples, --shuffle_train_dataset),
the modes (which splits are read), the trained model's labels when it is evaluated, the tokenizer (its vocabulary and
rules: `tokenizer_sha256`), --max_seq_len and how long texts are cut (--truncation, --head_tokens, --doc_stride;
--pool only pools an evaluation's windows and is not in it).
The files are hashed on every start, at disk speed (about 1 s per GB, a small part of what tokenising them costs),
rather than trusted by size and modification time: an edit that keeps both, or a copy over the file, is noticed too.
An entry holds <split>.arrow and meta.json (the labels, the notes said while reading, the first text for the model
card, the training text's [UNK] rate). It is written into a temporary directory and renamed into place: it exists
whole or not at all, and two runs building it at once keep one.

Who writes: one process, the main one, where every node sees the cache directory; the main process of each node where
each node has its own disk (utils/checkpoint.py output_dir_is_shared's test). The others wait for the entry outside
any collective (tokenising a large file may take longer than --ddp_timeout) and read it; a problem in the data (a bad
line) stops every rank with the writer's one line. The writer streams each file into an Arrow table in the entry's
temporary directory as it reads it (utils/text_data.py ExampleTable), checks the labels and tokenises from there, and
deletes the tables: its memory does not grow with the files.

The training data's fingerprint that a resume checks (utils/checkpoint.py DATA_KEY; utils/text_data.py
fingerprint_examples: the training examples as read, in order) is taken while the entry is built, in the pass that
reads the training file, and kept in meta.json: a later start reads it there, without a pass over the data.

Neighbours: utils/text_data.py (reading and tokenising), utils/checkpoint.py (what a resume must match).
"""
import hashlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path

import datasets
from accelerate.utils import broadcast_object_list
from datasets import Dataset

from . import checkpoint, runtime

CACHE_FORMAT = 1  # what an entry holds; another value names other entries, so older ones are never misread

META = "meta.json"

POLL_SECONDS = 0.5  # how often a waiting rank looks for the entry


def default_cache_dir():
    return Path(datasets.config.HF_DATASETS_CACHE) / "text_classification"


def file_sha256(path):
    """The SHA-256 of a file's bytes, read in 1 MiB blocks (memory stays flat for any size)."""
    path = Path(path)
    if not path.is_file():
        raise runtime.UserError(f"{path}: file not found")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_sha256(tokenizer):
    """What decides a tokenizer's output: a fast tokenizer's whole pipeline (vocabulary, normalizer, pre-tokenizer,
    [CLS]/[SEP] template) without the truncation and padding a call sets; a slow one's class and vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
    else:
        state = sorted(tokenizer.get_vocab().items())
    record = json.dumps([type(tokenizer).__name__, state], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(record.encode("utf-8")).hexdigest()


def digest(record):
    """The SHA-256 of a JSON-able record, independent of dict order."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


class DataCache:
    """One cache directory as this launch uses it (every rank builds one, at the same point: a collective)."""

    def __init__(self, accelerator, root):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        shared = checkpoint.output_dir_is_shared(accelerator, self.root)
        self.writes = accelerator.is_main_process if shared else accelerator.is_local_main_process
        self.accelerator = accelerator
        self.token = self._agree(lambda: secrets.token_hex(8))  # names this launch's failure notes

    def _agree(self, compute):
        """compute() on the main process, its result on every rank, or its UserError raised on every rank (a
        collective)."""
        outcome = [None]
        if self.accelerator.is_main_process:
            try:
                outcome = [(compute(), None)]
            except runtime.UserError as err:
                outcome = [(None, str(err))]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(outcome)
        value, problem = outcome[0]
        if problem:
            raise runtime.UserError(problem)
        return value

    def key(self, inputs):
        """The entry's name for `inputs()` (a JSON-able record of what determines the data), computed once, on the main
        process (reading the files to hash them), and shared with every rank."""
        return self._agree(lambda: digest({"format": CACHE_FORMAT, **inputs()}))

    def open(self, key, build, say=print):
        """(directory, meta) of entry `key`; the writer builds it first with build(directory) -> meta if it is not
        there, every other rank waits for it."""
        entry = self.root / key
        if self.writes and not (entry / META).is_file():
            self._build(entry, build, say)
        else:
            self._wait(entry)
        return entry, json.loads((entry / META).read_text(encoding="utf-8"))

    def _build(self, entry, build, say):
        tmp = entry.with_name(f".{entry.name}.tmp-{self.token}")
        failed = self._failure_note(entry)
        start = time.perf_counter()
        say(f"tokenising the data into {entry} (read by every rank and every later start)")
        try:
            tmp.mkdir(parents=True)
            meta = build(tmp)
            (tmp / META).write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
            self._rename(tmp, entry)
        except Exception as err:
            shutil.rmtree(tmp, ignore_errors=True)
            line = str(err) if isinstance(err, runtime.UserError) else runtime.write_failure(err, self.root)
            self._note_failure(failed, line or f"{type(err).__name__}: {err}")
            if line is None:
                raise
            raise runtime.UserError(line) from None
        failed.unlink(missing_ok=True)
        say(f"tokenised the data in {time.perf_counter() - start:.1f} s")

    @staticmethod
    def _rename(tmp, entry):
        """Put the finished entry in place; if another run put the same entry there first, keep that one."""
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / META).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)

    def _note_failure(self, note, line):
        """Leave `line` for the waiting ranks; on a full disk they stop when the launcher stops this process's job."""
        try:
            note.write_text(json.dumps({"token": self.token, "line": line}))
        except OSError:
            pass

    def _failure_note(self, entry):
        return entry.with_name(f".{entry.name}.failed")

    def _wait(self, entry):
        """Until the writer has put the entry in place; its one line if it failed in this launch."""
        note = self._failure_note(entry)
        while not (entry / META).is_file():
            problem = self._read_failure(note)
            if problem:
                raise runtime.UserError(problem)
            time.sleep(POLL_SECONDS)
            os.listdir(self.root)  # a listing revalidates NFS's cached view of the directory

    def _read_failure(self, note):
        try:
            failure = json.loads(note.read_text())
        except (OSError, ValueError):
            return None
        return failure["line"] if failure.get("token") == self.token else None


def read_split(entry, split):
    """A split of an entry, memory-mapped: every rank and every process on a machine share its pages."""
    return Dataset.from_file(str(Path(entry) / f"{split}.arrow"))
