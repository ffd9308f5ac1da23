"""`--metric NAME_OR_PATH`: any Hugging Face `evaluate` module, beside the built-in accuracy and F1.

A hub id (`matthews_correlation`) needs the hub or its cache; a local path works offline: a metric script
(`my_metric.py`) or a folder `my_metric/` holding `my_metric.py`. Every module is loaded, and computed once
on every class id, before training starts, so that a metric that cannot load or cannot take these
predictions fails in seconds rather than after the run.
"""
from utils.errors import UserError


def load_metrics(names_or_paths, num_labels):
    """The loaded modules, each checked on predictions = references = 0..num_labels-1."""
    if not names_or_paths:
        return []
    import evaluate  # a second of start-up, only for runs that ask for it

    modules = []
    for name in names_or_paths:
        try:
            # keep_in_memory: no cache file, so that several processes computing at once do not share a lock
            modules.append(evaluate.load(name, keep_in_memory=True))
        except Exception as err:  # evaluate raises whatever its download or import raised
            raise UserError(f"--metric {name}: cannot load this evaluate module ({first_line(err)}); offline, "
                            "pass a local metric script or a folder <name>/ holding <name>.py") from None
    every_class = list(range(num_labels))
    compute_metrics(modules, every_class, every_class, reserved={})
    return modules


def compute_metrics(modules, predictions, references, reserved):
    """{key: number or list} of every module; a key already in `reserved` (or another module's) becomes
    `<module name>_<key>`, so that `--metric accuracy` cannot overwrite the built-in accuracy."""
    results = {}
    for module in modules:
        try:
            values = module.compute(predictions=list(predictions), references=list(references))
        except Exception as err:
            raise UserError(f"--metric {module.name}: compute failed on {len(references)} class ids "
                            f"({first_line(err)})") from None
        for key, value in (values or {}).items():
            taken = key in reserved or key in results
            results[f"{module.name}_{key}" if taken else key] = plain(value)
    return results


def plain(value):
    """JSON-ready: metrics often return numpy scalars and arrays."""
    return value.tolist() if hasattr(value, "tolist") else value


def first_line(err):
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
