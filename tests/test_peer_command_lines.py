"""The command lines of the tools these scripts replace, pasted with only paths and sizes made tiny: each parses with
the peer's meaning (said once in the log), or stops with one line naming what replaces it (utils/flags.py)."""
import shlex

import pytest
from conftest import launch, read_json, read_jsonl, run_here

import train_bert_cls
import train_resnet
from utils.image_optim import lr_lambda

# (command as its README / docs / tests give it, {attribute: value} it must parse to, or the one error line's start)
BERT_COMMANDS = [
    # transformers examples/pytorch/text-classification/README.md, run_classification.py
    ("--model_name_or_path bert-base-uncased --dataset_name ag_news --shuffle_train_dataset --metric_name accuracy "
     "--text_column_name text --text_column_delimiter '\\n' --label_column_name label --do_train --do_eval "
     "--max_seq_length 512 --per_device_train_batch_size 32 --learning_rate 2e-5 --num_train_epochs 1 "
     "--output_dir /tmp/ag_news/", "error: --text_column_delimiter joins several --text_column_names"),
    ("--model_name_or_path bert-base-uncased --dataset_name ag_news --shuffle_train_dataset --metric_name accuracy "
     "--text_column_name text --label_column_name label --do_train --do_eval --max_seq_length 512 "
     "--per_device_train_batch_size 32 --learning_rate 2e-5 --num_train_epochs 1 --output_dir /tmp/ag_news/",
     {"train_batch_size": 64, "max_seq_len": 512, "shuffle_train_dataset": True}),
    # transformers examples/pytorch/test_pytorch_examples.py, run_glue's test (Trainer flags, = values)
    ("--model_name_or_path distilbert-base-uncased --output_dir /tmp/glue --overwrite_output_dir --train_file "
     "t.csv --validation_file v.csv --do_train --do_eval --per_device_train_batch_size=2 "
     "--per_device_eval_batch_size=1 --learning_rate=1e-4 --max_steps=10 --warmup_steps=2 --seed=42 "
     "--max_seq_length=128", {"train_batch_size": 4, "eval_batch_size": 2, "warmup_steps": 2, "max_train_steps": 10}),
    # Trainer booleans and float epochs (run_xnli's README), the scheduler flags
    ("--model_name_or_path m --train_file t.csv --do_train True --do_eval False --overwrite_output_dir True "
     "--gradient_checkpointing True --trust_remote_code False --num_train_epochs 2.0 --lr_scheduler_type "
     "cosine_with_restarts --lr_scheduler_kwargs '{\"num_cycles\": 2}' --optim adamw_torch_fused --fp16",
     {"do_train": True, "do_eval": False, "gradient_checkpointing": True, "trust_remote_code": False,
      "num_train_epochs": 2, "lr_scheduler_kwargs": {"num_cycles": 2}, "mixed_precision": "fp16"}),
    # run_glue_no_trainer's README
    ("--model_name_or_path bert-base-cased --train_file t.csv --max_length 128 --per_device_train_batch_size 32 "
     "--learning_rate 2e-5 --num_train_epochs 3 --output_dir /tmp/mrpc/ --do_train", {"max_seq_len": 128}),
    ("--model_name_or_path bert-base-cased --task_name mrpc --do_train", "error: --task_name is a flag of "
     "transformers' text-classification examples; here: --dataset_name nyu-mll/glue --dataset_config_name TASK"),
    # accelerate examples/README.md, complete_nlp_example.py
    ("--model_name_or_path m --train_file t.csv --do_train --mixed_precision fp16 --checkpointing_steps epoch "
     "--with_tracking --output_dir out", {"checkpointing_steps": None, "with_tracking": True}),
    ("--model_name_or_path m --train_file t.csv --do_train --fp16 --with_tracking --project_dir logs",
     "error: --project_dir is a flag of accelerate's examples; here: --output_dir DIR"),
    # the Chinese BERT tutorial's command (docs/bert.md)
    ("--bert_dir=../model_hub/chinese-bert-wwm-ext/ --data_dir=DATA --data_name=cnews --log_dir=./logs/ "
     "--output_dir=./checkpoints/ --num_tags=10 --seed=123 --max_seq_len=512 --lr=3e-5 --train_batch_size=12 "
     "--train_epochs=5 --eval_batch_size=12 --do_train --do_predict --do_test",
     {"model_name_or_path": "../model_hub/chinese-bert-wwm-ext/", "num_tags": 10, "learning_rate": 3e-5,
      "num_train_epochs": 5, "train_batch_size": 12}),
    ("--bert_dir=m --data_dir=DATA --local_rank 0 --do_train", "error: --local_rank is a flag of the Chinese BERT "
     "tutorial; here: the launcher's business"),
]

