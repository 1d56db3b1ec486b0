"""A raw-text epoch's later stages counted over the ranks: each rank tokenizes a share of them.

    torchrun --nproc_per_node=2 tests/frameworks/text_stages_split_job.py --data DIR --report REP \
        --first-stage-bytes 200 [--wait-for-counts] [--stop-after N] [--slow S] [--mesh]

Each rank builds ``PackedStream(tokenizer=...)`` with a callable (word lengths) that counts the texts
it tokenizes on the counting threads, calls ``set_epoch(0)`` (the first stage, counted over the ranks;
then the later ones beside training), and iterates the epoch in the main process.
``--wait-for-counts``: before iterating, wait until every stage is counted (so training never counts
a stage itself: what the counting threads tokenized is the split alone). ``--stop-after N``: rank 1
breaks out N batches past its first stage plan's (so a later stage was counted), destroys its
process group and exits while counting goes on; ``--slow S``: each counting call sleeps S seconds
(a slow count, so it is still running then). ``--workers N``: iterate a ``StreamLoader`` of N worker
processes instead, started at once (their stages are still being counted); with ``--stop-after``, a
plain ``DataLoader`` of N workers (a StreamLoader's end of pass is a collective: rank 1 is gone by then). ``--mesh`` (4 processes): a ("dp", "tp") = (2, 2) device
mesh, the pack's source built with ``mesh=mesh["dp"]``: each data-parallel group splits the stages
over its own two ranks.
Each process notes the texts it tokenized to count in ``counted-rank{rank}.log`` (``pid texts`` lines).
Writes a JSON report per rank: texts tokenized to count (after the first stage, and in all), the
token counts, every real token as (sample_id, token) per batch.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import threading
import time

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader

import streamshard as ss


class Lengths:
    def __init__(self, slow: float, log: str) -> None:
        self.texts, self.slow, self.lock, self.log = 0, slow, threading.Lock(), log

    def __call__(self, batch: list[str]) -> list[list[int]]:
        if threading.current_thread().name.startswith("streamshard-count"):  # counting, not reading
            with self.lock:
                self.texts += len(batch)
                with open(self.log, "a") as f:  # every process of the rank: its DataLoader workers too
                    f.write(f"{os.getpid()} {len(batch)}\n")
            time.sleep(self.slow)
        return [[len(word) for word in text.split()] for text in batch]


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # tests/launch.py on a timeout: where it waits
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--first-stage-bytes", type=int, required=True)
    parser.add_argument("--wait-for-counts", action="store_true")
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--mesh", action="store_true")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    where, dp = {}, rank
    if args.mesh:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        where, dp = {"mesh": mesh["dp"]}, mesh["dp"].get_local_rank()
    os.makedirs(args.report, exist_ok=True)
    tokenizer = Lengths(args.slow, os.path.join(args.report, f"counted-rank{rank}.log"))
    ps = ss.PackedStream(ss.ParquetStream(args.data, shuffle=True, seed=1, **where), column="text", seq_len=16,
                         batch_size=2, tokenizer=tokenizer, eos_id=0, first_stage_bytes=args.first_stage_bytes)
    ps.set_epoch(0)
    first = tokenizer.texts
    counts = ps.planner.counts
    every = np.arange(len(counts.tokens), dtype=np.int64)
    if args.wait_for_counts:
        deadline = time.monotonic() + 60
        while not counts.counted(every) and time.monotonic() < deadline:
            time.sleep(0.02)
    stop = None
    if args.stop_after is not None:  # past the first stage plan: its next batches need a later stage counted
        from streamshard.plan.packing_stages import StagePlans

        planner, n = ps.planner, max(args.workers or 0, 1)
        first_plan = StagePlans(planner.stages(0), counts, planner.config, 0, 2 * n).plan(0)
        stop = (first_plan.steps * n if first_plan is not None else 0) + args.stop_after
    batches = []
    # the stream itself (a StreamLoader's end of pass sets the next epoch, a collective), or a loader whose
    # worker processes (a callable tokenizer) need the later stages while this process's thread splits them:
    # a plain DataLoader where rank 1 stops early (no collective at rank 0's end of pass)
    loader = ps
    if args.workers is not None:
        loader = ss.StreamLoader(ps, num_workers=args.workers) if stop is None else \
            DataLoader(ps, batch_size=None, num_workers=args.workers)
    for batch in loader:
        sid, ids = batch["sample_id"].reshape(-1), batch["input_ids"].reshape(-1)
        batches.append([[s, t] for s, t in zip(sid.tolist(), ids.tolist()) if s >= 0])
        if rank == 1 and len(batches) == stop:
            break
    with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
        json.dump({"dp": dp, "first_stage_texts": first, "counted_texts": tokenizer.texts, "batches": batches,
                   "counts": counts.tokens.tolist(), "stages": len(ps.planner.stages(0))}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
