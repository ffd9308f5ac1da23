"""The text classifier's data: reading labelled text files (cnews `label<TAB>text`, CSV, JSON; `TextFormat`) or a
`datasets` dataset into `Example`s, each problem one line naming the file and the line; the label list and its checks;
predict files; the quick-try cuts; the streamed `ExampleTable` the data cache builds from; the training data's
fingerprint; cutting long texts (`LongText`) and tokenising once; padding per device; the length-grouped order
(`LengthGroupedSampler`).
Why each works as it does: docs/code.md#text_datapy; the formats as users see them: docs/bert_data_formats.md.
Neighbours: utils/text_cache.py (the tokenised data cache), utils/text_model.py (the model and tokenizer),
utils/text_metrics.py (loss, metrics, predictions).
"""
import ast
import codecs
import csv
import functools
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import tokenizers
import torch
from accelerate.utils import DynamoBackend
from datasets import ClassLabel, Dataset, DatasetDict, Features, List, Value
from datasets.arrow_writer import ArrowWriter
from datasets.exceptions import DatasetsError
from torch.utils.data import Sampler
from transformers import DataCollatorWithPadding

from . import checkpoint, runtime

TEXT_SUFFIXES = {".txt", ".tsv"}

CSV_SUFFIXES = {".csv"}

JSON_SUFFIXES = {".json", ".jsonl"}

DATA_SUFFIXES = (".txt", ".tsv", ".csv", ".jsonl", ".json")

SPLIT_STEMS = {  # --data_dir holds <stem><suffix> for a suffix of DATA_SUFFIXES; two such files for a split: an error
    "train": ("train", "cnews.train"),
    "validation": ("val", "dev", "validation", "cnews.val"),
    "test": ("test", "cnews.test"),
}

SPLIT_FLAGS = {"train": "--train_file", "validation": "--validation_file", "test": "--test_file"}

CSV_FIELD_LIMIT = 2**31 - 1  # characters; the csv module stops at 131,072 by default (2**31 - 1 fits a C long anywhere)

LINE_BREAK = re.compile(rb"\r\n|\r|\n")  # universal newlines, on bytes

DATASET_SPLITS = {  # DatasetDict keys taken for each role when no --*_split_name says otherwise, first match wins
    "train": ("train",),
    "validation": ("validation", "dev", "val", "valid"),
    "test": ("test",),
}

SHUFFLE_SEED = 42  # run_classification.py's default --shuffle_seed


@dataclass
class Example:
    text: str
    label: str | tuple[str, ...] | float | None  # a tuple when multi-label, a number for regression; None where a
    # predict file or a dataset's test split gives none
    where: str  # "path:line" or "<dataset> split 'train' row 7", for error messages
    text_pair: str | None = None  # the second sentence of a pair
    line: int | None = None  # the line where the record starts, numbered as a text editor shows it
    skipped: str | None = None  # predict files: why the record is not fed to the model ("blank line", "empty text")


@dataclass(frozen=True)
class TextFormat:
    """How the user's files are laid out (the --text_column/--text_pair_column/--label_column/... flags)."""
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    label_separator: str | None = None  # set: multi-label, the label field holds several labels
    encoding: str = "utf-8"
    joined_columns: tuple[str, ...] = ()  # --text_column_names a,b: the text is these fields joined, not text_column
    column_delimiter: str = " "  # between the joined fields
    regression: bool = False  # the label is a number

    @property
    def multi_label(self):
        return self.label_separator is not None

DEFAULT_FORMAT = TextFormat()


# add_text_format_args' flags (utils/checkpoint.py Role): what is read as texts and labels is in the training data's
# fingerprint; the label mode decides the loss and, with the threshold, what an evaluation of the exported model
# repeats (utils/text_model.py TRAINED_WITH)
TEXT_FORMAT_ROLES = {**dict.fromkeys(("--text_column", "--text_column_names", "--text_column_delimiter",
                                      "--text_pair_column", "--label_column", "--label_separator", "--encoding"),
                                     checkpoint.kept_by(checkpoint.DATA_KEY)),
                     "--multi_label": checkpoint.keep_as("multi_label").recorded(False),
                     "--threshold": checkpoint.MAY_CHANGE.recorded(0.5, only_with="multi_label"),
                     "--do_regression": checkpoint.keep_as("regression")}


@checkpoint.roles_beside("TEXT_FORMAT_ROLES")
def add_text_format_args(group):
    """The flags of `TextFormat` (transformers' run_classification names where it has them)."""
    group.add_argument("--text_column", default=None,
                       help="csv/json field of the text (default: text; where the data have a 'sentence' field and no "
                       "'text', sentence, run_classification.py's default, said once)")
    group.add_argument("--text_column_names", "--text_column_name", default=None,
                       help="run_classification.py's: one field (= --text_column), or several, comma-separated, "
                       "joined into one text by --text_column_delimiter")
    group.add_argument("--text_column_delimiter", default=None, help="with several --text_column_names; default ' '")
    group.add_argument("--text_pair_column", default=None,
                       help="csv/json field of the second sentence: a sentence-pair task (LCQMC, AFQMC, OCNLI)")
    group.add_argument("--label_column", "--label_column_name", default="label",
                       help="csv/json field of the label(s)")
    group.add_argument("--multi_label", action="store_true", default=None,
                       help="several labels per text (sigmoid + binary cross-entropy); evaluating a trained model: "
                       "its own label mode")
    group.add_argument("--label_separator", default=",", help="with --multi_label: between labels in a label field")
    group.add_argument("--threshold", type=float, default=None,
                       help="with --multi_label: probability from which a label is predicted (default: 0.5; "
                       "evaluating a trained model: the model's)")
    group.add_argument("--do_regression", type=runtime.hf_bool, nargs="?", const=True, default=False,
                       help="the label is a number (STS-B, ratings): one output, mean squared error")
    group.add_argument("--encoding", default="utf-8", help="of every input file, e.g. gb18030 (GBK), big5")


def check_text_format_args(args):
    """The flag combinations `text_format` cannot take, found while parsing the command line."""
    if args.text_column_names and args.text_column is not None:
        raise runtime.UserError("--text_column and --text_column_names name the same thing: pass one")
    if args.text_column_delimiter is not None and len((args.text_column_names or "").split(",")) < 2:
        raise runtime.UserError("--text_column_delimiter joins several --text_column_names (comma-separated); here "
                                "there is nothing to join")
    if args.do_regression and args.multi_label:
        raise runtime.UserError("--do_regression predicts one number per text; it cannot be combined with "
                                "--multi_label")


def text_format(args):
    """The TextFormat of the flags (--text_column: `text` until resolve_text_column has looked at the data)."""
    check_encoding(args.encoding)
    if args.multi_label and not args.label_separator:
        raise runtime.UserError("--label_separator: must not be empty")
    names = [name.strip() for name in (args.text_column_names or "").split(",") if name.strip()]
    joined = tuple(names) if len(names) > 1 else ()
    text_column = names[0] if len(names) == 1 else args.text_column or DEFAULT_FORMAT.text_column
    return TextFormat(text_column, args.text_pair_column, args.label_column,
                      args.label_separator if args.multi_label else None, args.encoding, joined,
                      " " if args.text_column_delimiter is None else args.text_column_delimiter, args.do_regression)


def resolve_text_column(args, columns, source, say=print):
    """--text_column where neither it nor --text_column_names is given: `text`, or `sentence` where the data's
    `columns` (of `source`) have that and no `text` (said once); set on args like a given one."""
    if args.text_column is not None or args.text_column_names:
        return
    sentence = "sentence" in columns and DEFAULT_FORMAT.text_column not in columns
    args.text_column = "sentence" if sentence else DEFAULT_FORMAT.text_column
    if sentence:
        say(f"--text_column sentence: {source} has a 'sentence' field and no 'text' (run_classification.py's default "
            f"text column)")


def resolve_file_text_column(args, say=print):
    """resolve_text_column from the fields of the first file of the run (--train_file, --validation_file,
    --test_file or --data_dir's, --predict_file)."""
    if args.text_column is not None or args.text_column_names:
        return
    files = split_files(args.data_dir, {"train": args.train_file, "validation": args.validation_file,
                                        "test": args.test_file}, say=lambda line: None)
    first = next((Path(path) for path in (*files.values(), args.predict_file) if path is not None), None)
    resolve_text_column(args, file_fields(first, text_format(args)) if first else (), first, say)


