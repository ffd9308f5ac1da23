"""The documentation's commands run as written.

Every shell command in README.md, docs/*.md, benchmarks/README.md and the scripts' --help texts that calls one of
this repository's scripts is checked here: its config file and script exist, and its arguments pass the script's own
argument parsing and validation (what `--help`-level checking can see without the data or GPUs it names). The tiny
CPU runs that the --help texts promise are run for real, as printed, and must reach what they promise. Every
relative link in the docs points at a file (and heading) that exists.
"""
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENV, HANG_S, ROOT, read_json

from utils.checkpoint import EXPORTED_HELP, EXPORTED_MEANING, ROLE_HELP, ROLE_MEANINGS

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
SCRIPTS = {"train_bert_cls.py": "train_bert_cls", "train_resnet.py": "train_resnet"}
# Placeholders the docs define in words next to the commands that use them.
PLACEHOLDERS = {
    "$BERT_ARGS": "--data_dir data/cnews --model_name_or_path hfl/chinese-bert-wwm-ext --output_dir outputs/cnews",
}


def code_blocks(text):
    """The contents of the fenced code blocks (```bash, ```sh or bare ```) of a Markdown text."""
    return re.findall(r"^```(?:bash|sh|console)?\n(.*?)^```", text, flags=re.S | re.M)