RESNET_COMMANDS = [
    # pytorch/examples imagenet/README.md and run_python_examples.sh
    ("-a resnet18 DATA", {"arch": "resnet18", "batch_size": 256}),
    ("-a resnet18 --dummy", {"dummy": 1_281_167}),
    ("--epochs 1 --dummy --no-accel", {"cpu": True, "epochs": 1}),
    ("-a resnet50 --dist-url 'tcp://127.0.0.1:FREEPORT' --dist-backend 'nccl' --multiprocessing-distributed "
     "--world-size 1 --rank 0 DATA", "error: --dist-url is a flag of pytorch/examples imagenet/main.py; here: "
     "accelerate launch --main_process_ip"),
    # torchvision references/classification/README.md
    ("--model mobilenet_v3_large --epochs 600 --opt rmsprop --batch-size 128 --lr 0.064 --wd 0.00001 "
     "--lr-step-size 2 --lr-gamma 0.973 --auto-augment imagenet --random-erase 0.2 --data-path DATA",
     {"arch": "mobilenet_v3_large", "opt": "rmsprop", "batch_size": 128, "lr_step_epochs": 2}),
    ("--model regnet_x_400mf --epochs 100 --batch-size 128 --wd 0.00005 --lr=0.8 --lr-scheduler=cosineannealinglr "
     "--lr-warmup-method=linear --lr-warmup-epochs=5 --lr-warmup-decay=0.1 --data-path DATA",
     {"lr": 0.8, "lr_scheduler": "cosineannealinglr", "lr_warmup_decay": 0.1}),
    ("--model resnet50 --opt SGD --lr-scheduler exponentiallr --lr-gamma 0.9 --amp --data-path DATA",
     {"opt": "sgd", "lr_scheduler": "exponentiallr", "mixed_precision": "fp16"}),
    ("--model swin_t --epochs 300 --batch-size 128 --opt adamw --lr 0.001 --weight-decay 0.05 --norm-weight-decay "
     "0.0 --bias-weight-decay 0.0 --transformer-embedding-decay 0.0 --lr-scheduler cosineannealinglr --lr-min "
     "0.00001 --amp --data-path DATA", "error: --transformer-embedding-decay is a flag of torchvision's"),
    # timm's training docs
    ("DATA --model seresnet34 --sched cosine --epochs 150 --warmup-epochs 5 --lr 0.4 --batch-size 256 --amp -j 4",
     "error: --arch seresnet34: not a torchvision classification model; timm's seresnet34 is -a timm:seresnet34"),
    ("DATA --model timm:seresnet34 --sched cosine --epochs 150 --warmup-epochs 5 --lr 0.4 --batch-size 256 --amp",
     {"arch": "timm:seresnet34", "lr_scheduler": "cosine", "warmup_epochs": 5, "mixed_precision": "fp16"}),
    ("--data-dir DATA --model resnet50 --img-size 160 --smoothing 0.1 --clip-grad 1.0 --min-lr 1e-5 "
     "--channels-last --log-interval 50 --grad-accum-steps 2 --sched cosine --decay-rate 0.5",
     {"image_size": 160, "label_smoothing": 0.1, "clip_grad_norm": 1.0, "lr_min": 1e-5, "channels_last": True,
      "print_freq": 50, "gradient_accumulation_steps": 2, "lr_gamma": 0.5}),
    ("DATA --model resnet50 --aa rand-m9-mstd0.5-inc1 --reprob 0.5 --remode pixel",
     {"auto_augment": "rand-m9-mstd0.5-inc1", "random_erase": 0.5, "random_erase_mode": "pixel"}),
    ("DATA --model resnet50 --aa v0 --reprob 0.25", {"auto_augment": "v0", "random_erase_mode": "pixel"}),
    ("DATA --model resnet50 --aa ra --random-erase 0.25", {"auto_augment": "ra", "random_erase_mode": "const"}),
    ("DATA --model resnet50 --aa rand-q9", "error: --aa rand-q9: timm does not read it"),
    ("DATA --model resnet50 --aa randaugment", "error: argument --auto_augment/--auto-augment/--aa: 'randaugment' "
     "is neither a torchvision policy"),
    ("DATA --opt rmsproptf --momentum 0.9", {"opt": "rmsproptf"}),
    ("DATA --opt lamb", "error: argument --opt: invalid choice 'lamb': (choose from sgd, sgd_nesterov, adamw, "),
]


