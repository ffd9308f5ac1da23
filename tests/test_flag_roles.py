"""Each flag's role is declared once, and what the checkpoints, the exports, the results and --help need is derived
from it.

The checks here are properties of the declarations, not a copy of them, so that a script with one more flag (and its
role line) passes them unchanged: every option has exactly one role and --help shows it; a flag a resume may change
is recorded in every checkpoint and named when it changes; a flag a resume must keep is in what the checkpoint must
match, and another value is refused naming it; a flag of this launch or of a fresh start is neither; a recorded flag
is what the exported model records. A flag without a role, or a role without a flag, stops every command with one
line naming the table to correct. Resumes that change or keep a flag end to end: tests/test_edges.py
(--label_smoothing, --seed).
"""
import argparse
import importlib.util
import types
from pathlib import Path

import pytest
import torch

import train_bert_cls
import train_resnet
from utils.checkpoint import (CHANGE, KEEP, LAUNCH, MUST_KEEP, ROLE_HELP, START, THIS_LAUNCH, FlagRoles, RoleError,
                              _report_changes, check_compatible, json_value, resume_settings, roles_beside)
from utils.image_augment import EVAL_IMAGE_FLAGS, IMAGE_DEFAULTS
from utils.runtime import UserError

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [train_bert_cls, train_resnet]
# the least each script parses: a training command
COMMANDS = {"train_bert_cls.py": ["--model_name_or_path", "m", "--train_file", "t.txt", "--do_train"],
            "train_resnet.py": ["--dummy", "10"]}


def options(parser):
    return [action for action in parser._actions if not isinstance(action, argparse._HelpAction)]


def parsed(script):
    return script.parse_args(COMMANDS[Path(script.__file__).name.replace("my_", "")])


def check_every_option_has_one_role_shown_by_help(script):
    parser = script.build_parser()
    roles = parser.flag_roles()  # a RoleError names every option without exactly one role
    assert len(roles.table) == len(options(parser))
    assert sorted(roles.dests.values()) == sorted(action.dest for action in options(parser))
    text = " ".join(parser.format_help().split())  # unwrapped
    shown = [action for action in options(parser) if action.help is not argparse.SUPPRESS]
    for action in shown:
        assert f"[{action.role_help}]" in text, action.option_strings
    assert sum(text.count(f"[{help}") for help in ROLE_HELP.values()) == len(shown)  # one per option, no more


def check_a_flag_a_resume_may_change_is_recorded_and_named(script):
    roles, args = script.flag_roles(), parsed(script)
    settings = resume_settings(args, roles.resumable())
    assert set(settings) == set(roles.flags(CHANGE))
    printed = []
    accelerator = types.SimpleNamespace(print=printed.append, num_processes=1, mixed_precision="no",
                                        device=torch.device("cpu"))
    for flag in settings:
        printed.clear()
        saved = {"settings": {**settings, flag: "an older value"}, "num_processes": 1}
        _report_changes(accelerator, "ckpt", saved, settings)
        assert printed == [f"resumed with changed settings (applied from here on): {flag} an older value -> "
                           f"{settings[flag]}"]


def check_a_flag_a_resume_must_keep_is_matched(script):
    roles, args = script.flag_roles(), parsed(script)
    computed = {role.kept_by: "made by main" for role in roles.table.values() if role.kept_by}
    must_match = roles.must_match(args, computed)
    kept = {role.key or flag: flag for flag, role in roles.table.items() if role.kind == KEEP and not role.kept_by}
    assert set(must_match) == set(computed) | set(kept)
    for key, flag in kept.items():
        assert must_match[key] == json_value(getattr(args, roles.dests[flag]))
        with pytest.raises(UserError, match=key):
            check_compatible({**must_match, key: "another value"}, must_match, "ckpt")
    others = roles.flags(LAUNCH) + roles.flags(START) + roles.flags(CHANGE)
    assert not set(others) & set(must_match)


