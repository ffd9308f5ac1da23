"""User-facing errors: one line naming the file (and line or key), exit code 2, no traceback.

Under a multi-process launch every rank usually meets the same bad input: the line is printed once, by each
machine's first process, and every rank writes it into the error file torch's elastic agent gives it
(TORCHELASTIC_ERROR_FILE), so that the launcher's failure summary, the last thing `accelerate launch` and `torchrun`
print, ends with this line instead of "To enable traceback see ...". The launcher's own traceback above that
summary is its business: it exits 1 there, the processes exit 2.
"""
import json
import os
import sys
import time

from tqdm.auto import tqdm


class UserError(Exception):
    """A problem with the user's input or command line, not a bug in this code."""


def run_cli(main, args):
    """Call `main(args)`; turn a UserError into one line on stderr and exit status 2."""
    try:
        return main(args)
    except UserError as err:
        line = f"error: {err}"
        if os.environ.get("LOCAL_RANK", "0") == "0":
            tqdm.write(line, file=sys.stderr)  # on its own line even under a progress bar
        record_for_launcher(line)
        sys.exit(2)


def record_for_launcher(line):
    """Write `line` where torch's elastic agent reads a failed worker's error (its summary prints it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary then says less; the line is on stderr already
