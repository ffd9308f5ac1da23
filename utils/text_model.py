"""Around the text classifier's model (train_bert_cls.py's adaptation section builds and loads it; nothing here names
a model class): where its files come from (run_classification.py's --config_name, --tokenizer_name, --cache_dir,
--model_revision, --token), the checks that a checkpoint of any layout fits the model, the text and the task, the
reference repository's best.pt, gradient checkpointing, attention without a device sync, the optimizer and its
parameter groups, the settings a trained model carries (TRAINED_WITH) and its model card.
Why each works as it does: docs/code.md#text_modelpy.
Neighbours: utils/text_data.py (tokenising), utils/text_metrics.py, utils/export.py (the export and checkpoint files).
"""
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
from transformers import Adafactor, get_scheduler

from . import checkpoint, export, outputs, runtime

TRAINED_WITH = "trained_with.json"
DEFAULT_MAX_SEQ_LEN = 512  # the reference's, and BERT's positions

ALLOWED_NEW_IN_ENCODER = ("pooler.",)


# add_model_source_args' flags (utils/checkpoint.py Role): the config's shape is part of what a resume must match
# (the scripts' `model` entry); another tokenizer would change the inputs; the rest say where files come from
MODEL_SOURCE_ROLES = {"--config_name": checkpoint.kept_by("model"), "--tokenizer_name": checkpoint.MUST_KEEP,
                      **checkpoint.this_launch("--cache_dir", "--model_revision", "--token", "--use_fast_tokenizer")}


@checkpoint.roles_beside("MODEL_SOURCE_ROLES")
def add_model_source_args(group):
    """Where the config, tokenizer and weights come from, with run_classification.py's flags."""
    group.add_argument("--config_name", default=None,
                       help="config.json from this hub id or directory instead of --model_name_or_path")
    group.add_argument("--tokenizer_name", default=None,
                       help="the tokenizer from this hub id or directory instead of --model_name_or_path")
    group.add_argument("--cache_dir", type=Path, default=None,
                       help="where hub downloads (model, config, tokenizer, --dataset_name) are kept; default: the "
                       "Hugging Face cache")
    group.add_argument("--model_revision", default=None,
                       help="branch, tag or commit of the hub ids of the model, config and tokenizer (default main)")
    group.add_argument("--token", default=None,
                       help="Hugging Face access token for private or gated repositories; never printed or written "
                       "(default: the one `hf auth login` saved)")
    group.add_argument("--use_fast_tokenizer", type=runtime.hf_bool, nargs="?", const=True, default=True,
                       help="only true: transformers 5 always loads the fast (Rust) tokenizer")


def check_model_source_args(args):
    """Refused while parsing: settings transformers would ignore."""
    if not args.use_fast_tokenizer:
        raise runtime.UserError("--use_fast_tokenizer false: transformers 5 always loads the fast (Rust `tokenizers`) "
                                "tokenizer and ignores this setting; drop it")
    sources = [args.model_name_or_path, args.config_name, args.tokenizer_name]
    if args.model_revision and all(Path(source).is_dir() for source in sources if source):
        raise runtime.UserError(f"--model_revision {args.model_revision}: a revision selects a version of a hub id, "
                                f"and the model, config and tokenizer all come from local directories")


@contextmanager
def loading(source, what):
    """transformers' loading errors (a missing file, no network for a hub id) as one line naming the source."""
    try:
        yield
    except (OSError, ValueError) as err:
        if "trust_remote_code" in str(err):  # transformers asks to run the repository's own Python code
            raise runtime.UserError(f"{source}: its {what} is custom code in the model's files; pass "
                                    f"--trust_remote_code if you trust that code") from None
        raise runtime.UserError(f"{source}: cannot load {what} ({str(err).strip().splitlines()[0]})") from None


def check_custom_code(source, trust_remote_code):
    """A UserError for a local model of a type only its own code defines (config.json `auto_map`) without
    --trust_remote_code."""
    config_file = Path(source) / "config.json"
    if trust_remote_code or not config_file.is_file():
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = read_model_json(config_file)
    if config.get("auto_map") and config.get("model_type") not in CONFIG_MAPPING:
        raise runtime.UserError(f"{source}: its model type {config.get('model_type')!r} is custom code in the model's "
                                f"files (config.json auto_map); pass --trust_remote_code if you trust that code")