def check_a_recorded_flag_is_exported(script):
    """Every recorded flag is in the export, one recorded `only_with` another where that holds only."""
    roles, args = script.flag_roles(), parsed(script)
    conditions = {role.only_with.partition("=")[::2] for role in roles.table.values() if role.only_with}
    if all(not role.applies(vars(args)) for role in roles.table.values() if role.only_with):
        unconditional = {roles.dests[flag] for flag, role in roles.table.items() if role.exported and not role.only_with}
        assert set(roles.exported_settings(args)) == unconditional
    for dest, value in conditions:
        setattr(args, dest, value or True)
    assert set(roles.exported_settings(args)) == set(roles.exported())
    assert set(roles.evaluation()) <= {flag for flag, role in roles.table.items() if role.exported}


PROPERTIES = [check_every_option_has_one_role_shown_by_help, check_a_flag_a_resume_may_change_is_recorded_and_named,
              check_a_flag_a_resume_must_keep_is_matched, check_a_recorded_flag_is_exported]


@pytest.mark.parametrize("check", PROPERTIES, ids=lambda check: check.__name__[len("check_"):])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda script: script.__name__)
def test_roles(script, check):
    check(script)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_each_shared_helpers_table_is_its_flags_and_spread_whole(script):
    """A shared add_*_args helper's flags have their roles in the table beside it (roles_beside), no more, no less,
    and the script's FLAG_ROLES spreads it as declared."""
    parser = script.build_parser()
    helper_tables = {action.role_table for action in options(parser) if hasattr(action, "role_table")}
    assert len(helper_tables) >= 4
    for table in helper_tables:
        theirs = [action for action in options(parser) if getattr(action, "role_table", None) == table]
        declared = {name for action in theirs for name in action.option_strings or [action.dest]} & set(table.entries())
        assert declared == set(table.entries()) and len(declared) == len(theirs), table
        assert all(script.FLAG_ROLES[flag] == role for flag, role in table.entries().items()), table


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


def test_the_lists_the_scripts_use_are_those_derived():
    bert = train_bert_cls.flag_roles()
    args = parsed(train_bert_cls)
    args.multi_label, args.doc_stride, args.truncation = True, 32, "head_tail"
    assert train_bert_cls.trained_with(args) == bert.exported_settings(args)
    assert train_bert_cls.trained_with(args).keys() == bert.exported().keys()
    resnet = train_resnet.flag_roles()
    assert IMAGE_DEFAULTS == resnet.exported() and EVAL_IMAGE_FLAGS == resnet.evaluation()
    resumable = list(resnet.resumable())
    assert resumable.index("--lr") < resumable.index("--epochs")  # FLAG_ROLES's order: the resume line's


def test_values_are_recorded_as_the_checkpoint_gives_them_back():
    args = train_resnet.parse_args(["--dummy", "10"])
    settings = resume_settings(args, train_resnet.flag_roles().resumable())
    assert settings["--crop_ratio"] == [0.75, 4 / 3]  # a tuple by default, a list once read from JSON


# ---- a user's fork: one more flag in a copy of a script ----