def file_fields(path, fmt):
    """The field names of a file's first record: a .csv's header, a .txt/.tsv's header row, the keys of a JSON
    file's first object; none for label<TAB>text lines. Only the first line is read, but from a JSON array."""
    suffix = path.suffix.lower()
    if suffix in CSV_SUFFIXES:
        return next((fields for _, fields in _table_records(path, check_encoding(fmt.encoding), ",") if fields), [])
    if suffix in JSON_SUFFIXES:
        first = next((line for _, line in _decoded_lines(path, fmt.encoding) if line.strip()), "")
        rows = _json_rows(path, fmt) if first.lstrip().startswith("[") else [(1, _json_line(path, first))]
        row = next((row for _, row in rows if row is not None), None)
        return list(row) if isinstance(row, dict) else []
    header = _header_row(path, fmt) if suffix in TEXT_SUFFIXES else None
    return header[1] if header else []


def _json_line(path, line):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None  # read as the file is read, later, where the error names its line


def label_set(example):
    """The labels of an example as a tuple (one for single-label)."""
    return example.label if isinstance(example.label, tuple) else (example.label,)


def find_split_file(data_dir, split):
    """The file for `split` ("train", "validation", "test") in --data_dir, or None: <name><suffix> for the names of
    SPLIT_STEMS (cnews.train, dev, validation, ...) and every supported suffix; two candidates are an error."""
    found = [Path(data_dir) / f"{stem}{suffix}" for stem in SPLIT_STEMS[split] for suffix in DATA_SUFFIXES
             if (Path(data_dir) / f"{stem}{suffix}").is_file()]
    if len(found) > 1:
        raise runtime.UserError(f"--data_dir {data_dir}: {' and '.join(path.name for path in found)} are each a "
                                f"{split} file; keep one of them there, or name it with {SPLIT_FLAGS[split]}")
    return found[0] if found else None


def split_files(data_dir, given, say=print):
    """{split: path or None}: the file given for each split (--train_file, ...), else the one --data_dir holds; with
    --data_dir, one line says which file each split uses."""
    if data_dir is None:
        return dict(given)
    if not Path(data_dir).is_dir():
        raise runtime.UserError(f"--data_dir {data_dir}: no such directory")
    files = {split: given.get(split) or find_split_file(data_dir, split) for split in SPLIT_FLAGS}
    say(f"--data_dir {data_dir}: " + ", ".join(f"{split} {files[split] or '(none)'}" for split in SPLIT_FLAGS))
    return files


def check_encoding(encoding):
    """A known codec in which a line break is the ASCII byte (0x0A, 0x0D): an undecodable byte's line is counted on
    the raw bytes."""
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        raise runtime.UserError(f"--encoding {encoding}: unknown encoding (e.g. utf-8, gb18030, big5)") from None
    if "\n".encode(name) != b"\n":
        raise runtime.UserError(f"--encoding {encoding}: not supported (lines must end in a 0x0A byte; convert the "
                                f"file to utf-8 or gb18030)")
    return name


def _open_text(path, codec, newline=None):
    """`path` opened for reading as text in `codec`; a UTF-8 byte order mark (Excel writes one) is not text."""
    path = Path(path)
    if not path.is_file():
        raise runtime.UserError(f"{path}: file not found")
    return open(path, encoding="utf-8-sig" if codec == "utf-8" else codec, newline=newline)


def looks_utf16(data):
    """A UTF-16 byte-order mark, or NUL bytes in a quarter of the first 4 KB (ASCII text in UTF-16 without one)."""
    head = data[:4096]
    return head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) or head.count(0) > len(head) // 4


def _decode_error(path, codec):
    """The UserError for a file that is not valid `codec`: the line and byte of its first undecodable byte."""
    data = Path(path).read_bytes()
    skip = len(codecs.BOM_UTF8) if codec == "utf-8" and data.startswith(codecs.BOM_UTF8) else 0
    utf8 = codec == "utf-8"
    hint = ("; pass --encoding gb18030 for GBK/GB2312 files, --encoding big5 for Big5" if utf8 else
            "; pass the file's real --encoding")
    if looks_utf16(data):
        hint = ("; it is UTF-16 (Windows' \"Unicode\": a byte-order mark, a NUL byte beside each ASCII character), "
                "whose line breaks no --encoding here reads: save it as UTF-8")
    try:
        data[skip:].decode(codec)
    except UnicodeDecodeError as err:
        before = data[:skip + err.start]
        line = len(LINE_BREAK.findall(before)) + 1
        byte = len(before) - max(before.rfind(b"\n"), before.rfind(b"\r")) - 1
        return runtime.UserError(f"{path}:{line}: not valid {'UTF-8' if utf8 else codec} ({err.reason} at byte "
                                 f"{byte}){hint}")
    return runtime.UserError(f"{path}: not valid {'UTF-8' if utf8 else codec}{hint}")  # changed while it was read


def _decoded_lines(path, encoding="utf-8"):
    """Yield (line_number, line) without its line end. Universal newlines: a line ends in \\n, \\r\\n or a lone \\r
    (old Mac files, some Excel exports), and lines are numbered as a text editor shows them."""
    codec = check_encoding(encoding)
    with _open_text(path, codec) as f:
        try:
            for number, line in enumerate(f, start=1):
                yield number, line.rstrip("\n")
        except UnicodeDecodeError:
            raise _decode_error(path, codec) from None


def _table_records(path, codec, delimiter):
    """Yield (line, fields) of each record of a CSV (or tab-separated) file, read by the csv module from the raw
    file; `line` is where the record starts; a blank line is a record with no fields."""
    csv.field_size_limit(CSV_FIELD_LIMIT)
    with _open_text(path, codec, newline="") as f:
        reader, start = csv.reader(f, delimiter=delimiter, strict=True), 1
        try:
            for fields in reader:
                yield start, fields
                start = reader.line_num + 1
        except UnicodeDecodeError:
            raise _decode_error(path, codec) from None
        except csv.Error as err:
            if str(err) == "unexpected end of data":
                raise runtime.UserError(f"{path}:{start}: a quoted field of this record is never closed (the file ends "
                                        f"inside it)") from None
            hint = "; or remove the header row to read lines as label<TAB>text" if delimiter == "\t" else ""
            raise runtime.UserError(f"{path}:{reader.line_num}: {str(err).replace(chr(9), 'TAB')} (a field holding a "
                                    f"quote must be quoted as a whole, its quotes doubled{hint})") from None


def _table_rows(path, fmt, labelled, delimiter):
    """Yield (line, row) of a file with a header row: row maps the header's names to the record's fields; None for a
    blank line. A record with another number of fields than the header is an error."""
    records = _table_records(path, check_encoding(fmt.encoding), delimiter)
    header_line, header = next(((line, fields) for line, fields in records if fields), (1, []))
    missing = [f"{column} ({flag})" for column, flag in _columns(fmt, labelled) if column not in header]
    if missing:
        raise runtime.UserError(f"{path}:{header_line}: header lacks column(s) {', '.join(missing)}"
                                + _sentence_hint(fmt, header))
    for line, fields in records:
        if not any(field.strip() for field in fields):
            yield line, None
        elif len(fields) != len(header):
            separator = "TAB" if delimiter == "\t" else f"'{delimiter}'"
            raise runtime.UserError(f"{path}:{line}: {len(fields)} fields, the header has {len(header)} (a field "
                                    f"holding a {separator}, a quote or a line break must be quoted)")
        else:
            yield line, dict(zip(header, fields))


def _json_rows(path, fmt):
    """Yield (line, value) of a JSON-lines file (None for a blank line), or of the items of one JSON array; `line` is
    where the value starts."""
    lines = list(_decoded_lines(path, fmt.encoding))
    first = next((line for _, line in lines if line.strip()), "")
    if first.lstrip().startswith("["):
        yield from _json_array_items(path, "\n".join(line for _, line in lines))
        return
    for number, line in lines:
        try:
            value = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as err:
            raise runtime.UserError(f"{path}:{number}: invalid JSON ({err.msg})") from None
        yield number, value


