"""Tokenising examples once and padding them per batch: how many tokens each step really computes.

Padding is chosen per device, because it only pays where the hardware wants it:
- CPU: none beyond the longest text of the batch (a multiple of 8 only adds tokens: up to a quarter more work on
  ~25-token headlines);
- CUDA: multiples of 8 (tensor-core friendly shapes);
- under torch.compile (the launcher's dynamo backend): multiples of COMPILE_PAD_MULTIPLE, so the compiler sees a
  bounded number of sequence lengths instead of recompiling for each new one.
`--pad_to_multiple_of N` and `--pad_to_max_length` override it.
"""
from accelerate.utils import DynamoBackend
from datasets import Dataset
from transformers import DataCollatorWithPadding

from .errors import UserError
from .text_data import label_set

CUDA_PAD_MULTIPLE = 8
COMPILE_PAD_MULTIPLE = 32  # at 512 tokens: at most 16 lengths per batch size to compile; at 64 tokens: 2


def add_padding_args(group):
    padding = group.add_mutually_exclusive_group()
    padding.add_argument("--pad_to_multiple_of", type=int, default=None,
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


def token_lengths(dataset):
    """Tokens per sample, for length-grouped batching."""
    return [len(ids) for ids in dataset["input_ids"]]