def forked(script, tmp_path, role_line=True):
    """A copy of `script` as my_<name>.py with one more flag (its parser line, and its role line unless not
    `role_line`), imported as a module."""
    text = Path(script.__file__).read_text(encoding="utf-8")
    end_of_parser = text.index("    return parser\n", text.index("def build_parser():"))
    text = (text[:end_of_parser] + '    parser.add_argument("--my_flag", type=float, default=0.5, '
            'help="a setting of my own")\n' + text[end_of_parser:])
    if role_line:
        assert text.count("FLAG_ROLES = {\n") == 1
        text = text.replace("FLAG_ROLES = {\n", 'FLAG_ROLES = {\n    "--my_flag": checkpoint.MAY_CHANGE,\n')
    path = tmp_path / f"my_{Path(script.__file__).name}"
    path.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_a_fork_with_a_new_flag_and_its_role_line_stays_green(script, tmp_path, capsys):
    fork = forked(script, tmp_path)
    for check in PROPERTIES:
        check(fork)
    assert parsed(fork).my_flag == 0.5 and "--my_flag" in fork.flag_roles().resumable()
    with pytest.raises(SystemExit) as stop:
        fork.parse_args(["--help"])
    assert stop.value.code == 0
    assert "a setting of my own (default: 0.5) [a resume may change it]" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_a_fork_with_a_new_flag_and_no_role_line_stops_in_one_line(script, tmp_path, capsys):
    fork = forked(script, tmp_path, role_line=False)
    for argv in (COMMANDS[Path(script.__file__).name], ["--help"]):
        with pytest.raises(SystemExit) as stop:
            fork.parse_args(argv)
        assert stop.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == (
            f"error: --my_flag has no role: add its line to FLAG_ROLES in my_{Path(script.__file__).name} (a role is "
            "MAY_CHANGE, MUST_KEEP, THIS_LAUNCH or FRESH_START: utils/checkpoint.py ROLE_MEANINGS)\n")


# ---- the messages for each mistake in a table ----

SHARED_ROLES = {"--shared_a": THIS_LAUNCH}


@roles_beside("SHARED_ROLES")
def add_shared_args(parser, with_b=False):
    parser.add_argument("--shared_a")
    if with_b:
        parser.add_argument("--shared_b")


def roles_error(table, with_b=False):
    parser = argparse.ArgumentParser()
    parser.add_argument("--own", "--own_alias")
    add_shared_args(parser, with_b)
    with pytest.raises(RoleError) as error:
        FlagRoles(parser, table, "FLAG_ROLES in x.py")
    return str(error.value).split(" (a role is")[0]


def test_each_mistake_names_the_flag_and_the_table_to_correct():
    here = add_shared_args.__module__.replace(".", "/") + ".py"  # utils/text_data.py for a module of utils/
    assert roles_error({"--own": THIS_LAUNCH}) == (
        f"--shared_a has its role in SHARED_ROLES in {here}, which FLAG_ROLES in x.py leaves out: add **SHARED_ROLES "
        "there")
    assert roles_error({"--own": THIS_LAUNCH, **SHARED_ROLES}, with_b=True) == (
        f"--shared_b has no role: add its line to SHARED_ROLES in {here}")
    assert roles_error({**SHARED_ROLES}) == "--own / --own_alias has no role: add its line to FLAG_ROLES in x.py"
    assert roles_error({"--own": THIS_LAUNCH, "--own_alias": THIS_LAUNCH, **SHARED_ROLES}) == (
        "--own / --own_alias has 2 roles (--own, --own_alias): keep one line in FLAG_ROLES in x.py")
    assert roles_error({"--own": THIS_LAUNCH, **SHARED_ROLES, "--gone": THIS_LAUNCH}) == (
        "--gone has a role but no option: remove its line from FLAG_ROLES in x.py")
    SHARED_ROLES["--shared_gone"] = THIS_LAUNCH
    try:
        assert roles_error({"--own": THIS_LAUNCH, **SHARED_ROLES}) == (
            f"--shared_gone has a role but no option: remove its line from SHARED_ROLES in {here}")
        with pytest.raises(RoleError, match="--shared_gone has a role but no option"):
            FlagRoles.of(add_shared_args)
    finally:
        del SHARED_ROLES["--shared_gone"]


def test_a_kept_by_entry_that_main_does_not_compute_is_an_error():
    args = parsed(train_bert_cls)
    computed = {role.kept_by: None for role in train_bert_cls.FLAG_ROLES.values() if role.kept_by}
    del computed["labels"]
    with pytest.raises(RoleError, match=r"no must_match entry for --labels_file \(kept by labels\)"):
        train_bert_cls.flag_roles().must_match(args, computed)
