"""Chinese news classification with BERT (the cnews example) on Hugging Face Accelerate.

One code path for CPU, one GPU, N GPUs and N machines; the hardware is chosen by the launcher:
    python train_bert_cls.py --data_dir data/cnews --model_name_or_path hfl/chinese-bert-wwm-ext \
        --do_train --do_eval --do_test --output_dir outputs/cnews
    accelerate launch --config_file accelerate_configs/4gpu.yaml train_bert_cls.py --data_dir data/cnews \
        --model_name_or_path hfl/chinese-bert-wwm-ext --do_train --do_eval --do_test --output_dir outputs/cnews
A tiny CPU run, from scratch on generated headlines in the cnews format (2 processes of gloo DDP; the test suite
runs these two commands as printed and expects a test accuracy above 0.85, chance being 0.1; its one epoch of 63 steps
reaches about 0.92):
    python -c "from utils.demo_data import write_text_classification_data as w; w('demo_data/bert_tiny')"
    OMP_NUM_THREADS=1 accelerate launch --config_file accelerate_configs/cpu_ddp.yaml train_bert_cls.py --cpu \
        --data_dir demo_data/bert_tiny --model_name_or_path demo_data/bert_tiny/model --from_scratch \
        --config_overrides num_hidden_layers=2,hidden_size=128,num_attention_heads=2,intermediate_size=512 \
        --max_seq_len 64 --learning_rate 2e-3 --num_train_epochs 1 --do_train --do_eval --do_test \
        --output_dir outputs/bert_tiny --overwrite_output_dir
Sentence pairs, multi-label, regression, `datasets` datasets, other encodings: docs/bert_data_formats.md;
checkpoints, compile, --metric: docs/bert_checkpoints_and_compile.md; run_classification.py's flags: docs/bert.md.
Batch sizes are GLOBAL: the same command trains the same way on any number of processes.
To adapt it (another model or head, a loss term, the tokenisation, other numbers from the evaluation), change the
functions of its ADAPTATION SECTION, right below the imports: nothing else names the model class, the loss or a
metric's computation.
"""
import argparse
import functools
import gc
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

# Start-up creates about half a million long-lived objects (torch, transformers, scikit-learn) and little garbage; at
# Python's default thresholds the collector walks all of them several times meanwhile, about 1 s of CPU per process
# (a fifth of its start-up). Full collections become rare; young objects are collected as before.
gc.set_threshold(700, 10, 1000)

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, SchedulerType, get_scheduler

from utils import (checkpoint, export, flags, loop, onnx_export, outputs, runtime, text_cache, text_data, text_metrics,
                   text_model)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


# ---------------------------------------------------------------------------------------------------------------------
# Adaptation: the functions to change to adapt this script. The rest of it and utils/ take what these return and never
# name the model class, the loss or the tokenizer's class.
#   new_model / load_model   the model: built from its config (--from_scratch; on the meta device, the empty twin
#                            whose parameter names an export must have and whose position table bounds --max_seq_len),
#                            or loaded from a checkpoint or a trained best_model/ (training, --do_eval/--do_test/
#                            --do_predict on a trained model); best_model/ is saved with save_pretrained, so what
#                            load_model loads, pipeline() loads too. A class of your own (a model_type transformers
#                            does not ship) is registered here, at import (AutoConfig.register,
#                            AutoModelForSequenceClassification.register), and the model card's snippet imports this
#                            script, under its own file name, to load it: docs/bert.md#adapting-it
#   load_tokenizer           the tokenisation (utils/text_data.py tokenize_examples calls it on batches of texts)
#   sample_losses            the training loss per sample, (b,): the loop averages it over the real samples of each
#                            optimizer step, so a term added here stays right under DDP, gradient accumulation, short
#                            last batches and --auto_find_batch_size's micro-batches
#   evaluate                 the evaluation's numbers: a dict of {name: number} (names without a prefix; `samples`:
#                            how many were evaluated), each printed in the console's eval lines, logged (metrics.jsonl's
#                            `eval` events, the trackers), recorded (all_results.json's and the model card's
#                            `eval_NAME`/`test_NAME`) and a choice of --metric_for_best_model: a number added here is
#                            all of that, with no other list to edit (a run that trains calls evaluate once on one
#                            validation batch before its first step to learn the names: utils/loop.py
#                            validation_names); beside them "report" and "confusion_matrix" (None where they do not
#                            apply), which report() writes as files, and --metric's lists of numbers, recorded too
# ---------------------------------------------------------------------------------------------------------------------
def new_model(config, trust_remote_code=False):
    """The classifier for `config` (its labels included), randomly initialised."""
    return AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)


def load_model(path, config, trust_remote_code=False, hub=None):
    """(the classifier from `path`'s weights, the names of the weights that start new): a head of another size, or
    none in the checkpoint, starts new; utils/text_model.py check_starting_weights refuses a new encoder weight."""
    text_model.check_weight_files(path)
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, config=config, ignore_mismatched_sizes=True,  # a fine-tuned head of another size
        trust_remote_code=trust_remote_code, output_loading_info=True, **(hub or {}))
    return model, text_model.new_weight_names(info)


def load_tokenizer(source, trust_remote_code=False, hub=None):
    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **(hub or {}))


def sample_losses(model, inputs, targets, args, class_weights=None):
    """The training loss of each sample of this process's (micro-)batch, (b,); `inputs`: the tokenised batch
    (input_ids, attention_mask, ...), `targets`: label ids (b,), multi-hot (b, C) or numbers (b,)."""
    logits = model(**inputs).logits  # (b, C)
    return text_metrics.training_loss(logits, targets, args.multi_label, args.label_smoothing, class_weights,
                                      args.do_regression)


@torch.no_grad()
def predict_logits(accelerator, model, dataloader, desc, pool="mean", guard=None):
    """Logits (N, C) and labels (N,) of exactly the N texts of the dataset, on every rank; a text cut into windows
    (--doc_stride: the batches carry each window's text index, `doc`) has its windows' logits pooled (`pool`).
    `guard`: a training run's PreemptionGuard, which abandons the evaluation on a stop."""
    model.eval()
    all_logits, all_labels, all_docs = [], [], []
    batches = guard.batches(dataloader) if guard else dataloader
    for batch in outputs.progress(accelerator, batches, desc=desc, leave=False, total=len(dataloader)):
        labels, docs = batch.pop("labels", None), batch.pop("doc", None)
        logits = model(**batch).logits.float()  # (B, C)
        all_logits.append(accelerator.gather_for_metrics(logits).cpu())
        all_labels.append(accelerator.gather_for_metrics(labels).cpu() if labels is not None else None)
        all_docs.append(accelerator.gather_for_metrics(docs).cpu() if docs is not None else None)
    model.train()
    logits = torch.cat(all_logits)
    labels = torch.cat(all_labels) if all_labels and all_labels[0] is not None else None
    if all_docs and all_docs[0] is not None:  # (W, C) window logits -> (N, C) text logits
        logits, labels = text_metrics.pool_windows(logits, labels, torch.cat(all_docs), pool)
    return logits, labels


def evaluate(accelerator, model, dataloader, labels, desc, args, metric_modules=(), guard=None):
    """Mean loss per sample, accuracy (exact match if multi-label), macro/micro F1 (regression: mse, rmse, mae,
    pearson, spearmanr), samples, report, confusion matrix; then --metric's results (a key these have gets its
    module's name in front)."""
    logits, targets = predict_logits(accelerator, model, dataloader, desc, args.pool, guard)
    metrics = text_metrics.evaluation_metrics(logits, targets, labels, args.multi_label, args.threshold,
                                              args.do_regression)
    return {**metrics, **text_metrics.compute_metrics(metric_modules, logits.argmax(-1).tolist(), targets.tolist(),
                                                      metrics)}
# --------------------------------------------------------------------------- end of the adaptation section -----------


