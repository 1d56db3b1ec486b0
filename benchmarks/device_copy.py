"""Does the copy to the GPU hide behind the training step? StreamLoader(device="cuda") against the usual idioms.

A corpus of fixed-length token rows (``input_ids``: ``seq`` int32 tokens per row, plus ``sample_id``) is
streamed to a CUDA device while a fixed GPU step (``--step-ms`` of bf16 matmuls, calibrated here) runs on
each batch. Measured in one process, one after another, on the same warm device:

* ``compute only``: the step alone on one batch on the GPU, before and after the other cases (clock drift);
* ``epoch already on the device``: the same loop (the step and the id check) over every batch of the
  epoch copied to the GPU beforehand: the ceiling the ``x ceiling`` column divides by;
* ``loader only, device="cuda"``: how fast StreamLoader delivers batches to the device with no step;
* ``DataLoader + pin_memory + .to(non_blocking)``: the idiom most loops use (pinned by DataLoader's
  pin thread, copied on the compute stream);
* ``StreamLoader, device=None + .to()``: the copy on the compute stream, synchronous;
* ``StreamLoader, device="cuda"``: pinned buffers reused, the copy on a side stream ``prefetch_depth``
  batches ahead (DevicePrefetcher).

Each pass checks on the device that every ``sample_id`` arrived exactly once (padding rows are
``-1``), so a fast wrong pipeline cannot win. Prints a table and writes JSON (``--out``).

    python benchmarks/device_copy.py [--rows 262144] [--seq 2048] [--batch 64] [--workers 4] [--step-ms 20]

Needs a CUDA device; on a machine without one it says so and exits 0 without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import streamshard as ss  # noqa: E402
from streamshard.io.cpu_usage import tree_cpu_seconds  # noqa: E402


def write_corpus(directory: Path, rows: int, seq: int, files: int, row_groups: int) -> None:
    """``files`` Parquet files of fixed-length int32 token rows; sample ids 0..rows-1 in file order."""
    rng = np.random.default_rng(0)
    per_file = rows // files
    for index in range(files):
        start = index * per_file
        tokens = rng.integers(0, 50_000, size=(per_file, seq), dtype=np.int32)
        table = pa.table({
            "sample_id": pa.array(np.arange(start, start + per_file, dtype=np.int64)),
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), seq),
        })
        pq.write_table(table, directory / f"part-{index:03d}.parquet", row_group_size=per_file // row_groups,
                       compression="snappy")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate_step(ms: float, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A GPU step of about ``ms`` milliseconds: ``k`` bf16 4096^2 matmuls, plus a reduction of the batch."""
    size = 4096 if device.type == "cuda" else 256  # CPU: only a smoke test of this script
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def matmuls(k: int) -> None:
        x = a
        for _ in range(k):
            x = x @ a
            x = x / 64
    matmuls(3)
    sync(device)
    start = time.perf_counter()
    matmuls(50)
    sync(device)
    per = (time.perf_counter() - start) / 50 * 1000
    k = max(1, round(ms / per))

    def step(tokens: torch.Tensor) -> torch.Tensor:
        matmuls(k)
        return tokens.float().mean()
    return step


