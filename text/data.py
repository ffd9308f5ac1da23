"""The text classifier's data: reading labelled text files, the label list, tokenising once, padding per batch,
and the length-grouped training order.

Files: cnews `label<TAB>text` (.txt/.tsv), CSV and JSON (lines or one array) with named columns (`TextFormat`):
one text or a sentence pair (LCQMC, AFQMC, OCNLI), one label or several (multi-label, separated by
`label_separator`), in any ASCII-compatible encoding. Every problem is a UserError that names the file and the
line, so a bad line in a 50k-line file is found in seconds instead of surfacing as a shape error three layers down.

Padding is chosen per device, because it only pays where the hardware wants it:
- CPU: none beyond the longest text of the batch (a multiple of 8 only adds tokens: up to a quarter more work on
  ~25-token headlines);
- CUDA: multiples of 8 (tensor-core friendly shapes);
- under torch.compile (the launcher's dynamo backend): multiples of COMPILE_PAD_MULTIPLE, so the compiler sees a
  bounded number of sequence lengths instead of recompiling for each new one.
`--pad_to_multiple_of N` and `--pad_to_max_length` override it.

Length-grouped order (`--group_by_length`, `LengthGroupedSampler`): transformers' idea (megabatches of 50 batches,
each sorted by length), made to fit this project's exactness rules:
- The order is a pure function of (seed, epoch): `set_epoch` is called by the prepared loader (Accelerate's
  seedable-sampler recipe), every process computes the same order, and `skip_first_batches` on resume skips
  exactly the batches already trained.
- It is a sampler of indices, batched by the DataLoader with the GLOBAL batch size (split_batches=True): a global
  batch is the same set of samples on any number of processes; each process then takes its consecutive slice of
  that batch (the longer half on rank 0), so per-process padding stays tight.
A batch then holds samples of similar length drawn from one megabatch (50 global batches of the shuffled data)
instead of a uniform random draw; the batches' order is shuffled again, so long and short batches alternate.

The training file's fingerprint (`fingerprint_examples`: the examples as read, hashed in order) goes into every
checkpoint, so that a resume on changed data is refused (common/checkpoint.py).

Neighbours: text/model.py (the model and tokenizer), text/metrics.py (loss, metrics, predictions).
"""
import codecs
import csv
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import DynamoBackend
from datasets import Dataset
from torch.utils.data import Sampler
from transformers import DataCollatorWithPadding

from common.checkpoint import data_fingerprint
from common.runtime import UserError, positive_int

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
    label: str | tuple[str, ...] | None  # a tuple of labels when multi-label; None for unlabelled prediction inputs
    where: str  # "path:line", for error messages
    text_pair: str | None = None  # the second sentence of a pair


@dataclass(frozen=True)
class TextFormat:
    """How the user's files are laid out (the --text_column/--text_pair_column/--label_column/... flags)."""
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    label_separator: str | None = None  # set: multi-label, the label field holds several labels
    encoding: str = "utf-8"

    @property
    def multi_label(self):
        return self.label_separator is not None

DEFAULT_FORMAT = TextFormat()


def add_text_format_args(group):
    """The flags of `TextFormat` (transformers' run_classification names where it has them)."""
    group.add_argument("--text_column", default="text", help="csv/json field of the text")
    group.add_argument("--text_pair_column", default=None,
                       help="csv/json field of the second sentence: a sentence-pair task (LCQMC, AFQMC, OCNLI)")
    group.add_argument("--label_column", default="label", help="csv/json field of the label(s)")
    group.add_argument("--multi_label", action="store_true", default=None,
                       help="several labels per text (sigmoid + binary cross-entropy); evaluating a trained model: "
                            "its own label mode")
    group.add_argument("--label_separator", default=",", help="with --multi_label: between labels in a label field")
    group.add_argument("--threshold", type=float, default=None,
                       help="with --multi_label: probability from which a label is predicted (default: 0.5; "
                            "evaluating a trained model: the model's)")
    group.add_argument("--encoding", default="utf-8", help="of every input file, e.g. gb18030 (GBK), big5")