def build_parser():
    """Every flag (utils/flags.py Parser: one-line errors, the other tools' spellings); each one's role for a resume
    and the export is declared in FLAG_ROLES below."""
    parser = flags.Parser(description=__doc__, roles=FLAG_ROLES, roles_in=f"FLAG_ROLES in {Path(__file__).name}")
    parser.refuse("the Chinese BERT tutorial", flags.TUTORIAL_FLAGS)
    parser.refuse("accelerate's examples", flags.ACCELERATE_EXAMPLE_FLAGS)
    parser.refuse("transformers' text-classification examples", flags.TRANSFORMERS_EXAMPLE_FLAGS)
    data = parser.add_argument_group("data")
    data.add_argument("--data_dir", type=Path,
                      help="directory with train/val/test files (also dev, validation, cnews.*), any supported type")
    data.add_argument("--train_file", type=Path, help=".txt/.tsv (label TAB text), .csv or .json(l) (label, text)")
    data.add_argument("--validation_file", type=Path)
    data.add_argument("--test_file", type=Path)
    data.add_argument("--predict_file", type=Path, help="texts to predict (docs/bert_data_formats.md); default: test")
    data.add_argument("--labels_file", type=Path, help="label names, one per line; default: sorted train labels")
    data.add_argument("--max_seq_len", "--max_seq_length", "--max_length", type=runtime.positive_int, default=None,
                      help="tokens; longer are truncated (default: 512 or the model's positions if fewer; without "
                      "--do_train: the trained model's)")
    text_data.add_dataset_args(data)
    text_data.add_text_format_args(data)
    text_data.add_padding_args(data)
    text_data.add_long_text_args(data)
    data.add_argument("--data_cache_dir", type=Path, default=None,
                      help="where the files are tokenised once for every rank and later start (utils/text_cache.py); "
                      "default: text_classification/ in datasets' cache (HF_DATASETS_CACHE)")
    data.add_argument("--group_by_length", action="store_true",
                      help="training batches of similar-length texts (less padding; see utils/text_data.py)")
    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", "--bert_dir", required=True, help="hub id or local directory")
    model.add_argument("--from_scratch", action="store_true",
                       help="random init from the directory's config.json + vocab.txt")
    model.add_argument("--config_overrides", default=None,
                       help='with --from_scratch, e.g. "num_hidden_layers=2,hidden_size=128"')
    model.add_argument("--init_from_legacy", type=Path, default=None,
                       help="weights from the reference repo's best.pt (bert.* + linear.*, `module.` or not)")
    model.add_argument("--trust_remote_code", action="store_true", help="allow code from the model repo (off)")
    text_model.add_model_source_args(model)
    model.add_argument("--num_tags", "--num_labels", type=runtime.positive_int, default=None,
                       help="the number of labels the data must have (the Chinese BERT tutorial's); default: any")
    for flag, reason in flags.TUTORIAL_IGNORED.items():
        model.add_argument(flag, action=flags.Ignored, reason=reason, help=argparse.SUPPRESS)
    modes = parser.add_argument_group("modes")
    modes.add_argument("--do_train", action="store_true")
    modes.add_argument("--do_eval", action="store_true", help="evaluate the best model on the validation file")
    modes.add_argument("--do_test", action="store_true", help="evaluate the best model once on the test file")
    modes.add_argument("--do_predict", action="store_true", help="write predictions.jsonl for --predict_file")
    train = parser.add_argument_group("training")
    train.add_argument("--train_batch_size", type=runtime.positive_int, default=32,
                       help=f"GLOBAL samples per optimizer micro-step, split over the processes: "
                       f"{flags.BERT_BATCH_RULE}")
    train.add_argument("--per_device_train_batch_size", type=runtime.positive_int, action=flags.PerDevice,
                       dest="train_batch_size", metavar="N",
                       global_flag="--train_batch_size", help="the Trainer's: times the processes = --train_batch_size")
    train.add_argument("--eval_batch_size", type=runtime.positive_int, default=64,
                       help="GLOBAL samples per evaluation batch")
    train.add_argument("--per_device_eval_batch_size", type=runtime.positive_int, action=flags.PerDevice,
                       dest="eval_batch_size", metavar="N",
                       global_flag="--eval_batch_size", help="the Trainer's: times the processes = --eval_batch_size")
    train.add_argument("--learning_rate", "--lr", type=runtime.positive_float, default=3e-5, help="peak learning rate")
    train.add_argument("--optim", choices=text_model.OPTIMIZERS, default="adamw_torch",
                       help="the Trainer's names and optimizers; adamw_torch and adamw_torch_fused are both torch's "
                       "AdamW, fused on CPU and CUDA")
    train.add_argument("--adam_beta1", type=float, default=0.9, help="AdamW's beta1 (the Trainer's)")
    train.add_argument("--adam_beta2", type=float, default=0.999, help="AdamW's beta2 (the Trainer's)")
    train.add_argument("--adam_epsilon", type=runtime.positive_float, default=1e-8,
                       help="AdamW's epsilon (the Trainer's)")
    train.add_argument("--layerwise_lr_decay", type=runtime.positive_float, default=1.0, metavar="FACTOR",
                       help="layer-wise learning-rate decay: encoder layer i of L at --learning_rate x "
                       "FACTOR^(L - i), the embeddings x FACTOR^(L + 1); 1: off")
    train.add_argument("--head_learning_rate", type=runtime.positive_float, default=None,
                       help="the classification head's (and pooler's) learning rate; default --learning_rate")
    train.add_argument("--lr_scheduler_type",
                       choices=[kind.value for kind in SchedulerType if kind.value != "reduce_lr_on_plateau"],
                       default="linear",
                       help="transformers.get_scheduler's schedule, after the warmup")
    train.add_argument("--lr_scheduler_kwargs", type=flags.json_object, default={}, metavar="JSON",
                       help='the schedule\'s own arguments, e.g. \'{"num_cycles": 2}\' for cosine_with_restarts')
    train.add_argument("--warmup_steps", type=runtime.nonnegative_int, default=None,
                       help="optimizer steps of warmup; default: --warmup_ratio of the total")
    train.add_argument("--weight_decay", type=runtime.nonnegative_float, default=0.01,
                       help="not applied to bias and LayerNorm")
    train.add_argument("--warmup_ratio", type=float, default=0.1, help="fraction of steps of linear warmup")
    train.add_argument("--max_grad_norm", type=runtime.nonnegative_float, default=1.0, help="0 disables clipping")
    train.add_argument("--label_smoothing", "--label_smoothing_factor", type=float, default=0.0,
                       help="training loss only (Trainer's label_smoothing_factor); eval loss stays plain")
    train.add_argument("--class_weights", default=None, metavar="balanced|FILE", help=loop.CLASS_WEIGHTS_HELP)
    train.add_argument("--gradient_accumulation_steps", type=runtime.positive_int, default=1)
    train.add_argument("--num_train_epochs", "--train_epochs", type=flags.whole_epochs, default=3,
                       help="whole epochs (the Trainer's 3.0 is 3)")
    train.add_argument("--max_train_steps", "--max_steps", type=runtime.positive_int, default=None,
                       help="optimizer steps, not epochs")
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--num_workers", "--dataloader_num_workers", type=runtime.nonnegative_int, default=0,
                       help="DataLoader processes")
    output = parser.add_argument_group("output")
    output.add_argument("--output_dir", type=Path, default=Path("outputs/bert_cls"))
    output.add_argument("--overwrite_output_dir", action="store_true")
    output.add_argument("--logging_steps", type=runtime.positive_int, default=50,
                        help="optimizer steps between log lines")
    output.add_argument("--log_sample_indices", action="store_true",
                        help="write each optimizer step's sample indices, per process, to OUTPUT_DIR/sample_indices/: "
                        "to check that 1 and N processes, or a resumed run, train the same samples in the same order")
    output.add_argument("--eval_steps", type=runtime.positive_int, default=None,
                        help="optimizer steps between evals; default per epoch")
    output.add_argument("--checkpointing_steps", "--save_steps", type=flags.steps_or_epoch, default=None,
                        help="optimizer steps between resumable checkpoints, or 'epoch': at the end of each epoch "
                        "(the default)")
    output.add_argument("--save_total_limit", type=runtime.nonnegative_int, default=2,
                        help="resumable checkpoints kept (0: all)")
    output.add_argument("--resume_from_checkpoint", default=None, help="PATH or 'latest'")
    checkpoint.add_allow_data_change(output)
    output.add_argument("--metric", "--metric_name", action="append", default=[], metavar="NAME_OR_PATH",
                        help="an `evaluate` module (hub id, or a local script offline) for the best model's "
                        "validation/test results beside accuracy and F1; repeatable")
    loop.add_selection_args(parser, "macro_f1, for regression mse")
    onnx_export.add_onnx_args(parser)
    runtime.add_runtime_args(parser)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)  # a flag without a role (FLAG_ROLES) stops here in one line, before anything starts
    onnx_export.check_onnx_args(parser, args)
    if not (args.do_train or args.do_eval or args.do_test or args.do_predict):
        parser.error("nothing to do: pass at least one of --do_train, --do_eval, --do_test, --do_predict")
    for check in (text_data.check_dataset_args, text_data.check_text_format_args, text_metrics.check_task_args,
                  text_model.check_model_source_args,
                  text_model.check_scheduler_args):
        try:
            check(args)
        except runtime.UserError as err:
            parser.error(str(err))
    loop.check_selection_args(parser, args, training=args.do_train)
    if args.do_train:  # the defaults now; a run that only evaluates a trained model takes its settings in main
        text_model.use_model_settings(args, print, flag_roles())
    return args