def hub_options(args):
    """from_pretrained's download options: --cache_dir, --model_revision, --token."""
    return {"cache_dir": args.cache_dir and str(args.cache_dir), "revision": args.model_revision, "token": args.token}


def check_weight_files(model_name_or_path):
    """A local safetensors file that is cut short, named before transformers reads it (its error would not name it)."""
    for weights in sorted(Path(model_name_or_path).glob("*.safetensors")):
        problem = export.safetensors_problem(weights)
        if problem:
            raise runtime.UserError(problem)


def new_weight_names(loading_info):
    """The weights from_pretrained(output_loading_info=True) started new: missing, or of another shape."""
    mismatched = {key[0] if isinstance(key, tuple) else key for key in loading_info.get("mismatched_keys", ())}
    return sorted(set(loading_info.get("missing_keys", ())) | mismatched)


def check_starting_weights(model, new_weights, source):
    """A UserError when a weight of the model's encoder (not its pooler) is among `new_weights`."""
    encoder = model.base_model_prefix + "."
    random_encoder = [key for key in new_weights if key.startswith(encoder)
                      and not key[len(encoder):].startswith(ALLOWED_NEW_IN_ENCODER)]
    if random_encoder:
        raise runtime.UserError(f"{source}: {len(random_encoder)} encoder weights are not in the checkpoint and would "
                                f"start from random (e.g. {random_encoder[0]}); is it a {model.config.model_type} "
                                f"checkpoint? (--from_scratch trains from random on purpose)")


def head_by_name(model, source, labels, say=print):
    """A trained classifier trained on further with this run's `labels`: its head rows reordered to follow them by
    name (said in one line); other names with as many labels: a UserError."""
    trained = saved_labels(source) if Path(source).is_dir() else None
    if not trained or trained == labels or len(trained) != len(labels):  # another count: a new head
        return
    if set(trained) != set(labels):
        ours, theirs = sorted(set(labels) - set(trained)), sorted(set(trained) - set(labels))
        raise runtime.UserError(f"{source}: trained for other labels ({', '.join(theirs[:4])}; the data has "
                                f"{', '.join(ours[:4])}): by position each label would start as another's; train from "
                                f"its base model, or name the labels as the model does")
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == len(labels)][-1]
    rows = [trained.index(label) for label in labels]
    with torch.no_grad():
        head.weight.copy_(head.weight[rows])
        if head.bias is not None:
            head.bias.copy_(head.bias[rows])
    say(f"{source}: its head lists the same {len(labels)} labels in another order: its rows are reordered to this "
        f"run's labels, matched by name")


MAX_UNK_RATE = 0.5  # above this the vocabulary does not fit the text (cnews_1000 with bert-base-chinese: 1.0%)


def unk_rate(tokenizer, dataset, column="input_ids", rows=100_000):
    """[UNK] tokens / all tokens that are not special tokens, over a tokenised dataset, `rows` rows at a time."""
    special = np.fromiter(set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}, dtype=np.int64)
    unknown = counted = 0
    for batch in dataset.with_format("arrow").iter(batch_size=rows):  # in the dataset's row order and selection
        ids = pc.list_flatten(batch[column]).to_numpy(zero_copy_only=False)  # the rows' ids, end to end
        real = ids[~np.isin(ids, special)]  # [UNK] is a special token too, but it is what is counted
        unknown += int(np.count_nonzero(real == tokenizer.unk_token_id))
        counted += real.size
    return unknown / max(1, counted)


def check_unk_rate(rate, source, limit=MAX_UNK_RATE):
    """The training text's [UNK] rate (`unk_rate`); above `limit` a UserError, on every rank alike."""
    if rate > limit:
        raise runtime.UserError(f"{source}: the tokenizer maps {rate:.0%} of the training text to [UNK]; its vocab.txt "
                                f"does not fit this text")
    return rate


def problem_type(multi_label, regression=False):
    """transformers' config.problem_type for this run's task."""
    if regression:
        return "regression"
    return "multi_label_classification" if multi_label else "single_label_classification"


UTF8_BOM = b"\xef\xbb\xbf"


