"""User-facing errors: one line naming the file (and line or key), exit code 2, no traceback."""
import sys

from tqdm.auto import tqdm


class UserError(Exception):
    """A problem with the user's input or command line, not a bug in this code."""


def run_cli(main, args):
    """Call `main(args)`; turn a UserError into one line on stderr and exit status 2."""
    try:
        return main(args)
    except UserError as err:
        tqdm.write(f"error: {err}", file=sys.stderr)  # on its own line even under a progress bar
        sys.exit(2)
