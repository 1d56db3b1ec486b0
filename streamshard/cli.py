"""The ``streamshard`` command: look at a corpus, preview an epoch's plan, measure read speed.

    streamshard inspect URL...   files, row groups, bytes, schema -> tensors, warnings
    streamshard plan URL...      rows, batches and padding per global worker for a topology
    streamshard bench URL...     stream one epoch through ParquetStream + DataLoader, timed

Every subcommand takes ``--json`` (stable keys, for scripts) and ``--storage-options`` (JSON text
or ``@file.json``). Expected failures print one line, ``streamshard: error: ...``, and exit 1
for data errors (catalog, read, conversion) or 2 for usage errors; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader

from .catalog import Catalog, list_files, read_footer
from .dataset import ParquetStream
from .errors import CatalogError, ConversionError, StreamshardError
from .plan import UNEVEN_POLICIES, UNITS, EpochPlan, Layout, PlanConfig
from .reader import RowGroupReader
from .storage import FileSystems
from .tensors import BatchConverter
from .topology import current_worker

PROG = "streamshard"
MIB = 1024 * 1024
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
    inspect.set_defaults(run=run_inspect, render=render_inspect)

    plan = sub.add_parser("plan", help="rows, batches and padding per global worker")
    _common(plan)
    plan.add_argument("--world-size", type=_positive, required=True)
    plan.add_argument("--num-workers", type=_non_negative, required=True, help="DataLoader workers per rank (0: main process)")
    plan.add_argument("--unit", choices=UNITS, default="row_group")
    plan.add_argument("--batch-size", type=_positive, default=None, help="rows per batch (default: one batch per row-group slice)")
    plan.add_argument("--shuffle", action="store_true")
    plan.add_argument("--seed", type=_non_negative, default=0)
    plan.add_argument("--epoch", type=_non_negative, default=0)
    plan.add_argument("--uneven", choices=UNEVEN_POLICIES, default="pad")
    plan.add_argument("--show", type=_non_negative, default=8, help="workers listed before summarising (default 8)")
    plan.set_defaults(run=run_plan, render=render_plan)

    bench = sub.add_parser("bench", help="stream one epoch through ParquetStream + DataLoader and time it")
    _common(bench)
    bench.add_argument("--num-workers", type=_non_negative, default=2)
    bench.add_argument("--batch-size", type=_positive, default=None)
    bench.add_argument("--max-batches", type=_positive, default=None, help="stop after this many batches")
    bench.add_argument("--read-ahead", type=_non_negative, default=2, help="row-group slices read ahead per worker")
    bench.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    bench.set_defaults(run=run_bench, render=render_bench)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("urls", nargs="+", metavar="URL", help="Parquet file, directory or glob; any fsspec URL")
    parser.add_argument("--columns", type=_column_list, default=None, help="comma-separated column projection")
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


# -- inspect ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FileBytes:
    """Byte sizes of one file's row groups from its footer (projected columns only)."""

    compressed: np.ndarray  # per row group
    uncompressed: np.ndarray  # per row group: the decoded-size estimate
    column_compressed: dict[str, int]  # per top-level column, whole file


def run_inspect(args: argparse.Namespace, err: TextIO) -> dict[str, Any]:
    """Read every footer; describe files, row groups, bytes and schema; collect warnings."""
    filesystems = FileSystems(args.storage_options)
    files = list_files(args.urls, filesystems)

    def one(item: tuple[str, int]) -> tuple[Any, _FileBytes]:
        url, size = item
        footer = read_footer(url, size, args.columns, filesystems)
        return footer, _file_bytes(footer, filesystems, args.columns)

    with ThreadPoolExecutor(max_workers=min(32, len(files))) as pool:
        read = list(pool.map(one, files))
    footers = [footer for footer, _ in read]
    warnings: list[dict[str, str]] = []
    try:
        schema = Catalog.from_footers(footers).schema
    except CatalogError as exc:  # schema drift: inspect reports it, every other command refuses
        warnings.append({"kind": "schema_drift", "message": str(exc)})
        schema = footers[0].schema
    rg_rows = np.concatenate([f.row_group_rows for f in footers]).astype(np.int64)
    comp = np.concatenate([b.compressed for _, b in read]).astype(np.int64)
    uncomp = np.concatenate([b.uncompressed for _, b in read]).astype(np.int64)
    report = {
        "files": len(files),
        "row_groups": int(len(rg_rows)),
        "rows": int(rg_rows.sum()),
        "file_bytes": int(sum(size for _, size in files)),
        "compressed_bytes": int(comp.sum()),
        "uncompressed_bytes": int(uncomp.sum()),
        "row_group_rows": _spread(rg_rows),
        "row_group_compressed_bytes": _spread(comp),
        "row_group_uncompressed_bytes": _spread(uncomp),
        "file_list": [
            {"url": f.url, "size": f.size, "row_groups": len(f.row_group_rows), "rows": int(f.row_group_rows.sum()),
             "compressed_bytes": int(b.compressed.sum())}
            for f, b in read
        ],
        "columns": _describe_columns(schema, footers[0].url, read),
        "warnings": warnings,
    }
    warnings.extend(_inspect_warnings(args, report, rg_rows, uncomp, [len(f.row_group_rows) for f in footers], footers))
    return report