def _json_array_items(path, text):
    """[(line, item)] of the JSON array `text`, each item decoded by json's own decoder where it starts."""
    decoder, space = json.JSONDecoder(), re.compile(r"[ \t\n\r]*")
    items, line, counted = [], 1, 0
    position = space.match(text, text.index("[") + 1).end()
    closed = text.startswith("]", position)  # an empty array
    while not closed:
        line, counted = line + text.count("\n", counted, position), position
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as err:
            raise runtime.UserError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
        items.append((line, item))
        position = space.match(text, position).end()
        closed = text.startswith("]", position)
        if not closed and not text.startswith(",", position):
            raise runtime.UserError(f"{path}:{text.count(chr(10), 0, position) + 1}: invalid JSON "
                                    f"(expected ',' or ']')")
        position = position if closed else space.match(text, position + 1).end()
    if text[position + 1:].strip():
        raise runtime.UserError(f"{path}:{text.count(chr(10), 0, position) + 1}: invalid JSON (data after the array)")
    return items


def _header_row(path, fmt):
    """(line, fields) of a .txt/.tsv file's first non-blank line if it is a header row (two or more TAB-separated
    fields, one of them the text or label column's name), else None."""
    for number, line in _decoded_lines(path, fmt.encoding):
        if line.strip():
            fields = line.split("\t")
            named = fmt.text_column in fields or fmt.label_column in fields
            return (number, fields) if len(fields) > 1 and named else None
    return None


def _rows(path, fmt, say, plain_lines, labelled=True):
    """Yield (line, row) of each record of a supported file (row: column name -> value, None for a blank line);
    `plain_lines(path, fmt)` reads a .txt/.tsv without a header row."""
    suffix = path.suffix.lower()
    if suffix in CSV_SUFFIXES:
        return _table_rows(path, fmt, labelled, ",")
    if suffix in JSON_SUFFIXES:
        return _json_rows(path, fmt)
    if suffix not in TEXT_SUFFIXES:
        raise runtime.UserError(f"{path}: unsupported file type '{suffix}' (use .txt/.tsv, .csv, .json or .jsonl)")
    header = _header_row(path, fmt)
    if header is None:
        return plain_lines(path, fmt)
    line, fields = header
    say(f"skipped the header row of {path}:{line} ({', '.join(name or '(index)' for name in fields)}): its columns are "
        f"read by name, quoted fields as pandas and the csv module write them")
    return _table_rows(path, fmt, labelled, "\t")


def _cnews_lines(path, fmt):
    """Rows of a header-less .txt/.tsv training file: `label<TAB>text` lines (the text may hold more TABs)."""
    if fmt.text_pair_column:
        raise runtime.UserError(f"{path}: sentence pairs need a .csv or .json(l) file with named columns (or a .tsv "
                                f"whose first line is a header row); other .txt/.tsv files are 'label<TAB>text'")
    for number, line in _decoded_lines(path, fmt.encoding):
        if not line.strip():
            yield number, None  # blank lines (often a trailing one) carry nothing
            continue
        if "\t" not in line:
            raise runtime.UserError(f"{path}:{number}: expected 'label<TAB>text', found no TAB")
        label, text = line.split("\t", 1)
        yield number, {fmt.label_column: label, fmt.text_column: text}


def _check_text(text, where):
    if not isinstance(text, str) or not text.strip():
        raise runtime.UserError(f"{where}: empty text")
    return text.strip()


def _list_items(label):
    """The items of a list label: a JSON list, or the text Python or JSON writes for a list (pandas saves a list
    column as "['a', 'b']"); None for anything else."""
    if isinstance(label, list):
        return label
    text = label.strip() if isinstance(label, str) else ""
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        value = ast.literal_eval(text)  # literals only: nothing is run
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, list) else None


def _check_label(label, where, fmt=DEFAULT_FORMAT):
    """One label; with multi-label a sorted tuple of labels (a list, or a field split on the separator; empty: none);
    with regression a finite number. A list without --multi_label: a UserError."""
    if fmt.regression:
        return _check_number(label, where)
    if isinstance(label, dict):
        raise runtime.UserError(f"{where}: the label is a JSON object; expected a label (with --multi_label: a list)")
    items = _list_items(label)
    if items is not None and not fmt.multi_label:
        raise runtime.UserError(f"{where}: the label {str(label)[:60]} is a list; pass --multi_label for several "
                                f"labels per text")
    if fmt.multi_label:
        if label is None:
            raise runtime.UserError(f"{where}: no label field")
        parts = items if items is not None else str(label).split(fmt.label_separator)
        return tuple(sorted({str(part).strip() for part in parts if str(part).strip()}))
    if label is None or not str(label).strip():
        raise runtime.UserError(f"{where}: empty label")
    return str(label).strip()


def _check_number(label, where):
    if label is None or not str(label).strip():
        raise runtime.UserError(f"{where}: empty label")
    try:
        value = float(label)
    except (TypeError, ValueError):
        raise runtime.UserError(f"{where}: label {str(label).strip()!r} is not a number (--do_regression)") from None
    if not math.isfinite(value) or isinstance(label, bool):
        raise runtime.UserError(f"{where}: label {str(label).strip()!r} is not a finite number (--do_regression)")
    return value


@functools.cache  # once per format, not once per line
def _columns(fmt, labelled):
    """(field, flag) pairs a row must have."""
    columns = ([(column, "--text_column_names") for column in fmt.joined_columns] if fmt.joined_columns
               else [(fmt.text_column, "--text_column")])
    if fmt.text_pair_column:
        columns.append((fmt.text_pair_column, "--text_pair_column"))
    if labelled:
        columns.append((fmt.label_column, "--label_column"))
    return tuple(columns)


def _check_columns(row, where, fmt, labelled):
    if not isinstance(row, dict):
        fields = " and ".join(f"'{column}'" for column, _ in _columns(fmt, labelled))
        raise runtime.UserError(f"{where}: expected an object with {fields}")
    for column, flag in _columns(fmt, labelled):
        if column not in row:
            hint = ("; files to train or evaluate on need labels (texts without labels go to --predict_file)"
                    if column == fmt.label_column else _sentence_hint(fmt, row))
            raise runtime.UserError(f"{where}: no field '{column}' ({flag}){hint}")


def _sentence_hint(fmt, fields):
    """run_classification.py reads a `sentence` column by default, this script `text`: name the flag to pass."""
    if fmt.text_column not in fields and "sentence" in fields and not fmt.joined_columns:
        return "; it has 'sentence', run_classification.py's default text column: pass --text_column sentence"
    return ""


def _row_text(row, fmt):
    """The text of a row: its text column, or with --text_column_names a,b those columns joined as
    run_classification.py joins them (None, a missing csv/parquet value, joins as nothing)."""
    if not fmt.joined_columns:
        return row[fmt.text_column]
    return fmt.column_delimiter.join("" if row[column] is None else str(row[column]) for column in fmt.joined_columns)


def _example(row, where, fmt, line, labelled=True):
    _check_columns(row, where, fmt, labelled)
    label = _check_label(row[fmt.label_column], where, fmt) if labelled else None
    pair = _check_text(row[fmt.text_pair_column], where) if fmt.text_pair_column else None
    return Example(_check_text(_row_text(row, fmt), where), label, where, pair, line)


def iter_examples(path, labelled=True, fmt=DEFAULT_FORMAT, say=print):
    """The examples of a labelled file one at a time, as they are read (labelled=False: a .csv/.json(l) file's labels
    are not read); `say` prints one-line notes. A file without examples is a UserError."""
    path = Path(path)
    found = False
    for line, row in _rows(path, fmt, say, _cnews_lines, labelled):
        if row is not None:
            found = True
            yield _example(row, f"{path}:{line}", fmt, line, labelled)
    if not found:
        raise runtime.UserError(f"{path}: no examples (the file is empty)")


def read_examples(path, labelled=True, fmt=DEFAULT_FORMAT, say=print):
    """All examples of a labelled file, as a list (`iter_examples`)."""
    return list(iter_examples(path, labelled, fmt, say))


