"""Each flag's role is declared once, and what the checkpoints, the exports and the results need is derived from it.

Every option of each script's parser has exactly one entry in its FLAG_ROLES (utils/checkpoint.py FlagRoles), so a
new flag cannot be forgotten: the scripts refuse to start without one. The derived lists hold today's entries plus
the additions named here, each with its reason. Resumes that change or keep a flag behave as its role says:
tests/test_edges.py (--label_smoothing, --seed).
"""
import argparse

import pytest

import train_bert_cls
import train_resnet
from utils.checkpoint import MAY_CHANGE, MUST_KEEP, THIS_LAUNCH, FlagRoles, RoleError
from utils.image_augment import EVAL_IMAGE_FLAGS, IMAGE_DEFAULTS

SCRIPTS = [train_bert_cls, train_resnet]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_every_option_of_the_parser_has_exactly_one_role(script):
    parser = script.build_parser()
    roles = FlagRoles(parser, script.FLAG_ROLES)  # raises RoleError naming every flag without a role
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(roles.dests) == len(options) == len(script.FLAG_ROLES)


def test_a_flag_without_a_role_or_a_role_without_a_flag_is_an_error():
    parser = train_bert_cls.build_parser()
    parser.add_argument("--new_flag", type=int, default=0)
    with pytest.raises(RoleError, match=r"no role declared for --new_flag \(declare each flag's role"):
        FlagRoles(parser, train_bert_cls.FLAG_ROLES)
    with pytest.raises(RoleError, match="a role for no option: --gone"):
        FlagRoles(train_bert_cls.build_parser(), {**train_bert_cls.FLAG_ROLES, "--gone": THIS_LAUNCH})
    aliases = {**train_bert_cls.FLAG_ROLES, "--label_smoothing_factor": MAY_CHANGE}  # the same option twice
    with pytest.raises(RoleError, match=r"--label_smoothing / --label_smoothing_factor \(declared twice\)"):
        FlagRoles(train_bert_cls.build_parser(), aliases)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_the_script_refuses_to_start_with_a_flag_without_a_role(script, monkeypatch):
    build = script.build_parser

    def with_a_new_flag():
        parser = build()
        parser.add_argument("--new_flag", type=int, default=0)
        return parser

    monkeypatch.setattr(script, "build_parser", with_a_new_flag)
    script.flag_roles.cache_clear()
    try:
        with pytest.raises(RoleError, match="no role declared for --new_flag"):
            script.parse_args(["--help"])
    finally:
        script.flag_roles.cache_clear()


def test_a_recorded_flag_with_a_parser_default_is_an_error():
    """A .recorded() flag's default lives in its role: with one in the parser, an evaluation could never tell that
    the command line left it out, and would rebuild the model with that value instead of the trained model's."""
    parser = train_resnet.build_parser()
    parser.add_argument("--head_hidden", type=int, default=0)
    with pytest.raises(RoleError, match=r"--head_hidden \(default=0\): a .recorded\(\) flag is default=None in the "
                                        r"parser, its default in .recorded\(DEFAULT\)"):
        FlagRoles(parser, {**train_resnet.FLAG_ROLES, "--head_hidden": MUST_KEEP.recorded(0)})
    parser = train_resnet.build_parser()
    parser.add_argument("--head_hidden", type=int, default=None)
    roles = FlagRoles(parser, {**train_resnet.FLAG_ROLES, "--head_hidden": MUST_KEEP.recorded(0)})
    assert roles.exported()["head_hidden"] == 0
    # read back from an export's fields and from a checkpoint's training_state.json (KEEP: under the flag)
    assert roles.recorded_in({"head_hidden": 64, "val_resize": 20})["head_hidden"] == 64
    assert roles.recorded_in({"--head_hidden": 64, "settings": {"--val_resize": 20}}) == {"head_hidden": 64,
                                                                                        "val_resize": 20}


def test_a_kept_by_entry_that_main_does_not_compute_is_an_error():
    args = train_bert_cls.parse_args(["--model_name_or_path", "m", "--train_file", "t.txt", "--do_train"])
    with pytest.raises(RoleError, match=r"no must_match entry for --labels_file \(kept by labels\)"):
        train_bert_cls.flag_roles().must_match(args, {"model": {}, "training_data": None, "class_weights": None,
                                                      "metric_for_best_model": "accuracy",
                                                      "greater_is_better": True})


# What each list held before the roles were declared, and what the declaration adds (named, with why).
BERT_RESUMABLE = {"--learning_rate": "learning_rate", "--weight_decay": "weight_decay",
                  "--warmup_ratio": "warmup_ratio", "--num_train_epochs": "num_train_epochs",
                  "--max_train_steps": "max_train_steps", "--max_grad_norm": "max_grad_norm",
                  "--early_stopping_patience": "early_stopping_patience",
                  "--early_stopping_threshold": "early_stopping_threshold"}
BERT_RESUMABLE_ADDED = {
    "--label_smoothing": "label_smoothing",  # the training loss only: nothing restored depends on it
    "--validation_file": "validation_file", "--validation_split_name": "validation_split_name",  # named: the best
    "--threshold": "threshold", "--eval_steps": "eval_steps",  # so far was measured with the old ones
    "--pool": "pool",  # how an evaluation pools a text's windows: the training does not depend on it
    # the Trainer's schedule flags: the schedule is a function of the step, rebuilt at the resumed one
    "--lr_scheduler_type": "lr_scheduler_type", "--lr_scheduler_kwargs": "lr_scheduler_kwargs",
    "--warmup_steps": "warmup_steps",
}
BERT_KEPT = ["--train_batch_size", "--max_train_samples", "--max_eval_samples", "--shuffle_train_dataset",
             "--shuffle_seed", "--gradient_accumulation_steps", "--max_seq_len", "multi_label", "regression"]