# Each flag's role (utils/checkpoint.py ROLE_MEANINGS; the shared helpers' flags beside their add_*_args):
# MAY_CHANGE on resume (named, then applied), MUST_KEEP (refused otherwise; keep_as: recorded under that name,
# kept_by: through the must_match entry main computes from it), THIS_LAUNCH, FRESH_START; `.recorded()`: the
# exported model records it (best_model/trained_with.json) and evaluation results carry it. Every option of
# build_parser() has exactly one entry (a shared helper's, in its *_ROLES spread here): otherwise every command stops
# with one line naming the flag; --help shows each flag's role.
FLAG_ROLES = {
    # data: the training data and its cuts are part of the checkpoint; the validation set may change (named)
    "--data_dir": checkpoint.kept_by(checkpoint.DATA_KEY), "--train_file": checkpoint.kept_by(checkpoint.DATA_KEY),
    "--validation_file": checkpoint.MAY_CHANGE,
    "--test_file": checkpoint.THIS_LAUNCH, "--predict_file": checkpoint.THIS_LAUNCH,
    "--labels_file": checkpoint.kept_by("labels"),
    "--data_cache_dir": checkpoint.THIS_LAUNCH,  # where the tokenised data are kept, not what they are
    "--max_seq_len": checkpoint.MUST_KEEP.recorded(),  # another length changes the inputs themselves
    **text_data.DATASET_ROLES, **text_data.TEXT_FORMAT_ROLES, **text_data.PADDING_ROLES,
    "--group_by_length": checkpoint.MUST_KEEP,  # the sampler: which samples each step sees
    # model: its shape must match; the starting weights matter to a fresh run only
    "--model_name_or_path": checkpoint.kept_by("model"), "--from_scratch": checkpoint.FRESH_START,
    "--config_overrides": checkpoint.kept_by("model"),
    "--init_from_legacy": checkpoint.FRESH_START, "--trust_remote_code": checkpoint.THIS_LAUNCH,
    **text_model.MODEL_SOURCE_ROLES,
    **checkpoint.this_launch("--do_train", "--do_eval", "--do_test", "--do_predict"),
    # training: the global batch, its accumulation and the seed decide which samples each step sees; the optimizer's
    # hyperparameters, the schedule's length and the loss's smoothing apply from the resumed step on
    "--train_batch_size": checkpoint.MUST_KEEP, "--eval_batch_size": checkpoint.THIS_LAUNCH,
    "--learning_rate": checkpoint.MAY_CHANGE,
    "--per_device_train_batch_size": checkpoint.keep_as("--train_batch_size"),
    "--per_device_eval_batch_size": checkpoint.THIS_LAUNCH,
    # the optimizer's state and its parameter groups are the checkpoint's; the schedule may change
    "--optim": checkpoint.MUST_KEEP, "--adam_beta1": checkpoint.MUST_KEEP, "--adam_beta2": checkpoint.MUST_KEEP,
    "--adam_epsilon": checkpoint.MUST_KEEP,
    "--layerwise_lr_decay": checkpoint.MUST_KEEP, "--head_learning_rate": checkpoint.MUST_KEEP,
    "--lr_scheduler_type": checkpoint.MAY_CHANGE, "--lr_scheduler_kwargs": checkpoint.MAY_CHANGE,
    "--warmup_steps": checkpoint.MAY_CHANGE,
    "--weight_decay": checkpoint.MAY_CHANGE, "--warmup_ratio": checkpoint.MAY_CHANGE,
    "--num_train_epochs": checkpoint.MAY_CHANGE,
    "--max_train_steps": checkpoint.MAY_CHANGE, "--max_grad_norm": checkpoint.MAY_CHANGE,
    "--label_smoothing": checkpoint.MAY_CHANGE,
    "--class_weights": checkpoint.kept_by("class_weights"), "--gradient_accumulation_steps": checkpoint.MUST_KEEP,
    "--seed": checkpoint.MUST_KEEP,
    "--num_workers": checkpoint.THIS_LAUNCH,
    # output: when to validate may change (named: early stopping counts validations); the rest is this launch's
    "--eval_steps": checkpoint.MAY_CHANGE,
    **checkpoint.this_launch("--output_dir", "--overwrite_output_dir", "--logging_steps", "--checkpointing_steps",
                             "--save_total_limit", "--resume_from_checkpoint", "--allow_data_change", "--metric"),
    "--log_sample_indices": checkpoint.THIS_LAUNCH,  # a record of what each step trains on, which it does not change
    **loop.SELECTION_ROLES, **text_data.LONG_TEXT_ROLES, **onnx_export.ONNX_ROLES,
    **checkpoint.this_launch("--cpu", "--mixed_precision", "--fp16", "--bf16", "--dist_backend", "--ddp_timeout",
                             "--data_parallel", "--report_to", "--with_tracking", "--gradient_checkpointing",
                             "--auto_find_batch_size"),
    # which kernels compute each step, not what is trained: a resume may add or drop it (bitwise equality with an
    # uninterrupted run needs it in every launch of both, on a GPU)
    "--use_deterministic_algorithms": checkpoint.THIS_LAUNCH,
    # the Chinese BERT tutorial's: a check of the label count, and two flags taken and ignored (said at start)
    **checkpoint.this_launch("--num_tags", "--data_name", "--log_dir"),
}


@functools.cache
def flag_roles():
    """FLAG_ROLES checked against build_parser() (RoleError if a flag has no role) and resolved to args attributes."""
    return build_parser().flag_roles()


def trained_with(args):
    """What best_model/ records in TRAINED_WITH: the settings an evaluation of it must repeat."""
    return flag_roles().exported_settings(args)


