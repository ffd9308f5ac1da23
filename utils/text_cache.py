"""The tokenised data cache of the text classifier: the training, validation and test files read, checked and
tokenised once, by one process, into memory-mapped Arrow files that every rank and every later start reads.
Owns the entry's key (`DataCache.key`, the tokenizer's `tokenizer_sha256`), who writes an entry and how the other ranks
wait for it (`DataCache.open`), and reading a split back (`read_split`).

Where, the key, an entry's content, who writes: docs/code.md#text_cachepy; the user's view: docs/bert.md.
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
    """The SHA-256 of what decides a tokenizer's output, without a call's truncation and padding."""
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
        """compute() on the main process; its result, or its UserError raised, on every rank (a collective)."""
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
        """The entry's name for `inputs()` (a JSON-able record of what determines the data); a collective."""
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
        # if another run put the same entry in place first, keep that one
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / META).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)

    def _note_failure(self, note, line):
        # on a full disk the waiting ranks stop when the launcher stops this process's job
        try:
            note.write_text(json.dumps({"token": self.token, "line": line}))
        except OSError:
            pass

    def _failure_note(self, entry):
        return entry.with_name(f".{entry.name}.failed")

    def _wait(self, entry):
        # until the writer has put the entry in place; its one line if it failed in this launch
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
