"""Token packing: padding share and tokens/s, packed vs unpacked, on a skewed tokenized corpus.

Corpus: 4,000 documents (lengths 1..4,096, log-normal: many short, a long tail), 8 files of
uneven row groups, ``input_ids`` list<int32>. For 2 ranks x 2 workers (ranks run one after the
other in this process, each through ``StreamLoader(num_workers=2)``) it reports, per configuration:

* token slots delivered, real tokens, and the padding share of the slots;
* tokens/s (real tokens over the wall time of all ranks' epochs).

Configurations: ``PackedStream(seq_len=2048, batch_size=4)`` (token-balanced blocks), the unpacked
``ParquetStream(batch_size=4)`` whose batches are ``[4, longest row]`` padded with zeros, and a packed
``BlendedStream`` of that corpus and a second one like it (another 4,000 documents), weighted by their
sequences so one blend epoch is one epoch of each (every token once; the script checks it).

    .venv/bin/python benchmarks/packing.py
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import streamshard as ss

DOCS, FILES, SEQ, BATCH, RANKS, WORKERS = 4_000, 8, 2048, 4, 2, 2


def write(directory: str, seed: int = 0) -> int:
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.5, 1.2, DOCS), 1, 4096).astype(np.int64)
    cuts = np.sort(rng.choice(np.arange(1, DOCS), FILES - 1, replace=False))
    for f, part in enumerate(np.split(lengths, cuts)):
        ids = pa.array([rng.integers(0, 50_000, n, dtype=np.int32) for n in part], pa.list_(pa.int32()))
        table = pa.table({"input_ids": ids})
        pq.write_table(table, os.path.join(directory, f"part-{f}.parquet"), row_group_size=int(rng.integers(50, 400)))
    return int(lengths.sum())


def run(make) -> dict[str, float]:
    slots = tokens = 0
    start = time.perf_counter()
    for rank in range(RANKS):
        for batch in ss.StreamLoader(make(rank), num_workers=WORKERS):
            ids = batch["input_ids"]
            slots += ids.numel()
            if "position_ids" in batch:
                tokens += int((batch["sample_id"] >= 0).sum())
            else:
                tokens += int(batch["input_ids_lengths"][batch["sample_id"] >= 0].sum())
    seconds = time.perf_counter() - start
    return {"slots": slots, "tokens": tokens, "padding_share": 1 - tokens / slots, "seconds": seconds,
            "tokens_per_s": tokens / seconds}


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        directory, second = os.path.join(root, "a"), os.path.join(root, "b")
        total, other = write(directory), write(second, seed=1)

        def stream(rank: int, path: str = directory, **kwargs) -> ss.ParquetStream:
            return ss.ParquetStream(path, shuffle=True, seed=0, rank=rank, world_size=RANKS, **kwargs)

        def packed_blend(rank: int) -> ss.PackedStream:
            weights = {"a": float(-(-total // SEQ)), "b": float(-(-other // SEQ))}  # one epoch of each
            blend = ss.BlendedStream({"a": stream(rank), "b": stream(rank, second)}, weights, batch_size=BATCH,
                                     order="shuffled")
            return ss.PackedStream(blend, seq_len=SEQ, batch_size=BATCH)

        cases = {
            f"PackedStream(seq_len={SEQ}, batch_size={BATCH})":
                lambda r: ss.PackedStream(stream(r), seq_len=SEQ, batch_size=BATCH),
            f"ParquetStream(batch_size={BATCH}), padded [B, longest]": lambda r: stream(r, batch_size=BATCH),
            "PackedStream(BlendedStream(a, b)), 2 corpora": packed_blend,
        }
        expected = {name: total for name in cases}
        expected["PackedStream(BlendedStream(a, b)), 2 corpora"] = total + other
        results = {name: run(make) for name, make in cases.items()}
        for name, make in cases.items():  # a second round, interleaved: report the faster of the two
            again = run(make)
            if again["seconds"] < results[name]["seconds"]:
                results[name] = again
    print(f"{DOCS} documents, {total:,} tokens, {RANKS} ranks x {WORKERS} workers, load {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':48} {'slots':>11} {'padding':>8} {'tokens/s':>12}")
    for name, r in results.items():
        print(f"{name:48} {r['slots']:11,} {r['padding_share']:8.2%} {r['tokens_per_s']:12,.0f}")
        assert r["tokens"] == expected[name], f"{name}: {r['tokens']} tokens delivered, {expected[name]} expected"
    os.makedirs(os.path.join(os.path.dirname(__file__), "out"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "out", "packing.json"), "w") as f:
        json.dump({"tokens": total, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
