"""The ``streamshard`` command: its numbers agree with the catalog and the plan; errors are one line."""

from __future__ import annotations

import fcntl
import io
import json
import re
import os
import pty
import struct
import subprocess
import sys
import termios
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamshard.io.catalog import Catalog
from streamshard.cli import main
from streamshard.streams.dataset import ParquetStream
from streamshard.testing import write_corpus

LAYOUT = [[900, 700, 1100]] + [[3]] * 5 + [[]] + [[0, 5, 0]] + [[40, 1, 250]]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "corpus"
    write_corpus(str(root), LAYOUT)
    return str(root)


@pytest.fixture(scope="module")
def drifted(tmp_path_factory):
    root = tmp_path_factory.mktemp("drift")
    pq.write_table(pa.table({"a": [1, 2], "b": [0.5, 1.5]}), root / "x.parquet")
    pq.write_table(pa.table({"a": ["x", "y"], "b": [0.5, 1.5]}), root / "y.parquet")
    return str(root)


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def run_json(*argv: str) -> dict:
    code, out, err = run(*argv, "--json")
    assert code == 0, err
    return json.loads(out)


def assert_one_line_error(err: str, *fragments: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("streamshard: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


# -- inspect ----------------------------------------------------------------------------------


def test_inspect_counts_match_the_catalog_and_the_footers(corpus):
    report = run_json("inspect", corpus)
    catalog = Catalog.build(corpus)
    assert (report["files"], report["row_groups"], report["rows"]) == (
        catalog.num_files, catalog.num_row_groups, catalog.num_rows)
    assert report["row_group_rows"] == {"min": 0, "median": float(np.median(catalog.rg_rows)), "max": 1100}
    assert [f["rows"] for f in report["file_list"]] == [sum(rgs) for rgs in LAYOUT]
    compressed = 0
    for url in catalog.urls:
        meta = pq.ParquetFile(url.removeprefix("file://")).metadata
        groups = [meta.row_group(r) for r in range(meta.num_row_groups)]
        compressed += sum(g.column(c).total_compressed_size for g in groups for c in range(g.num_columns))
    assert report["compressed_bytes"] == compressed
    assert sum(c["compressed_bytes"] for c in report["columns"]) == compressed


def test_inspect_maps_columns_to_the_keys_batches_hold(corpus):
    report = run_json("inspect", corpus, "--columns", "input_ids,label")
    keys = [t["key"] for c in report["columns"] for t in c["tensors"]]
    batch = next(iter(ParquetStream(corpus, columns=["input_ids", "label"], batch_size=4)))
    assert keys == [k for k in batch if k != "sample_id"]
    tokens = report["columns"][0]["tensors"][0]
    assert (tokens["dtype"], tokens["shape"]) == ("int32", ["rows", "max_len"])
    assert report["compressed_bytes"] < run_json("inspect", corpus)["compressed_bytes"]


def test_inspect_flags_unsupported_columns_without_failing(tmp_path):
    table = pa.table({"a": [1, 2], "d": pa.array([[None], []], pa.list_(pa.null()))})  # no tensor meaning
    pq.write_table(table, tmp_path / "x.parquet")
    report = run_json("inspect", str(tmp_path))
    supported = {c["name"]: c["supported"] for c in report["columns"]}
    assert supported == {"a": True, "d": False}
    assert "'d'" in report["columns"][1]["error"]
    assert [w["kind"] for w in report["warnings"]] == ["unsupported_columns"]


def test_inspect_warns_about_memory_units_and_empty_files(corpus):
    quiet = run_json("inspect", corpus)
    assert {w["kind"] for w in quiet["warnings"]} == {"empty_files"}
    loud = run_json("inspect", corpus, "--memory-budget", "0.01", "--world-size", "8", "--num-workers", "2")
    kinds = {w["kind"] for w in loud["warnings"]}
    assert kinds == {"empty_files", "memory_budget", "too_few_units"}
    non_empty = sum(1 for rgs in LAYOUT for rows in rgs if rows)
    assert f"{non_empty} non-empty row group(s) for 16 global workers" in "".join(
        w["message"] for w in loud["warnings"])
    files_with_rows = sum(1 for rgs in LAYOUT if sum(rgs))
    short = run_json("inspect", corpus, "--unit", "file", "--world-size", str(files_with_rows + 1))
    assert "too_few_units" in {w["kind"] for w in short["warnings"]}
    enough = run_json("inspect", corpus, "--unit", "file", "--world-size", str(files_with_rows))
    assert "too_few_units" not in {w["kind"] for w in enough["warnings"]}


def test_inspect_reports_schema_drift_as_a_warning_and_plan_refuses_it(drifted):
    code, out, err = run("inspect", drifted)
    assert code == 0 and err == ""
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "x.parquet" in warning[0] and "y.parquet" in warning[0]
    code, out, err = run("plan", drifted, "--world-size", "1", "--num-workers", "0")
    assert code == 1 and out == ""
    assert_one_line_error(err, "x.parquet", "y.parquet")


def test_inspect_calls_a_column_nullable_only_if_some_file_may_hold_nulls_even_when_schemas_drift(tmp_path):
    for directory in "ab":
        (tmp_path / directory).mkdir()
    pq.write_table(pa.table({"id": pa.array([1, 2], pa.int64()), "x": [0.5, 1.5], "score": [1.0, None]}),
                   tmp_path / "a" / "part.parquet")  # pyarrow writes every column as optional
    pq.write_table(pa.table({"id": pa.array([3], pa.int32()), "x": [2.5], "score": [3.0], "extra": [7]}),
                   tmp_path / "b" / "part.parquet")  # int32 id and an extra column: drift
    alone = {d: {c["name"]: c["nullable"] for c in run_json("inspect", str(tmp_path / d))["columns"]} for d in "ab"}
    assert alone == {"a": {"id": False, "x": False, "score": True},
                     "b": {"id": False, "x": False, "score": False, "extra": False}}
    report = run_json("inspect", str(tmp_path / "a"), str(tmp_path / "b"))
    assert [w["kind"] for w in report["warnings"]] == ["schema_drift"]
    columns = {c["name"]: c for c in report["columns"]}
    assert {name: c["nullable"] for name, c in columns.items()} == {
        "id": False, "x": False, "score": True, "extra": False}  # score: a file's statistics say it may
    assert {name: [t["key"] for t in c["tensors"]] for name, c in columns.items()} == {
        "id": ["id"], "x": ["x"], "score": ["score", "score_mask"], "extra": ["extra"]}
    assert (columns["id"]["types"], columns["extra"]["files"]) == (["int64", "int32"], 1)
    _, text, _ = run("inspect", str(tmp_path / "a"), str(tmp_path / "b"))
    assert [line for line in text.splitlines() if "(nullable)" in line] == [
        line for line in text.splitlines() if line.startswith("  score:")]
    assert "  extra: int64 (in 1 of 2 files)" in text and "(types differ: int64, int32)" in text


def test_inspect_text_names_the_numbers(corpus):
    code, out, _ = run("inspect", corpus)
    assert code == 0
    assert f"rows         {sum(map(sum, LAYOUT)):,}" in out
    assert "input_ids int32[rows, max_len]; input_ids_lengths int64[rows]" in out


# -- plan -------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    world=st.integers(1, 5),
    workers=st.integers(0, 3),
    batch_size=st.one_of(st.none(), st.integers(1, 300)),
    unit=st.sampled_from(["row_group", "file"]),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
    uneven=st.sampled_from(["pad", "drop"]),
)
def test_plan_matches_the_dataset_epoch_summary(corpus, world, workers, batch_size, unit, shuffle, epoch, uneven):
    argv = ["plan", corpus, "--world-size", str(world), "--num-workers", str(workers), "--unit", unit,
            "--epoch", str(epoch), "--uneven", uneven, "--seed", "3"]
    argv += ["--batch-size", str(batch_size)] if batch_size else ["--row-group-batches"]
    report = run_json(*argv, *(["--shuffle"] if shuffle else []))
    ds = ParquetStream(corpus, batch_size=batch_size, unit=unit, shuffle=shuffle, seed=3, uneven=uneven,
                       rank=0, world_size=world)
    summary = ds.epoch_summary(workers, epoch)
    rows = [w["rows"] for w in report["workers"]]
    assert len(rows) == summary["global_workers"] == report["global_workers"]
    assert sum(rows) + summary["dropped_rows"] == ds.catalog.num_rows == report["rows"]
    ds.set_epoch(epoch)
    assert report["steps_per_rank"] == ds.steps_per_epoch(workers)
    assert all(w["batches"] == summary["steps_per_worker"] for w in report["workers"])
    cost = report["uneven_cost"][uneven]
    assert (cost["padding_batches"], cost["dropped_rows"]) == (summary["padding_batches"], summary["dropped_rows"])
    assert sum(w["padding_batches"] for w in report["workers"]) == summary["padding_batches"]
    assert report["uneven_cost"]["pad"]["dropped_rows"] == 0
    assert report["uneven_cost"]["pad"]["delivered_rows"] == ds.catalog.num_rows


@pytest.mark.parametrize("batch_size", [None, 64])
@pytest.mark.parametrize("uneven", ["pad", "drop"])
def test_plan_padding_and_rows_are_what_the_stream_yields(corpus, batch_size, uneven):
    world = 3
    argv = ["plan", corpus, "--world-size", str(world), "--num-workers", "0", "--uneven", uneven]
    report = run_json(*argv, *(["--batch-size", str(batch_size)] if batch_size else ["--row-group-batches"]))
    for rank in range(world):
        ds = ParquetStream(corpus, columns=["id"], batch_size=batch_size, uneven=uneven, rank=rank, world_size=world)
        ids = np.concatenate([b["sample_id"].numpy() for b in ds])
        planned = report["workers"][rank]
        assert (planned["rows"], planned["padding_rows"]) == (int((ids >= 0).sum()), int((ids < 0).sum()))


def test_plan_defaults_are_the_stream_defaults(corpus):
    report = run_json("plan", corpus, "--world-size", "2", "--num-workers", "2")
    ds = ParquetStream(corpus, rank=0, world_size=2)
    assert report["batch_size"] == ds.config.batch_size == 256
    assert report["steps_per_rank"] == ds.steps_per_epoch(2)
    assert report["uneven_cost"]["pad"]["padding_batches"] == ds.epoch_summary(2)["padding_batches"]


def test_plan_text_summarises_many_workers(corpus):
    code, out, _ = run("plan", corpus, "--world-size", "16", "--num-workers", "4", "--batch-size", "32")
    assert code == 0
    assert "16 rank(s) x 4 worker(s) = 64 global workers" in out
    assert "(56 more)" in out and "what uneven costs" in out
    assert sum(1 for line in out.splitlines() if line.strip().startswith(("pad ", "* pad", "drop", "* drop"))) == 2


# -- bench ------------------------------------------------------------------------------------


def test_bench_streams_every_row_once_and_times_each_worker(corpus):
    code, out, err = run("bench", corpus, "--num-workers", "2", "--batch-size", "100", "--json")
    assert code == 0
    report = json.loads(out)
    ds = ParquetStream(corpus, batch_size=100)
    assert report["rows"] == report["catalog_rows"] == ds.catalog.num_rows
    assert report["batches"] == ds.steps_per_epoch(2)
    assert [w["worker"] for w in report["workers"]] == [0, 1]
    assert sum(w["rows"] for w in report["workers"]) == report["rows"]
    assert sum(w["batches"] for w in report["workers"]) == report["batches"]
    for w in report["workers"]:
        assert w["busy_s"] >= w["wait_s"] >= 0 and w["read_s"] > 0 and w["read_bytes"] > 0
        assert w["prepare_s"] > 0 and w["convert_s"] > 0  # the one-off conversion, then the gathering
    assert report["rows_per_s"] > 0 and err == ""  # stderr is no terminal here: no progress bar
    assert report["cpu_seconds"] > 0
    assert report["cpu_s_per_mrows"] == pytest.approx(report["cpu_seconds"] / report["rows"] * 1e6)


def test_bench_stops_after_max_batches(corpus):
    code, out, err = run("bench", corpus, "--num-workers", "0", "--max-batches", "3", "--quiet", "--json")
    report = json.loads(out)
    assert code == 0 and err == ""
    assert report["batches"] == 3 and report["stopped_early"]


def run_subprocess(*argv: str, stderr_on: str) -> tuple[int, str, str]:
    """``python -m streamshard argv`` with stdout to a pipe and stderr to a ``"pipe"`` or a ``"terminal"``
    (a pseudo-terminal of 24 x 100 characters); returns (exit code, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env = {k: v for k, v in env.items() if not k.startswith("TQDM_")}  # no user overrides of the bar
    command = [sys.executable, "-m", "streamshard", *argv]
    if stderr_on == "pipe":
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        return done.returncode, done.stdout, done.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:  # read while the child writes, so a full terminal buffer never blocks it
        while True:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer of the terminal has closed it
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=slave, text=True, env=env, timeout=120)
    finally:
        os.close(slave)
        reader.join(timeout=60)
        os.close(master)
    return done.returncode, done.stdout, b"".join(chunks).decode()


@pytest.mark.parametrize("command, unit", [("bench", "rows/s"), ("inspect", "files")])
def test_progress_is_a_bar_on_a_terminal_and_nothing_in_a_pipe_or_with_quiet(corpus, command, unit):
    code, out, err = run_subprocess(command, corpus, "--json", stderr_on="terminal")
    assert code == 0 and "100%|" in err and unit in err  # the bar, drawn to its end
    assert json.loads(out)["rows"] == sum(map(sum, LAYOUT))  # --json on stdout stays clean
    code, out, err = run_subprocess(command, corpus, "--json", stderr_on="pipe")
    assert code == 0 and err == ""  # a log file gets no carriage returns (and no progress)
    assert json.loads(out)["rows"] == sum(map(sum, LAYOUT))
    code, out, err = run_subprocess(command, corpus, "--json", "--quiet", stderr_on="terminal")
    assert code == 0 and err == ""
    assert json.loads(out)["rows"] == sum(map(sum, LAYOUT))


def test_reading_the_footers_shows_progress_on_a_terminal_for_plan_and_bench(corpus):
    files = len(LAYOUT)
    for argv in (("plan", corpus, "--world-size", "2", "--num-workers", "1", "--json"), ("bench", corpus, "--json")):
        code, out, err = run_subprocess(*argv, stderr_on="terminal")
        assert code == 0 and re.search(rf"catalog: {files}(\.00)?footers", err), err[-300:]  # every footer counted
        code, out, err = run_subprocess(*argv, stderr_on="pipe")
        assert code == 0 and err == "" and json.loads(out)["rows"] == sum(map(sum, LAYOUT))


# -- errors and storage -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, code, fragment",
    [
        (["inspect", "/nonexistent/streamshard-cli/*.parquet"], 1, "no files matched"),
        (["plan", "{corpus}"], 2, "--world-size"),
        (["plan", "{corpus}", "--world-size", "0", "--num-workers", "1"], 2, "--world-size"),
        (["inspect", "{corpus}", "--storage-options", "{not json"], 2, "not valid JSON"),
        (["inspect", "{corpus}", "--storage-options", "[1]"], 2, "JSON object"),
        (["inspect", "{corpus}", "--storage-options", "@/nonexistent/options.json"], 2, "cannot read"),
        (["inspect", "{corpus}", "--columns", "id,nope"], 1, "nope"),
        (["bench", "{corpus}", "--columns", "id,id"], 2, "duplicates"),
        (["frobnicate"], 2, "invalid choice"),
    ],
)
def test_errors_are_one_line_with_the_right_exit_code(corpus, argv, code, fragment):
    got, out, err = run(*[a.replace("{corpus}", corpus) for a in argv])
    assert got == code and out == ""
    assert_one_line_error(err, fragment)


def test_bench_reports_an_unconvertible_column_as_a_data_error(tmp_path):
    pq.write_table(pa.table({"d": pa.array([[None], []], pa.list_(pa.null()))}), tmp_path / "x.parquet")
    code, _, err = run("bench", str(tmp_path), "--num-workers", "0")
    assert code == 1
    assert_one_line_error(err, "'d'")


def test_python_dash_m_runs_the_command(corpus, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-m", "streamshard", "inspect", corpus, "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"] == sum(map(sum, LAYOUT))
    failed = subprocess.run([sys.executable, "-m", "streamshard", "inspect", str(tmp_path / "missing")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert failed.returncode == 1 and failed.stdout == ""
    assert_one_line_error(failed.stderr, "missing' does not exist")


def test_inspect_reads_s3_with_storage_options_from_a_file(corpus, s3, tmp_path):
    url = s3.upload(corpus, "cli-inspect")
    options = tmp_path / "s3.json"
    options.write_text(json.dumps(s3.storage_options))
    report = run_json("inspect", url, "--storage-options", f"@{options}")
    local = run_json("inspect", corpus)
    assert report["file_list"][0]["url"].startswith("s3://cli-inspect/")
    for key in ("files", "row_groups", "rows", "compressed_bytes", "row_group_rows"):
        assert report[key] == local[key]
    inline = run_json("plan", url, "--world-size", "2", "--num-workers", "1",
                      "--storage-options", json.dumps(s3.storage_options))
    assert sum(w["rows"] for w in inline["workers"]) == local["rows"]