class ExampleTable:
    """A split's examples in an Arrow file, written as the file is read (`write`) and memory-mapped; iterated, cut
    (`select`, slices) and tokenised (`columns`) a batch at a time (docs/code.md#text_datapy)."""

    BATCH = 10_000  # examples per Arrow record batch

    def __init__(self, dataset, source, first_seen=None, fingerprint=None):
        self.dataset, self.source = dataset, source
        self.first_seen, self.fingerprint = first_seen, fingerprint  # of these rows in this order; None: not taken

    @classmethod
    def write(cls, examples, path, fmt, source):
        """`examples` (an iterable: iter_examples reading `source`) written to the Arrow file `path` as they come."""
        label = (Value("float64") if fmt.regression else List(Value("string")) if fmt.multi_label
                 else Value("string"))
        features = Features({"text": Value("string"), **({"text_pair": Value("string")} if fmt.text_pair_column
                                                         else {}), "label": label, "line": Value("int64")})
        first_seen, fingerprint = {}, checkpoint.DataFingerprint()
        with ArrowWriter(features=features, path=str(path)) as writer:
            examples = iter(examples)
            while batch := list(itertools.islice(examples, cls.BATCH)):
                writer.write_batch({"text": [e.text for e in batch], "label": [e.label for e in batch],
                                    "line": [e.line for e in batch],
                                    **({"text_pair": [e.text_pair for e in batch]} if fmt.text_pair_column else {})})
                for label, where in _first_seen(batch).items():
                    first_seen.setdefault(label, where)
                for example in batch:
                    fingerprint.add(example_record(example))
            writer.finalize()
        return cls(Dataset.from_file(str(path)), source, first_seen, fingerprint)

    def __len__(self):
        return len(self.dataset)

    def __iter__(self):
        paired = "text_pair" in self.dataset.column_names
        for batch in self.dataset.iter(batch_size=self.BATCH):
            for i, (text, label, line) in enumerate(zip(batch["text"], batch["label"], batch["line"])):
                yield Example(text, tuple(label) if isinstance(label, list) else label, f"{self.source}:{line}",
                              batch["text_pair"][i] if paired else None, line)

    def __getitem__(self, index):
        if isinstance(index, slice):
            bounds = index.indices(len(self))
            return self if bounds == (0, len(self), 1) else self.select(range(*bounds))
        return next(iter(self.select([range(len(self))[index]])))

    def select(self, indices):
        return ExampleTable(self.dataset.select(indices), self.source)

    def columns(self, targets):
        """text (and text_pair) and labels (`targets` of each batch of labels), as tokenize_columns reads them; written
        beside the table's file."""
        path = Path(self.dataset.cache_files[0]["filename"])
        return self.dataset.map(lambda batch: {"labels": targets(batch["label"])}, batched=True,
                                batch_size=self.BATCH, remove_columns=["label", "line"],
                                cache_file_name=str(path.with_name(f"columns-{path.name}")))


def read_predict_file(path, fmt=DEFAULT_FORMAT, labels=(), say=print):
    """One Example per record of a --predict_file, blank lines and empty texts marked `skipped`; `labels` (the
    model's) recognise `label<TAB>text` lines (docs/bert_data_formats.md#predict-files-and-predictionsjsonl)."""
    path = Path(path)
    rows = _rows(path, fmt, say, functools.partial(_predict_lines, labels=set(labels), say=say), labelled=False)
    examples = [_predict_example(row, f"{path}:{line}", fmt, line) for line, row in rows]
    if all(example.skipped for example in examples):
        raise runtime.UserError(f"{path}: no texts (the file is empty)")
    return examples


def _predict_lines(path, fmt, labels, say):
    """Rows of a header-less .txt/.tsv predict file: one text per line (a TAB may be part of a text), or, when every
    non-blank line is `label<TAB>text` with a label of the model, those lines' texts and labels."""
    if fmt.text_pair_column:
        raise runtime.UserError(f"{path}: sentence pairs to predict need a .csv or .json(l) file with named columns")
    lines = list(_decoded_lines(path, fmt.encoding))
    texts = [(number, line) for number, line in lines if line.strip()]
    with_label = [number for number, line in texts if _starts_with_label(line, labels, fmt)]
    if len(texts) / 2 < len(with_label) < len(texts):
        first = next(number for number, line in texts if not _starts_with_label(line, labels, fmt))
        raise runtime.UserError(f"{path}:{first}: {len(with_label)} of the {len(texts)} lines are 'label<TAB>text' "
                                f"with a label of the model, this one is not; correct it, or give the texts as .jsonl "
                                f"with a 'text' field")
    is_labelled = bool(texts) and len(with_label) == len(texts)
    if is_labelled:
        say(f"{path}: every line is 'label<TAB>text' with a label of the model: predicting on the texts (the labels go "
            f"to label_given)")
    for number, line in lines:
        if not line.strip():
            yield number, None
        elif is_labelled:
            label, text = line.split("\t", 1)
            yield number, {fmt.label_column: label, fmt.text_column: text}
        else:
            yield number, {fmt.text_column: line}


def _starts_with_label(line, labels, fmt):
    label, tab, _ = line.partition("\t")
    if fmt.regression:  # a number, then the text
        return bool(tab) and _label_number(label.strip()) is not None
    names = label.split(fmt.label_separator) if fmt.multi_label else [label]
    return bool(tab and label.strip()) and all(name.strip() in labels for name in names)


def _predict_example(row, where, fmt, line):
    """An Example to predict; a blank line or an empty text is kept as a `skipped` one."""
    if row is None:
        return Example("", None, where, line=line, skipped="blank line")
    _check_columns(row, where, fmt, labelled=False)
    texts = [_row_text(row, fmt)] + ([row[fmt.text_pair_column]] if fmt.text_pair_column else [])
    if any(isinstance(text, str) and not text.strip() for text in texts):
        return Example("", None, where, line=line, skipped="empty text")
    given = row.get(fmt.label_column)
    label = _check_label(given, where, fmt) if given not in (None, "") else None
    pair = _check_text(row[fmt.text_pair_column], where) if fmt.text_pair_column else None
    return Example(_check_text(_row_text(row, fmt), where), label, where, pair, line)


@dataclass
class Splits:
    """What a run reads: {"train"|"validation"|"test"|"predict": examples}, the label list the data defines (None:
    the training examples' sorted labels) and the lines that say what was read for what."""
    examples: dict
    labels: list[str] | None = None
    notes: list[str] = field(default_factory=list)


# run_classification.py evaluates on the test split when there is no validation split; here the test set is only
# ever evaluated by --do_test, once, on the selected model
TEST_FOR_EVAL = ("; run_classification.py would evaluate on the test split instead: here that is --do_test (or pass "
                 "the test file as --validation_file)")


def read_file_splits(args, fmt, say=print, tables=None):
    """The split files this run needs (--data_dir's set on args); with `tables` (a directory), each file streams
    into an ExampleTable there instead of a list."""
    files = split_files(args.data_dir, {"train": args.train_file, "validation": args.validation_file,
                                        "test": args.test_file}, say)
    args.train_file, args.validation_file, args.test_file = files.values()
    needed = {"train": args.do_train, "validation": args.do_eval, "test": args.do_test}
    for split, need in needed.items():
        if need and files[split] is None:
            raise runtime.UserError(f"--do_{'eval' if split == 'validation' else split} needs a {split} file "
                                    f"(--{split}_file, or --data_dir {args.data_dir or 'DIR'} holding one)"
                                    + (TEST_FOR_EVAL if split == "validation" and files["test"] is not None else ""))
    if args.do_train and files["validation"] is not None:
        needed["validation"] = True  # model selection uses the validation set, never the test set
    if tables is None:
        return Splits({split: read_examples(files[split], fmt=fmt, say=say) for split, need in needed.items() if need})
    Path(tables).mkdir(parents=True, exist_ok=True)
    return Splits({split: ExampleTable.write(iter_examples(files[split], fmt=fmt, say=say),
                                             Path(tables) / f"{split}.arrow", fmt, Path(files[split]))
                   for split, need in needed.items() if need})


