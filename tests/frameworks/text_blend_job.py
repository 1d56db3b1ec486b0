"""A blend of two text corpora with num_samples, planned in stages, on the ranks of a process group.

    torchrun --nproc_per_node=2 tests/frameworks/text_blend_job.py --a DIR --b DIR --weights WA WB \
        --num-samples N --report REP

Each rank builds ``PackedStream(BlendedStream(...), tokenizer=...)`` with a callable that counts the texts
it is given to count (on the counting threads, not reading), calls ``set_epoch(0)`` (every corpus's first
stage counted over the ranks, the later stages split over the ranks beside training), waits until every
stage is counted (so training never counts one itself), iterates ``--epochs`` epochs with thread workers
and writes a JSON report: the texts it tokenized to count in ``set_epoch`` and in all, the stages, and
every real token as (corpus, sample_id, token) per batch.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np

import torch.distributed as dist

import streamshard as ss


class Lengths:
    def __init__(self) -> None:
        self.texts, self.lock = 0, threading.Lock()

    def __call__(self, batch: list[str]) -> list[list[int]]:
        if threading.current_thread().name.startswith("streamshard-count"):  # counting, not reading
            with self.lock:
                self.texts += len(batch)
        return [[len(word) for word in text.split()] for text in batch]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--weights", type=float, nargs=2, required=True)
    parser.add_argument("--num-samples", type=int, required=True)
    parser.add_argument("--first-stage-bytes", type=int, required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = Lengths()
    corpora = {"a": ss.ParquetStream(args.a, shuffle=True, seed=1), "b": ss.ParquetStream(args.b, shuffle=True, seed=2)}
    blend = ss.BlendedStream(corpora, dict(zip("ab", args.weights)), batch_size=999, seed=3,
                             num_samples=args.num_samples)
    ps = ss.PackedStream(blend, column="text", seq_len=16, batch_size=2, tokenizer=tokenizer, eos_id=0,
                         first_stage_bytes=args.first_stage_bytes)
    ps.set_epoch(0)
    first = tokenizer.texts
    deadline = time.monotonic() + 60
    while not all(c.counted(np.arange(len(c.tokens))) for c in ps._corpus_counts()) and time.monotonic() < deadline:
        time.sleep(0.02)
    loader = ss.StreamLoader(ps, num_workers=2, workers="threads")
    epochs = []
    for _ in range(args.epochs):
        batches = []
        for batch in loader:
            c, sid, ids = (batch[k].reshape(-1).tolist() for k in ("corpus", "sample_id", "input_ids"))
            batches.append([[k, s, t] for k, s, t in zip(c, sid, ids) if s >= 0])
        epochs.append(batches)
    os.makedirs(args.report, exist_ok=True)
    with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
        json.dump({"first_stage_texts": first, "counted_texts": tokenizer.texts, "epochs": epochs, "stages": len(ps.planner.stages(0))}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