def parse(module, command, tmp_path, capsys):
    """(args, None) or (None, the whole of stderr) for `command` with DATA a real directory."""
    argv = shlex.split(command.replace("DATA", str(tmp_path)))
    try:
        return module.parse_args(argv), None
    except SystemExit as exit_:
        assert exit_.code == 2
        return None, capsys.readouterr().err


@pytest.mark.parametrize("module, command, expected",
                         [(train_bert_cls, *case) for case in BERT_COMMANDS] +
                         [(train_resnet, *case) for case in RESNET_COMMANDS], ids=lambda value: str(value)[:40])
def test_peer_command_parses_or_is_refused_in_one_line(module, command, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # a per-device batch is then twice the global one
    for split in ("train", "test"):
        (tmp_path / f"{split}.txt").write_text("体育\t一个标题\n", encoding="utf-8")
    args, error = parse(module, command, tmp_path, capsys)
    if isinstance(expected, str):
        assert error is not None and error.startswith(expected) and error.count("\n") == 1, error
        return
    assert error is None, error
    for name, value in expected.items():
        assert getattr(args, name) == value, (name, getattr(args, name))


def test_every_spelling_that_is_not_the_flag_own_is_said_once(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = train_bert_cls.parse_args(["--bert_dir", "m", "--train_file", "t.csv", "--do_train",
                                      "--per_device_train_batch_size", "32", "--lr", "2e-5", "--bf16"])
    assert args.train_batch_size == 128
    assert args.command_notes == ("--per_device_train_batch_size 32 x 4 processes = --train_batch_size 128 "
                                  "(the GLOBAL batch)", "--bert_dir m = --model_name_or_path m",
                                  "--lr 2e-05 = --learning_rate 2e-05", "--bf16 = --mixed_precision bf16")


@pytest.mark.parametrize("module, argv, line", [
    (train_bert_cls, ["--model_name_or_path", "m", "--do_train", "--per_device_train_batch_sz", "8"],
     "error: unrecognized flag --per_device_train_batch_sz; did you mean --per_device_train_batch_size?\n"),
    (train_bert_cls, ["--model_name_or_path", "m", "--do_train", "--lr_scheduler_type", "cosin"],
     "error: argument --lr_scheduler_type: invalid choice 'cosin': did you mean cosine? (choose from linear, "),
    (train_bert_cls, ["--model_name_or_path", "m", "--do_train", "--num_train_epochs", "2.5"],
     "error: argument --num_train_epochs/--train_epochs: must be a positive integer, not '2.5': whole epochs only "
     "here; for part of an epoch pass --max_train_steps"),
    (train_bert_cls, ["--model_name_or_path", "m", "--do_train", "--fp16", "--mixed_precision", "bf16"],
     "error: --fp16 and --mixed_precision set the same thing (--mixed_precision); pass one\n"),
    (train_bert_cls, ["--model_name_or_path", "m", "--do_train", "--lr_scheduler_type", "cosine_with_min_lr"],
     "error: --lr_scheduler_type cosine_with_min_lr with --lr_scheduler_kwargs {}: "),
    (train_bert_cls, ["--model_name_or_path", "m", "--do_train", "maybe"],
     "error: unexpected argument 'maybe' (a flag before it takes no value, or it is misspelt)\n"),
    (train_resnet, ["--dummy", "--lr-scheduler", "cosineanealinglr"],
     "error: argument --lr_scheduler/--lr-scheduler/--sched: invalid choice 'cosineanealinglr': did you mean "
     "cosineannealinglr?"),
    (train_resnet, ["--dummy", "--sched", "cosine", "--lr-scheduler", "step"],
     "error: --sched and --lr-scheduler set the same thing (--lr_scheduler); pass one\n"),
    (train_resnet, ["--dummy", "--print_freq", "5"], "error: unrecognized flag --print_freq; did you mean --print-freq?\n"),
])
def test_a_refused_flag_or_value_costs_one_line(module, argv, line, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(line) and err.count("\n") == 1 and "usage:" not in err, err


def test_trainer_boolean_values_and_optional_values():
    args = train_bert_cls.parse_args(["--model_name_or_path", "m", "--train_file", "t.csv", "--do_train", "true",
                                      "--multi_label", "False", "--do_eval", "--group_by_length", "0"])
    assert (args.do_train, args.multi_label, args.do_eval, args.group_by_length) == (True, False, True, False)
    args = train_resnet.parse_args(["-a", "resnet18", "--dummy", "/data/imagenet"])  # main.py's --dummy DATA
    assert args.dummy == 1_281_167 and str(args.data) == "/data/imagenet"
    assert train_resnet.parse_args(["--dummy", "8"]).dummy == 8


def test_shuffle_seed_zero_is_a_seed():
    args = train_bert_cls.parse_args(["--model_name_or_path", "m", "--train_file", "t.csv", "--do_train",
                                      "--shuffle_train_dataset", "True", "--shuffle_seed", "0"])
    computed = dict.fromkeys(["labels", "model", "training_data", "class_weights", "metric_for_best_model",
                              "greater_is_better"])
    assert args.shuffle_seed == 0 and train_bert_cls.flag_roles().must_match(args, computed)["--shuffle_seed"] == 0


def test_torchvision_exponential_schedule():
    args = train_resnet.parse_args(["--dummy", "--lr-scheduler", "exponentiallr", "--lr-gamma", "0.5"])
    factor = lr_lambda(args, 10, 100)
    assert (factor(0), factor(9), factor(10), factor(25)) == (1.0, 1.0, 0.5, 0.25)


def test_trainer_command_trains_with_trainer_meanings(text_data, tmp_path):
    """The Trainer's spellings on 2 processes: a per-device batch of 8 is the global 16, said once, first; the cosine
    schedule with 2 warmup steps is transformers' own; the Trainer's Adafactor trains."""
    from transformers import get_cosine_schedule_with_warmup
    import torch
    out = tmp_path / "trainer"
    proc = launch("train_bert_cls.py", [
        "--bert_dir", text_data / "model", "--from_scratch", "--data_dir", text_data, "--max_length", "16",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--lr", "2e-3",
        "--num_train_epochs", "1.0", "--max_steps", "6", "--lr_scheduler_type", "cosine", "--warmup_steps", "2",
        "--checkpointing_steps", "epoch", "--logging_steps", "1", "--do_train", "True", "--do_eval", "True",
        "--optim", "adafactor",
        "--do_test", "False", "--num_tags", "10", "--log_dir", "logs", "--output_dir", out,
        "--overwrite_output_dir", "True"], num_processes=2)
    assert proc.stdout.splitlines()[0].startswith("batch: --train_batch_size 16 = 8 per process x 2 processes")
    assert proc.stdout.count("read as: --per_device_train_batch_size 8 x 2 processes = --train_batch_size 16") == 1
    assert proc.stdout.count("read as: --log_dir logs: ignored") == 1
    results = read_json(out / "all_results.json")
    assert (results["global_batch_size"], results["per_device_batch_size"]) == (16, 8)
    assert "eval_accuracy" in results and not any(key.startswith("test_") for key in results)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    expected = get_cosine_schedule_with_warmup(optimizer, 2, 6)
    rates = []  # the rate after each step, as the log line of that step shows it
    for _ in range(6):
        optimizer.step()
        expected.step()
        rates.append(expected.get_last_lr()[0])
    logged = [event["lr"] for event in read_jsonl(out / "metrics.jsonl") if event["event"] == "train"]
    assert logged == pytest.approx(rates, rel=1e-4, abs=1e-12), (logged, rates)


def test_timm_command_trains_with_timm_meanings(few_digits, tmp_path):
    """timm's spellings (and main.py's --no-accel), one process: the run takes them and says how it read them."""
    out = tmp_path / "timm"
    proc = run_here("train_resnet.py", [
        "--data-dir", few_digits, "--model", "resnet18", "--sched", "cosine", "--min-lr", "1e-4", "--img-size", "16",
        "--val_resize", "16", "--smoothing", "0.1", "--clip-grad", "1.0", "--log-interval", "1",
        "--grad-accum-steps", "1", "--per_device_batch_size", "32", "--epochs", "1", "-j", "0", "--no-accel",
        "--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--output-dir", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("batch: -b 32 = 32 per process x 1 process"), lines[:3]
    for note in ("--sched cosine = --lr_scheduler cosine", "--img-size 16 = --image_size 16",
                 "--smoothing 0.1 = --label_smoothing 0.1", "--no-accel = --cpu",
                 "--aa rand-m9-mstd0.5-inc1 = --auto_augment rand-m9-mstd0.5-inc1",
                 "--reprob: timm's per-pixel noise = --random_erase_mode pixel"):
        assert proc.stdout.count(f"read as: {note}") == 1, note
    results = read_json(out / "all_results.json")
    assert results["global_batch_size"] == 32 and results["device"] == "cpu"
    assert results["deterministic_algorithms"] is False  # not asked for (tests/test_determinism.py: asked for)
    settings = read_json(out / "run_config.json")["args"]
    assert (settings["auto_augment"], settings["random_erase"], settings["random_erase_mode"]) == \
        ("rand-m9-mstd0.5-inc1", 0.25, "pixel"), settings


class NotANamespace:
    """A class a checkpoint may not hold: only argparse.Namespace is allowed beside the tensors."""

    def __init__(self):
        self.model = "resnet18"


def test_torchvision_checkpoint_file_evaluates_and_resumes(few_digits, tmp_path):
    """torchvision's checkpoint.pth (model, optimizer, lr_scheduler, epoch, args as a pickled argparse.Namespace):
    -e evaluates its weights at the image sizes its args recorded; --resume continues after its epoch; any other
    pickled class in it is refused in one line."""
    import argparse

    import torch
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    args = argparse.Namespace(model="resnet18", lr=0.1, val_resize_size=16, val_crop_size=16, train_crop_size=16,
                              interpolation="bilinear")
    checkpoint = tmp_path / "checkpoint.pth"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "lr_scheduler": {}, "epoch": 0,
                "args": args}, checkpoint)
    common = [few_digits, "-a", "resnet18", "-j", "0", "-b", "32", "--cpu"]
    proc = run_here("train_resnet.py", [*common, "-e", "--resume", checkpoint, "--output_dir", tmp_path / "eval"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = read_json(tmp_path / "eval" / "eval_results.json")
    assert results["eval_samples"] > 0 and "eval_acc1" in results
    proc = run_here("train_resnet.py", [*common, "--image_size", "16", "--val_resize", "16", "--epochs", "2",
                                        "--resume", checkpoint, "--output_dir", tmp_path / "resumed"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = {event["epoch"] for event in read_jsonl(tmp_path / "resumed" / "metrics.jsonl") if "epoch" in event}
    assert epochs and min(epochs) >= 1, epochs  # torchvision's epoch 0 was done: the run trains epoch 1 (of 0, 1)
    torch.save({"model": model.state_dict(), "epoch": 0, "args": NotANamespace()}, checkpoint)
    proc = run_here("train_resnet.py", [*common, "-e", "--resume", checkpoint, "--output_dir", tmp_path / "evil"],
                    check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "NotANamespace" in proc.stderr, proc.stderr


def test_accelerate_examples_resume_path_names_this_layout(tmp_path):
    """accelerate's examples resume from OUTPUT_DIR/step_N; here the checkpoints are OUTPUT_DIR/checkpoints/step_N:
    the line names the one to pass."""
    from utils.checkpoint import STATE_FILE, resolve_resume
    from utils.runtime import UserError

    (tmp_path / "checkpoints" / "step_5").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_5" / STATE_FILE).write_text("{}")
    with pytest.raises(UserError, match=f"no such checkpoint directory; this run's checkpoints are in "
                                        f"{tmp_path / 'checkpoints'}: --resume_from_checkpoint "
                                        f"{tmp_path / 'checkpoints' / 'step_5'} "):
        resolve_resume(str(tmp_path / "step_5"), tmp_path / "checkpoints")
    assert resolve_resume(str(tmp_path / "checkpoints" / "step_5"), tmp_path / "checkpoints").name == "step_5"


def test_run_classification_sentence_column_is_named(tmp_path):
    """run_classification.py reads a `sentence` column by default; here --text_column is `text`: the line says which
    flag reads that file."""
    import csv

    from utils.runtime import UserError
    from utils.text_data import DEFAULT_FORMAT, read_examples

    path = tmp_path / "train.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["sentence", "label"], ["一个标题", "体育"]])
    with pytest.raises(UserError, match=r"header lacks column\(s\) text \(--text_column\); it has 'sentence', "
                                        r"run_classification.py's default text column: pass --text_column sentence"):
        read_examples(path, fmt=DEFAULT_FORMAT)
    path = tmp_path / "train.jsonl"
    path.write_text('{"sentence": "一个标题", "label": "体育"}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"no field 'text' \(--text_column\); it has 'sentence'"):
        read_examples(path, fmt=DEFAULT_FORMAT)


def test_timm_mixing_flags_mix_the_whole_batch_as_timm_does():
    args = train_resnet.parse_args(["--dummy", "--mixup", "0.2", "--cutmix", "1.0"])
    assert (args.mixup_alpha, args.cutmix_alpha, args.mixup_mode) == (0.2, 1.0, "batch")
    assert "--cutmix: timm's whole-batch mixing = --mixup_mode batch" in args.command_notes
    assert train_resnet.parse_args(["--dummy", "--mixup-alpha", "0.2"]).mixup_mode == "pair"  # ours and torchvision's
    assert train_resnet.parse_args(["--dummy", "--mixup", "0.2", "--mixup_mode", "pair"]).mixup_mode == "pair"


def test_layerwise_learning_rate_decay_and_head_learning_rate():
    """Each parameter's learning rate: the head's own, encoder layer i of L at lr x decay^(L - i), the embeddings
    at lr x decay^(L + 1); no weight decay on biases and LayerNorm; without either flag the two plain groups."""
    from transformers import BertConfig, BertForSequenceClassification

    from utils.text_model import optimizer_groups

    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=16, num_labels=3))
    groups = optimizer_groups(model, 0.01, 1e-3, 0.5, 1e-2)
    rate = {id(p): (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert rate[id(named["classifier.weight"])] == (1e-2, 0.01)
    assert rate[id(named["bert.pooler.dense.weight"])] == (1e-2, 0.01)
    assert rate[id(named["bert.encoder.layer.1.attention.self.query.weight"])] == (1e-3 * 0.5, 0.01)
    assert rate[id(named["bert.encoder.layer.0.output.LayerNorm.weight"])] == (1e-3 * 0.25, 0.0)
    assert rate[id(named["bert.embeddings.word_embeddings.weight"])] == (1e-3 * 0.125, 0.01)
    assert len(rate) == len(named)
    assert [g["weight_decay"] for g in optimizer_groups(model, 0.01)] == [0.01, 0.0]


@pytest.mark.parametrize("optim, kind", [("adamw_torch", "AdamW"), ("sgd", "SGD"), ("adafactor", "Adafactor"),
                                         ("adagrad", "Adagrad"), ("rmsprop", "RMSprop")])
def test_trainer_optimizers(optim, kind):
    import torch

    from utils.text_model import build_optimizer

    args = train_bert_cls.parse_args(["--model_name_or_path", "m", "--train_file", "t.csv", "--do_train",
                                      "--optim", optim, "--learning_rate", "0.01"])
    optimizer = build_optimizer([{"params": [torch.nn.Parameter(torch.ones(2))]}], args, torch.device("cpu"))
    assert type(optimizer).__name__ == kind and optimizer.param_groups[0]["lr"] == 0.01


def test_timm_rmsproptf_is_timms_own():
    import torch
    from timm.optim import RMSpropTF

    from utils.image_optim import build_optimizer

    args = train_resnet.parse_args(["--dummy", "--opt", "rmsproptf", "--lr", "0.016", "--momentum", "0.9"])
    optimizer = build_optimizer(torch.nn.Linear(2, 2), args)
    assert isinstance(optimizer, RMSpropTF)
    assert (optimizer.defaults["alpha"], optimizer.defaults["momentum"], optimizer.defaults["lr"]) == (0.9, 0.9, 0.016)


def test_do_eval_without_validation_says_what_run_classification_would_do(text_data, tmp_path):
    """run_classification.py falls back to the test split for --do_eval; here the line says so and names --do_test."""
    proc = run_here("train_bert_cls.py", ["--model_name_or_path", text_data / "model", "--from_scratch",
                                          "--train_file", text_data / "train.txt", "--test_file",
                                          text_data / "test.txt", "--do_train", "--do_eval",
                                          "--output_dir", tmp_path / "out"], check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "needs a validation file" in proc.stderr and "run_classification.py would evaluate on the test split " \
        "instead: here that is --do_test" in proc.stderr, proc.stderr


def test_timm_augmentation_flags_build_timms_ops():
    """--aa: timm's own RandAugment with the string's magnitude and its deviation, on this pipeline's uint8 tensors,
    the same for the same image seed; --reprob / --remode: RandomErasing filling as timm's modes do (pixel: a normal
    value per pixel, rand: one per channel, const: zeros, torchvision's --random-erase default)."""
    import torch
    from timm.data.auto_augment import RandAugment
    from torchvision.transforms import v2

    from utils.image_augment import ChannelNoiseErasing, TimmAugment

    args = train_resnet.parse_args(["--dummy", "--img-size", "32", "--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.5"])
    steps = train_resnet.train_transform(args).transforms
    timm_ops = [step for step in steps if isinstance(step, TimmAugment)]
    assert len(timm_ops) == 1 and isinstance(timm_ops[0].op, RandAugment), steps
    assert {(op.magnitude, op.magnitude_std) for op in timm_ops[0].op.ops} == {(9, 0.5)}
    assert {op.name for op in timm_ops[0].op.ops} >= {"PosterizeIncreasing", "SolarizeIncreasing"}  # inc1's ops
    erasing = steps[-1]
    assert type(erasing) is v2.RandomErasing and erasing.p == 0.5 and erasing.value is None  # None: per-pixel normal
    image = torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8)
    outputs = []
    for _ in range(2):
        torch.manual_seed(3)
        outputs.append(timm_ops[0](image))
    assert outputs[0].dtype == torch.uint8 and outputs[0].shape == image.shape and torch.equal(*outputs)
    for seed in range(100):  # timm's strongest posterize keeps 0 bits, which Pillow >= 12 refuses on its own
        torch.manual_seed(seed)
        timm_ops[0](image)
    const = train_resnet.train_transform(train_resnet.parse_args(["--dummy", "--random-erase", "0.5"])).transforms[-1]
    assert type(const) is v2.RandomErasing and const.value == [0.0]
    args = train_resnet.parse_args(["--dummy", "--reprob", "1", "--remode", "rand"])
    per_channel = train_resnet.train_transform(args).transforms[-1]
    assert isinstance(per_channel, ChannelNoiseErasing)
    torch.manual_seed(0)
    erased = per_channel(torch.full((3, 64, 64), 7.0))
    rectangle = erased[:, (erased != 7.0).all(0).any(1)][:, :, (erased != 7.0).all(0).any(0)]  # (3, h, w)
    assert rectangle.numel() > 3 and all(channel.unique().numel() == 1 for channel in rectangle), rectangle
    assert rectangle[:, 0, 0].unique().numel() == 3  # a value of its own per channel


# transformers examples/pytorch/text-classification/README.md, the multi-label example (reuters21578's ModApte
# configuration: train, test and `unused` splits, a list of topics per article); the local dataset has no
# configurations, so --dataset_config_name ModApte goes with the hub id
REUTERS_COMMAND = ("--model_name_or_path MODEL --dataset_name DATA --shuffle_train_dataset --remove_splits unused "
                   "--metric_name f1 --text_column_name text --label_column_name topics --do_train --do_eval "
                   "--max_seq_length 16 --per_device_train_batch_size 16 --learning_rate 2e-3 --num_train_epochs 1 "
                   "--output_dir OUT")


def write_reuters_like(root):
    """train / test / unused splits with reuters21578's columns: `text` and `topics`, a list of strings (some
    empty, as many ModApte articles are), written by save_to_disk."""
    import random

    from datasets import Dataset, DatasetDict

    from utils.demo_data import TOPICS, make_headline

    rng = random.Random(0)
    names = list(TOPICS)[:4]

    def split(n):
        topics = [sorted(set(rng.sample(names, rng.choice([0, 1, 1, 2])))) for _ in range(n)]
        return Dataset.from_dict({"text": [make_headline(rng, (t or names)[0], 0.0) for t in topics], "topics": topics})

    DatasetDict(train=split(64), test=split(16), unused=split(8)).save_to_disk(str(root))
    return root


def test_run_classification_reuters_multi_label_example(text_data, tmp_path):
    """The pasted command stops in one line naming --do_test (no validation split: run_classification.py would
    evaluate on the test split); with --do_test, in one line naming --multi_label (list labels); with both it trains,
    the `unused` split dropped, --metric_name f1 read as the built-in micro-F1 (said once)."""
    data = write_reuters_like(tmp_path / "reuters")
    command = REUTERS_COMMAND.replace("MODEL", str(text_data / "model")).replace("DATA", str(data))
    argv = [*shlex.split(command.replace("OUT", str(tmp_path / "out"))), "--from_scratch"]
    proc = run_here("train_bert_cls.py", argv, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--do_eval needs a validation split" in proc.stderr and "here that is --do_test" in proc.stderr
    argv[argv.index("--do_eval")] = "--do_test"
    proc = run_here("train_bert_cls.py", argv, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "column 'topics' holds lists of labels: pass --multi_label" in proc.stderr, proc.stderr
    proc = run_here("train_bert_cls.py", [*argv, "--multi_label", "--remove_splits", "nonesuch"], check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "has no split nonesuch" in proc.stderr
    proc = run_here("train_bert_cls.py", [*argv, "--multi_label"])
    assert proc.stdout.count("read as: --metric f1 with --multi_label = the built-in micro_f1") == 1, proc.stdout
    assert "train <- split 'train' (64 rows), test <- split 'test' (16 rows)" in proc.stdout, proc.stdout
    results = read_json(tmp_path / "out" / "all_results.json")
    assert 0.0 <= results["test_micro_f1"] <= 1.0, results