def load_dataset_dict(name, config_name, cache_dir=None, token=None):
    """A DatasetDict from a save_to_disk directory (load_from_disk), or from datasets.load_dataset (a hub id, a
    directory of parquet/csv/json files); a single Dataset is the train split, as load_dataset names one file."""
    path = Path(name)
    saved = path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())
    if saved and config_name:
        raise runtime.UserError(f"--dataset_config_name {config_name}: {name} was written by save_to_disk, which has "
                                f"no configurations")
    scripts = sorted(path.glob("*.py")) if path.is_dir() and not saved else []
    if scripts:  # datasets 4 no longer runs loading scripts (a RuntimeError)
        raise runtime.UserError(f"--dataset_name {name}: holds a loading script ({scripts[0].name}), which datasets no "
                                f"longer runs; load the data with it once and save_to_disk, or convert it to "
                                f"parquet/csv/json files in that directory")
    try:
        loaded = (datasets.load_from_disk(str(path)) if saved else
                  datasets.load_dataset(name, config_name, cache_dir=cache_dir and str(cache_dir), token=token))
    except (OSError, ValueError, DatasetsError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise runtime.UserError(f"--dataset_name {name}: cannot load ({first}); a hub id needs the hub or its cache "
                                f"(--cache_dir), a local directory must be written by save_to_disk or hold "
                                f"parquet/csv/json files") from None
    return loaded if isinstance(loaded, DatasetDict) else DatasetDict(train=loaded)


def comma_list(text):
    """argparse type of a comma-separated list of names (--remove_splits unused,extra)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def removed_splits(dataset_dict, names, dataset_name):
    """`dataset_dict` without the splits of --remove_splits, each of which it must have (as run_classification.py's
    `pop` requires)."""
    missing = [name for name in names if name not in dataset_dict]
    if missing:
        raise runtime.UserError(f"--remove_splits {','.join(names)}: {dataset_name} has no split {missing[0]} (it has "
                                f"{', '.join(dataset_dict)})")
    return DatasetDict({key: split for key, split in dataset_dict.items() if key not in names})


def dataset_split(dataset_dict, role, chosen, name):
    """The DatasetDict key used as `role` ('train', 'validation', 'test'): --{role}_split_name, else the first of
    DATASET_SPLITS[role] the dataset has; None if it has none."""
    if chosen is not None and chosen not in dataset_dict:
        raise runtime.UserError(f"--{role}_split_name {chosen}: {name} has no such split (it has "
                                f"{', '.join(dataset_dict)})")
    return chosen or next((key for key in DATASET_SPLITS[role] if key in dataset_dict), None)


def _label_feature(dataset, fmt):
    """The label column's ClassLabel (also inside a list, for multi-label), or None."""
    feature = dataset.features.get(fmt.label_column)
    inner = getattr(feature, "feature", None)  # List(ClassLabel) and Sequence(ClassLabel)
    return feature if isinstance(feature, ClassLabel) else inner if isinstance(inner, ClassLabel) else None


def dataset_labels(dataset, fmt, where):
    """(label list, note) the dataset defines: a ClassLabel's names, or an integer column's values in numeric order;
    (None, None) for string labels and for regression. A float column without --do_regression: a UserError."""
    feature = dataset.features.get(fmt.label_column)
    dtype = getattr(feature, "dtype", None)
    class_label = _label_feature(dataset, fmt)
    if fmt.regression:
        if class_label is not None:
            raise runtime.UserError(f"{where}: column '{fmt.label_column}' is a ClassLabel (categories, not numbers); "
                                    f"drop --do_regression")
        return None, None
    if isinstance(feature, (datasets.List, datasets.LargeList)) and not fmt.multi_label:
        raise runtime.UserError(f"{where}: column '{fmt.label_column}' holds lists of labels: pass --multi_label")
    if class_label is not None:
        return list(class_label.names), (f"labels: the ClassLabel names of column '{fmt.label_column}', in the "
                                         f"dataset's order (ids as in the dataset)")
    if dtype in ("float16", "float32", "float64"):
        raise runtime.UserError(f"{where}: column '{fmt.label_column}' holds {dtype} numbers: pass --do_regression to "
                                f"predict them, or make them integer classes")
    if dtype is not None and dtype.startswith(("int", "uint")) and not fmt.multi_label:
        values = sorted(set(dataset[fmt.label_column]))
        return [str(v) for v in values], f"labels: the integers of column '{fmt.label_column}', in numeric order"
    return None, None


def dataset_examples(dataset, fmt, where, labelled=True):
    """The rows of one split as Examples (ClassLabel ids as their names); `where`: '<dataset> split <name>'."""
    columns = [column for column, _ in _columns(fmt, labelled)]
    missing = [f"'{column}' ({flag})" for column, flag in _columns(fmt, labelled) if column not in dataset.features]
    if missing:
        raise runtime.UserError(f"{where}: no column {', '.join(missing)}; it has {', '.join(dataset.features)}")
    rows = dataset.select_columns(columns).to_dict()  # {column: values}: one pass in C instead of a dict per row
    class_label = _label_feature(dataset, fmt) if labelled else None
    examples = []
    for index in range(len(dataset)):
        row = {column: rows[column][index] for column in columns}
        if class_label is not None:
            row[fmt.label_column] = _label_names(row[fmt.label_column], class_label, f"{where} row {index}")
        examples.append(_example(row, f"{where} row {index}", fmt, None, labelled))
    if not examples:
        raise runtime.UserError(f"{where}: no rows")
    return examples


def _label_names(ids, class_label, where):
    if isinstance(ids, list):
        return [_label_names(i, class_label, where) for i in ids]
    if ids is None or ids < 0:  # GLUE's test splits carry -1: no label
        raise runtime.UserError(f"{where}: label {ids} (no label; a test split without labels can only be predicted, "
                                f"with --do_predict)")
    return class_label.names[ids]


def read_dataset_splits(args):
    """--dataset_name's splits this run needs, as Examples, and its test split to predict without --predict_file; the
    text column resolved from the first one's columns (resolve_text_column)."""
    dataset_dict = load_dataset_dict(args.dataset_name, args.dataset_config_name, args.cache_dir, args.token)
    dataset_dict = removed_splits(dataset_dict, args.remove_splits, args.dataset_name)
    roles = {role: dataset_split(dataset_dict, role, getattr(args, f"{role}_split_name"), args.dataset_name)
             for role in DATASET_SPLITS}
    needed = {"train": args.do_train,  # model selection uses the validation split, never the test split
              "validation": args.do_eval or (args.do_train and roles["validation"] is not None), "test": args.do_test}
    for role, need in needed.items():
        if need and roles[role] is None:
            raise runtime.UserError(f"--do_{'eval' if role == 'validation' else role} needs a {role} split: "
                                    f"{args.dataset_name} has {', '.join(dataset_dict)} (--{role}_split_name NAME)"
                                    + (TEST_FOR_EVAL if role == "validation" and roles["test"] is not None else ""))
    if args.do_predict and not args.predict_file and roles["test"] is None:
        raise runtime.UserError(f"--do_predict needs --predict_file or a test split: {args.dataset_name} has "
                                f"{', '.join(dataset_dict)} (--test_split_name NAME)")
    where = {role: f"{args.dataset_name} split '{key}'" for role, key in roles.items()}
    first = next(role for role, need in needed.items() if need) if any(needed.values()) else "test"
    column_notes = []
    if roles[first] is not None:
        resolve_text_column(args, dataset_dict[roles[first]].column_names, where[first], column_notes.append)
    fmt = text_format(args)
    labels, labels_note = (dataset_labels(dataset_dict[roles["train"]], fmt, where["train"]) if needed["train"]
                           else (None, None))
    used = [f"{role} <- split '{roles[role]}' ({len(dataset_dict[roles[role]]):,} rows)"
            for role, need in needed.items() if need]
    if args.do_predict and not args.predict_file:
        used.append(f"predict <- split '{roles['test']}' (its labels unused)")
    splits = Splits({role: dataset_examples(dataset_dict[roles[role]], fmt, where[role])
                     for role, need in needed.items() if need}, labels,
                    [note for note in (*column_notes, f"--dataset_name {args.dataset_name}: {', '.join(used)}",
                                       labels_note) if note])
    if args.do_predict and not args.predict_file:
        splits.examples["predict"] = dataset_examples(dataset_dict[roles["test"]], fmt, where["test"], False)
    return splits


def select_examples(examples, args):
    """run_classification.py's quick-try cuts (--shuffle_train_dataset, then the first --max_*_samples); returns
    (examples, notes)."""
    limits = {"train": args.max_train_samples, "validation": args.max_eval_samples, "test": args.max_eval_samples,
              "predict": args.max_predict_samples}
    selected, notes = {}, []
    for split, items in examples.items():
        if split == "train" and args.shuffle_train_dataset:
            seed = SHUFFLE_SEED if args.shuffle_seed is None else args.shuffle_seed
            order = np.random.default_rng(seed).permutation(len(items))
            items = items.select(order) if isinstance(items, ExampleTable) else [items[i] for i in order]
        selected[split] = items[:limits[split]]
        if limits[split] is not None:
            notes.append(f"{split}: the first {len(selected[split]):,} of {len(items):,} examples"
                         + (" (after --shuffle_train_dataset)" if split == "train" and args.shuffle_train_dataset
                            else ""))
    return selected, notes


# add_dataset_args' flags (utils/checkpoint.py Role): the training split is in the training data's fingerprint, and
# the cuts and the shuffle decide which examples there are; the validation set may change (named: the best model so
# far was measured on the old one); the test and predict cuts concern this launch only
DATASET_ROLES = {**dict.fromkeys(("--dataset_name", "--dataset_config_name", "--train_split_name", "--remove_splits"),
                                 checkpoint.kept_by(checkpoint.DATA_KEY)),
                 "--validation_split_name": checkpoint.MAY_CHANGE, "--test_split_name": checkpoint.THIS_LAUNCH,
                 "--max_train_samples": checkpoint.MUST_KEEP, "--max_eval_samples": checkpoint.MUST_KEEP,
                 "--max_predict_samples": checkpoint.THIS_LAUNCH,
                 "--shuffle_train_dataset": checkpoint.MUST_KEEP, "--shuffle_seed": checkpoint.MUST_KEEP}


@checkpoint.roles_beside("DATASET_ROLES")
def add_dataset_args(group):
    """run_classification.py's dataset flags: a `datasets` dataset instead of files, and the quick-try cuts."""
    group.add_argument("--dataset_name", default=None,
                       help="instead of files: a hub id, or a local directory written by save_to_disk or holding "
                       "parquet/csv/json files (datasets.load_from_disk / load_dataset)")
    group.add_argument("--dataset_config_name", default=None, help="the hub dataset's configuration, e.g. stsb")
    for role, default in (("train", "train"), ("validation", "validation, dev, val or valid"), ("test", "test")):
        group.add_argument(f"--{role}_split_name", default=None,
                           help=f"the dataset's split used as {role} set; default: {default}")
    group.add_argument("--remove_splits", type=comma_list, default=(),
                       help="splits of the dataset to drop before the train/validation/test splits are chosen "
                       "(comma-separated; run_classification.py's), e.g. unused")
    group.add_argument("--max_train_samples", type=int, default=None,
                       help="train on the first N examples (labels still come from all of them)")
    group.add_argument("--max_eval_samples", type=int, default=None,
                       help="the first N examples of the validation and the test set")
    group.add_argument("--max_predict_samples", type=int, default=None, help="the first N texts to predict")
    group.add_argument("--shuffle_train_dataset", type=runtime.hf_bool, nargs="?", const=True, default=False,
                       help="shuffle the training examples once, before --max_train_samples")
    group.add_argument("--shuffle_seed", type=int, default=None,
                       help=f"with --shuffle_train_dataset; default {SHUFFLE_SEED}")


def check_dataset_args(args):
    """Flag combinations refused while parsing: two data sources, or a flag that would be ignored."""
    files = [f"--{name}" for name in ("data_dir", "train_file", "validation_file", "test_file")
             if getattr(args, name) is not None]
    if args.dataset_name and files:
        raise runtime.UserError(f"--dataset_name and {files[0]} are two sources of data: pass one")
    without_dataset = [f"--{name}" for name in ("dataset_config_name", "train_split_name", "validation_split_name",
                                                "test_split_name", "remove_splits") if getattr(args, name)]
    if without_dataset and not args.dataset_name:
        raise runtime.UserError(f"{without_dataset[0]} needs --dataset_name")
    for name, mode in (("max_train_samples", args.do_train), ("max_predict_samples", args.do_predict),
                       ("max_eval_samples", args.do_train or args.do_eval or args.do_test)):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise runtime.UserError(f"--{name} {value}: must be at least 1")
        if value is not None and not mode:
            raise runtime.UserError(f"--{name}: nothing of that kind is read in this run")
    if args.shuffle_seed is not None and not args.shuffle_train_dataset:
        raise runtime.UserError("--shuffle_seed needs --shuffle_train_dataset")
    if args.shuffle_train_dataset and args.shuffle_seed is None:  # the seed the shuffle uses, as checkpoints record it
        args.shuffle_seed = SHUFFLE_SEED
    # a --data_dir that does not exist is named by the data loading, in its own line
    test_split = args.test_file or args.dataset_name or (args.data_dir and (not Path(args.data_dir).is_dir()
                                                                            or find_split_file(args.data_dir, "test")))
    if args.do_predict and not (args.predict_file or test_split):
        raise runtime.UserError("--do_predict needs --predict_file, or a test split to predict "
                                "(run_classification.py's --test_file, --data_dir with a test file, --dataset_name)")


def read_labels_file(path, encoding="utf-8"):
    """Label names, one per line, in the order that defines their ids."""
    labels = [line.strip() for _, line in _decoded_lines(path, encoding) if line.strip()]
    if not labels:
        raise runtime.UserError(f"{path}: no labels (the file is empty)")
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise runtime.UserError(f"{path}: label(s) listed twice: {', '.join(duplicates)}")
    return labels


def build_label_list(train_examples, labels_file=None, encoding="utf-8"):
    """The labels file's order if given, else the sorted labels of `train_examples` (any iterable, one pass)."""
    if labels_file:
        labels = read_labels_file(labels_file, encoding)
        check_known_labels(train_examples, labels, source=str(labels_file))
        return labels
    first_seen = _first_seen(train_examples)
    _check_spellings(first_seen)
    return sorted(first_seen)


def _first_seen(examples):
    """{label: where it first appears}, in the order of first appearance."""
    if isinstance(examples, ExampleTable) and examples.first_seen is not None:
        return examples.first_seen  # taken as the file was read
    first_seen = {}
    for example in examples:
        for label in label_set(example):
            first_seen.setdefault(label, example.where)
    return first_seen


def check_label_spellings(examples):
    """A UserError for one number spelt two ways ('1', '1.0') among the labels, naming the first line of each."""
    _check_spellings(_first_seen(examples))


def _check_spellings(first_seen):
    by_number = {}
    for label, where in first_seen.items():
        number = _label_number(label)
        if number is not None and number in by_number:
            other, other_where = by_number[number]
            raise runtime.UserError(f"{other_where}: label '{other}' and {where}: label '{label}' are one number "
                                    f"written two ways and would be two classes; write it one way (or, if they are "
                                    f"different classes, list both in --labels_file)")
        if number is not None:
            by_number[number] = (label, where)


def _label_number(label):
    """The number a label spells ('1', '1.0', '1e0'; 'true' and 'false' as JSON writes booleans: 1 and 0), or None."""
    if label.lower() in ("true", "false"):
        return float(label.lower() == "true")
    try:
        number = float(label)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def check_known_labels(examples, labels, source="the train file"):
    """Every label must be one the model can predict; name the first line that is not."""
    known = set(labels)
    for label, where in _first_seen(examples).items():  # the first line with an unknown label
        if label not in known:
            raise runtime.UserError(f"{where}: label '{label}' is not in {source}")


def write_labels_file(labels, path):
    Path(path).write_text("".join(f"{label}\n" for label in labels), encoding="utf-8")

CUDA_PAD_MULTIPLE = 8

COMPILE_PAD_MULTIPLE = 32  # at 512 tokens: at most 16 lengths per batch size to compile; at 64 tokens: 2


# add_padding_args' flags (utils/checkpoint.py Role): padding never enters a per-sample loss
PADDING_ROLES = checkpoint.this_launch("--pad_to_multiple_of", "--pad_to_max_length")


@checkpoint.roles_beside("PADDING_ROLES")
def add_padding_args(group):
    padding = group.add_mutually_exclusive_group()
    padding.add_argument("--pad_to_multiple_of", type=runtime.positive_int, default=None,
                         help=f"tokens; default: none on CPU, {CUDA_PAD_MULTIPLE} on CUDA, "
                         f"{COMPILE_PAD_MULTIPLE} under torch.compile (bounds the shapes it compiles)")
    padding.add_argument("--pad_to_max_length", action="store_true",
                         help="pad every batch to --max_seq_len (one shape; most padding)")


TRUNCATION = ("head", "tail", "head_tail")
POOLING = ("mean", "max")
# the cut changes the training inputs (a resume keeps it); the pooling, an evaluation's, may change; the export records
# what applies, so an evaluation of the model cuts and pools as its training did (the defaults: where none is
# recorded; --head_tokens': resolve_head_tokens, from --max_seq_len)
LONG_TEXT_ROLES = {"--truncation": checkpoint.MUST_KEEP.recorded("head"),
                   "--head_tokens": checkpoint.MUST_KEEP.recorded(None, only_with="truncation=head_tail"),
                   "--doc_stride": checkpoint.MUST_KEEP.recorded(None),
                   "--pool": checkpoint.MAY_CHANGE.recorded("mean", only_with="doc_stride")}


@checkpoint.roles_beside("LONG_TEXT_ROLES")
def add_long_text_args(group):
    group.add_argument("--truncation", choices=TRUNCATION, default=None,
                       help="which tokens of a text longer than --max_seq_len are kept: the first (head), the last "
                       "(tail), or --head_tokens first and the rest last (head_tail) (default: head; without "
                       "--do_train: the model's)")
    group.add_argument("--head_tokens", type=runtime.positive_int, default=None,
                       help="--truncation head_tail: tokens kept from the head (default: a quarter of --max_seq_len's "
                       "text tokens, as Sun et al. 2019's 128 of 510; without --do_train: the model's)")
    group.add_argument("--doc_stride", type=runtime.nonnegative_int, default=None,
                       help="tokens: a longer text becomes windows of --max_seq_len tokens overlapping by this many; "
                       "each window trains with its text's label, evaluation and prediction pool a text's windows "
                       "(--pool) (default: no windows; without --do_train: the model's)")
    group.add_argument("--pool", choices=POOLING, default=None,
                       help="--doc_stride: a text's logits from its windows': their mean or maximum (default: mean)")


@dataclass(frozen=True)
class LongText:
    """How a text longer than max_seq_len tokens is cut (the module header)."""
    truncation: str = "head"
    head_tokens: int = 128  # head_tail: tokens from the head
    doc_stride: int | None = None  # windows overlapping by this many tokens; None: one cut text
    pool: str = "mean"

    def describe(self):
        if self.doc_stride is not None:
            return f"windows overlapping by {self.doc_stride} tokens, logits pooled by {self.pool}"
        return {"head": "the first tokens", "tail": "the last tokens",
                "head_tail": f"the first {self.head_tokens} tokens and the last ones"}[self.truncation]


def default_head_tokens(max_seq_len):
    """--head_tokens' default: a quarter of the text tokens of `max_seq_len` (all but [CLS] and [SEP]), rounded up:
    128 of 510 at 512, Sun et al.'s head; the rest, the tail, is three quarters."""
    return math.ceil((max_seq_len - 2) / 4)


def resolve_head_tokens(args, say=print):
    """--head_tokens where neither the command line nor the trained model gives one: with --truncation head_tail
    default_head_tokens (said once), else LongText's 128 (docs/code.md#text_datapy)."""
    if args.head_tokens is not None:
        return
    if args.truncation != "head_tail":
        args.head_tokens = LongText.head_tokens
        return
    args.head_tokens = default_head_tokens(args.max_seq_len)
    room = args.max_seq_len - 2
    if args.head_tokens < room:
        say(f"--head_tokens {args.head_tokens}: --truncation head_tail keeps the first {args.head_tokens} and the last "
            f"{room - args.head_tokens} of the {room} text tokens of --max_seq_len {args.max_seq_len} (a quarter from "
            f"the head, as Sun et al.'s 128 of 510)")


def long_text(args, max_seq_len, paired):
    """The LongText of the resolved flags, checked against max_seq_len and the data (one line each)."""
    settings = LongText(args.truncation, args.head_tokens, args.doc_stride, args.pool)
    if settings.doc_stride is not None and settings.truncation != "head":
        raise runtime.UserError(f"--doc_stride {settings.doc_stride} keeps every token in windows: --truncation "
                                f"{settings.truncation} has nothing to cut; pass one of them")
    if paired and settings != LongText(pool=settings.pool, head_tokens=settings.head_tokens):
        raise runtime.UserError("--truncation tail/head_tail and --doc_stride cut single texts; sentence pairs are cut "
                                "longest_first (the longer one loses tokens)")
    if settings.doc_stride is not None and settings.doc_stride >= max_seq_len - 2:
        raise runtime.UserError(f"--doc_stride {settings.doc_stride}: windows of --max_seq_len {max_seq_len} tokens "
                                f"hold {max_seq_len - 2} text tokens; the overlap must be smaller")
    if settings.truncation == "head_tail" and max_seq_len - 2 < 2:
        raise runtime.UserError(f"--truncation head_tail: --max_seq_len {max_seq_len} holds {max_seq_len - 2} text "
                                f"tokens; a head and a tail need 2 or more")
    if settings.truncation == "head_tail" and settings.head_tokens >= max_seq_len - 2:
        raise runtime.UserError(f"--head_tokens {settings.head_tokens}: --max_seq_len {max_seq_len} holds "
                                f"{max_seq_len - 2} text tokens; leave some for the tail")
    return settings


def default_pad_multiple(device_type, compiled):
    """The padding multiple for a device when the user did not choose one (None: pad to the longest text)."""
    if compiled:
        return COMPILE_PAD_MULTIPLE
    return CUDA_PAD_MULTIPLE if device_type == "cuda" else None


def resolve_padding(args, accelerator):
    """{"pad_to_multiple_of": N or None, "pad_to_max_length": bool} for this run, recorded with its results."""
    if args.pad_to_multiple_of is not None and args.pad_to_multiple_of < 1:
        raise runtime.UserError(f"--pad_to_multiple_of {args.pad_to_multiple_of}: must be a positive number of tokens")
    compiled = accelerator.state.dynamo_plugin.backend != DynamoBackend.NO
    multiple = args.pad_to_multiple_of
    if multiple is None and not args.pad_to_max_length:
        multiple = default_pad_multiple(accelerator.device.type, compiled)
    return {"pad_to_multiple_of": multiple, "pad_to_max_length": args.pad_to_max_length}


def build_collator(tokenizer, max_seq_len, pad_to_multiple_of=None, pad_to_max_length=False):
    if pad_to_max_length:
        return DataCollatorWithPadding(tokenizer, padding="max_length", max_length=max_seq_len)
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)


