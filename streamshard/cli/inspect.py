"""``streamshard inspect``: files, row groups, bytes and schema -> tensors of a corpus, with warnings.

Everything comes from the Parquet footers (one ranged read per file, in parallel), except one
sample: the first pages of the string/binary columns of the first non-empty row group, decoded to
learn their average value size (a dictionary-encoded footer does not say it). Decoded sizes are
estimated from the Arrow types (``decoded_size.py``), not the footer's encoded sizes. Schema drift
is reported as a warning here, where every other command refuses it.
"""

from __future__ import annotations

import argparse
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..io.catalog import Catalog, read_footer
from ..format.decoded_size import byte_array_leaves, decoded_bytes, leaf_value_bytes
from ..errors import CatalogError, ConversionError
from ..io.partitions import drop_columns
from ..format.schema import canonical_type, unify
from ..io.sources import Listing, list_sources
from ..io.storage import FileSystems
from ..convert.tensors import BatchConverter
from ..progress import progress_bar
from ..streams.delivery import READ_AHEAD_BYTES

log = logging.getLogger("streamshard")

MIB = 1024 * 1024
SAMPLE_ROWS = 4096  # rows decoded from one row group to measure string/binary value sizes
_SAMPLE_FILES = 8  # files tried (in URL order) to find a non-empty row group to sample


@dataclass(frozen=True)
class _FileBytes:
    """Byte sizes of one file's row groups from its footer (projected columns only)."""

    compressed: np.ndarray  # per row group
    uncompressed: np.ndarray  # per row group: the footer's (encoded) uncompressed size
    decoded: np.ndarray  # per row group: the estimated Arrow size (what a reader holds)
    column_compressed: dict[str, int]  # per top-level column, whole file


def run_inspect(args: argparse.Namespace, err: TextIO) -> dict[str, Any]:
    """Read every footer; describe files, row groups, bytes and schema; collect warnings."""
    filesystems = FileSystems(args.storage_options)
    partitioning = None if getattr(args, "partitioning", "hive") == "none" else "hive"
    listing = list_sources(args.urls, filesystems, partitioning=partitioning)  # what a stream would read
    files = [(f.url, f.size) for f in listing.files]
    keys = set(listing.keys)
    columns = None if args.columns is None else [c for c in args.columns if c not in keys]
    value_bytes = _sample_value_bytes(files, filesystems, columns)

    def one(item: tuple[str, int]) -> tuple[Any, _FileBytes]:
        url, size = item
        footer = drop_columns(read_footer(url, size, columns, filesystems), keys)  # a key is the path's value
        return footer, _file_bytes(footer, filesystems, columns, value_bytes)

    read: list[tuple[Any, _FileBytes]] = []
    with ThreadPoolExecutor(max_workers=min(32, len(files))) as pool, progress_bar(
        err, total=len(files), unit="files", desc="footers", quiet=args.quiet
    ) as bar:
        for result in pool.map(one, files):  # in URL order, as the catalog needs them
            read.append(result)
            bar.update(1)
    footers = [footer for footer, _ in read]
    warnings: list[dict[str, str]] = []
    try:
        Catalog.from_footers(footers, listing=listing)  # only to learn whether the schemas agree; columns are described below
    except CatalogError as exc:  # schema drift: inspect reports it, every other command refuses
        warnings.append({"kind": "schema_drift", "message": str(exc)})
    rg_rows = np.concatenate([f.row_group_rows for f in footers]).astype(np.int64)
    comp = np.concatenate([b.compressed for _, b in read]).astype(np.int64)
    uncomp = np.concatenate([b.uncompressed for _, b in read]).astype(np.int64)
    decoded = np.concatenate([b.decoded for _, b in read]).astype(np.int64)
    report = {
        "files": len(files),
        "row_groups": int(len(rg_rows)),
        "rows": int(rg_rows.sum()),
        "file_bytes": int(sum(size for _, size in files)),
        "compressed_bytes": int(comp.sum()),
        "uncompressed_bytes": int(uncomp.sum()),
        "decoded_bytes": int(decoded.sum()),
        "row_group_rows": spread(rg_rows),
        "row_group_compressed_bytes": spread(comp),
        "row_group_uncompressed_bytes": spread(uncomp),
        "row_group_decoded_bytes": spread(decoded),
        "file_list": [
            {"url": f.url, "size": f.size, "row_groups": len(f.row_group_rows), "rows": int(f.row_group_rows.sum()),
             "compressed_bytes": int(b.compressed.sum())}
            for f, b in read
        ],
        "columns": _describe_columns(_column_fields(footers) + _key_fields(listing, args.columns), footers[0].url,
                                     read),
        "partition_keys": listing.keys,
        "tables": list(listing.tables),
        "warnings": warnings,
    }
    warnings.extend(_inspect_warnings(args, report, rg_rows, decoded, [len(f.row_group_rows) for f in footers], footers))
    if listing.deleted:  # the footers count rows a Delta deletion vector deletes; a stream leaves them out
        gone = sum(len(rows) for rows in listing.deleted.values())
        warnings.append({"kind": "deleted_rows", "message": (
            f"{gone:,} row(s) of {len(listing.deleted)} file(s) are deleted by deletion vectors: the row counts above "
            f"include them, a stream delivers {report['rows'] - gone:,} rows")})
    return report