def read_model_json(path, bom_allowed=False):
    """A JSON file of a model directory; not JSON, or starting with a UTF-8 byte-order mark unless `bom_allowed`
    (our own files), a UserError naming it."""
    data = Path(path).read_bytes()
    if data.startswith(UTF8_BOM) and not bom_allowed:
        raise runtime.UserError(f"{path}: starts with a UTF-8 byte-order mark (a re-save in Windows Notepad?), which "
                                f"transformers cannot read; save it as UTF-8 without a BOM")
    try:
        return json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise runtime.UserError(f"{path}: not a readable JSON file (cut short by a copy or a full disk?): "
                                f"{err}") from None


def check_problem_type(model_name_or_path, multi_label, regression=False):
    """A trained model evaluated or used for prediction in the mode it was trained in (config.json problem_type)."""
    config_file = Path(model_name_or_path) / "config.json"
    saved = read_model_json(config_file).get("problem_type") if config_file.is_file() else None
    wanted = problem_type(multi_label, regression)
    flags = {"multi_label_classification": "--multi_label", "regression": "--do_regression"}
    if saved in ("multi_label_classification", "single_label_classification", "regression") and saved != wanted:
        advice = [f"drop {flags[wanted]}"] if wanted in flags else []
        advice += [f"pass {flags[saved]}"] if saved in flags else []
        raise runtime.UserError(f"{config_file}: the model was trained for {saved}; {'; '.join(advice)}")

# The reference BERT cnews repository saved `best.pt` as {"state_dict": model.state_dict(), ...} for a module
# holding `self.bert = BertModel(...)` and a `self.linear` head, `module.`-prefixed when trained under
# DataParallel. Its label order came from a Python set: pass the order it used with --labels_file.
LEGACY_BERT_HEADS = ("linear.", "fc.", "classifier.")


def load_legacy_bert(path, model):
    """Load the reference repo's best.pt into a Hugging Face *ForSequenceClassification model, or say why not."""
    state_dict = export.load_torch_checkpoint(path)["state_dict"]
    renamed = {}
    for key, value in state_dict.items():
        head = next((h for h in LEGACY_BERT_HEADS if key.startswith(h)), None)
        key = "classifier." + key[len(head):] if head else key
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if not key.startswith(("bert.", "classifier.")):
            key = "bert." + key  # a bare BertModel state_dict
        if not key.endswith("position_ids"):  # a buffer, rebuilt by the model
            renamed[key] = value
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith("position_ids")}
    unknown = sorted(set(renamed) - set(expected))
    missing = sorted(set(expected) - set(renamed))
    if unknown or missing:
        raise runtime.UserError(f"{path}: does not fit {type(model).__name__}: "
                                + (f"unknown key(s) {', '.join(unknown[:3])}" if unknown else "")
                                + ("; " if unknown and missing else "")
                                + (f"missing key(s) {', '.join(missing[:3])}" if missing else ""))
    for key, value in renamed.items():
        if value.shape != expected[key].shape and key.startswith("classifier."):
            raise runtime.UserError(f"{path}: its head predicts {value.shape[0]} classes, this run has "
                                    f"{expected[key].shape[0]} labels (check --labels_file)")
        if value.shape != expected[key].shape:
            raise runtime.UserError(f"{path}: {key} has shape {tuple(value.shape)}, this model "
                                    f"{tuple(expected[key].shape)} (check --model_name_or_path / --config_overrides)")
    model.load_state_dict(renamed, strict=False)
    return model