BERT_KEPT_ADDED = ["--seed", "--group_by_length",  # the sample order
                   "--tokenizer_name",  # the inputs
                   "--truncation", "--head_tokens", "--doc_stride",  # how long texts become the inputs
                   "--optim", "--adam_beta1", "--adam_beta2", "--adam_epsilon",  # the optimizer's state
                   "--layerwise_lr_decay", "--head_learning_rate"]  # its parameter groups
RESNET_RESUMABLE = {"--lr": "lr", "--momentum": "momentum", "--wd": "weight_decay", "--epochs": "epochs",
                    "--lr_scheduler": "lr_scheduler", "--lr_step_epochs": "lr_step_epochs",
                    "--warmup_epochs": "warmup_epochs", "--lr_warmup_method": "lr_warmup_method",
                    "--lr_warmup_decay": "lr_warmup_decay", "--lr_min": "lr_min", "--val_crop_size": "val_crop_size",
                    "--val_resize": "val_resize", "--interpolation": "interpolation",
                    "--early_stopping_patience": "early_stopping_patience",
                    "--early_stopping_threshold": "early_stopping_threshold"}
RESNET_RESUMABLE_ADDED = [  # each applies from the resumed step on, and was taken without a word before
    "--label_smoothing", "--lr_gamma", "--clip_grad_norm", "--drop_path", "--drop", "--sync_bn", "--crop_scale",
    "--crop_ratio", "--hflip", "--auto_augment", "--ra_magnitude", "--augmix_severity", "--random_erase", "--reprob",
    "--random_erase_mode",
    "--mixup_alpha", "--cutmix_alpha", "--mixup", "--cutmix", "--mixup_mode", "--model_ema_steps",
    "--model_ema_decay"]
RESNET_KEPT = ["arch", "global_batch_size", "--gradient_accumulation_steps", "--train_crop_size", "--opt", "model_ema"]
RESNET_KEPT_ADDED = ["--seed", "--ra_sampler", "--ra_reps",  # which images (and augmentations) each step sees
                     "--norm_weight_decay", "--bias_weight_decay"]  # the optimizer's parameter groups


def test_bert_lists_are_derived_from_the_roles():
    roles = train_bert_cls.flag_roles()
    assert roles.resumable() == {**BERT_RESUMABLE, **BERT_RESUMABLE_ADDED}
    args = train_bert_cls.parse_args(["--model_name_or_path", "m", "--train_file", "t.txt", "--do_train"])
    computed = {"labels": [], "model": {}, "training_data": None, "class_weights": None,
                "metric_for_best_model": "accuracy", "greater_is_better": True}
    assert sorted(roles.must_match(args, computed)) == sorted([*computed, *BERT_KEPT, *BERT_KEPT_ADDED])
    long_texts = {"truncation": "head", "head_tokens": 128, "doc_stride": None}  # pool: with --doc_stride only
    assert roles.exported() == {"max_seq_len": None, "multi_label": False, "threshold": 0.5, **long_texts,
                                "pool": "mean"}
    args.truncation, args.head_tokens = "head", 128  # use_model_settings's defaults
    assert train_bert_cls.trained_with(args) == {"max_seq_len": args.max_seq_len, "multi_label": False, **long_texts}
    args.multi_label = True
    assert train_bert_cls.trained_with(args) == {"max_seq_len": args.max_seq_len, "multi_label": True,
                                                 "threshold": 0.5, **long_texts}
    assert roles.evaluation() == {"--max_seq_len": "max_seq_len", "--multi_label": "multi_label",
                                  "--threshold": "threshold", "--truncation": "truncation",
                                  "--head_tokens": "head_tokens", "--doc_stride": "doc_stride", "--pool": "pool"}


def test_resnet_lists_are_derived_from_the_roles():
    roles = train_resnet.flag_roles()
    added = {flag: roles.dests[flag] for flag in RESNET_RESUMABLE_ADDED}
    assert roles.resumable() == {**RESNET_RESUMABLE, **added}
    assert list(roles.resumable()).index("--lr") < list(roles.resumable()).index("--epochs")  # the line's order
    args = train_resnet.parse_args(["--dummy", "10"])
    computed = {"class_to_idx": {}, "class_weights": None, "training_data": None, "metric_for_best_model": "acc1",
                "greater_is_better": True}
    assert sorted(roles.must_match(args, computed)) == sorted([*computed, *RESNET_KEPT, *RESNET_KEPT_ADDED])
    assert IMAGE_DEFAULTS == roles.exported() == {"train_crop_size": 224, "val_crop_size": 224, "val_resize": 256,
                                                  "interpolation": "bilinear"}
    assert EVAL_IMAGE_FLAGS == roles.evaluation() == {"--val_crop_size": "val_crop_size", "--val_resize": "val_resize",
                                                      "--interpolation": "interpolation"}


def test_values_are_recorded_as_the_checkpoint_gives_them_back():
    args = train_resnet.parse_args(["--dummy", "10"])
    settings = train_resnet.resume_settings(args, train_resnet.flag_roles().resumable())
    assert settings["--crop_ratio"] == [0.75, 4 / 3]  # a tuple by default, a list once read from JSON