def text_format(args):
    check_encoding(args.encoding)
    if args.multi_label and not args.label_separator:
        raise UserError("--label_separator: must not be empty")
    return TextFormat(args.text_column, args.text_pair_column, args.label_column,
                      args.label_separator if args.multi_label else None, args.encoding)


def label_set(example):
    """The labels of an example as a tuple (one for single-label)."""
    return example.label if isinstance(example.label, tuple) else (example.label,)


def find_split_file(data_dir, split):
    """The file for `split` in a cnews-style directory, or None."""
    for name in SPLIT_NAMES[split]:
        path = Path(data_dir) / name
        if path.is_file():
            return path
    return None


def check_encoding(encoding):
    """A known codec in which a newline is the byte 0x0A (lines are split before decoding, to name the bad line)."""
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        raise UserError(f"--encoding {encoding}: unknown encoding (e.g. utf-8, gb18030, big5)") from None
    if "\n".encode(name) != b"\n":
        raise UserError(f"--encoding {encoding}: not supported (lines must end in a 0x0A byte; convert the file "
                        "to utf-8 or gb18030)")
    return name


def _decoded_lines(path, encoding="utf-8"):
    """Yield (line_number, line) with the trailing newline removed; undecodable bytes name their line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: file not found")
    codec = check_encoding(encoding)
    utf8 = codec == "utf-8"
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if utf8 and number == 1 else codec)
            except UnicodeDecodeError as err:
                hint = ("; pass --encoding gb18030 for GBK/GB2312 files, --encoding big5 for Big5" if utf8 else
                        "; pass the file's real --encoding")
                raise UserError(f"{path}:{number}: not valid {'UTF-8' if utf8 else encoding} "
                                f"({err.reason} at byte {err.start}){hint}") from None
            yield number, line.rstrip("\r\n")


def _check_text(text, where):
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"{where}: empty text")
    return text.strip()


def _check_label(label, where, fmt=DEFAULT_FORMAT):
    """One label, or with multi-label a sorted tuple of labels (a JSON list, or a field split on the separator).

    An empty multi-label field is an example with none of the labels, as in most multi-label corpora."""
    if fmt.multi_label:
        if label is None:
            raise UserError(f"{where}: no label field")
        parts = label if isinstance(label, list) else str(label).split(fmt.label_separator)
        return tuple(sorted({str(part).strip() for part in parts if str(part).strip()}))
    if label is None or not str(label).strip():
        raise UserError(f"{where}: empty label")
    return str(label).strip()


def _read_tab_separated(path, fmt=DEFAULT_FORMAT):
    if fmt.text_pair_column:
        raise UserError(f"{path}: sentence pairs need a .csv or .json(l) file with named columns; "
                        ".txt/.tsv files are 'label<TAB>text'")
    for number, line in _decoded_lines(path, fmt.encoding):
        if not line.strip():
            continue  # blank lines (often a trailing one) carry nothing
        where = f"{path}:{number}"
        if "\t" not in line:
            raise UserError(f"{where}: expected 'label<TAB>text', found no TAB")
        label, text = line.split("\t", 1)
        yield Example(_check_text(text, where), _check_label(label, where, fmt), where)


def _columns(fmt, labelled):
    """(field, flag) pairs a row must have."""
    columns = [(fmt.text_column, "--text_column")]
    if fmt.text_pair_column:
        columns.append((fmt.text_pair_column, "--text_pair_column"))
    if labelled:
        columns.append((fmt.label_column, "--label_column"))
    return columns


def _example(row, where, fmt, labelled):
    for column, flag in _columns(fmt, labelled):
        if column not in row:
            raise UserError(f"{where}: no field '{column}' ({flag})")
    label = _check_label(row[fmt.label_column], where, fmt) if labelled else None
    pair = _check_text(row[fmt.text_pair_column], where) if fmt.text_pair_column else None
    return Example(_check_text(row[fmt.text_column], where), label, where, pair)


def _read_csv(path, labelled, fmt=DEFAULT_FORMAT):
    lines = (line for _, line in _decoded_lines(path, fmt.encoding))
    reader = csv.DictReader(lines)
    missing = [f"{column} ({flag})" for column, flag in _columns(fmt, labelled)
               if column not in (reader.fieldnames or [])]
    if missing:
        raise UserError(f"{path}:1: header lacks column(s) {', '.join(missing)}")
    for row in reader:
        yield _example({k: v for k, v in row.items() if v is not None}, f"{path}:{reader.line_num}", fmt, labelled)


def _read_json(path, labelled, fmt=DEFAULT_FORMAT):
    numbered = list(_decoded_lines(path, fmt.encoding))
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
            fields = " and ".join(f"'{column}'" for column, _ in _columns(fmt, labelled))
            raise UserError(f"{where}: expected an object with {fields}")
        yield _example(row, where, fmt, labelled)


def read_examples(path, labelled=True, fmt=DEFAULT_FORMAT):
    """All examples of a labelled file (.txt/.tsv label TAB text, .csv or .json/.jsonl with the `fmt` columns)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        examples = list(_read_tab_separated(path, fmt))
    elif suffix in CSV_SUFFIXES:
        examples = list(_read_csv(path, labelled, fmt))
    elif suffix in JSON_SUFFIXES:
        examples = list(_read_json(path, labelled, fmt))
    else:
        raise UserError(f"{path}: unsupported file type '{suffix}' (use .txt/.tsv, .csv, .json or .jsonl)")
    if not examples:
        raise UserError(f"{path}: no examples (the file is empty)")
    return examples