def enable_gradient_checkpointing(model, source):
    """--gradient_checkpointing: transformers' own, non-reentrant (docs/code.md#text_modelpy)."""
    if not model.supports_gradient_checkpointing:
        raise runtime.UserError(f"{source}: {type(model).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its name since transformers 5.2x; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


SDPA_WITH_MASK = "sdpa_with_mask"  # the name sync_free_attention registers


def sync_free_attention(model):
    """Every SDPA model in `model` switched to SDPA with a mask always built: no device sync per forward pass
    (docs/code.md#text_modelpy)."""
    from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def mask_always(*args, **kwargs):
        return sdpa_mask(*args, **{**kwargs, "allow_is_bidirectional_skip": False})

    AttentionInterface.register(SDPA_WITH_MASK, sdpa_attention_forward)
    AttentionMaskInterface.register(SDPA_WITH_MASK, mask_always)
    for module in model.modules():  # outermost first: switching a model switches the models inside it
        if isinstance(module, PreTrainedModel) and module.config._attn_implementation == "sdpa":
            module.set_attn_implementation(SDPA_WITH_MASK)


def saved_labels(model_name_or_path):
    """The id order a trained model was saved with (config id2label), or None for a base model."""
    config_file = Path(model_name_or_path) / "config.json"
    if not config_file.is_file():
        return None
    id2label = read_model_json(config_file).get("id2label")
    if not id2label or all(name.startswith("LABEL_") for name in id2label.values()):
        return None
    return [id2label[str(i)] for i in range(len(id2label))]


NO_DECAY = ("bias", "LayerNorm.weight", "layernorm.weight", "layer_norm.weight")


def optimizer_groups(model, weight_decay, learning_rate=None, layer_decay=1.0, head_learning_rate=None):
    """Parameter groups without weight decay on biases and LayerNorm weights, and with `layer_decay` < 1 or a
    `head_learning_rate` one per depth and decay (docs/code.md#text_modelpy)."""
    named = list(model.named_parameters())
    if layer_decay == 1.0 and head_learning_rate is None:
        return [
            {"params": [p for n, p in named if not any(nd in n for nd in NO_DECAY)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if any(nd in n for nd in NO_DECAY)], "weight_decay": 0.0},
        ]
    layers = model.config.num_hidden_layers
    groups = {}
    for name, parameter in named:
        rate = _layer_learning_rate(name, model.base_model_prefix, layers, learning_rate, layer_decay,
                                    head_learning_rate)
        decay = 0.0 if any(nd in name for nd in NO_DECAY) else weight_decay
        groups.setdefault((rate, decay), []).append(parameter)
    return [{"params": params, "lr": rate, "weight_decay": decay} for (rate, decay), params in groups.items()]


def _layer_learning_rate(name, base_prefix, layers, learning_rate, layer_decay, head_learning_rate):
    if not name.startswith(f"{base_prefix}.") or ".pooler." in f".{name}":
        return head_learning_rate or learning_rate
    layer = re.search(r"\.layer\.(\d+)\.", name)
    depth = int(layer.group(1)) + 1 if layer else 0  # the embeddings below layer 0
    return learning_rate * layer_decay ** (layers + 1 - depth)


# the Trainer's --optim names, each the optimizer the Trainer builds for it
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "adagrad", "rmsprop")


def build_optimizer(groups, args, device):
    """The Trainer's --optim over `groups` (optimizer_groups), with its --adam_* settings for AdamW."""
    if args.optim in ("adamw_torch", "adamw_torch_fused"):
        # fused: one kernel for all parameters; the step of the 21,128-row embedding was a fifth of a small model's step
        return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                 eps=args.adam_epsilon, fused=device.type in ("cpu", "cuda"))
    if args.optim == "adafactor":  # the Trainer's: a fixed learning rate, not Adafactor's relative step
        return Adafactor(groups, lr=args.learning_rate, scale_parameter=False, relative_step=False)
    optimizers = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop}
    return optimizers[args.optim](groups, lr=args.learning_rate)


HUB_OR_PATH_FLAGS = ("--model_name_or_path", "--config_name", "--tokenizer_name", "--dataset_name", "--metric")


def check_scheduler_args(args):
    """A UserError for a --lr_scheduler_type its --lr_scheduler_kwargs do not fit, by building it on a stand-in."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    try:
        get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=1, num_training_steps=10,
                      scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    except (TypeError, ValueError) as err:
        raise runtime.UserError(f"--lr_scheduler_type {args.lr_scheduler_type} with --lr_scheduler_kwargs "
                                f"{json.dumps(args.lr_scheduler_kwargs)}: {err}") from None


def check_hub_ids_or_paths(args, flags=HUB_OR_PATH_FLAGS):
    """A UserError for a hub-or-path flag's value that names nothing local and is no hub id, without the network."""
    for flag in flags:
        value = getattr(args, flag[2:])
        for item in value if isinstance(value, list) else [value] if value is not None else []:
            _check_hub_id_or_path(flag, str(item))


def _check_hub_id_or_path(flag, value):
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(value).expanduser().exists():
        return
    namespace = value.split("/")[0] if value.count("/") == 1 else None
    reason = None
    if value.startswith((".", "~")) or os.path.isabs(value) or (os.altsep and os.altsep in value) or "\\" in value:
        reason = "it is written as a path"
    elif value.count("/") > 1:
        reason = "a hub id has at most one '/'"
    elif namespace and Path(namespace).is_dir():
        reason = f"{namespace}/ is a local directory"
    else:
        try:
            validate_repo_id(value)
        except HFValidationError:
            reason = "it is not of a hub id's form (NAME or ORG/NAME)"
    if reason:
        raise runtime.UserError(f"{flag} {value}: no such file or directory (a local path, since {reason})")


