"""ActivationCache costs: host lookup latency, disk-tier read speed vs raw memmap, frozen-prefix speedup.

* ``host_get``: ``get`` of 1,024 random ids from a host tier of ``--records`` 1 KiB records
  (256 float32), median and p90 over repeats; ``get_or_compute`` with every id a hit likewise.
* ``disk_read``: the same batches from a disk-only cache (``host_bytes=0``, slot file in the page
  cache) vs a raw ``np.memmap`` gather of exactly the same slots (same bytes, no index, no
  checksum); random and contiguous id batches; payload MB/s and the ratio raw / cache.
* ``frozen_prefix``: an epoch over in-memory batches through a frozen 4-layer 1024-wide MLP and a
  trainable head, epoch 1 (compute + put) vs the median of epochs 2-4 (all hits), host tier and
  disk tier (``host_bytes=0``). torch runs single-threaded so the numbers are repeatable.

Prints a table and writes ``benchmarks/out/cache.json``.

    .venv/bin/python benchmarks/cache.py [--records 65536]
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from streamshard.cache import ActivationCache  # noqa: E402

DIM, BATCH = 256, 1024
OUT = Path(__file__).resolve().parent / "out" / "cache.json"


def timed(fn, repeats: int) -> np.ndarray:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return np.array(times)


def filled(cache: ActivationCache, n: int) -> ActivationCache:
    for start in range(0, n, 8192):
        ids = torch.arange(start, min(start + 8192, n))
        cache.put(ids, ids[:, None].float() + torch.arange(DIM).float())
    return cache


def batches(n: int, count: int, contiguous: bool, seed: int = 0) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    if contiguous:
        return [torch.arange(s, s + BATCH) for s in rng.integers(0, n - BATCH, count)]
    return [torch.from_numpy(rng.choice(n, BATCH, replace=False)) for _ in range(count)]


def bench_host(n: int, repeats: int) -> dict:
    cache = filled(ActivationCache(host_bytes=n * DIM * 4), n)
    work = batches(n, repeats + 1, contiguous=False)
    it = iter(work)
    get_s = timed(lambda: cache.get(next(it)), repeats)
    it = iter(work)
    goc_s = timed(lambda: cache.get_or_compute(next(it), lambda pos: torch.zeros(len(pos), DIM)), repeats)
    return {"records": n, "record_bytes": DIM * 4, "batch": BATCH,
            "get_ms_median": 1e3 * float(np.median(get_s)), "get_ms_p90": 1e3 * float(np.quantile(get_s, 0.9)),
            "get_or_compute_ms_median": 1e3 * float(np.median(goc_s))}


def bench_disk(n: int, repeats: int, root: Path) -> list[dict]:
    cache = filled(ActivationCache(root / "disk", key="bench", host_bytes=0), n)
    cache.flush()
    slots_path = root / "disk" / "slots.bin"
    words = 2 + DIM * 4 // 8
    raw = np.memmap(slots_path, np.uint64, "r", shape=(os.path.getsize(slots_path) // (8 * words), words))
    raw[:].sum()  # both paths read from the page cache
    rows = []
    for contiguous in (False, True):
        work = batches(n, repeats + 1, contiguous)
        it = iter(work)
        cache_s = timed(lambda: cache.get(next(it)), repeats)
        it = iter(work)  # slot == id here: records were appended in id order
        raw_s = timed(lambda: np.ascontiguousarray(raw[np.sort(next(it).numpy())][:, 2:]), repeats)
        mb = BATCH * DIM * 4 / 1e6
        rows.append({"pattern": "contiguous" if contiguous else "random",
                     "cache_MBps": mb / float(np.median(cache_s)), "raw_memmap_MBps": mb / float(np.median(raw_s)),
                     "cache_ms_median": 1e3 * float(np.median(cache_s)), "raw_ms_median": 1e3 * float(np.median(raw_s)),
                     "ratio_raw_over_cache": float(np.median(cache_s) / np.median(raw_s))})
    cache.close()
    return rows


def bench_workload(root: Path, samples: int, batch: int) -> list[dict]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, 1024), torch.nn.ReLU()]
    for _ in range(3):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    prefix = torch.nn.Sequential(*layers, torch.nn.Linear(1024, 128)).eval().requires_grad_(False)
    x, y = torch.randn(samples, 32), torch.randint(0, 10, (samples,))
    out = []
    for tier, kwargs in (("host", {"host_bytes": 1 << 30}), ("disk", {"directory": root / "wl", "key": "wl", "host_bytes": 0})):
        head = torch.nn.Linear(128, 10)
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
        with torch.no_grad():
            prefix(x[:batch])  # warm up kernels outside the timed epochs
        with ActivationCache(**kwargs) as cache:
            times = []
            for _epoch in range(4):
                start = time.perf_counter()
                for s in range(0, samples, batch):
                    ids = torch.arange(s, min(s + batch, samples))
                    xb = x[ids]

                    def run_prefix(miss: torch.Tensor, xb: torch.Tensor = xb) -> torch.Tensor:
                        with torch.no_grad():
                            return prefix(xb[miss])

                    loss = torch.nn.functional.cross_entropy(head(cache.get_or_compute(ids, run_prefix)), y[ids])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                times.append(time.perf_counter() - start)
        warm = float(np.median(times[1:]))  # median of epochs 2-4: the machine is shared and noisy
        out.append({"tier": tier, "samples": samples, "epoch1_s": times[0], "epoch2_s": warm,
                    "epochs_s": times, "speedup": times[0] / warm})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--samples", type=int, default=16384)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        host = bench_host(args.records, args.repeats)
        disk = bench_disk(args.records, args.repeats, Path(tmp))
        workload = bench_workload(Path(tmp), args.samples, 512)
    print(f"host get, {BATCH} ids x {DIM * 4} B from {args.records} records: median {host['get_ms_median']:.3f} ms, "
          f"p90 {host['get_ms_p90']:.3f} ms; get_or_compute (all hits) {host['get_or_compute_ms_median']:.3f} ms")
    print(f"\n{'disk pattern':<12} {'cache MB/s':>11} {'memmap MB/s':>12} {'cache ms':>9} {'raw ms':>7} {'raw/cache':>10}")
    for r in disk:
        print(f"{r['pattern']:<12} {r['cache_MBps']:>11.0f} {r['raw_memmap_MBps']:>12.0f} {r['cache_ms_median']:>9.3f} "
              f"{r['raw_ms_median']:>7.3f} {r['ratio_raw_over_cache']:>9.2f}x")
    print(f"\n{'workload tier':<14} {'epoch 1 s':>10} {'epoch 2 s':>10} {'speedup':>8}")
    for r in workload:
        print(f"{r['tier']:<14} {r['epoch1_s']:>10.3f} {r['epoch2_s']:>10.3f} {r['speedup']:>7.1f}x")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": {"python": platform.python_version(), "torch": torch.__version__,
                                           "numpy": np.__version__, "cpus": os.cpu_count(),
                                           "torch_threads": torch.get_num_threads()},
                               "args": vars(args), "host_get": host, "disk_read": disk, "frozen_prefix": workload},
                              indent=2))
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
