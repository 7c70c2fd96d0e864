"""Command line: plan tables, show a plan, compare two plans (python -m planners --help).

The flags are declared in planners/cli_flags.py, the commands in planners/cli_commands.py, and
how a plan file's recorded settings meet the flags in planners/cli_settings.py; here the errors
become exit codes.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from planners.cli_commands import COMMANDS
from planners.cli_flags import build_parser
from planners.explain import NoPlanError
from planners.types import PlanError

EXIT_NO_PLAN = 1  # the input is valid but no plan fits; the message says why
EXIT_BAD_INPUT = 2  # a bad file or flag; one line says which and where


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (0 ok, 1 no plan fits, 2 bad input)."""
    args = build_parser().parse_args(argv)
    command = COMMANDS[args.command]
    try:
        return command(args)
    except NoPlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_PLAN
    except PlanError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `... | head`: the reader stopped reading; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the flush at exit does not fail again
        return 0
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
