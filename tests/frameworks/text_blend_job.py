"""A blend of two text corpora with num_samples, planned in stages, on the ranks of a process group.

    torchrun --nproc_per_node=2 tests/frameworks/text_blend_job.py --a DIR --b DIR --weights WA WB \
        --num-samples N --report REP

Each rank builds ``PackedStream(BlendedStream(...), tokenizer=...)`` with a callable that counts the texts
it is given, calls ``set_epoch(0)`` (every corpus's first stage counted over the ranks), iterates
``--epochs`` epochs with thread workers and writes a JSON report: the texts it tokenized in
``set_epoch``, the stages, and every real token as (corpus, sample_id, token) per batch.
"""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist

import streamshard as ss


class Lengths:
    def __init__(self) -> None:
        self.texts = 0

    def __call__(self, batch: list[str]) -> list[list[int]]:
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
    counted = tokenizer.texts
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
        json.dump({"counted_texts": counted, "epochs": epochs, "stages": len(ps.planner.stages(0))}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
