"""The ``streamshard`` command: look at a corpus, preview an epoch's plan, measure read speed.

    streamshard inspect URL...   files, row groups, bytes, schema -> tensors, warnings
    streamshard plan URL...      rows, batches and padding per global worker for a topology
    streamshard bench URL...     stream one epoch through ParquetStream + StreamLoader, timed

Every subcommand takes ``--json`` (stable keys, for scripts) and ``--storage-options`` (JSON text
or ``@file.json``). Expected failures print one line, ``streamshard: error: ...``, and exit 1
for data errors (catalog, read, conversion) or 2 for usage errors; never a traceback.

This module is the command line itself: arguments, dispatch, output and exit codes. Each
subcommand's work and its text rendering live in ``inspect``, ``plan`` and ``bench`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence, TextIO

from ..streams.dataset import DEFAULT_BATCH_SIZE
from ..errors import StreamshardError
from ..plan.epoch_plan import UNEVEN_POLICIES, UNITS
from .bench import render_bench, run_bench
from .inspect import render_inspect, run_inspect
from .plan import render_plan, run_plan

PROG = "streamshard"
EXIT_DATA, EXIT_USAGE = 1, 2


class UsageError(Exception):
    """A command line that cannot be run as given (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage and exits; we want one line and a return code.
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


# -- entry point ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        args = build_parser().parse_args(argv)
        args.storage_options = parse_storage_options(args.storage_options)
        report = args.run(args, err)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UsageError as exc:
        return _fail(err, str(exc), EXIT_USAGE)
    except StreamshardError as exc:  # CatalogError, ReadError, ConversionError
        return _fail(err, str(exc), EXIT_DATA)
    except ValueError as exc:  # an argument the library refused (batch_size=0, ...)
        return _fail(err, str(exc), EXIT_USAGE)
    except KeyboardInterrupt:
        return _fail(err, "interrupted", 130)
    try:
        if args.json:
            json.dump(report, out, indent=2, sort_keys=True)
            out.write("\n")
        else:
            out.write(args.render(report, args))
        out.flush()
    except BrokenPipeError:  # `streamshard plan ... | head`: the reader left, which is fine
        if out is sys.stdout:  # keep the interpreter's final flush from complaining
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


def _fail(err: TextIO, message: str, code: int) -> int:
    err.write(f"{PROG}: error: {_one_line(message)}\n")
    return code


def _one_line(message: str) -> str:
    """The message on one line; an error re-raised by a DataLoader worker keeps only its cause."""
    if "Original Traceback" in message:
        last = [line for line in message.strip().splitlines() if line.strip()][-1]
        head, sep, rest = last.partition(": ")
        message = rest if sep and "Error" in head else last
    return " ".join(message.split())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Inspect, plan and benchmark Parquet corpora for streamshard.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    inspect = sub.add_parser("inspect", help="files, row groups, bytes, schema -> tensors, warnings")
    _common(inspect)
    inspect.add_argument("--memory-budget", type=_mib, default=512.0, metavar="MIB",
                         help="warn about row groups whose decoded size estimate exceeds this (MiB, default 512)")
    inspect.add_argument("--world-size", type=_positive, default=None, help="ranks you plan to train with")
    inspect.add_argument("--num-workers", type=_non_negative, default=None, help="DataLoader workers per rank")
    inspect.add_argument("--unit", choices=UNITS, default="row_group", help="sharding unit to check against workers")
    _quiet(inspect)
    inspect.set_defaults(run=run_inspect, render=render_inspect)

    plan = sub.add_parser("plan", help="rows, batches and padding per global worker")
    _common(plan)
    plan.add_argument("--world-size", type=_positive, required=True)
    plan.add_argument("--num-workers", type=_non_negative, required=True, help="DataLoader workers per rank (0: main process)")
    plan.add_argument("--unit", choices=UNITS, default="row_group")
    _batch_size(plan)
    plan.add_argument("--shuffle", action="store_true")
    plan.add_argument("--seed", type=_non_negative, default=0)
    plan.add_argument("--epoch", type=_non_negative, default=0)
    plan.add_argument("--uneven", choices=UNEVEN_POLICIES, default="pad")
    plan.add_argument("--show", type=_non_negative, default=8, help="workers listed before summarising (default 8)")
    _quiet(plan)
    plan.set_defaults(run=run_plan, render=render_plan)

    bench = sub.add_parser("bench", help="stream one epoch through ParquetStream + StreamLoader and time it")
    _common(bench)
    bench.add_argument("--num-workers", type=_non_negative, default=2)
    _batch_size(bench)
    bench.add_argument("--max-batches", type=_positive, default=None, help="stop after this many batches")
    bench.add_argument("--read-ahead", type=_non_negative, default=2, help="row-group slices read ahead per worker")
    _quiet(bench)
    bench.set_defaults(run=run_bench, render=render_bench)
    return parser


def _quiet(command: argparse.ArgumentParser) -> None:
    command.add_argument("--quiet", action="store_true",
                         help="no progress bar on stderr (there is none unless stderr is a terminal)")


def _batch_size(command: argparse.ArgumentParser) -> None:
    """--batch-size N (the ParquetStream default unless given) or --row-group-batches (batch_size=None)."""
    sizes = command.add_mutually_exclusive_group()
    sizes.add_argument("--batch-size", type=_positive, default=DEFAULT_BATCH_SIZE,
                       help=f"rows per batch (default {DEFAULT_BATCH_SIZE}, as ParquetStream)")
    sizes.add_argument("--row-group-batches", dest="batch_size", action="store_const", const=None,
                       help="one batch per row-group slice (batch_size=None)")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("urls", nargs="+", metavar="URL",
                        help="Parquet file, directory or glob, or a Delta table's root (its latest version); any fsspec URL")
    parser.add_argument("--columns", type=_column_list, default=None, help="comma-separated column projection")
    parser.add_argument("--partitioning", choices=("hive", "none"), default="hive",
                        help="hive: k=v directory names become columns (default); none: ignored")
    parser.add_argument("--storage-options", default=None, metavar="JSON|@FILE",
                        help="fsspec options as JSON text, or @path to a JSON file")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _positive(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of MiB: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _column_list(text: str) -> list[str]:
    columns = [c.strip() for c in text.split(",") if c.strip()]
    if not columns:
        raise argparse.ArgumentTypeError("give at least one column name")
    return columns


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """``--storage-options``: JSON object text, or ``@path`` to a file holding one."""
    if text is None:
        return {}
    source = "--storage-options"
    if text.startswith("@"):
        source = text[1:]
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise UsageError(f"--storage-options: cannot read {source}: {exc.strerror or exc}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{source}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{source}: must be a JSON object, got {type(value).__name__}")
    return value