def position_limit(model):
    """The most tokens `model` (may be on the meta device) takes by its learned position table; None without one
    (relative or rotary positions)."""
    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, torch.nn.Embedding):
            return module.num_embeddings - (module.padding_idx + 1 if module.padding_idx is not None else 0)
    return None


def fit_max_seq_len(max_seq_len, empty_model, source, say):
    """--max_seq_len for `empty_model` (built on the meta device): a UserError above its positions; none given,
    DEFAULT_MAX_SEQ_LEN or the model's lower limit (said in one line)."""
    limit = position_limit(empty_model)
    if max_seq_len is None:
        if limit is not None and limit < DEFAULT_MAX_SEQ_LEN:
            say(f"--max_seq_len {limit}: the most {source} takes (its learned position embeddings), not the default "
                f"{DEFAULT_MAX_SEQ_LEN}")
            return limit
        return DEFAULT_MAX_SEQ_LEN
    if limit is not None and max_seq_len > limit:
        raise runtime.UserError(f"--max_seq_len {max_seq_len}: {source} takes at most {limit} tokens (its learned "
                                f"position embeddings); pass --max_seq_len {limit} or less")
    return max_seq_len


def recorded_settings(model_name_or_path):
    """A local model's TRAINED_WITH, else its label mode from config.json's problem_type; {} for a base model."""
    model_dir = Path(model_name_or_path)
    if (model_dir / TRAINED_WITH).is_file():
        return read_model_json(model_dir / TRAINED_WITH, bom_allowed=True)
    config_file = model_dir / "config.json"
    problem_type = read_model_json(config_file).get("problem_type") if config_file.is_file() else None
    return {"multi_label": problem_type == "multi_label_classification"} if problem_type else {}


def use_model_settings(args, say, roles):
    """The settings `roles` (the script's FlagRoles) mark as recorded: given, else the trained model's (without
    --do_train), else the defaults; returns settings_from_model's results tag (docs/code.md#text_modelpy)."""
    settings = roles.exported()
    recorded = {} if args.do_train else roles.model_settings(recorded_settings(args.model_name_or_path))
    if args.multi_label is None:
        args.multi_label = bool(recorded.get("multi_label", settings["multi_label"]))
        if args.multi_label and args.metric:
            raise runtime.UserError(f"--metric: {args.model_name_or_path} is a multi-label model, and --metric passes "
                                    f"one class id per sample; use the built-in exact-match accuracy and "
                                    f"micro/macro F1")
    others = {dest: default for dest, default in settings.items() if dest != "multi_label"}
    return export.settings_from_model(args, others, recorded, args.model_name_or_path, say)


def long_text_usage(args):
    """The model card's lines that cut long texts as the training did; none for --truncation head."""
    room = args.max_seq_len - 2
    if args.doc_stride is not None:
        pooled = "logits.mean(0)" if args.pool == "mean" else "logits.max(0).values"
        return ["", f"Trained on windows of {args.max_seq_len} tokens overlapping by {args.doc_stride}, a text's "
                "prediction pooling its windows' logits: pipeline() sees the first window only. To reproduce:", "",
                "```python", "import torch", "",
                "# tokenizers >= 0.23.3: 0.23.2 returns two windows at most, whatever the text's length",
                f"inputs = classifier.tokenizer(text, truncation=True, max_length={args.max_seq_len}, "
                f"stride={args.doc_stride}, return_overflowing_tokens=True, padding=True, return_tensors=\"pt\")",
                "inputs.pop(\"overflow_to_sample_mapping\")",
                "with torch.no_grad():",
                "    logits = classifier.model(**inputs).logits  # (windows, labels)",
                f"probabilities = {pooled}.softmax(-1)", "```"]
    if args.truncation == "tail":
        return ["", "Trained on the last tokens of long texts: set `classifier.tokenizer.truncation_side = \"left\"` "
                "before calling the pipeline."]
    if args.truncation == "head_tail":
        return ["", f"Trained on the first {args.head_tokens} and last {room - args.head_tokens} tokens of long texts "
                "(pipeline() keeps the first ones). To reproduce:", "",
                "```python", "import torch", "", "tokenizer = classifier.tokenizer",
                "ids = tokenizer(text, add_special_tokens=False)[\"input_ids\"]",
                f"if len(ids) > {room}:", f"    ids = ids[:{args.head_tokens}] + ids[-{room - args.head_tokens}:]",
                "with torch.no_grad():",
                "    logits = classifier.model(input_ids=torch.tensor([[tokenizer.cls_token_id, *ids, "
                "tokenizer.sep_token_id]])).logits", "```"]
    return []