def _file_bytes(footer: Any, filesystems: FileSystems, columns: list[str] | None) -> _FileBytes:
    """Compressed and uncompressed bytes per row group from one file's footer (one ranged read)."""
    fs, path = filesystems.resolve(footer.url)
    start = footer.size - footer.footer_length - 8 if footer.footer_length else max(footer.size - 1024 * 1024, 0)
    try:
        tail = fs.cat_file(path, start=start, end=footer.size)
        meta = pq.read_metadata(pa.BufferReader(tail))
    except Exception as exc:  # noqa: BLE001 - read_footer has already vetted the file; report anything else
        raise CatalogError(f"{footer.url}: cannot read the footer: {type(exc).__name__}: {exc}") from exc
    wanted = set(columns) if columns is not None else None
    comp = np.zeros(meta.num_row_groups, dtype=np.int64)
    uncomp = np.zeros(meta.num_row_groups, dtype=np.int64)
    per_column: dict[str, int] = {}
    for r in range(meta.num_row_groups):
        group = meta.row_group(r)
        for c in range(group.num_columns):
            chunk = group.column(c)
            top = chunk.path_in_schema.split(".")[0]
            if wanted is not None and top not in wanted:
                continue
            comp[r] += chunk.total_compressed_size
            uncomp[r] += chunk.total_uncompressed_size
            per_column[top] = per_column.get(top, 0) + chunk.total_compressed_size
    return _FileBytes(comp, uncomp, per_column)


def _spread(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"min": 0, "median": 0, "max": 0}
    return {"min": int(values.min()), "median": float(np.median(values)), "max": int(values.max())}


def _describe_columns(schema: pa.Schema, source: str, read: list[tuple[Any, _FileBytes]]) -> list[dict[str, Any]]:
    """What each column becomes in a batch (keys, dtypes, shapes), or why it cannot."""
    out = []
    for field in schema:
        entry: dict[str, Any] = {
            "name": field.name,
            "type": str(field.type),
            "nullable": field.nullable,
            "compressed_bytes": int(sum(b.column_compressed.get(field.name, 0) for _, b in read)),
        }
        try:
            converter = BatchConverter(pa.schema([field]), source=source)
            empty = converter(pa.Table.from_batches([], schema=pa.schema([field])))
            entry["tensors"] = [_describe_value(key, empty.get(key)) for key in converter.keys]
            entry["supported"], entry["error"] = True, None
        except ConversionError as exc:
            entry["tensors"], entry["supported"], entry["error"] = [], False, str(exc)
        out.append(entry)
    return out