def read_unlabelled(path, fmt=DEFAULT_FORMAT):
    """Examples to predict: one text per line, or JSON lines/CSV with the `fmt` text (and pair) columns."""
    path = Path(path)
    if path.suffix.lower() in CSV_SUFFIXES | JSON_SUFFIXES:
        return read_examples(path, labelled=False, fmt=fmt)
    if fmt.text_pair_column:
        raise UserError(f"{path}: sentence pairs to predict need a .csv or .json(l) file with named columns")
    examples = [
        Example(_check_text(line, f"{path}:{number}"), None, f"{path}:{number}")
        for number, line in _decoded_lines(path, fmt.encoding)
        if line.strip()
    ]
    if not examples:
        raise UserError(f"{path}: no texts (the file is empty)")
    return examples


def read_labels_file(path, encoding="utf-8"):
    """Label names, one per line, in the order that defines their ids."""
    labels = [line.strip() for _, line in _decoded_lines(path, encoding) if line.strip()]
    if not labels:
        raise UserError(f"{path}: no labels (the file is empty)")
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise UserError(f"{path}: label(s) listed twice: {', '.join(duplicates)}")
    return labels


def build_label_list(train_examples, labels_file=None, encoding="utf-8"):
    """Deterministic label order: the labels file if given, else the sorted labels of the train file.

    (The reference built it from a Python set, so ids changed between runs.)
    """
    if labels_file:
        labels = read_labels_file(labels_file, encoding)
        check_known_labels(train_examples, labels, source=str(labels_file))
        return labels
    return sorted({label for example in train_examples for label in label_set(example)})


def check_known_labels(examples, labels, source="the train file"):
    """Every label must be one the model can predict; name the first line that is not."""
    known = set(labels)
    for example in examples:
        for label in label_set(example):
            if label not in known:
                raise UserError(f"{example.where}: label '{label}' is not in {source}")


def write_labels_file(labels, path):
    Path(path).write_text("".join(f"{label}\n" for label in labels), encoding="utf-8")

CUDA_PAD_MULTIPLE = 8

COMPILE_PAD_MULTIPLE = 32  # at 512 tokens: at most 16 lengths per batch size to compile; at 64 tokens: 2