def load_splits(args, checkpoint_labels, say=print, with_predict=True, tables=None):
    """Read and validate every input (files or --dataset_name) before anything is written; say what was read for
    what; return (labels, {split: examples}), "predict" among the splits with --do_predict (and `with_predict`).
    With `tables` (a directory), files stream into ExampleTables there instead of lists."""
    if args.dataset_name:
        data = text_data.read_dataset_splits(args)
    else:
        text_data.resolve_file_text_column(args, say)
        data = text_data.read_file_splits(args, text_data.text_format(args), say, tables)
    fmt = text_data.text_format(args)
    examples = data.examples
    if args.do_regression:  # one output, named after what it predicts
        labels = checkpoint_labels if checkpoint_labels and not args.do_train else [args.label_column]
    elif "train" in examples and data.labels and not args.labels_file:
        labels = data.labels
    elif "train" in examples:  # from all of them, before --max_train_samples (run_classification.py does the same)
        labels = text_data.build_label_list(examples["train"], args.labels_file, args.encoding)
    elif args.labels_file:
        labels = text_data.build_label_list([], args.labels_file, args.encoding)
    else:
        labels = checkpoint_labels
    if checkpoint_labels and not args.do_train and labels != checkpoint_labels:
        raise runtime.UserError(f"{args.labels_file}: labels {labels} disagree with {args.model_name_or_path} (trained "
                                f"with {checkpoint_labels})")
    if labels is None:
        raise runtime.UserError(f"{args.model_name_or_path}: no label mapping in its config.json; pass --labels_file")
    for split in ("validation", "test"):
        if split in examples and not args.do_regression:
            text_data.check_known_labels(examples[split], labels,
                                         source=f"the labels of the model ({', '.join(labels)})")
    predict_file = args.predict_file or (None if args.dataset_name else args.test_file)
    if with_predict and args.do_predict and predict_file:  # without --predict_file, the test split, as
        # run_classification.py does
        examples["predict"] = text_data.read_predict_file(predict_file, fmt, labels, say)
    examples, cuts = text_data.select_examples(examples, args)
    for note in data.notes + cuts:
        say(note)
    return labels, examples


def check_model_files(args):
    """The local model's config.json read as transformers will read it (a BOM, a file cut short: one line naming it),
    and custom code refused without --trust_remote_code, before transformers reports either as a tokenizer failure."""
    source = args.tokenizer_name or args.model_name_or_path
    for directory in dict.fromkeys((source, args.config_name or args.model_name_or_path)):
        text_model.check_custom_code(directory, args.trust_remote_code)


def tokenizer_and_length(args, say=print):
    """The tokenizer, and --max_seq_len fitted to the model's positions (its empty twin on the meta device), then
    --head_tokens' default: they decide the tokenised data."""
    source = args.tokenizer_name or args.model_name_or_path
    check_model_files(args)
    with text_model.loading(source, "tokenizer"):
        tokenizer = load_tokenizer(source, args.trust_remote_code, text_model.hub_options(args))
    empty_model = export.on_meta_device(lambda: new_model(model_config(args), args.trust_remote_code))
    args.max_seq_len = text_model.fit_max_seq_len(args.max_seq_len, empty_model,
                                                  args.config_name or args.model_name_or_path,
                                                  say)
    text_data.resolve_head_tokens(args, say)  # its default is a share of --max_seq_len
    return tokenizer


def tokenised_data(args, tokenizer, checkpoint_labels, say=print, directory=None):
    """Every split read, checked and tokenised (into `directory`'s <split>.arrow files when given, the files read
    through Arrow tables beside them, deleted once tokenised) as a TextData; in memory, with the records to predict
    (the cache leaves them out: they are read by every process)."""
    tables = directory and not args.dataset_name and Path(directory) / "read"
    labels, examples = load_splits(args, checkpoint_labels, say, with_predict=directory is None, tables=tables)
    predict = examples.pop("predict", None)
    cut = text_data.long_text(args, args.max_seq_len,
                              any(e.text_pair is not None for s in examples.values() for e in s[:1]))
    # evaluated texts keep their windows' text index, to pool them (predict_logits)
    datasets = {split: text_data.tokenize_examples(tokenizer, split_examples,
                                                   text_data.label_targets(split_examples, labels, args.multi_label,
                                                                           args.do_regression),
                                                   args.max_seq_len, cut, split != "train",
                                                   directory and Path(directory) / f"{split}.arrow")
                for split, split_examples in examples.items()}
    first = next((found[0] for found in (examples.get("validation"), examples.get("train")) if found), None)
    data = text_data.TextData(labels, datasets, [first.text, first.text_pair] if first else [None, None],
                              text_model.unk_rate(tokenizer, datasets["train"]) if "train" in datasets else None,
                              text_data.fingerprint_examples(args.train_file or args.dataset_name,
                                                             examples.get("train")),
                              predict=predict)
    if tables:
        shutil.rmtree(tables)
    return data


def read_predict_records(args, labels, say=print):
    """--do_predict's records from a file (--predict_file, else the test file), cut by --max_predict_samples."""
    predict_file = args.predict_file or args.test_file
    selected, notes = text_data.select_examples({"predict": text_data.read_predict_file(predict_file,
                                                                                        text_data.text_format(args),
                                                                                        labels, say)},
                                                args)
    for note in notes:
        say(note)
    return selected["predict"]


def cache_inputs(args, tokenizer, checkpoint_labels):
    """What decides the tokenised data of a run on files: the files (where they are, which the notes said while
    reading them name, and their bytes) and every flag that changes how they are read, cut (--max_*_samples; long
    texts: --truncation, --head_tokens, --doc_stride), labelled and tokenised (utils/text_cache.py)."""
    files = text_data.split_files(args.data_dir, {"train": args.train_file, "validation": args.validation_file,
                                                  "test": args.test_file}, say=lambda line: None)
    return {"files": {split: [str(Path(path).resolve()), text_cache.file_sha256(path)] for split, path in files.items()
                      if path is not None},
            "labels_file": args.labels_file and text_cache.file_sha256(args.labels_file),
            "format": vars(text_data.text_format(args)),
            "modes": [args.do_train, args.do_eval, args.do_test],
            "cuts": [args.max_train_samples, args.max_eval_samples, args.shuffle_train_dataset, args.shuffle_seed],
            "checkpoint_labels": checkpoint_labels, "tokenizer": text_cache.tokenizer_sha256(tokenizer),
            "max_seq_len": args.max_seq_len, "long_texts": [args.truncation, args.head_tokens, args.doc_stride]}


def load_text_data(args, accelerator, tokenizer, checkpoint_labels, say=print):
    """The labels and the tokenised splits: files are read and tokenised once, by one process, into the data cache
    that every rank and later start reads; a --dataset_name dataset is read and tokenised by each process."""
    if checkpoint_labels and not args.do_train:
        text_model.check_problem_type(args.model_name_or_path, args.multi_label, args.do_regression)
    if args.dataset_name:
        return tokenised_data(args, tokenizer, checkpoint_labels, say)
    text_data.resolve_file_text_column(args, say)  # before the cache key, which holds it
    cache = text_cache.DataCache(accelerator, args.data_cache_dir or text_cache.default_cache_dir())
    key = cache.key(lambda: cache_inputs(args, tokenizer, checkpoint_labels))

    def build(directory):
        notes = []
        data = tokenised_data(args, tokenizer, checkpoint_labels, notes.append, directory)
        data.notes = notes
        return data.meta()

    entry, meta = cache.open(key, build)
    for note in meta["notes"]:
        say(note)
    args.train_file, args.validation_file, args.test_file = text_data.split_files(
        args.data_dir, {"train": args.train_file, "validation": args.validation_file, "test": args.test_file},
        say=lambda line: None).values()  # as the reading process set them, for run_config.json and the model card
    predict = read_predict_records(args, meta["labels"], say) if args.do_predict else None
    return text_data.TextData(meta["labels"], {split: text_cache.read_split(entry, split) for split in meta["splits"]},
                              meta["first_text"],
                              meta["unk_rate"], meta["fingerprint"], meta["notes"], predict)


def long_text_stats(args, splits):
    """all_results.json's entries on how long texts were cut: the cut, and with windows each split's window count."""
    cut = text_data.long_text(args, args.max_seq_len, paired=False)  # checked against the data when it was tokenised
    windows = {f"{split}_windows": len(dataset) for split, dataset in splits.items()} if cut.doc_stride else {}
    return {"long_texts": cut.describe(), **windows}