def _file_bytes(footer: Any, filesystems: FileSystems, columns: list[str] | None,
                value_bytes: dict[str, float]) -> _FileBytes:
    """Compressed, uncompressed and estimated decoded bytes per row group from one file's footer (one ranged read)."""
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
    return _FileBytes(comp, uncomp, decoded_bytes(meta, columns, value_bytes), per_column)


def _sample_value_bytes(files: list[tuple[str, int]], filesystems: FileSystems,
                        columns: list[str] | None) -> dict[str, float]:
    """Average data bytes per value of each string/binary leaf (by Parquet path), measured on the
    first ``SAMPLE_ROWS`` rows of the first non-empty row group (only the first pages are read)."""
    for url, size in files[:_SAMPLE_FILES]:
        fs, path = filesystems.resolve(url)
        try:
            with fs.open(path, "rb") as handle:
                parquet = pq.ParquetFile(handle, buffer_size=256 * 1024, pre_buffer=False)
                meta, schema = parquet.metadata, parquet.schema_arrow
                wanted = [f for f in schema if (columns is None or f.name in columns) and byte_array_leaves(f)]
                group = next((r for r in range(meta.num_row_groups) if meta.row_group(r).num_rows), None)
                if not wanted:
                    return {}
                if group is None:
                    continue
                batch = next(parquet.iter_batches(batch_size=SAMPLE_ROWS, row_groups=[group],
                                                  columns=[f.name for f in wanted]))
        except Exception as exc:  # noqa: BLE001 - the footer pass that follows reports this file's problem
            log.debug("%s: no value-size sample: %s: %s", url, type(exc).__name__, exc)
            continue
        leaves = meta.row_group(group)
        paths = [leaves.column(c).path_in_schema for c in range(leaves.num_columns)]
        out: dict[str, float] = {}
        for field in wanted:
            mine = [p for p in paths if p == field.name or p.startswith(field.name + ".")]
            for index, (nbytes, values) in zip(byte_array_leaves(field), leaf_value_bytes(batch.column(field.name))):
                if values and index < len(mine):
                    out[mine[index]] = nbytes / values
        return out
    return {}


def spread(values: np.ndarray) -> dict[str, float]:
    """``{min, median, max}`` of ``values`` (zeros when empty); ``plan`` reports balance in the same shape."""
    if len(values) == 0:
        return {"min": 0, "median": 0, "max": 0}
    return {"min": int(values.min()), "median": float(np.median(values)), "max": int(values.max())}


@dataclass(frozen=True)
class _Column:
    """One column of the corpus: its field as the catalog types it, how many files hold it, the types seen."""

    field: pa.Field
    files: int
    types: list[str]


