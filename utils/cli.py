"""The command line both scripts share the look of."""
import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the module docstring's layout (its commands) and shows every flag's default."""