def run_pass(batches: Iterable[Any], step: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
             total_rows: int, move: str) -> dict[str, float]:
    """One epoch: move each batch (``none``, ``sync`` or ``nonblocking``), step, count ids on the device."""
    seen = torch.zeros(total_rows, dtype=torch.int32, device=device)
    cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
    rows = batches_n = 0
    nbytes = 0
    waited = 0.0
    source = iter(batches)
    while True:
        t = time.perf_counter()
        batch = next(source, None)
        waited += time.perf_counter() - t
        if batch is None:
            break
        ids, tokens = batch["sample_id"], batch["input_ids"]
        if move != "none":
            ids = ids.to(device, non_blocking=move == "nonblocking")
            tokens = tokens.to(device, non_blocking=move == "nonblocking")
        assert tokens.device.type == ids.device.type == device.type, "the batch did not arrive on the device"
        # no host sync (a boolean index would wait for the GPU and serialise the pipeline being measured)
        seen.index_add_(0, ids.clamp(min=0), (ids >= 0).to(torch.int32))
        step(tokens)
        rows += tokens.shape[0]
        nbytes += tokens.numel() * tokens.element_size() + ids.numel() * ids.element_size()
        batches_n += 1
    sync(device)
    wall = time.perf_counter() - t0
    cpu = tree_cpu_seconds() - cpu0
    counts = seen.cpu().numpy()
    if not (counts == 1).all():
        raise AssertionError(f"{move}: {int((counts == 0).sum())} ids missing, {int((counts > 1).sum())} repeated")
    return {"wall_s": wall, "rows": rows, "batches": batches_n, "rows_per_s": rows / wall,
            "gb_per_s": nbytes / wall / 1e9, "ms_per_step": wall / batches_n * 1000,
            "wait_ms_per_step": waited / batches_n * 1000,
            "cpu_s_per_m_rows": cpu / rows * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=262_144)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--row-groups", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests the script")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "device_copy.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("device_copy.py: no CUDA device here; nothing measured")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp)
        t = time.perf_counter()
        write_corpus(corpus, args.rows, args.seq, args.files, args.row_groups)
        rows = args.rows // args.files * args.files
        print(f"corpus: {rows} rows x {args.seq} int32 tokens, {args.files} files, written in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        step = calibrate_step(args.step_ms, device)

        def stream() -> ss.ParquetStream:
            return ss.ParquetStream(str(corpus), columns=["sample_id", "input_ids"], batch_size=args.batch,
                                    shuffle=True, seed=0)

        one = next(iter(ss.StreamLoader(stream(), num_workers=0)))
        on_device = {k: v.to(device) for k, v in one.items()}
        steps = -(-rows // args.batch)
        results: dict[str, dict[str, float]] = {}

        def compute_only() -> dict[str, float]:
            """The step alone on one batch already on the device (its ids would repeat: no id check)."""
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                step(on_device["input_ids"])
            sync(device)
            wall = time.perf_counter() - t0
            return {"wall_s": wall, "rows_per_s": steps * args.batch / wall, "ms_per_step": wall / steps * 1000}
        # measured before and after the cases: a GPU that warms up runs its clocks down, and the
        # ceiling is the slower of the two (the cases ran in between)
        results["compute only, before"] = compute_only()
        # the same loop (id check included) over every batch of the epoch already on the device
        resident = [{k: v.to(device) for k, v in b.items()} for b in ss.StreamLoader(stream(), num_workers=0)]
        run_pass(resident, step, device, rows, "none")
        results["epoch already on the device"] = run_pass(resident, step, device, rows, "none")
        del resident
        cases: list[tuple[str, Callable[[], Iterable[Any]], Any, str]] = [
            ("loader only, device='cuda'",
             lambda: ss.StreamLoader(stream(), num_workers=args.workers, device=device), lambda t: t, "none"),
            ("DataLoader(pin_memory) + .to(non_blocking)",
             lambda: torch.utils.data.DataLoader(stream(), batch_size=None, num_workers=args.workers,
                                                 pin_memory=device.type == "cuda"), step, "nonblocking"),
            ("StreamLoader(device=None) + .to()",
             lambda: ss.StreamLoader(stream(), num_workers=args.workers, pin_memory=False), step, "sync"),
            ("StreamLoader(device='cuda')",
             lambda: ss.StreamLoader(stream(), num_workers=args.workers, device=device), step, "none"),
            ("StreamLoader(device='cuda', workers='processes')",
             lambda: ss.StreamLoader(stream(), num_workers=args.workers, device=device, workers="processes"),
             step, "none"),
        ]
        for name, make, fn, move in cases:
            run_pass(make(), fn, device, rows, move)  # warm: workers, page cache, pinned pool
            results[name] = run_pass(make(), fn, device, rows, move)
            print(f"  {name}: {results[name]['rows_per_s']:,.0f} rows/s", flush=True)
        results["compute only, after"] = compute_only()
    ceiling = results["epoch already on the device"]["ms_per_step"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"\n{name}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{args.workers} workers, batch {args.batch} x {args.seq} int32 ({args.batch * args.seq * 4 / 2**20:.1f} MiB)")
    print(f"{'configuration':50} {'rows/s':>10} {'GB/s':>6} {'ms/step':>8} {'x ceiling':>9} {'CPU-s/M rows':>12} {'wait ms':>8}")
    for name, r in results.items():
        print(f"{name:50} {r['rows_per_s']:>10,.0f} {r.get('gb_per_s', float('nan')):>6.2f} "
              f"{r['ms_per_step']:>8.2f} {ceiling / r['ms_per_step']:>9.2f} {r.get('cpu_s_per_m_rows', float('nan')):>12.2f} {r.get('wait_ms_per_step', float('nan')):>8.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "device": name, "torch": torch.__version__, "python": platform.python_version(),
        "cpus": os.cpu_count(), "args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