def label_targets(examples, labels, multi_label, regression=False):
    """Class ids, multi-hot float rows (multi-label) or the numbers (regression), in the id order of `labels`; for an
    ExampleTable, the function that makes them from a batch of its labels."""
    label2id = {label: i for i, label in enumerate(labels)}

    def targets(values):
        if regression:
            return [float(value) for value in values]
        if not multi_label:
            return [label2id[value] for value in values]
        rows = []
        for value in values:
            row = [0.0] * len(labels)
            for label in value:
                row[label2id[label]] = 1.0
            rows.append(row)
        return rows
    return targets if isinstance(examples, ExampleTable) else targets([e.label for e in examples])


def tokenize(tokenizer, texts, targets, max_seq_len, text_pairs=None, cut=LongText(), keep_doc=False,
             cache_file=None):
    """`tokenize_columns` of texts (and sentence pairs) and their targets held in lists."""
    columns = {"text": list(texts), **({"text_pair": list(text_pairs)} if text_pairs is not None else {}),
               **({"labels": targets} if targets is not None else {})}
    return tokenize_columns(tokenizer, Dataset.from_dict(columns), max_seq_len, cut, keep_doc, cache_file)


def tokenize_columns(tokenizer, dataset, max_seq_len, cut=LongText(), keep_doc=False, cache_file=None):
    """`dataset` (columns text, text_pair, labels) tokenised into `cache_file` (else in memory), a text cut as `cut`
    says; `keep_doc`: each window's text index in a `doc` column (docs/code.md#text_datapy)."""
    if cut.doc_stride is not None:
        return tokenize_windows(tokenizer, dataset, max_seq_len, cut.doc_stride, keep_doc, cache_file)
    if cut.truncation != "head":
        return tokenize_cut(tokenizer, dataset, max_seq_len, cut, cache_file)
    paired = "text_pair" in dataset.column_names

    def encode(batch):
        pair = batch["text_pair"] if paired else None
        return tokenizer(batch["text"], pair, truncation="longest_first", max_length=max_seq_len)

    return dataset.map(encode, batched=True, batch_size=1000,
                       remove_columns=[c for c in dataset.column_names if c != "labels"],
                       cache_file_name=cache_file and str(cache_file))