def model_config(args, labels=None):
    """The model's config with our label mapping and task (and --config_overrides for a model built from it); with
    no `labels`, the labels its config.json has."""
    label_kwargs = {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
                    "label2id": {label: i for i, label in enumerate(labels)},
                    "problem_type": text_model.problem_type(args.multi_label, args.do_regression)} if labels else {}
    source = args.config_name or args.model_name_or_path
    with text_model.loading(source, "config"):
        config = AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code,
                                            **text_model.hub_options(args),
                                            **label_kwargs)
    if from_config(args) and args.config_overrides:
        config.update_from_string(args.config_overrides)
    return config


def from_config(args):
    """Whether the model starts from its config alone (--init_from_legacy's weights replace every pretrained one)."""
    return bool(args.from_scratch or args.init_from_legacy)


def build_model(args, labels, say=print, tokenizer=None):
    """(tokenizer, model): the adaptation section's (the tokenizer: `tokenizer`, else load_tokenizer's), with our
    label mapping in the model's config and its starting weights checked; --max_seq_len is fitted to the model's
    positions with the tokenizer (tokenizer_and_length)."""
    path = Path(args.model_name_or_path)
    has_weights = any((path / name).exists() for name in WEIGHT_FILES)
    if path.is_dir() and not has_weights and not from_config(args):
        raise runtime.UserError(f"{path}: no model weights ({', '.join(WEIGHT_FILES[::2])}); pass --from_scratch to "
                                f"train a randomly initialised model from its config.json")
    remote = args.trust_remote_code
    if tokenizer is None:
        tokenizer = tokenizer_and_length(args, say)
    config = model_config(args, labels)
    with text_model.loading(path, "model"):
        model = new_model(config, remote) if from_config(args) else load_checked(args, config)
    if not from_config(args) and not args.do_regression:
        text_model.head_by_name(model, path, labels, say)
    if args.init_from_legacy:
        text_model.load_legacy_bert(args.init_from_legacy, model)
    if args.gradient_checkpointing:
        text_model.enable_gradient_checkpointing(model, args.model_name_or_path)
    text_model.sync_free_attention(model)
    # transformers 5 silently ignores `vocab_file=` and maps every Chinese character to [UNK]: check the vocab.
    if len(tokenizer) < 100 or len(tokenizer) > config.vocab_size:
        raise runtime.UserError(f"{args.tokenizer_name or path}: tokenizer has {len(tokenizer)} tokens but the model "
                                f"expects {config.vocab_size}; is vocab.txt there and read?")
    return tokenizer, model


def load_checked(args, config):
    """load_model's model, refused where its encoder would start from random weights."""
    model, new_weights = load_model(args.model_name_or_path, config, args.trust_remote_code,
                                    text_model.hub_options(args))
    text_model.check_starting_weights(model, new_weights, args.model_name_or_path)
    return model


def build_dataloaders(args, tokenizer, datasets, predict_examples, padding=None):
    """The (unprepared) loaders of the tokenised datasets, batch size = GLOBAL batch; padding: `resolve_padding`'s,
    by default the CPU's (to the longest text of each batch)."""
    collator = text_data.build_collator(tokenizer, args.max_seq_len, **(padding or {}))
    loaders = {}
    for split, dataset in datasets.items():
        training = split == "train"
        # a sampler whose order depends on (seed, epoch) only, like the seedable random sampler it replaces
        sampler = (text_data.LengthGroupedSampler(text_data.token_lengths(dataset), args.train_batch_size, args.seed)
                   if training and args.group_by_length else None)
        loaders[split] = DataLoader(dataset, shuffle=training and sampler is None, sampler=sampler,
                                    collate_fn=collator, **runtime.loader_settings(args.num_workers),
                                    batch_size=args.train_batch_size if training else args.eval_batch_size,
                                    generator=runtime.loader_generator(args.seed) if training else None)
    if predict_examples is not None:  # blank lines have a row in predictions.jsonl, but nothing to predict
        texts = [e for e in predict_examples if not e.skipped]
        cut = text_data.long_text(args, args.max_seq_len, texts[0].text_pair is not None)
        # a text's windows keep its index, to pool them (predicted_rows)
        dataset = text_data.tokenize_examples(tokenizer, texts, None, args.max_seq_len, cut, keep_doc=True)
        loaders["predict"] = DataLoader(dataset, batch_size=args.eval_batch_size, collate_fn=collator,
                                        **runtime.loader_settings(args.num_workers))
    return loaders


def save_best_model(accelerator, model, tokenizer, best_dir, settings, log, card_results, step=None, remote=False):
    """Hugging Face format (config with id2label, safetensors, tokenizer), no `module.` prefix, with what it was
    trained with (`settings`, TRAINED_WITH; the tokenizer truncates at max_seq_len, in pipeline() too), its model card
    (README.md, from `card_results`) and the selected `step` (best_step.json), swapped in atomically; a full disk
    stops every rank with one line and keeps the previous best_model/. `remote`: --trust_remote_code."""
    tmp = best_dir.with_name(best_dir.name + ".tmp")
    bare = accelerator.unwrap_model(model, keep_torch_compile=False)
    state_dict = export.full_state_dict(accelerator, model, export.on_meta_device(lambda: new_model(bare.config,
                                                                                                      remote)))
    with runtime.writing(accelerator, best_dir.parent, unfinished=tmp):
        if accelerator.is_main_process:
            # save_original_format=False: transformers 5 would write the checkpoint's own names back (LayerNorm.gamma)
            bare.save_pretrained(tmp, state_dict=state_dict, save_original_format=False)
            save_tokenizer_and_settings(tokenizer, settings, tmp)
            log.write_model_card(tmp / "README.md", card_results)
            if step is not None:
                export.mark_selection(tmp, step)
            checkpoint.replace_dir_atomically(tmp, best_dir)


def save_tokenizer_and_settings(tokenizer, settings, folder):
    """The tokenizer, truncating at max_seq_len (in pipeline() too), and TRAINED_WITH, the `settings` an evaluation
    of the model must repeat: beside the weights in best_model/, beside model.onnx in onnx/."""
    tokenizer.model_max_length = settings["max_seq_len"]
    tokenizer.save_pretrained(folder)
    (Path(folder) / text_model.TRAINED_WITH).write_text(json.dumps(settings, indent=2) + "\n")


def best_model_selection(accelerator, args, model, validation_loader, labels, metric_modules):
    """Which validation metric selects the best model: --metric_for_best_model (default: default_metric), one of the
    numbers evaluate() returns, whose names one evaluation of a validation batch gives before training (a mistyped one
    stops the run there, in one line naming them). A run that validates nothing (no validation set, or no training)
    keeps the default."""
    names = None
    if args.do_train and validation_loader is not None:
        names = loop.validation_names(accelerator, model, validation_loader, lambda batches: evaluate(
            accelerator, model, batches, labels, "validation", args, metric_modules))
    loop.resolve_selection(args, names, default=text_metrics.default_metric(args.do_regression))
    return loop.Selection.from_args(args, position="step")


@dataclass
class Task:
    """What main resolved before training that the loop needs."""
    labels: list  # names in id order
    must_match: dict  # what a resumed checkpoint must agree with
    selection: loop.Selection  # the validation metric that selects the best model, and early stopping
    metric_modules: list  # --metric's evaluate modules
    class_weights: torch.Tensor | None  # (C,) --class_weights