def own_type_import(model_type, script, trust_remote_code=False):
    """The model card's import of the script that registers `model_type` where transformers does not ship it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES or trust_remote_code:  # remote code: config.json's auto_map names it
        return []
    module = Path(script).stem
    line = f"import {module}" if module.isidentifier() else f"importlib.import_module({json.dumps(module)})"
    return [*([] if module.isidentifier() else ["import importlib"]),
            f"{line}  # registers the model type {json.dumps(model_type)} (below)"]


def model_card(args, labels, data, run, model_type="bert", script="train_bert_cls.py"):
    """best_model/README.md's fixed part (utils/outputs.py ModelCard); `run`: run_info's settings
    (docs/code.md#text_modelpy)."""
    best_dir = Path(args.output_dir) / "best_model"
    first_text, first_pair = data.first_text  # of the validation set, else the training set
    literal = json.dumps({"text": first_text, "text_pair": first_pair}, ensure_ascii=False)
    text = json.dumps(first_text, ensure_ascii=False) if first_pair is None else literal
    options = f"truncation=True, max_length={args.max_seq_len}" + (", top_k=None" if args.multi_label else "")
    registers = own_type_import(model_type, script, args.trust_remote_code)
    script = Path(script).name
    usage = "\n".join([
        "```python", *registers, "from transformers import pipeline", "",
        f"classifier = pipeline(\"text-classification\", model={json.dumps(str(best_dir))})",
        f"# truncated at {args.max_seq_len} tokens, as in training"
        + ("; top_k=None: every label's probability (multi-label)" if args.multi_label else ""),
        f"print(classifier({text}, {options}))", "```", "",
        *([f"`{model_type}` is {script}'s own model type, which transformers knows once the script has registered it "
           f"(its ADAPTATION SECTION, at import): run this where `{script}` and its `utils/` can be imported (its "
           f"directory), or register the model's classes as that section does before `pipeline()`.", ""]
          if registers else []),
        f"Or with this script: `python {script} --model_name_or_path {best_dir} --do_predict --predict_file "
        + (f"texts.jsonl --text_column {args.text_column} --text_pair_column {args.text_pair_column}"
           if first_pair is not None else "texts.txt")
        + f" --max_seq_len {args.max_seq_len}{' --multi_label' if args.multi_label else ''} --output_dir OUT` "
        "(it cuts long texts as the training did, from the model's trained_with.json).", *long_text_usage(args)])
    model = str(args.model_name_or_path)
    if args.from_scratch:
        model += f" (from scratch{', ' + args.config_overrides if args.config_overrides else ''})"
    settings = {"model": model, "multi_label": args.multi_label, "max_seq_len": args.max_seq_len,
                "long texts": args.truncation if args.doc_stride is None else
                f"windows, --doc_stride {args.doc_stride}, --pool {args.pool}",
                "train_batch_size (global)": args.train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps, "learning_rate": args.learning_rate,
                "num_train_epochs": args.num_train_epochs, "max_train_steps": args.max_train_steps, "seed": args.seed,
                "mixed_precision": run["mixed_precision"], "processes": run["num_processes"]}
    hub_id = not args.from_scratch and not Path(model).exists()  # the hub's base_model field takes hub ids only
    files = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
    if args.do_regression:  # one output
        labels = [f"{labels[0]} (regression: the predicted number, pipeline()'s score)"]
    return outputs.ModelCard(
        title=f"{Path(args.output_dir).name}/best_model",
        metadata={"library_name": "transformers", "pipeline_tag": "text-classification",
                  "tags": ["text-classification", "train_bert_cls.py"], "model_name": Path(args.output_dir).name,
                  **({"base_model": args.model_name_or_path} if hub_id else {})},
        labels=labels, settings=settings, usage=usage, command=outputs.command_line(),
        data_files={split: (files[split] or f"{args.dataset_name} ({split})", len(found))
                    for split, found in data.datasets.items()})