def tokenize_windows(tokenizer, dataset, max_seq_len, doc_stride, keep_doc, cache_file=None):
    """Each text as windows of max_seq_len tokens overlapping by doc_stride ([CLS] and [SEP] in each), with the
    text's label (and its index as `doc` if keep_doc)."""
    check_windows_cover(tokenizer, max_seq_len, doc_stride)

    def encode(batch, indices):
        encoded = tokenizer(batch["text"], truncation=True, max_length=max_seq_len, stride=doc_stride,
                            return_overflowing_tokens=True)
        texts_of_windows = encoded.pop("overflow_to_sample_mapping")  # the batch position of each window's text
        columns = {"doc": indices if keep_doc else None, "labels": batch.get("labels")}
        return {**encoded, **{name: [values[i] for i in texts_of_windows] for name, values in columns.items()
                              if values is not None}}

    return dataset.map(encode, batched=True, batch_size=1000, with_indices=True, remove_columns=dataset.column_names,
                       cache_file_name=cache_file and str(cache_file))


def check_windows_cover(tokenizer, max_seq_len, doc_stride):
    """A UserError where the tokenizer's windows drop tokens of a long text (docs/code.md#text_datapy)."""
    probe = " ".join(["a"] * 3 * max_seq_len)
    whole = len(tokenizer(probe, add_special_tokens=False)["input_ids"])
    windows = tokenizer([probe], truncation=True, max_length=max_seq_len, stride=doc_stride,
                        return_overflowing_tokens=True)["input_ids"]  # a batch, as tokenize_windows calls it
    covered = sum(len(w) - tokenizer.num_special_tokens_to_add() for w in windows) - doc_stride * (len(windows) - 1)
    if covered != whole:
        raise runtime.UserError(f"--doc_stride: this tokenizer's windows hold {covered} of a {whole}-token text "
                                f"({len(windows)} windows, tokenizers {tokenizers.__version__}; 0.23.2 stops after "
                                f"two): pip install 'tokenizers>=0.23.3'")