def shell_commands(block):
    """One string per command: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        commands.append(line)
    return commands


def script_argv(command):
    """(script, argv) for a command that runs one of the training scripts, else None.

    Environment assignments, `python`, `accelerate launch [launcher flags]`, `torchrun [flags]` and `srun ...`
    prefixes are skipped; the launcher's --config_file must exist.
    """
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    words = shlex.split(command, comments=True)
    script_at = next((i for i, w in enumerate(words) if Path(w).name in SCRIPTS), None)
    if script_at is None:
        return None
    head = words[:script_at]
    if "--config_file" in head:
        config = ROOT / head[head.index("--config_file") + 1]
        assert config.is_file(), f"{command}: no config file {config}"
    return Path(words[script_at]).name, words[script_at + 1:]


def documented_commands():
    found = []
    for doc in DOCS:
        for block in code_blocks(doc.read_text(encoding="utf-8")):
            for command in shell_commands(block):
                if script_argv(command) is not None:
                    found.append((doc.relative_to(ROOT).as_posix(), command))
    for script, module in SCRIPTS.items():
        for block in re.findall(r"^    (\S.*(?:\n {4,}\S.*)*)", importlib.import_module(module).__doc__, flags=re.M):
            for command in shell_commands(block):
                if script_argv(command) is not None:
                    found.append((f"{script} --help", command))
    return found


COMMANDS = documented_commands()


def test_the_docs_have_commands_to_check():
    """The extractor itself: it must find the quick starts of both scripts in README.md and the --help texts."""
    sources = {source for source, _ in COMMANDS}
    assert {"README.md", "docs/bert.md", "docs/resnet.md", "docs/launching.md", "train_bert_cls.py --help",
            "train_resnet.py --help"} <= sources, sources
    assert len(COMMANDS) >= 25


@pytest.mark.parametrize("source,command", COMMANDS, ids=[f"{s}:{c[:60]}" for s, c in COMMANDS])
def test_documented_command_parses(source, command):
    script, argv = script_argv(command)
    module = importlib.import_module(SCRIPTS[script])
    try:
        module.parse_args(argv)
    except SystemExit as exit_:
        if exit_.code:
            pytest.fail(f"{source}: `{command}` is refused by {script}'s argument parsing (exit {exit_.code})")


def markdown_links(text):
    return re.findall(r"\]\(([^)\s]+)\)", text)


def anchors(path):
    """GitHub's heading anchors of a Markdown file."""
    slugs = set()
    for heading in re.findall(r"^#+ (.*)$", path.read_text(encoding="utf-8"), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_links_resolve(doc):
    broken = []
    for link in markdown_links(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+://", link) or link.startswith("mailto:"):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(link)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(link)
    assert not broken, f"{doc.name}: broken links {broken}"


def tiny_run(module):
    """The commands of a script's `--help` tiny CPU run (the indented lines after "A tiny CPU run"), and the
    result its text promises: (commands, results key, threshold)."""
    doc = importlib.import_module(module).__doc__
    paragraph = doc[doc.index("A tiny CPU run"):]
    block = re.match(r"[^\n]*(?:\n(?! {4})[^\n]*)*((?:\n {4}[^\n]*)+)", paragraph).group(1)
    promise = re.search(r"expects a (test accuracy|top-1 accuracy) above ([\d.]+)(%?)", paragraph.replace("\n", " "))
    key = "test_accuracy" if promise.group(1) == "test accuracy" else "eval_acc1"
    return shell_commands(block.strip("\n").replace("\n    ", "\n")), key, float(promise.group(2))


@pytest.mark.long  # a learning check (the accuracy it promises); test_documented_command_parses checks its commands
@pytest.mark.parametrize("module", SCRIPTS.values())
def test_help_tiny_run_runs_as_printed(module, tmp_path):
    """Copy-pasted from --help into a fresh checkout (here: the repository's files linked into an empty
    directory), the tiny run works and reaches what its text promises."""
    for name in ("train_bert_cls.py", "train_resnet.py", "utils", "accelerate_configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    commands, key, threshold = tiny_run(module)
    assert len(commands) == 2, commands
    env = {**ENV, "PATH": f"{Path(sys.executable).parent}:{ENV['PATH']}"}  # `python` and `accelerate`: this venv's
    for command in commands:
        proc = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=HANG_S)
        assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    out = tmp_path / re.search(r"--output_dir (\S+)", commands[-1]).group(1)
    assert read_json(out / "all_results.json")[key] > threshold


# run_classification.py's flags: every field of its ModelArguments and DataTrainingArguments, as read from
# transformers' examples/pytorch/text-classification/run_classification.py at v4.57 (check_min_version("4.57.0.dev0");
# the examples are not part of the installed transformers package).
MODEL_ARGUMENTS = ("model_name_or_path", "config_name", "tokenizer_name", "cache_dir", "use_fast_tokenizer",
                   "model_revision", "token", "trust_remote_code", "ignore_mismatched_sizes")
DATA_TRAINING_ARGUMENTS = (
    "dataset_name", "dataset_config_name", "do_regression", "text_column_names", "text_column_delimiter",
    "train_split_name", "validation_split_name", "test_split_name", "remove_splits", "remove_columns",
    "label_column_name", "max_seq_length", "preprocessing_num_workers", "overwrite_cache", "pad_to_max_length",
    "shuffle_train_dataset", "shuffle_seed", "max_train_samples", "max_eval_samples", "max_predict_samples",
    "metric_name", "train_file", "validation_file", "test_file")
# The TrainingArguments the commands of its README (and of run_glue.py's) pass.
README_TRAINING_ARGUMENTS = ("output_dir", "do_train", "do_eval", "do_predict", "per_device_train_batch_size",
                             "per_device_eval_batch_size", "learning_rate", "num_train_epochs", "max_steps", "seed")
# TrainingArguments fields of transformers 4 that transformers 5 (installed) dropped, still in users' commands.
TRANSFORMERS_4_TRAINING_ARGUMENTS = ("overwrite_output_dir", "warmup_ratio", "group_by_length")
BERT_MINIMAL = ["--model_name_or_path", "m", "--do_train"]


def flag_table(heading):
    """(flag, status, how) rows of the docs/bert.md table under `heading`."""
    text = (ROOT / "docs" / "bert.md").read_text(encoding="utf-8")
    section = text[text.index(heading):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else None]
    lines = [line for line in section.splitlines() if line.startswith("| `--")]
    rows = [re.fullmatch(r"\| `--(\w+)` \| (supported|replaced|not supported) \| (.+) \|", line) for line in lines]
    assert all(rows), [line for line, row in zip(lines, rows) if not row]
    return [row.groups() for row in rows]


def run_classification_table():
    return flag_table("## run_classification.py flag → ours")


BERT_TABLES = ("## run_classification.py flag → ours", "## The Chinese BERT tutorial's flag → ours",
               "## accelerate's examples' flag → ours")
# Values a refused flag is probed with: it is refused only if it is refused without a value and with each of these,
# so that a flag that became supported with `choices` (or as a switch) cannot pass as refused
PROBE_VALUES = ("1", "true", "0.5", "epoch", "linear", "adamw_torch", "x", "cnews")


def bert_parses(argv):
    import contextlib
    import io

    import train_bert_cls

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            train_bert_cls.parse_args(argv)
    except SystemExit as exit_:
        return not exit_.code
    return True


def test_run_classification_table_covers_every_flag():
    import dataclasses

    from transformers import TrainingArguments

    flags = [flag for flag, _, _ in run_classification_table()]
    assert len(flags) == len(set(flags)), "a flag listed twice"
    for name in (*MODEL_ARGUMENTS, *DATA_TRAINING_ARGUMENTS, *README_TRAINING_ARGUMENTS):
        assert name in flags, f"docs/bert.md's run_classification.py table lacks --{name}"
    known = {*MODEL_ARGUMENTS, *DATA_TRAINING_ARGUMENTS, *TRANSFORMERS_4_TRAINING_ARGUMENTS,
             *(field.name for field in dataclasses.fields(TrainingArguments))}
    assert not set(flags) - known, f"not a flag of run_classification.py: {sorted(set(flags) - known)}"


@pytest.mark.parametrize("flag, status, how", [row for heading in BERT_TABLES for row in flag_table(heading)],
                         ids=lambda value: str(value)[:30])
def test_run_classification_table_tells_the_truth(flag, status, how):
    """A supported flag's example (the code that starts its cell) parses and uses that very spelling; a replaced
    one's example parses with our flag; every replaced or unsupported flag is refused, never silently taken."""
    if status == "not supported":
        assert not how.startswith("`"), "an unsupported flag explains why, in words"
    else:
        example = shlex.split(re.match(r"`([^`]+)`", how).group(1))
        data = [] if {"--dataset_name", "--train_file", "--data_dir"} & set(example) else ["--train_file", "t.csv"]
        minimal = BERT_MINIMAL if "--bert_dir" not in example else BERT_MINIMAL[2:]  # its alias
        assert bert_parses([*minimal, *data, *example]), f"`{' '.join(example)}` is refused"
        assert (f"--{flag}" in example) == (status == "supported"), example
    if status != "supported":
        for probe in ([], *([value] for value in PROBE_VALUES)):
            assert not bert_parses([*BERT_MINIMAL, "--train_file", "t.csv", f"--{flag}", *probe]), \
                f"--{flag} {' '.join(probe)} is accepted"


def test_bert_table_defaults_are_the_parser_defaults():
    """A row saying `default X here` states the parser's default of the flag that row's example sets."""
    import train_bert_cls

    parser = train_bert_cls.build_parser()
    checked = 0
    for heading in BERT_TABLES:
        for flag, status, how in flag_table(heading):
            stated = re.search(r"default (?:`(--\w+)` )?([\w.+-]+) here", how)
            if not stated:
                continue
            example = shlex.split(re.match(r"`([^`]+)`", how).group(1))
            ours = stated.group(1) or next(word for word in example if word.startswith("--"))
            default = parser.get_default(parser._option_string_actions[ours].dest)
            if default is None:  # decided at start (the model's positions): its help says how
                continue
            same = (str(default) == stated.group(2) or not isinstance(default, (str, bool))
                    and float(default) == float(stated.group(2)))
            assert same, f"--{flag}: the default of {ours} is {default}"
            checked += 1
    assert checked >= 8, checked


def test_resnet_peer_spellings_are_accepted_or_refused_in_one_line():
    """Every torchvision and timm flag the recipe table names is a flag of train_resnet.py, or refused in one line
    with what replaces it."""
    import train_resnet
    from utils.image_references import MAIN_PY_FLAGS, TIMM_FLAGS, TORCHVISION_FLAGS

    text = (ROOT / "docs" / "resnet_recipes.md").read_text(encoding="utf-8")
    table = text[text.index("## Flags and their torchvision / timm equivalents"):]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    theirs = {flag for row in rows for cell in row[1:3] for flag in re.findall(r"`(--[\w-]+)", cell)}
    ours = set(train_resnet.build_parser()._option_string_actions)
    unknown = theirs - ours - {*MAIN_PY_FLAGS, *TORCHVISION_FLAGS, *TIMM_FLAGS}
    # timm's flags with no counterpart that the table itself says are not built here, by name
    assert unknown == {"--pretrained-path", "--input-size", "--crop-pct", "--scale", "--ratio", "--train-interpolation",
                       "--repeated-aug", "--patience-epochs"}, sorted(unknown)


def test_resume_doc_explains_each_role_as_help_shows_it():
    """faults_and_resume.md explains every role in the words --help shows after each flag, with its meaning
    (utils/checkpoint.py ROLE_HELP, ROLE_MEANINGS), and lists no flag's role itself: --help shows each one."""
    text = (ROOT / "docs" / "faults_and_resume.md").read_text(encoding="utf-8")
    section = text[text.index("## Each flag's role on resume"):]
    section = section[:section.index("\n## ", 1)]
    for kind, words in ROLE_HELP.items():
        assert f"| `[{words}]` | {ROLE_MEANINGS[kind]} |" in section, words
    assert f"| `...; {EXPORTED_HELP}]` | {EXPORTED_MEANING} |" in section
    assert "| flags |" not in section  # no table copying the declarations


def test_readme_stays_scannable():
    """README.md is read in two minutes: at most 150 lines; detail belongs in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"


def pytest_lines(target):
    """The arguments of each pytest that `make TARGET` runs, as make prints them without running anything (`make
    -n`)."""
    proc = subprocess.run(["make", "-n", "--no-print-directory", target, "PY=python"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    lines = [shlex.split(line) for line in proc.stdout.splitlines() if " -m pytest " in line]
    return [line[line.index("pytest") + 1:] for line in lines]


def test_make_test_leaves_the_long_tier_to_make_test_long_and_ci_runs_both(pytestconfig):
    """The README's `make test` deselects the tests marked `long` and lists its 15 slowest tests; `make test-long`
    runs exactly those, the 8-process ones (`alone`) after the rest on one worker; `.ci/run` runs both, so no check
    stops being run."""
    [fast], (long, alone) = pytest_lines("test"), pytest_lines("test-long")
    assert "--durations=15" in fast and fast[fast.index("-m") + 1] == "not long" and fast[-1] == "tests"
    assert long[long.index("-m") + 1] == "long and not alone" and long[-1] == "tests"
    assert alone[alone.index("-m") + 1] == "alone" and alone[-1] == "tests" and "-n" not in alone
    assert any(marker.startswith("long:") for marker in pytestconfig.getini("markers"))  # registered in conftest.py
    for path in (ROOT / "tests").glob("test_*.py"):  # what runs alone belongs to the long tier too
        text = path.read_text()
        assert "pytest.mark.alone" not in text or "pytest.mark.long" in text, path
    marked = [path.name for path in (ROOT / "tests").glob("test_*.py") if "@pytest.mark.long" in path.read_text()]
    assert marked, "no test is marked long: `make test-long` would collect nothing and fail"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test" in ci and "make test-long" in ci