def _column_fields(footers: list[Any]) -> list[_Column]:
    """Every column any file has, in first-seen order, typed as the catalog would type it.

    Each column is unified on its own (:func:`unify`), so drift elsewhere does not hide what is true of
    it: it is nullable only if some file's statistics say it may hold nulls (a writer's ``optional``
    alone is not enough), and its nested nullability is merged over the files that hold it. A column
    whose types disagree is shown as its first file has it, with the other types listed.
    """
    nullable = set().union(*(f.maybe_null for f in footers))
    holders: dict[str, list[tuple[str, pa.Field]]] = {}
    for footer in footers:
        for field in footer.schema:
            holders.setdefault(field.name, []).append((footer.url, field))
    columns = []
    for name, held in holders.items():
        try:
            field = unify([(url, pa.schema([f])) for url, f in held], nullable, {}).field(0)
        except CatalogError:  # the types disagree; the drift warning names the files
            field = pa.field(name, canonical_type(held[0][1].type), nullable=name in nullable)
        types = list(dict.fromkeys(str(canonical_type(f.type)) for _, f in held))
        columns.append(_Column(field, len(held), types))
    return columns


def _key_fields(listing: Listing, columns: list[str] | None) -> list[_Column]:
    """The partition keys as columns (from the paths or a table's log: held by every file, in no file's bytes)."""
    if listing.partitions is None:
        return []
    out = []
    for name in listing.keys:
        if columns is None or name in columns:
            values = listing.partitions.column(name)
            out.append(_Column(pa.field(name, values.type, nullable=values.null_count > 0), len(listing.files),
                               [str(values.type)]))
    return out


def _describe_columns(columns: list[_Column], source: str, read: list[tuple[Any, _FileBytes]]) -> list[dict[str, Any]]:
    """What each column becomes in a batch (keys, dtypes, shapes), or why it cannot."""
    out = []
    for column in columns:
        field = column.field
        entry: dict[str, Any] = {
            "name": field.name,
            "type": str(field.type),
            "nullable": field.nullable,
            "files": column.files,
            "types": column.types,
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
    decoded: np.ndarray,
    rgs_per_file: list[int],
    footers: list[Any],
) -> list[dict[str, str]]:
    warnings = []
    budget = int(args.memory_budget * MIB)
    big = np.flatnonzero(decoded > budget)
    if len(big):
        warnings.append({"kind": "memory_budget", "message": (
            f"{len(big)} row group(s) exceed the {args.memory_budget:g} MiB decoded budget "
            f"(largest {_human(int(decoded.max()))}); a worker holds the ones its batch needs, and reads ahead only "
            f"within {READ_AHEAD_BYTES // MIB} MiB decoded (read_ahead, default 2, reads at most); with shuffle=True its whole window "
            "(shuffle_window, default 16); "
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
                "split units (a split row group is decoded by each of them, keeping only its part), and with batch_size=None "
                "most workers yield padding; write smaller row groups or use fewer workers")})
    return warnings


def render_inspect(r: dict[str, Any], args: argparse.Namespace) -> str:
    """The ``inspect`` report ``r`` as text for a terminal (``--json`` prints ``r`` itself)."""
    lines = [f"table        {tag}" for tag in r.get("tables", ())] + [
        f"files        {r['files']:,}  ({_human(r['file_bytes'])} on storage)",
        f"row groups   {r['row_groups']:,}",
        f"rows         {r['rows']:,}",
        f"compressed   {_human(r['compressed_bytes'])}   decoded estimate {_human(r['decoded_bytes'])}"
        "  (projected columns)",
        "",
        "row groups        min       median          max",
        _spread_line("rows", r["row_group_rows"], lambda v: f"{v:,.0f}"),
        _spread_line("compressed", r["row_group_compressed_bytes"], _human),
        _spread_line("decoded", r["row_group_decoded_bytes"], _human),
        "",
        "columns -> batch entries",
    ]
    keys = set(r.get("partition_keys", ()))
    for c in r["columns"]:
        nullable = " (nullable)" if c["nullable"] else ""
        nullable += " (partition key)" if c["name"] in keys else ""
        head = f"  {c['name']}: {c['type']}{nullable}{_drift_note(c, r['files'])}, {_human(c['compressed_bytes'])}"
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


def _drift_note(column: dict[str, Any], files: int) -> str:
    """`` (in 3 of 8 files)``, `` (types differ: int32, int64)``: how a column drifts, or ''."""
    note = f" (in {column['files']} of {files} files)" if column["files"] < files else ""
    if len(column["types"]) > 1:
        note += f" (types differ: {', '.join(column['types'])})"
    return note


def _spread_line(label: str, summary: dict[str, float], fmt: Any) -> str:
    return f"  {label:<12}{fmt(summary['min']):>10}{fmt(summary['median']):>13}{fmt(summary['max']):>13}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
