"""Host-to-device copies on this machine: bandwidth (pinned, pageable) and whether a copy on a side stream
overlaps a kernel on the compute stream. Explains benchmarks/device_copy.py's numbers on a given machine
(a virtualised GPU may serialise copies with kernels). Prints a table and writes JSON (``--out``).

    python benchmarks/h2d_probe.py [--out benchmarks/out/h2d_probe.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1000


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "h2d_probe.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("h2d_probe.py: no CUDA device here; nothing measured")
        return 0
    out: dict[str, float] = {}
    side = torch.cuda.Stream()
    for mib in (2, 64):
        n = mib * 2**20
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(n, dtype=torch.uint8)
        dest = torch.empty(n, dtype=torch.uint8, device="cuda")
        out[f"pinned {mib} MiB ms"] = timed(lambda: dest.copy_(pinned, non_blocking=True), 20)
        out[f"pageable {mib} MiB ms"] = timed(lambda: dest.copy_(pageable), 20)
        out[f"pinned {mib} MiB GB/s"] = n / out[f"pinned {mib} MiB ms"] / 1e6
        out[f"pageable {mib} MiB GB/s"] = n / out[f"pageable {mib} MiB ms"] / 1e6
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    pinned = torch.empty(2 * 2**20, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty(2 * 2**20, dtype=torch.uint8, device="cuda")

    def kernels() -> None:
        x = a
        for _ in range(20):
            x = x @ a
    out["20 matmuls ms"] = timed(kernels, 10)
    out["20 x 2 MiB pinned copies ms"] = timed(lambda: [dest.copy_(pinned, non_blocking=True) for _ in range(20)], 10)

    def both() -> None:
        with torch.cuda.stream(side):
            for _ in range(20):
                dest.copy_(pinned, non_blocking=True)
        kernels()
    out["both, copies on a side stream ms"] = timed(both, 10)
    for key, value in out.items():
        print(f"{key:40} {value:10.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "results": out}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
