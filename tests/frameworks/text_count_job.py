"""Counting a text corpus's tokens over the ranks: each rank tokenizes a share, all get every count.

    torchrun --nproc_per_node=2 tests/frameworks/text_count_job.py --data DIR --report REP

Each rank builds ``PackedStream(tokenizer=...)`` with a callable that counts the texts it is given,
calls ``set_epoch(0)`` (the counting pass, split over the default group), iterates its epoch and
writes a JSON report: how many texts it tokenized to count, the token counts per row group, and every
real token as (sample_id, token) in delivery order.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal

import torch.distributed as dist

import streamshard as ss


class Lengths:
    def __init__(self) -> None:
        self.texts = 0

    def __call__(self, batch: list[str]) -> list[list[int]]:
        self.texts += len(batch)
        return [[len(word) for word in text.split()] for text in batch]


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # tests/launch.py on a timeout: where it waits
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--first-stage-bytes", type=int, default=None, help="stage the epochs (else the default)")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = Lengths()
    staging = {} if args.first_stage_bytes is None else {"first_stage_bytes": args.first_stage_bytes}
    ps = ss.PackedStream(ss.ParquetStream(args.data, shuffle=True, seed=1), column="text", seq_len=16,
                         batch_size=2, tokenizer=tokenizer, eos_id=0, **staging)
    ps.set_epoch(0)
    counted = tokenizer.texts
    loader = ss.StreamLoader(ps, num_workers=0)
    epochs = []
    for _ in range(args.epochs):  # each epoch's first stage is counted over both ranks (a collective)
        tokens = []
        for batch in loader:
            sid, ids = batch["sample_id"].reshape(-1), batch["input_ids"].reshape(-1)
            tokens.append([[s, t] for s, t in zip(sid.tolist(), ids.tolist()) if s >= 0])
        epochs.append(tokens)
    os.makedirs(args.report, exist_ok=True)
    with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
        json.dump({"counted_texts": counted, "counts": ps.tokens.tolist(), "batches": epochs[0], "epochs": epochs,
                   "stages": len(ps.planner.stages(0)) if args.first_stage_bytes else 1}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
