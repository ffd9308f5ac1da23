"""The command line both scripts read: the parser (`Parser`: a refused flag or value costs one line naming what
replaces it or the closest flag), the spellings users bring from the tools these scripts replace (the Trainer,
run_classification.py, accelerate's examples, the Chinese BERT tutorial, main.py, torchvision, timm) read with their
meaning and said once, each flag's role checked and shown by --help, and the argparse types both scripts share.
How each of these works: docs/code.md#flags-the-number-types---help-and-flagspy.

Neighbours: utils/runtime.py (UserError, the number types, HelpFormatter), utils/checkpoint.py (the roles).
"""
import argparse
import difflib
import json
import math
import sys

from . import checkpoint, runtime

TRUE_WORDS = ("true", "yes", "1")
FALSE_WORDS = ("false", "no", "0")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, peer spellings and the notes that say how they were read, and each flag's role:
    `roles` is the script's table ({flag: Role}, spreading the shared helpers' tables), named `roles_in` in messages."""

    def __init__(self, roles=None, roles_in="FLAG_ROLES", **kwargs):
        kwargs.setdefault("formatter_class", runtime.HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # a prefix of a flag is a typo here, not the flag
        super().__init__(**kwargs)
        self.replaced = {}  # {flag: (tool, what replaces it)}
        self.roles, self.roles_in = roles, roles_in

    def flag_roles(self):
        """FlagRoles of this parser's options (a RoleError if one has no role, or a role no option)."""
        return checkpoint.FlagRoles(self, self.roles, self.roles_in)

    def check_roles(self):
        """Every option has its role, shown by --help: else one line and exit status 2, before anything starts."""
        if self.roles is not None:
            try:
                self.flag_roles()
            except checkpoint.RoleError as err:
                self.error(str(err))

    def refuse(self, tool, replacements):
        """Flags of `tool` ({flag: what replaces it}) that are refused with that one line."""
        for flag, replacement in replacements.items():
            self.replaced[flag] = (tool, replacement)

    def error(self, message):
        self.exit(2, f"error: {message}\n")

    def format_help(self):
        self.check_roles()
        return super().format_help()

    def parse_args(self, args=None, namespace=None):
        self.check_roles()
        argv = [str(word) for word in (sys.argv[1:] if args is None else args)]
        argv, booleans = self._boolean_values(argv)
        argv = self._unparsed_optional_values(argv)
        parsed, extras = self.parse_known_args(argv, namespace)
        if extras:
            self.error(self._unknown(extras))
        for dest, value in booleans.items():
            setattr(parsed, dest, value)
        parsed.command_notes = tuple(getattr(parsed, "command_notes", ())) + tuple(self._resolve_spellings(argv,
                                                                                                           parsed))
        return parsed

    def _check_value(self, action, value):
        if isinstance(value, str) and value in getattr(action, "peer_values", {}):
            return
        if action.choices is not None and value not in action.choices:
            choices = [str(choice) for choice in action.choices]
            close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]}? " if close else ""
            raise argparse.ArgumentError(action, f"invalid choice {value!r}: {hint}(choose from {', '.join(choices)})")

    def _action_of(self, word):
        """The action of an option word (`--flag` or `--flag=value`), or None."""
        return self._option_string_actions.get(word.split("=", 1)[0]) if word.startswith("-") else None

    def _boolean_values(self, argv):
        """argv without the values given to boolean flags (`--do_train True`), and {dest: value} of those."""
        kept, booleans, i = [], {}, 0
        while i < len(argv):
            word = argv[i]
            i += 1
            action = self._action_of(word)
            if not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                kept.append(word)
                continue
            flag, _, value = word.partition("=")
            if not value and i < len(argv) and argv[i].lower() in TRUE_WORDS + FALSE_WORDS:
                value = argv[i]
                i += 1
            if not value:
                kept.append(flag)
            elif value.lower() in TRUE_WORDS + FALSE_WORDS:
                booleans[action.dest] = (value.lower() in TRUE_WORDS) == isinstance(action, argparse._StoreTrueAction)
                kept.append(flag)  # counted as used (_resolve_spellings); its value is set from `booleans`
            else:
                self.error(f"{flag}: expected true or false, not {value!r}")
        return kept, booleans

    def _unparsed_optional_values(self, argv):
        """argv where a word that is not the optional number of the flag before it is left to the next argument."""
        kept = list(argv)
        for i, word in enumerate(argv[:-1]):
            action = self._action_of(word)
            following = argv[i + 1]
            if (action is not None and action.nargs == "?" and "=" not in word and _takes_numbers(action)
                and not following.startswith("-") and not _is_number(following)):
                kept[i] = f"{word}={action.const}"
        return kept

    def _unknown(self, extras):
        """The one line for the first argument nothing took."""
        flags = [word for word in extras if word.startswith("-") and not _is_number(word)]
        if not flags:
            return f"unexpected argument {extras[0]!r} (a flag before it takes no value, or it is misspelt)"
        flag = flags[0].split("=", 1)[0]
        if flag in self.replaced:
            tool, replacement = self.replaced[flag]
            return f"{flag} is a flag of {tool}; here: {replacement}"
        known = [option for option in self._option_string_actions if option.startswith("--")]
        close = difflib.get_close_matches(flag, known + list(self.replaced), n=1, cutoff=0.6)
        return f"unrecognized flag {flag}" + (f"; did you mean {close[0]}?" if close else " (see --help)")

    def _resolve_spellings(self, argv, parsed):
        """Peer values turned into ours, and the notes of spellings not a flag's own; two of one setting refused."""
        notes, used = [], {}
        for word in argv:
            action = self._action_of(word)
            if action is None or action.dest in ("help", argparse.SUPPRESS):
                continue
            spelling = word.split("=", 1)[0]
            previous = used.setdefault(action.dest, (spelling, action))
            if previous[0] != spelling and not isinstance(action, argparse._AppendAction):
                self.error(f"{previous[0]} and {spelling} set the same thing ({own_name(action, self)}); pass one")
            value = getattr(parsed, action.dest, None)
            if isinstance(value, str) and value in getattr(action, "peer_values", {}):
                setattr(parsed, action.dest, action.peer_values[value])
                notes.append(f"{spelling} {value} = {own_name(action, self)} {action.peer_values[value]}")
            elif not same_name(spelling, action.dest) and not isinstance(action, PerDevice):
                given = "" if action.nargs == 0 else f" {value}"
                switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
                meant = "" if switch else f" {value}"
                notes.append(f"{spelling}{given} = {own_name(action, self)}{meant}")
        return list(dict.fromkeys(notes))


