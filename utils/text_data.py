"""Reading labelled text files (cnews `label<TAB>text`, CSV, JSON lines) and the label mapping.

Every problem is a UserError that names the file and the line, so a bad line in a 50k-line file
is found in seconds instead of surfacing as a shape error three layers down.
"""
import csv
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

TEXT_SUFFIXES = {".txt", ".tsv"}
CSV_SUFFIXES = {".csv"}
JSON_SUFFIXES = {".json", ".jsonl"}
SPLIT_NAMES = {  # file names looked for in --data_dir, first match wins
    "train": ("train.txt", "cnews.train.txt", "train.tsv", "train.csv", "train.jsonl", "train.json"),
    "validation": ("val.txt", "cnews.val.txt", "dev.txt", "val.tsv", "val.csv", "val.jsonl", "val.json"),
    "test": ("test.txt", "cnews.test.txt", "test.tsv", "test.csv", "test.jsonl", "test.json"),
}


@dataclass
class Example:
    text: str
    label: str | None  # None for unlabelled prediction inputs
    where: str  # "path:line", for error messages


def find_split_file(data_dir, split):
    """The file for `split` in a cnews-style directory, or None."""
    for name in SPLIT_NAMES[split]:
        path = Path(data_dir) / name
        if path.is_file():
            return path
    return None


def _decoded_lines(path):
    """Yield (line_number, line) with the trailing newline removed; undecodable bytes name their line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: file not found")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise UserError(f"{path}:{number}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
            yield number, line.rstrip("\r\n")


def _check_text(text, where):
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"{where}: empty text")
    return text.strip()


def _check_label(label, where):
    if label is None or not str(label).strip():
        raise UserError(f"{where}: empty label")
    return str(label).strip()


def _read_tab_separated(path):
    for number, line in _decoded_lines(path):
        if not line.strip():
            continue  # blank lines (often a trailing one) carry nothing
        where = f"{path}:{number}"
        if "\t" not in line:
            raise UserError(f"{where}: expected 'label<TAB>text', found no TAB")
        label, text = line.split("\t", 1)
        yield Example(_check_text(text, where), _check_label(label, where), where)


def _read_csv(path, labelled):
    lines = (line for _, line in _decoded_lines(path))
    reader = csv.DictReader(lines)
    needed = {"text", "label"} if labelled else {"text"}
    missing = needed - set(reader.fieldnames or [])
    if missing:
        raise UserError(f"{path}:1: header lacks column(s) {', '.join(sorted(missing))}")
    for row in reader:
        where = f"{path}:{reader.line_num}"
        label = _check_label(row.get("label"), where) if labelled else None
        yield Example(_check_text(row.get("text"), where), label, where)


def _read_json(path, labelled):
    numbered = list(_decoded_lines(path))
    first = next((line for _, line in numbered if line.strip()), "")
    if first.lstrip().startswith("["):  # one JSON array
        try:
            rows = json.loads("\n".join(line for _, line in numbered))
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
        records = [(f"{path}: item {i}", row) for i, row in enumerate(rows)]
    else:  # JSON lines
        records = []
        for number, line in numbered:
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{number}: invalid JSON ({err.msg})") from None
    for where, row in records:
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected an object with 'text'" + (" and 'label'" if labelled else ""))
        label = _check_label(row.get("label"), where) if labelled else None
        yield Example(_check_text(row.get("text"), where), label, where)


def read_examples(path, labelled=True):
    """All examples of a labelled file (.txt/.tsv label TAB text, .csv or .json/.jsonl with label,text)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        examples = list(_read_tab_separated(path))
    elif suffix in CSV_SUFFIXES:
        examples = list(_read_csv(path, labelled))
    elif suffix in JSON_SUFFIXES:
        examples = list(_read_json(path, labelled))
    else:
        raise UserError(f"{path}: unsupported file type '{suffix}' (use .txt/.tsv, .csv, .json or .jsonl)")
    if not examples:
        raise UserError(f"{path}: no examples (the file is empty)")
    return examples


def read_texts(path):
    """Unlabelled texts to predict: one text per line, or JSON lines/CSV with a 'text' field."""
    path = Path(path)
    if path.suffix.lower() in CSV_SUFFIXES | JSON_SUFFIXES:
        examples = read_examples(path, labelled=False)
    else:
        examples = [
            Example(_check_text(line, f"{path}:{number}"), None, f"{path}:{number}")
            for number, line in _decoded_lines(path)
            if line.strip()
        ]
        if not examples:
            raise UserError(f"{path}: no texts (the file is empty)")
    return [example.text for example in examples]


def read_labels_file(path):
    """Label names, one per line, in the order that defines their ids."""
    labels = [line.strip() for _, line in _decoded_lines(path) if line.strip()]
    if not labels:
        raise UserError(f"{path}: no labels (the file is empty)")
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise UserError(f"{path}: label(s) listed twice: {', '.join(duplicates)}")
    return labels


def build_label_list(train_examples, labels_file=None):
    """Deterministic label order: the labels file if given, else the sorted labels of the train file.

    (The reference built it from a Python set, so ids changed between runs.)
    """
    if labels_file:
        labels = read_labels_file(labels_file)
        check_known_labels(train_examples, labels, source=str(labels_file))
        return labels
    return sorted({example.label for example in train_examples})


def check_known_labels(examples, labels, source="the train file"):
    """Every label must be one the model can predict; name the first line that is not."""
    known = set(labels)
    for example in examples:
        if example.label not in known:
            raise UserError(f"{example.where}: label '{example.label}' is not in {source}")


def write_labels_file(labels, path):
    Path(path).write_text("".join(f"{label}\n" for label in labels), encoding="utf-8")