@dataclass
class Training:
    """What the training loop works with, prepared for this launch (prepare_training)."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: DataLoader
    eval_loader: DataLoader | None
    checkpoints: checkpoint.Checkpoints
    state: dict  # where the run starts (a checkpoint's position) and what it selected so far (best_*)
    cadence: loop.Cadence
    selection: loop.Selection  # the validation metric that selects the best model


def prepare_training(args, accelerator, model, loaders, log, task, resume_path):
    """AdamW and its warmup schedule, prepared with the loaders, then restored from `resume_path`
    (--resume_from_checkpoint as agree_on_resume found it, or a checkpoint an earlier attempt of this launch saved);
    prints the run summary."""
    steps_per_epoch = math.ceil(len(loaders["train"]) / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    groups = text_model.optimizer_groups(model, args.weight_decay, args.learning_rate, args.layerwise_lr_decay,
                                         args.head_learning_rate)
    optimizer = text_model.build_optimizer(groups, args, accelerator.device)
    # Sized from the UNprepared loader; with split_batches the prepared scheduler steps once per optimizer step.
    warmup_steps = (args.warmup_steps if args.warmup_steps is not None
                    else math.ceil(args.warmup_ratio * max_train_steps))
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps,
                              num_training_steps=max_train_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    eval_loader = loaders.get("validation")
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, loaders["train"], scheduler)
    eval_loader = accelerator.prepare(eval_loader) if eval_loader is not None else None

    checkpoints = checkpoint.Checkpoints(accelerator, args.output_dir, args.save_total_limit, task.must_match,
                                         checkpoint.resume_settings(args, flag_roles().resumable()),
                                         exports=["best_model"],
                                         allow_data_change=args.allow_data_change,
                                         best_export_step=lambda: export.selected_step(args.output_dir / "best_model"),
                                         per_process=checkpoint.per_process_differences(model), say=log.console)
    fresh = {"completed_steps": 0, "epoch": 0, "batches_in_epoch": 0, **task.selection.fresh_state()}
    state = checkpoints.restore(resume_path, fresh, len(train_loader), optimizer, scheduler)
    log.open(resume_step=state["completed_steps"] if resume_path else None, state=state)
    cadence = loop.Cadence(max_train_steps, steps_per_epoch, len(train_loader), log_every=args.logging_steps,
                           eval_every=args.eval_steps, checkpoint_every=args.checkpointing_steps)
    runtime.print_run_summary(accelerator, "Running training", {
        **runtime.run_info(accelerator, args.train_batch_size),
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "samples_per_optimizer_step": args.train_batch_size * args.gradient_accumulation_steps,
        "train_samples": len(loaders["train"].dataset),
        "steps_per_epoch": steps_per_epoch, "epochs": cadence.epochs, "total_steps": max_train_steps,
        "resume_step": state["completed_steps"],
        "checkpoints_resume_on": checkpoint.resumable_process_counts(args.train_batch_size),
    })
    checkpoint.say_processes(accelerator.print, accelerator.num_processes, checkpoints.per_process)
    return Training(model, optimizer, scheduler, train_loader, eval_loader, checkpoints, state, cadence,
                    task.selection)


def log_validation(log, completed_steps, metrics, eval_seconds, train_seconds):
    """A validation during training: its `eval` event in metrics.jsonl and one console line, with every number
    evaluate() returned."""
    log.log("eval", completed_steps,
            {**text_metrics.recorded(metrics), "eval_seconds": eval_seconds, "train_seconds": train_seconds})
    log.console(f"eval step {completed_steps} | {outputs.format_numbers(metrics)}")


@dataclass
class Keeping:
    """What a validation during training keeps besides its metrics: the best weights (in memory and best_model/), the
    time it took and when."""
    best: export.BestWeights  # this run's best weights, in memory on every rank
    tokenizer: object  # saved with best_model/
    speed: loop.Throughput  # times the validation and the export apart from training
    start_time: float  # time.perf_counter() at the start of training


def validate_and_stop(accelerator, training, task, args, log, keeping, guard, completed_steps):
    """The validation at `completed_steps`, a new best model kept and exported, then whether the run stops there:
    ((step, metrics), the step of an early stop or None, whether a SIGTERM stops it). A stop during the validation
    abandons it, leaving it due at this step (VALIDATION_DUE): (None, None, True)."""
    state, selection, model = training.state, training.selection, training.model
    guard.step = completed_steps  # the step an abandoned validation names
    state[checkpoint.VALIDATION_DUE] = True
    try:
        with keeping.speed.pause("eval") as evaluation:
            metrics = evaluate(accelerator, model, training.eval_loader, task.labels, "validation", args,
                               task.metric_modules, guard)
    except loop.EvaluationAbandoned as abandoned:
        accelerator.print(f"{abandoned}: the checkpoint keeps it due, and the resumed run validates first")
        return None, None, True
    state[checkpoint.VALIDATION_DUE] = False
    log_validation(log, completed_steps, metrics, evaluation.seconds, time.perf_counter() - keeping.start_time)
    if selection.update(state, metrics, completed_steps):  # a new best model, kept and exported
        keeping.best.keep(model)
        with keeping.speed.pause("save"):
            save_best_model(accelerator, model, keeping.tokenizer, args.output_dir / "best_model", trained_with(args),
                            log, {**selection.results(state), **text_metrics.flat_metrics(metrics, "eval"),
                                  "launches": training.checkpoints.launches}, completed_steps,
                            args.trust_remote_code)
    stopped_at = completed_steps if selection.should_stop(state) else None
    return (completed_steps, metrics), stopped_at, guard.should_stop(completed_steps) and stopped_at is None


def select_best_model(accelerator, training, best, last_eval, completed_steps, preempted, best_dir):
    """Put the weights of the best validation score into the model: this run's from memory, or, selected before
    the run resumed, from best_model/ (a preempted run keeps its last weights). Returns their validation metrics when
    they are the last ones measured (nothing to reload or re-evaluate), else None."""
    best_step = training.state["best_step"]
    if last_eval is not None and last_eval[0] == best_step == completed_steps:
        accelerator.print(f"the best model is the last one evaluated (step {completed_steps}): its validation results "
                          f"are reused")
        return last_eval[1]
    if best.held and not preempted:
        best.restore(training.model)
    elif best_step is not None and not preempted:  # selected before this run resumed: on the main disk
        export.load_selected_weights(accelerator, training.model, best_dir, best_step)
    return None


@dataclass
class TrainResult:
    model: torch.nn.Module  # the selected model (best validation score), or the last one where nothing selects
    results: dict  # all_results.json's training entries
    preempted: bool  # stopped on SIGTERM after saving a checkpoint
    best_eval: dict | None  # the selected model's validation metrics, when they are the last ones measured


def train(args, accelerator, model, tokenizer, loaders, log, task, attempt):
    """The training loop; `attempt`: micro-batches and the checkpoint to start from (OutOfMemoryRetry)."""
    training = prepare_training(args, accelerator, model, loaders, log, task, attempt.resume)
    samples = outputs.SampleLog(accelerator, args.output_dir, training.train_loader, args.gradient_accumulation_steps,
                                enabled=args.log_sample_indices)
    model, optimizer, scheduler = training.model, training.optimizer, training.scheduler
    state, cadence, selection = training.state, training.cadence, training.selection
    best_dir = args.output_dir / "best_model"
    guard = loop.PreemptionGuard(accelerator, training.checkpoints.latest, "--resume_from_checkpoint latest")
    meter = loop.LossMeter(accelerator.device)
    health = loop.HealthCheck(accelerator, meter, model, training.checkpoints.latest, "--learning_rate")
    best = export.BestWeights()  # this run's best weights, in memory on every rank
    keeping = Keeping(best, tokenizer, loop.Throughput(), time.perf_counter())
    loss_scale = loop.LossScale(accelerator, len(loaders["train"].dataset), args.train_batch_size,
                                args.gradient_accumulation_steps)
    last_eval = None  # (step, metrics) of the last validation
    completed_steps = state["completed_steps"]
    samples_seen = 0
    preempted = False
    stopped_at = None  # the step of an early stop
    bar = outputs.progress(accelerator, total=cadence.total_steps, initial=completed_steps)
    start_time = keeping.start_time
    speed = keeping.speed  # samples/s of training alone: evaluation and epoch starts are timed apart
    model.train()
    # a stop abandoned this validation: it comes first
    if state[checkpoint.VALIDATION_DUE] and training.eval_loader is not None:
        # (stopped again during it, the run leaves that checkpoint as it was: the latest, with its validation due)
        last_eval, stopped_at, preempted = validate_and_stop(accelerator, training, task, args, log, keeping, guard,
                                                             completed_steps)
    for epoch in range(state["epoch"], cadence.epochs):
        if preempted or stopped_at is not None:
            break
        batches, batches_in_epoch = loop.epoch_batches(accelerator, training.train_loader, epoch, state)
        window = None  # where the accumulation window began, what a stop inside it goes back to
        for batch in speed.epoch(batches):
            window = window or guard.start_window(batches_in_epoch, model)
            with accelerator.accumulate(model):
                for offset, part in attempt.micro_batches(model, batch):  # the batch, or its micro-batches
                    inputs = {k: v for k, v in part.items() if k != "labels"}
                    losses = sample_losses(model, inputs, part["labels"], args, task.class_weights)  # (b,)
                    # a mean over the real samples of the whole optimizer step, padding and short windows included
                    loss, local_mean, local_real = loss_scale.loss(losses, batches_in_epoch, offset)
                    accelerator.backward(loss)
                    meter.update(local_mean, local_real)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            samples_seen += loss_scale.real_in_batch(batches_in_epoch)
            batches_in_epoch += 1
            if not accelerator.sync_gradients:
                if guard.stops_inside_window(completed_steps, window, model):
                    preempted, batches_in_epoch = True, window.first_batch
                    with speed.pause("save"):
                        training.checkpoints.save(completed_steps, state, epoch, batches_in_epoch)
                    break
                continue
            window = None
            completed_steps += 1
            samples.step(completed_steps, epoch, batches_in_epoch)
            speed.step(args.gradient_accumulation_steps * args.train_batch_size)
            bar.update(1)
            due = cadence.after_step(completed_steps, batches_in_epoch)
            if due.log:
                health.check(completed_steps)
                values = {"loss": meter.mean(accelerator), "lr": scheduler.get_last_lr()[0], **speed.read()}
                log.console(outputs.format_step_line(epoch + 1, completed_steps, cadence.total_steps, values))
                log.log("train", completed_steps, {"epoch": epoch + 1, **values})
            if due.evaluate and training.eval_loader is not None:
                health.check(completed_steps)
                last_eval, stopped_at, preempted = validate_and_stop(accelerator, training, task, args, log, keeping,
                                                                     guard, completed_steps)
            else:
                preempted = guard.should_stop(completed_steps)
            if (due.checkpoint and stopped_at is None) or preempted:
                health.check(completed_steps, parameters=True)
                with speed.pause("save"):
                    training.checkpoints.save(completed_steps, state, epoch, batches_in_epoch)
            if preempted or due.finished or stopped_at is not None:
                break
        if cadence.finished(completed_steps):
            break
    bar.close()
    guard.close(preempted)  # from here on, SIGTERM stops the run at once
    if not preempted:  # trained to its end: the abandoned branches are rotated
        training.checkpoints.finish()
    if training.eval_loader is None and not preempted:  # nothing to select with: the final model is the best one
        save_best_model(accelerator, model, tokenizer, best_dir, trained_with(args), log, {},
                        remote=args.trust_remote_code)
    best_eval = select_best_model(accelerator, training, best, last_eval, completed_steps, preempted, best_dir)
    seconds = time.perf_counter() - start_time
    results = {"startup_seconds": speed.startup_seconds, "train_runtime": seconds,
               "train_samples_per_second": samples_seen / seconds, "train_steps": completed_steps,
               "launches": training.checkpoints.launches,
               f"best_eval_{selection.metric}": selection.best(state), **selection.results(state, stopped_at)}
    return TrainResult(model, results, preempted, best_eval)


def report(accelerator, log, prefix, metrics, labels, output_dir):
    """Flat `{prefix}_*` results, plus the per-class report and the confusion matrix as files."""
    if metrics["report"] is not None:  # None for regression
        log.write_json(f"{prefix}_report.json", metrics["report"])
    if metrics["confusion_matrix"] is not None:  # None for multi-label and regression
        accelerator.on_main_process(text_metrics.save_confusion_matrix)(
            metrics["confusion_matrix"], labels, output_dir / f"{prefix}_confusion_matrix.csv",
            output_dir / f"{prefix}_confusion_matrix.png", title=f"{prefix} confusion matrix")
    accelerator.print(f"{prefix}: {outputs.format_numbers(metrics)}")
    return text_metrics.flat_metrics(metrics, prefix)


def evaluate_selected_model(accelerator, log, model, prepared, labels, args, metric_modules, trained=None, tag=""):
    """--do_eval / --do_test on the selected model: `eval{tag}_*` / `test{tag}_*` results with the settings they used;
    the validation `trained` (this run's TrainResult) measured last is reused when it was the selected model's (and no
    --metric module asks for more)."""
    results = {}
    step = trained.results["train_steps"] if trained else 0
    for split, mode in (("validation", "eval"), ("test", "test")):
        prefix = mode + tag
        if getattr(args, f"do_{mode}") and split in prepared:
            reuse = trained.best_eval if trained and split == "validation" else None
            metrics = reuse or evaluate(accelerator, model, prepared[split], labels, split, args, metric_modules)
            results.update(report(accelerator, log, prefix, metrics, labels, args.output_dir),
                           **{f"{prefix}_settings": trained_with(args)})
            log.log(f"best_model_{prefix}", step, text_metrics.recorded(metrics))
    return results


def take_records(records, count):
    """The next records of the iterator `records` that hold `count` predicted ones (and the skipped ones among them)."""
    taken = []
    while count:
        taken.append(next(records))
        count -= not taken[-1].skipped
    return taken


@torch.no_grad()
def predicted_rows(accelerator, model, loader, examples, labels, args):
    """predictions.jsonl's rows in input order, a batch at a time: every rank runs its part of each batch, the
    batch's logits are gathered, and the main process makes its rows (only one batch's logits and rows are held)."""
    model.eval()
    records = iter(examples)
    windows = text_metrics.StreamedWindows(args.pool)  # --doc_stride: a text's windows pooled once they have all come
    for batch in outputs.progress(accelerator, loader, desc="predict", leave=False):
        batch.pop("labels", None)
        docs = batch.pop("doc", None)
        logits = accelerator.gather_for_metrics(model(**batch).logits.float()).cpu()  # (B, C): the whole batch
        if docs is not None:
            logits = windows.add(logits, accelerator.gather_for_metrics(docs).cpu())
        if accelerator.is_main_process:
            yield from text_metrics.prediction_rows(logits, take_records(records, len(logits)), labels,
                                                    args.multi_label,
                                                    args.threshold, args.do_regression)
    last = windows.end(len(labels))  # the last text's windows, and the skipped records after it
    if accelerator.is_main_process:
        yield from text_metrics.prediction_rows(last, take_records(records, len(last)) + list(records), labels,
                                                args.multi_label,
                                                args.threshold, args.do_regression)
    model.train()


def write_predictions(accelerator, log, model, loader, examples, labels, args):
    log.write_jsonl("predictions.jsonl", predicted_rows(accelerator, model, loader, examples, labels, args))
    skipped = sum(1 for example in examples if example.skipped)
    accelerator.print(f"wrote {len(examples) - skipped} predictions and {skipped} skipped rows (blank lines, empty "
                      f"texts) to {args.output_dir / 'predictions.jsonl'}, one row per input record")


ONNX_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # in the order of BERT's forward arguments


def export_selected_onnx(accelerator, args, model, tokenizer, loaders):
    """--export_onnx: the selected model as OUT/onnx/model.onnx, checked on the first --onnx_check_samples texts,
    with what loads it beside it (docs/code.md#onnx_exportpy); its onnx_* results. A collective; the main process
    exports."""
    split = next(name for name in ("validation", "test", "train", "predict") if name in loaders)
    results = {}
    with runtime.writing(accelerator, args.output_dir / "onnx"):
        if accelerator.is_main_process:
            texts = (({name: batch[name] for name in ONNX_INPUTS if name in batch},
                      batch.get("labels", torch.full((len(batch["input_ids"]),), float("nan"))))  # none: no accuracy
                     for batch in loaders[split])
            batches = onnx_export.check_batches(texts, args.onnx_check_samples)
            accelerator.print(f"ONNX export checked on the {split} texts")
            results = onnx_export.export_and_check(model, batches, args.output_dir / "onnx", args.onnx_int8,
                                                   sequence_axis=True, say=accelerator.print)
            model.config.save_pretrained(args.output_dir / "onnx")
            save_tokenizer_and_settings(tokenizer, trained_with(args), args.output_dir / "onnx")
    return results


def write_results(log, args, results, results_tag):
    """A training run's all_results.json, flat, its settings and launches in all_results_settings.json (and the model
    card, now with the test results); an evaluation of a trained output_dir writes its own
    {eval,test}{results_tag}_results.json (and _settings.json) and adds to all_results.json, never replacing numbers
    measured with other settings (results_tag: use_model_settings's)."""
    if args.do_train:
        log.write_results("all_results.json", results)
        log.write_model_card(args.output_dir / "best_model" / "README.md", results)
        return
    prefixes = [mode + results_tag for mode in ("eval", "test") if getattr(args, f"do_{mode}")]
    for prefix in prefixes:
        log.write_results(f"{prefix}_results.json", {k: v for k, v in results.items()
                                                     if not k.startswith(("eval_", "test_")) or k.startswith(prefix)})
    log.merge_results(results, tuple(f"{prefix}_" for prefix in prefixes))


def main(args):
    # BERT's buffers (position and token type ids) are constants: DDP's broadcast of them before every forward pass
    # would be a collective each step for nothing. A model whose buffers training changes (BatchNorm) needs it. Up to
    # four loaders (train, validation, test, predict) start workers.
    accelerator = runtime.build_accelerator(args, args.output_dir, args.gradient_accumulation_steps,
                                            broadcast_buffers=False, loader_workers=4 * args.num_workers)
    batch = (("--train_batch_size", args.train_batch_size) if args.do_train
             else ("--eval_batch_size", args.eval_batch_size))
    flags.say_command(accelerator.print, args, flags.batch_line(*batch, accelerator.num_processes,
                                                                flags.BERT_BATCH_RULE))
    runtime.hold_output_dir(accelerator, args.output_dir)
    text_model.check_hub_ids_or_paths(args)  # before anything could go to the hub for a mistyped path
    # "" unless evaluating with other settings than trained
    results_tag = text_model.use_model_settings(args, accelerator.print, flag_roles())
    set_seed(args.seed)
    resume_path = None
    if args.do_train:  # the checkpoint to resume from, its files checked before anything is built or written
        outputs.check_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
        resume_path = checkpoint.agree_on_resume(accelerator, args.resume_from_checkpoint,
                                                 args.output_dir / "checkpoints")
    batches = {"--train_batch_size": args.train_batch_size} if args.do_train else {}
    per_device_batch = checkpoint.check_global_batches(accelerator, {**batches,
                                                                     "--eval_batch_size": args.eval_batch_size},
                                                       resume_path)
    tokenizer = tokenizer_and_length(args, accelerator.print)
    checkpoint_labels = None if args.do_train else text_model.saved_labels(args.model_name_or_path)
    data = load_text_data(args, accelerator, tokenizer, checkpoint_labels, accelerator.print)
    labels, splits = data.labels, data.datasets
    if args.num_tags and args.num_tags != len(labels):
        raise runtime.UserError(f"--num_tags {args.num_tags}: the data has {len(labels)} labels "
                                f"({', '.join(labels[:5])}{', ...' if len(labels) > 5 else ''})")
    metric_modules = text_metrics.load_metrics(args.metric, len(labels), args.cache_dir)
    train_ids = splits["train"].with_format("numpy")["labels"] if args.class_weights else None
    class_weights = loop.load_class_weights(args.class_weights, labels, train_ids)  # --do_train: checked by parse_args
    if class_weights:
        accelerator.print(class_weights.line())
    tokenizer, model = build_model(args, labels, accelerator.print, tokenizer)
    padding = text_data.resolve_padding(args, accelerator)
    loaders = build_dataloaders(args, tokenizer, splits, data.predict, padding)
    selection = best_model_selection(accelerator, args, model, loaders.get("validation"), labels, metric_modules)
    # what a resumed run must share with its checkpoint: what main computes from the flags kept_by it, and the
    # MUST_KEEP flags' values (FLAG_ROLES)
    must_match = flag_roles().must_match(args, {
        "labels": labels, "class_weights": class_weights and class_weights.by_label,  # a resumed run keeps its loss
        "model": {k: getattr(model.config, k, None) for k in
                  ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")},
        checkpoint.DATA_KEY: data.fingerprint, **selection.must_match()})
    model = runtime.maybe_data_parallel(model, args)
    retry = loop.OutOfMemoryRetry(accelerator, model, per_device_batch, args.gradient_accumulation_steps,
                                  args.output_dir / "checkpoints", args.auto_find_batch_size and args.do_train)
    stats = long_text_stats(args, splits)
    if data.unk_rate is not None:
        stats["train_unk_rate"] = text_model.check_unk_rate(data.unk_rate,
                                                            args.tokenizer_name or args.model_name_or_path)
        accelerator.print(f"tokenizer: {len(tokenizer)} tokens; [UNK] rate of the training text "
                          f"{stats['train_unk_rate']:.2%}")

    log = outputs.RunLog(accelerator, args.output_dir)
    results = {**runtime.run_info(accelerator, args.train_batch_size), **padding, **stats}
    trained = None
    if args.do_train:
        log.start(args, "bert_cls", clear=args.overwrite_output_dir and not args.resume_from_checkpoint,
                  card=text_model.model_card(args, labels, data, results,
                                             accelerator.unwrap_model(model).config.model_type, Path(__file__).name))
        accelerator.on_main_process(text_data.write_labels_file)(labels, args.output_dir / "labels.txt")
        task = Task(labels, must_match, selection, metric_modules,
                    class_weights and class_weights.tensor(accelerator.device))
        trained = retry.run(lambda attempt: train(args, accelerator, model, tokenizer, loaders, log, task, attempt),
                            resume=resume_path)
        results.update(trained.results, **retry.results)
        if results["stopped_early"]:
            accelerator.print(f"stopped early at step {results['stopped_early_at_step']}: "
                              f"{results['stopped_early_reason']}")
        if trained.preempted:
            accelerator.print("stopped on SIGTERM after saving a checkpoint; continue with --resume_from_checkpoint "
                              "latest")
            log.write_results("all_results.json", {**results, "preempted": True})
            log.end()
            return results
        model = trained.model
        prepared = {split: accelerator.prepare(loader) for split, loader in loaders.items() if split != "train"}
    else:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        model, prepared = export.prepare_for_inference(accelerator, model, loaders)
    results.update(evaluate_selected_model(accelerator, log, model, prepared, labels, args, metric_modules, trained,
                                           results_tag))
    if args.export_onnx:
        results.update(export_selected_onnx(accelerator, args, accelerator.unwrap_model(model), tokenizer, loaders))
    if args.do_predict:
        write_predictions(accelerator, log, model, prepared["predict"], data.predict, labels, args)
    write_results(log, args, results, results_tag)
    accelerator.print(json.dumps(results, indent=2, ensure_ascii=False))
    log.end()
    return results


if __name__ == "__main__":
    runtime.run_cli(main, parse_args())