def peer_values(action, values):
    """Let `action` (what add_argument returned) take another tool's values ({theirs: ours}) for its own."""
    action.peer_values = values
    return action


def own_name(action, parser):
    """A flag's own name: the spelling of its destination, else its first long option."""
    own = f"--{action.dest}"
    owner = parser._option_string_actions.get(own)
    if owner is not None:
        return own
    return next((option for option in action.option_strings if option.startswith("--")), action.option_strings[0])


def same_name(spelling, dest):
    return spelling.lstrip("-").replace("-", "_") == dest or len(spelling) == 2  # -b, -j: main.py's short forms


def _takes_numbers(action):
    """Whether an action's type reads numbers (positive_int, float), not words (hf_bool reads 1 but not 2)."""
    try:
        action.type("2")
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False
    return action.type is not None and not isinstance(action.type("2"), str)


def _is_number(word):
    try:
        float(word)
    except ValueError:
        return False
    return True


class PerDevice(argparse.Action):
    """The Trainer's per-device batch size, kept as the GLOBAL batch: times the launched processes, said once."""

    def __init__(self, option_strings, dest, global_flag, **kwargs):
        self.global_flag = global_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        processes = runtime.launched_world_size()
        setattr(namespace, self.dest, values * processes)
        note = (f"{option_string} {values} x {processes} process{'es' if processes > 1 else ''} = {self.global_flag} "
                f"{values * processes} (the GLOBAL batch)")
        namespace.command_notes = (*getattr(namespace, "command_notes", ()), note)


class Ignored(argparse.Action):
    """A peer's flag that changes nothing here, taken with its value and said once ("--log_dir ./logs: ignored")."""

    def __init__(self, option_strings, dest, reason, **kwargs):
        self.reason = reason
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        note = f"{option_string} {values}: ignored, {self.reason}"
        namespace.command_notes = (*getattr(namespace, "command_notes", ()), note)


def whole_epochs(text):
    """argparse type of an epoch count given as the Trainer's float (`2.0`): a whole number >= 1."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value < 1 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}: whole epochs only here; for part "
                                         f"of an epoch pass --max_train_steps (optimizer steps)")
    return int(value)


def steps_or_epoch(text):
    """argparse type of --checkpointing_steps: optimizer steps, or accelerate's examples' `epoch` (None: at the end of
    each epoch)."""
    if text == "epoch":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of steps or 'epoch', not {text!r}")
    return value


def json_object(text):
    """argparse type of the Trainer's dict flags (--lr_scheduler_kwargs '{"num_cycles": 2}'): a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"num_cycles\": 2}}', not {text!r}")
    return value


BERT_BATCH_RULE = ("--train_batch_size and --eval_batch_size are GLOBAL on any number of processes; the Trainer's "
                   "per-device sizes are --per_device_train_batch_size / --per_device_eval_batch_size")

# The Chinese BERT tutorial's flags (taishan1994/pytorch_bert_chinese_text_classification, main.py and
# main_distributed.py) with no counterpart here; its others are aliases (--bert_dir, --lr, --train_epochs) or, for
# --num_tags, a check of the data's label count.
TUTORIAL_FLAGS = {
    "--gpu_ids": "the launcher chooses the GPUs: accelerate launch --gpu_ids 0,1 (or CUDA_VISIBLE_DEVICES)",
    "--local_world_size": "accelerate launch --num_processes N (or torchrun --nproc_per_node N)",
    "--local_rank": "the launcher's business (accelerate launch / torchrun); drop --local_rank",
}
TUTORIAL_IGNORED = {  # the tutorial's flags that change nothing here, and why
    "--data_name": "--data_dir alone names the data",
    "--log_dir": "the logs go to --output_dir (metrics.jsonl; runs/ with --report_to tensorboard)",
}

# transformers' text-classification examples' flags with no counterpart here
TRANSFORMERS_EXAMPLE_FLAGS = {
    "--task_name": "--dataset_name nyu-mll/glue --dataset_config_name TASK (run_glue's GLUE tasks)",
}

# accelerate's examples' flags (examples/complete_nlp_example.py, complete_cv_example.py) with no counterpart here
ACCELERATE_EXAMPLE_FLAGS = {
    "--project_dir": "--output_dir DIR (the trackers write to DIR/runs)",
}


def batch_line(flag, global_batch, processes, rule):
    """The first line a run prints: the global batch, per process, and the rule (the same on any process count)."""
    per_process = global_batch // processes if global_batch % processes == 0 else global_batch / processes
    return (f"batch: {flag} {global_batch} = {per_process} per process x {processes} "
            f"process{'es' if processes > 1 else ''} ({rule})")


def say_command(say, args, first_line):
    """Print the run's first line, then how each peer spelling of the command was read, once."""
    say(first_line)
    for note in args.command_notes:
        say(f"read as: {note}")