def _describe_value(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        shape = ["rows"] + (["max_len" if value.shape[1] == 0 else int(value.shape[1])] if value.dim() == 2 else [])
        return {"key": key, "kind": "tensor", "dtype": str(value.dtype).replace("torch.", ""), "shape": shape}
    return {"key": key, "kind": "list", "dtype": "python", "shape": ["rows"]}


def _inspect_warnings(
    args: argparse.Namespace,
    report: dict[str, Any],
    rg_rows: np.ndarray,
    uncomp: np.ndarray,
    rgs_per_file: list[int],
    footers: list[Any],
) -> list[dict[str, str]]:
    warnings = []
    budget = int(args.memory_budget * MIB)
    big = np.flatnonzero(uncomp > budget)
    if len(big):
        warnings.append({"kind": "memory_budget", "message": (
            f"{len(big)} row group(s) exceed the {args.memory_budget:g} MiB decoded budget "
            f"(largest {_human(int(uncomp.max()))}); a worker holds up to 1 + read_ahead (default 2) of them at once; "
            "rewrite with smaller row groups or project fewer --columns")})
    unsupported = [c["name"] for c in report["columns"] if not c["supported"]]
    if unsupported:
        warnings.append({"kind": "unsupported_columns", "message": (
            f"{len(unsupported)} column(s) have no tensor conversion: {', '.join(unsupported)}; "
            "leave them out with --columns (columns= in ParquetStream)")})
    empty_files = [f.url for f, n in zip(footers, rgs_per_file) if n == 0 or int(f.row_group_rows.sum()) == 0]
    if empty_files:
        warnings.append({"kind": "empty_files", "message": f"{len(empty_files)} file(s) have no rows, e.g. {empty_files[0]}"})
    if args.world_size is not None or args.num_workers is not None:
        workers = (args.world_size or 1) * max(args.num_workers or 0, 1)
        files_with_rows = sum(1 for f in footers if int(f.row_group_rows.sum()) > 0)
        units = int((rg_rows > 0).sum()) if args.unit == "row_group" else files_with_rows
        if units < workers:
            warnings.append({"kind": "too_few_units", "message": (
                f"{units} non-empty {args.unit.replace('_', ' ')}(s) for {workers} global workers: workers "
                "split units and each decodes a whole row group to keep its slice, and with batch_size=None "
                "most workers yield padding; write smaller row groups or use fewer workers")})
    return warnings


def render_inspect(r: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"files        {r['files']:,}  ({_human(r['file_bytes'])} on storage)",
        f"row groups   {r['row_groups']:,}",
        f"rows         {r['rows']:,}",
        f"compressed   {_human(r['compressed_bytes'])}   decoded estimate {_human(r['uncompressed_bytes'])}"
        "  (projected columns)",
        "",
        "row groups        min       median          max",
        _spread_line("rows", r["row_group_rows"], lambda v: f"{v:,.0f}"),
        _spread_line("compressed", r["row_group_compressed_bytes"], _human),
        _spread_line("decoded", r["row_group_uncompressed_bytes"], _human),
        "",
        "columns -> batch entries",
    ]
    for c in r["columns"]:
        head = f"  {c['name']}: {c['type']}{' (nullable)' if c['nullable'] else ''}, {_human(c['compressed_bytes'])}"
        if c["supported"]:
            parts = [f"{t['key']} {t['dtype']}[{', '.join(map(str, t['shape']))}]" if t["kind"] == "tensor"
                     else f"{t['key']} list[python]" for t in c["tensors"]]
            lines.append(f"{head} -> {'; '.join(parts)}")
        else:
            lines.append(f"{head} -> UNSUPPORTED: {c['error']}")
    lines.append("")
    for w in r["warnings"]:
        lines.append(f"warning: {w['message']}")
    if not r["warnings"]:
        lines.append("no warnings")
    return "\n".join(lines) + "\n"


def _spread_line(label: str, spread: dict[str, float], fmt: Any) -> str:
    return f"  {label:<12}{fmt(spread['min']):>10}{fmt(spread['median']):>13}{fmt(spread['max']):>13}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# -- plan -------------------------------------------------------------------------------------


def run_plan(args: argparse.Namespace, err: TextIO) -> dict[str, Any]:
    """Each global worker's rows, batches and padding for the epoch, under both uneven policies."""
    catalog = Catalog.build(args.urls, args.columns, args.storage_options)
    workers = args.world_size * max(args.num_workers, 1)
    plans = {
        policy: EpochPlan(
            Layout(catalog.rg_rows, catalog.rg_file),
            PlanConfig(unit=args.unit, shuffle=args.shuffle, seed=args.seed, batch_size=args.batch_size, uneven=policy),
            args.epoch,
            workers,
        )
        for policy in UNEVEN_POLICIES
    }
    per_policy = {policy: _worker_rows(plan, args.num_workers) for policy, plan in plans.items()}
    chosen = per_policy[args.uneven]
    rows = np.array([w["rows"] for w in chosen], dtype=np.int64)
    return {
        "rows": catalog.num_rows,
        "files": catalog.num_files,
        "row_groups": catalog.num_row_groups,
        "world_size": args.world_size,
        "num_workers": args.num_workers,
        "global_workers": workers,
        "unit": args.unit,
        "batch_size": args.batch_size,
        "shuffle": args.shuffle,
        "seed": args.seed,
        "epoch": args.epoch,
        "uneven": args.uneven,
        "steps_per_worker": plans[args.uneven].steps,
        "steps_per_rank": plans[args.uneven].steps * max(args.num_workers, 1),
        "workers": chosen,
        "balance": {
            "rows": _spread(rows),
            "rows_max_over_mean": float(rows.max() / rows.mean()) if rows.sum() else 1.0,
        },
        "uneven_cost": {policy: _cost(plans[policy], per_policy[policy]) for policy in UNEVEN_POLICIES},
    }


def _worker_rows(plan: EpochPlan, num_workers: int) -> list[dict[str, int]]:
    begin, end = plan.block_bounds(np.arange(plan.num_workers))
    per_rank = max(num_workers, 1)
    out = []
    for g in range(plan.num_workers):
        work = plan.worker_plan(g)
        padding_batches = work.steps - work.real_batches
        out.append({
            "global_worker": g,
            "rank": g // per_rank,
            "worker": g % per_rank,
            "pieces": len(work.pieces),
            "rows": work.rows,
            "batches": work.steps,
            "real_batches": work.real_batches,
            "padding_batches": padding_batches,
            "padding_rows": _padding_rows(plan, work, padding_batches),
            "dropped_rows": int(end[g] - begin[g]) - work.rows,
        })
    return out


def _padding_rows(plan: EpochPlan, work: Any, padding_batches: int) -> int:
    """Padding rows ParquetStream yields: a topped-up last batch plus padding batches."""
    bs = plan.config.batch_size
    if bs is not None:
        return work.steps * bs - work.rows
    if padding_batches == 0:
        return 0
    # Padding batches copy the shape of the worker's last batch (or an even share if it has none).
    rows = int(work.pieces.rows[-1]) if len(work.pieces) else max(1, -(-plan.total_rows // plan.num_workers))
    return padding_batches * rows


def _cost(plan: EpochPlan, workers: list[dict[str, int]]) -> dict[str, int]:
    batches = sum(w["batches"] for w in workers)
    padding = sum(w["padding_batches"] for w in workers)
    return {
        "steps_per_worker": plan.steps,
        "batches": batches,
        "padding_batches": padding,
        "padding_rows": sum(w["padding_rows"] for w in workers),
        "dropped_rows": plan.dropped_rows(),
        "delivered_rows": sum(w["rows"] for w in workers),
    }


def render_plan(r: dict[str, Any], args: argparse.Namespace) -> str:
    show = args.show
    bs = r["batch_size"] if r["batch_size"] is not None else "one per row-group slice"
    lines = [
        f"{r['rows']:,} rows in {r['files']} files / {r['row_groups']} row groups",
        f"{r['world_size']} rank(s) x {max(r['num_workers'], 1)} worker(s) = {r['global_workers']} global workers; "
        f"unit={r['unit']} batch_size={bs} shuffle={r['shuffle']} seed={r['seed']} epoch={r['epoch']} uneven={r['uneven']}",
        f"steps: {r['steps_per_worker']} per global worker, {r['steps_per_rank']} per rank (DataLoader batches)",
        "",
        f"{'worker':>8} {'rank':>5} {'w':>3} {'pieces':>7} {'rows':>10} {'batches':>8} {'padding':>8} {'pad rows':>9} {'dropped':>8}",
    ]
    workers = r["workers"]
    shown = workers if len(workers) <= show else workers[: show // 2] + [None] + workers[-(show - show // 2):]
    for w in shown:
        if w is None:
            lines.append(f"{'...':>8}  ({len(workers) - show} more)")
            continue
        lines.append(
            f"{w['global_worker']:>8} {w['rank']:>5} {w['worker']:>3} {w['pieces']:>7} {w['rows']:>10,} "
            f"{w['batches']:>8} {w['padding_batches']:>8} {w['padding_rows']:>9,} {w['dropped_rows']:>8,}"
        )
    rows = r["balance"]["rows"]
    lines += [
        "",
        f"rows per worker: min {rows['min']:,} / median {rows['median']:,.0f} / max {rows['max']:,}"
        f"  (max/mean {r['balance']['rows_max_over_mean']:.3f})",
        "what uneven costs this epoch:",
    ]
    for policy, c in r["uneven_cost"].items():
        mark = "*" if policy == r["uneven"] else " "
        share = c["padding_batches"] / c["batches"] if c["batches"] else 0.0
        lines.append(
            f" {mark} {policy:<4} {c['steps_per_worker']} steps/worker, {c['padding_batches']:,} padding batches "
            f"({share:.1%}), {c['padding_rows']:,} padding rows, {c['dropped_rows']:,} dropped rows"
        )
    return "\n".join(lines) + "\n"


# -- bench ------------------------------------------------------------------------------------


def run_bench(args: argparse.Namespace, err: TextIO) -> dict[str, Any]:
    """Stream one epoch through ParquetStream + DataLoader, timing each worker's stages.

    Measured in the main process: rows (padding excluded), batches, wall time from the first
    ``iter(loader)`` (worker start-up included) and tensor bytes delivered. Measured inside each
    worker, by ``_TimedStream``: see ``_WorkerTimes``.
    """
    stats = torch.zeros((max(args.num_workers, 1), len(_WorkerTimes.FIELDS)), dtype=torch.float64).share_memory_()
    ds = _TimedStream(
        args.urls, columns=args.columns, batch_size=args.batch_size, storage_options=args.storage_options,
        rank=0, world_size=1, read_ahead=args.read_ahead, stats=stats,
    )
    ds.set_epoch(0)  # reads the footers once here, so the workers inherit the catalog
    loader = DataLoader(ds, batch_size=None, num_workers=args.num_workers)
    progress = _Progress(err, enabled=not args.quiet)
    rows = batches = nbytes = 0
    stopped_early = False
    start = time.perf_counter()
    for batch in loader:
        ids = batch["sample_id"]
        rows += int((ids >= 0).sum())
        nbytes += sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))
        batches += 1
        progress.update(rows, nbytes, time.perf_counter() - start)
        if args.max_batches is not None and batches >= args.max_batches:
            stopped_early = True
            break
    seconds = time.perf_counter() - start
    del loader  # stop the workers before reading what they wrote
    progress.finish(rows, nbytes, seconds)
    workers = [_WorkerTimes.as_dict(i, row) for i, row in enumerate(stats.tolist())]
    storage_bytes = sum(w["read_bytes"] for w in workers)
    return {
        "rows": rows,
        "batches": batches,
        "seconds": seconds,
        "rows_per_s": rows / seconds if seconds else 0.0,
        "mb_per_s": nbytes / 1e6 / seconds if seconds else 0.0,
        "storage_mb_per_s": storage_bytes / 1e6 / seconds if seconds else 0.0,
        "delivered_bytes": nbytes,
        "storage_bytes": storage_bytes,
        "num_workers": args.num_workers,
        "batch_size": args.batch_size,
        "read_ahead": args.read_ahead,
        "max_batches": args.max_batches,
        "stopped_early": stopped_early,
        "catalog_rows": ds.catalog.num_rows,
        "workers": workers,
    }


def render_bench(r: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"{r['rows']:,} rows in {r['batches']:,} batches, {r['seconds']:.2f} s "
        f"(num_workers={r['num_workers']}, batch_size={r['batch_size']}{', stopped early' if r['stopped_early'] else ''})",
        f"  {r['rows_per_s']:,.0f} rows/s   {r['mb_per_s']:.1f} MB/s delivered (tensor bytes)   "
        f"{r['storage_mb_per_s']:.1f} MB/s read from storage",
        "",
        f"{'worker':>6} {'rows':>10} {'batches':>8} {'busy s':>7} {'wait s':>7} {'io s':>7} {'decode s':>9} "
        f"{'convert s':>9} {'read MB':>8}",
    ]
    for w in r["workers"]:
        lines.append(
            f"{w['worker']:>6} {w['rows']:>10,} {w['batches']:>8} {w['busy_s']:>7.2f} {w['wait_s']:>7.2f} "
            f"{w['io_s']:>7.2f} {w['decode_s']:>9.2f} {w['convert_s']:>9.2f} {w['read_bytes'] / 1e6:>8.1f}"
        )
    lines += [
        "",
        "busy: time the worker spent producing batches; wait: part of it blocked on the read-ahead thread;",
        "io: time in storage reads, decode: rest of RowGroupReader.read (both on the read-ahead thread);",
        "convert: Arrow -> torch. MB are 10**6 bytes.",
    ]
    return "\n".join(lines) + "\n"


class _WorkerTimes:
    """One DataLoader worker's stage times, kept in a row of a shared-memory tensor.

    busy_s     time inside the worker's ``next()``: producing batches, not idling on the DataLoader
    wait_s     part of busy_s spent blocked on the read-ahead thread for the next Arrow table
    read_s     wall time of ``RowGroupReader.read`` calls (read-ahead threads): fetch + Parquet decode
    io_s       part of read_s spent fetching byte ranges from storage (``RowGroupReader._fetch``)
    decode_s   read_s - io_s: decompression and decoding to Arrow (reported, not stored)
    convert_s  Arrow -> torch (``BatchConverter``), on the worker's main thread
    read_bytes bytes the reader fetched from storage (``RowGroupReader.stats``)
    With several read-ahead threads, read_s and io_s are sums over threads and can exceed busy_s.
    """

    FIELDS = ("rows", "batches", "busy_s", "wait_s", "read_s", "io_s", "convert_s", "read_bytes")

    def __init__(self, stats: Any, worker: int) -> None:
        self.row = stats[worker]
        self.values = dict.fromkeys(self.FIELDS, 0.0)
        self.readers: list[RowGroupReader] = []
        self.lock = threading.Lock()

    def add(self, field: str, amount: float) -> None:
        with self.lock:
            self.values[field] += amount

    def instrument(self, reader: RowGroupReader) -> None:
        """Time this reader's ``read`` and (when it has one) its byte-range fetch seam ``_fetch``."""
        self.readers.append(reader)
        reader.read = self._timed(reader.read, "read_s")  # type: ignore[method-assign]
        if hasattr(reader, "_fetch"):  # private seam of RowGroupReader: fetch the bytes of some ranges
            reader._fetch = self._timed(reader._fetch, "io_s")  # type: ignore[attr-defined]

    def _timed(self, fn: Any, field: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(field, time.perf_counter() - start)

        return timed

    def flush(self) -> None:
        fetched = sum(getattr(getattr(r, "stats", None), "bytes_fetched", 0) for r in self.readers)
        with self.lock:
            self.values["read_bytes"] = float(fetched)
            self.row.copy_(torch.tensor([self.values[f] for f in self.FIELDS], dtype=torch.float64))

    @classmethod
    def as_dict(cls, worker: int, row: list[float]) -> dict[str, Any]:
        d: dict[str, Any] = dict(zip(cls.FIELDS, row))
        for key in ("rows", "batches", "read_bytes"):
            d[key] = int(d[key])
        d["decode_s"] = max(d["read_s"] - d["io_s"], 0.0)
        return {"worker": worker, **d}


class _TimedStream(ParquetStream):
    """ParquetStream with stage timers; what it yields is exactly what ParquetStream yields."""

    def __init__(self, *args: Any, stats: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stats = stats
        self._times: _WorkerTimes | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_times": None}

    def __iter__(self) -> Any:
        times = self._times = _WorkerTimes(self.stats, current_worker()[0])
        batches = super().__iter__()
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                times.add("busy_s", time.perf_counter() - start)
                times.flush()
                return
            times.add("busy_s", time.perf_counter() - start)
            ids = batch["sample_id"]
            times.add("rows", int((ids >= 0).sum()))
            times.add("batches", 1)
            times.flush()
            yield batch

    @property
    def converter(self) -> Any:
        convert = super().converter
        times = self._times
        if times is None:  # main process (set_epoch): nothing to time
            return convert

        def timed(table: Any) -> Any:
            start = time.perf_counter()
            try:
                return convert(table)
            finally:
                times.add("convert_s", time.perf_counter() - start)

        return timed

    def iter_piece_tables(self, plan: Any, pieces: Any, reader: Any = None) -> Any:
        tables = super().iter_piece_tables(plan, pieces, reader)
        times = self._times
        try:
            while True:
                start = time.perf_counter()
                try:
                    table = next(tables)
                except StopIteration:
                    return
                finally:
                    if times is not None:
                        times.add("wait_s", time.perf_counter() - start)
                yield table
        finally:
            tables.close()

    def _reader(self) -> RowGroupReader:
        reader = super()._reader()
        if self._times is not None:
            self._times.instrument(reader)
        return reader


class _Progress:
    """One status line on stderr, redrawn with a carriage return at most 4 times a second."""

    def __init__(self, err: TextIO, enabled: bool = True) -> None:
        self.err, self.enabled, self.last = err, enabled, -1.0

    def update(self, rows: int, nbytes: int, seconds: float) -> None:
        if self.enabled and seconds - self.last >= 0.25:
            self.last = seconds
            self._write(rows, nbytes, seconds, end="")

    def finish(self, rows: int, nbytes: int, seconds: float) -> None:
        if self.enabled:
            self._write(rows, nbytes, seconds, end="\n")

    def _write(self, rows: int, nbytes: int, seconds: float, end: str) -> None:
        rate = rows / seconds if seconds else 0.0
        mbs = nbytes / 1e6 / seconds if seconds else 0.0
        self.err.write(f"\r{rows:>12,} rows  {rate:>10,.0f} rows/s  {mbs:>8.1f} MB/s  {seconds:>6.1f} s{end}")
        self.err.flush()
