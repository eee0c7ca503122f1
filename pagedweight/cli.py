"""`pagedweight` command line: one argparse subcommand per module.

A module joins by being listed in COMMAND_MODULES and exposing
`add_parser(subparsers) -> ArgumentParser` and `run(args) -> int`. Bad input (ValueError, CheckpointError,
missing files, a directory or a file where the other is wanted, no permission, a page store's tmpfs too small) ends
with exit status 2 and one line on stderr; other exceptions are bugs and keep their traceback. Ctrl-C ends with
status 130 and one line, after the command's own clean-up.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from loguru import logger

COMMAND_MODULES: tuple[str, ...] = ("pagedweight.generate", "pagedweight.train", "pagedweight.run", "pagedweight.convert",
                                     "pagedweight.actors.serve_cli")
EXIT_BAD_INPUT = 2


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Says an option's default where its help does not already say it (and not for a switch or a None default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and ("default" in action.help or action.default is None or isinstance(action.default, bool)):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedweight",
        description="PagedWeight: serve MoE models trading expert-weight precision against KV cache.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="loguru level of the logs written to stderr (default: INFO)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        module.add_parser(subparsers).set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logger.remove()
    # the stderr of the moment, not the object of this call: one replaced meanwhile (a test's capture, closed after
    # it) would otherwise take every later log line and report an error for each
    logger.add(lambda message: sys.stderr.write(message), level=args.log_level, colorize=sys.stderr.isatty())
    from pagedweight.checkpoint import CheckpointError
    from pagedweight.page_store import PageStoreFull

    try:
        return int(args._run(args))
    except (ValueError, CheckpointError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
            PageStoreFull) as e:
        reason = " ".join(str(e).split())  # one line, whatever the exception text holds
        print(f"pagedweight {args.command}: error: {reason}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # the command has cleaned up on its way out (page store, partial output)
        print(f"pagedweight {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