def tokenize_cut(tokenizer, dataset, max_seq_len, cut, cache_file=None):
    """Each text's tail, or its head and tail, in max_seq_len tokens with [CLS] and [SEP] (the tokenizer's ids)."""
    if tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise runtime.UserError(f"--truncation {cut.truncation}: the tokenizer has no [CLS]/[SEP] tokens to frame the "
                                f"kept tokens with; use --truncation head or --doc_stride")
    room = max_seq_len - 2
    head = cut.head_tokens if cut.truncation == "head_tail" else 0

    def encode(batch):
        # every token first (verbose=False: the "longer than the maximum" warning is what the cut handles)
        tokens = tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]
        kept = [ids if len(ids) <= room else ids[:head] + ids[len(ids) - (room - head):] for ids in tokens]
        input_ids = [[tokenizer.cls_token_id, *ids, tokenizer.sep_token_id] for ids in kept]
        return {"input_ids": input_ids, "token_type_ids": [[0] * len(ids) for ids in input_ids],
                "attention_mask": [[1] * len(ids) for ids in input_ids]}

    return dataset.map(encode, batched=True, batch_size=1000,
                       remove_columns=[c for c in dataset.column_names if c != "labels"],
                       cache_file_name=cache_file and str(cache_file))


def tokenize_examples(tokenizer, examples, targets, max_seq_len, cut=LongText(), keep_doc=False, cache_file=None):
    """`tokenize` for Examples: texts, and sentence pairs when the examples have them. An ExampleTable is tokenised
    from its columns, with `targets` (label_targets' for a table) applied to its labels a batch at a time."""
    if isinstance(examples, ExampleTable):
        return tokenize_columns(tokenizer, examples.columns(targets), max_seq_len, cut, keep_doc, cache_file)
    pairs = [e.text_pair for e in examples] if examples[0].text_pair is not None else None
    return tokenize(tokenizer, [e.text for e in examples], targets, max_seq_len, pairs, cut, keep_doc, cache_file)


def fingerprint_examples(path, examples):
    """The training file's fingerprint for its checkpoints (utils/checkpoint.py data_fingerprint): its examples as
    read (text, pair, labels), in order; None without training examples."""
    if examples is None:
        return None
    if isinstance(examples, ExampleTable) and examples.fingerprint is not None:
        return examples.fingerprint.result(path)  # taken as the file was read
    return checkpoint.data_fingerprint(path, map(example_record, examples))


_RECORD = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps' output, without its per-call set-up


def example_record(example):
    """An example as its training file's fingerprint hashes it: [text, text_pair, label] in JSON."""
    return _RECORD([example.text, example.text_pair, example.label])


def token_lengths(dataset):
    """Tokens per sample (N,), for length-grouped batching: counted by Arrow, without a Python list per text."""
    return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_numpy()


@dataclass
class TextData:
    """The data a run trains and evaluates on: the label list, the tokenised splits ({"train"|"validation"|"test":
    Dataset}, memory-mapped from the data cache for files), and what was learnt while reading them."""
    labels: list[str]
    datasets: dict
    first_text: list  # [text, text_pair or None] of the first validation (else training) example, for the model card
    unk_rate: float | None  # [UNK] tokens among the training text's tokens; None without training data
    fingerprint: dict | None  # the training data's, for the checkpoints (utils/checkpoint.py data_fingerprint)
    notes: list[str] = field(default_factory=list)  # said while reading (a header row skipped, the cuts)
    predict: list | None = None  # --do_predict's records (Examples, blank lines marked `skipped`), in input order

    def meta(self):
        """What the data cache keeps beside the Arrow files (utils/text_cache.py)."""
        return {"labels": self.labels, "splits": list(self.datasets), "first_text": self.first_text,
                "unk_rate": self.unk_rate, "fingerprint": self.fingerprint, "notes": self.notes}

MEGABATCH_BATCHES = 50  # transformers' choice: large enough to group well, small enough to stay random


class LengthGroupedSampler(Sampler):
    def __init__(self, lengths, batch_size, seed, megabatch_batches=MEGABATCH_BATCHES):
        self.lengths = torch.tensor(lengths)  # a copy: token_lengths() gives Arrow's read-only array
        self.batch_size = batch_size  # the GLOBAL batch size of the DataLoader that batches these indices
        self.seed = seed
        self.megabatch = batch_size * megabatch_batches
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.lengths)

    def batches(self):
        """The epoch's batches of indices; only the last one may be short, as in an unshuffled DataLoader."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator)
        grouped = []
        for megabatch in order.split(self.megabatch):
            # stable sort, longest first: ties keep the shuffled order
            by_length = torch.sort(self.lengths[megabatch], descending=True, stable=True).indices
            grouped.append(megabatch[by_length])
        batches = list(torch.cat(grouped).split(self.batch_size))
        short = batches.pop() if len(batches[-1]) < self.batch_size else None
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator)]
        return [b.tolist() for b in batches] + ([short.tolist()] if short is not None else [])

    def __iter__(self):
        for batch in self.batches():
            yield from batch