def add_padding_args(group):
    padding = group.add_mutually_exclusive_group()
    padding.add_argument("--pad_to_multiple_of", type=positive_int, default=None,
                         help=f"tokens; default: none on CPU, {CUDA_PAD_MULTIPLE} on CUDA, "
                              f"{COMPILE_PAD_MULTIPLE} under torch.compile (bounds the shapes it compiles)")
    padding.add_argument("--pad_to_max_length", action="store_true",
                         help="pad every batch to --max_seq_len (one shape; most padding)")


def default_pad_multiple(device_type, compiled):
    """The padding multiple for a device when the user did not choose one (None: pad to the longest text)."""
    if compiled:
        return COMPILE_PAD_MULTIPLE
    return CUDA_PAD_MULTIPLE if device_type == "cuda" else None


def resolve_padding(args, accelerator):
    """{"pad_to_multiple_of": N or None, "pad_to_max_length": bool} for this run, recorded with its results."""
    if args.pad_to_multiple_of is not None and args.pad_to_multiple_of < 1:
        raise UserError(f"--pad_to_multiple_of {args.pad_to_multiple_of}: must be a positive number of tokens")
    compiled = accelerator.state.dynamo_plugin.backend != DynamoBackend.NO
    multiple = args.pad_to_multiple_of
    if multiple is None and not args.pad_to_max_length:
        multiple = default_pad_multiple(accelerator.device.type, compiled)
    return {"pad_to_multiple_of": multiple, "pad_to_max_length": args.pad_to_max_length}


def build_collator(tokenizer, max_seq_len, pad_to_multiple_of=None, pad_to_max_length=False):
    if pad_to_max_length:
        return DataCollatorWithPadding(tokenizer, padding="max_length", max_length=max_seq_len)
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)


def label_targets(examples, labels, multi_label):
    """Class ids (single-label) or multi-hot float rows (multi-label) in the id order of `labels`."""
    label2id = {label: i for i, label in enumerate(labels)}
    if not multi_label:
        return [label2id[e.label] for e in examples]
    targets = []
    for example in examples:
        row = [0.0] * len(labels)
        for label in label_set(example):
            row[label2id[label]] = 1.0
        targets.append(row)
    return targets


def tokenize(tokenizer, texts, targets, max_seq_len, text_pairs=None):
    """Tokenise once, batched with the fast tokenizer; padding happens per batch in the collator.

    A sentence pair becomes the tokenizer's pair encoding ([CLS] a [SEP] b [SEP], token_type_ids 0/1), truncated
    longest_first: the longer sentence loses tokens first, so a short question keeps all of its words."""
    columns = {"text": list(texts)}
    paired = text_pairs is not None
    if paired:
        columns["text_pair"] = list(text_pairs)
    if targets is not None:
        columns["labels"] = targets

    def encode(batch):
        pair = batch["text_pair"] if paired else None
        return tokenizer(batch["text"], pair, truncation="longest_first", max_length=max_seq_len)

    dataset = Dataset.from_dict(columns)
    return dataset.map(encode, batched=True, batch_size=1000, remove_columns=[c for c in columns if c != "labels"])


def tokenize_examples(tokenizer, examples, targets, max_seq_len):
    """`tokenize` for Examples: texts, and sentence pairs when the examples have them."""
    pairs = [e.text_pair for e in examples] if examples[0].text_pair is not None else None
    return tokenize(tokenizer, [e.text for e in examples], targets, max_seq_len, pairs)


def fingerprint_examples(path, examples):
    """The training file's fingerprint for its checkpoints (common/checkpoint.py data_fingerprint): its examples as
    read (text, pair, labels), in order; None without training examples."""
    if examples is None:
        return None
    return data_fingerprint(path, (json.dumps([e.text, e.text_pair, e.label], ensure_ascii=False) for e in examples))


def token_lengths(dataset):
    """Tokens per sample, for length-grouped batching."""
    return [len(ids) for ids in dataset["input_ids"]]

MEGABATCH_BATCHES = 50  # transformers' choice: large enough to group well, small enough to stay random


class LengthGroupedSampler(Sampler):
    def __init__(self, lengths, batch_size, seed, megabatch_batches=MEGABATCH_BATCHES):
        self.lengths = torch.as_tensor(lengths)
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
