"""Pretrain a tiny language model on packed sequences (CPU), with a mid-epoch checkpoint.

    python examples/pretrain_packed.py

Writes a small tokenized corpus (documents of 1..600 tokens), packs it into [4, 256] batches with
``ss.PackedStream`` and trains a bigram model for a few steps: the next-token loss only counts
pairs inside one document (``sample_id`` equal) and never padding (``sample_id == -1``);
``ss.cu_seqlens`` gives the document boundaries a varlen attention kernel would take. Halfway
through, the loader's state is saved and a fresh loader resumes from it. At the end the example
checks that every token of every document was trained on exactly once: each document's fragments
are slices of it, in order inside each fragment (with 2 workers, a document cut at the boundary of
two workers' blocks can arrive tail first: each fragment is its own attention segment anyway).
"""

from __future__ import annotations

import itertools
import json
import tempfile
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import streamshard as ss

VOCAB, SEQ, BATCH = 512, 256, 4


def write_corpus(directory: str) -> list[list[int]]:
    rng = np.random.default_rng(0)
    docs = []
    for n in np.clip(rng.lognormal(4.5, 1.0, 300), 1, 600).astype(int):  # a learnable chain: t -> 7t + 3
        doc = [int(rng.integers(1, VOCAB))]
        while len(doc) < n:
            doc.append((doc[-1] * 7 + 3) % VOCAB)
        docs.append(doc)
    for f, part in enumerate((docs[:120], docs[120:130], docs[130:])):
        pq.write_table(pa.table({"input_ids": pa.array(part, pa.list_(pa.int32()))}), f"{directory}/part-{f}.parquet",
                       row_group_size=40)
    return docs


def stream(directory: str) -> ss.PackedStream:
    source = ss.ParquetStream(directory, shuffle=True, seed=0, rank=0, world_size=1)
    return ss.PackedStream(source, column="input_ids", seq_len=SEQ, batch_size=BATCH)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    ids, sid = batch["input_ids"].long(), batch["sample_id"]
    pairs = (sid[:, 1:] == sid[:, :-1]) & (sid[:, 1:] >= 0)  # next token of the same document
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits[pairs], ids[:, 1:][pairs]) if pairs.any() else logits.sum() * 0
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        docs = write_corpus(directory)
        model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, VOCAB))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        seen: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)  # document -> (start, tokens) fragments

        def consume(batch: dict[str, torch.Tensor]) -> float:
            for row_ids, row_sid, row_pos in zip(batch["input_ids"].tolist(), batch["sample_id"].tolist(),
                                                 batch["position_ids"].tolist()):
                for i, (s, p) in enumerate(zip(row_sid, row_pos)):
                    if s >= 0 and (p == 0 or i == 0):  # a fragment starts
                        seen[s].append((len(seen[s]), []))
                    if s >= 0:
                        seen[s][-1][1].append(row_ids[i])
            return train_step(model, optimizer, batch)

        loader = ss.StreamLoader(stream(directory), num_workers=2)
        total = len(loader)
        losses = [consume(b) for b in itertools.islice(loader, total // 2)]
        checkpoint = json.dumps(loader.state_dict())  # preemption: the data state goes with the model's
        first = next(iter(ss.StreamLoader(stream(directory)))) if total else None
        cu = ss.cu_seqlens(first["position_ids"]) if first is not None else torch.zeros(1)
        print(f"{total} batches of {BATCH}x{SEQ}; stopped after {total // 2}; checkpoint {len(checkpoint)} bytes; "
              f"batch 0 holds {len(cu) - 1} segments (cu_seqlens)")

        resumed = ss.StreamLoader(stream(directory), num_workers=2)
        resumed.load_state_dict(json.loads(checkpoint))
        losses += [consume(b) for b in resumed]
        tokens = sum(len(d) for d in docs)
        padding = 1 - tokens / (total * BATCH * SEQ)
        print(f"trained on {tokens:,} tokens in {total} steps ({padding:.1%} padding); loss {np.mean(losses[:3]):.2f} -> {np.mean(losses[-3:]):.2f}")
        exact = all(_covers(seen.get(s, []), d) for s, d in enumerate(docs))
        print(f"every token of every document once, in order, across the checkpoint: {exact}")
        if not exact or np.mean(losses[-3:]) >= np.mean(losses[:3]):
            raise SystemExit("packing lost, repeated or reordered tokens, or the model did not learn")


def _covers(fragments: list[tuple[int, list[int]]], doc: list[int]) -> bool:
    """The fragments are contiguous slices of ``doc`` that tile it exactly once."""
    pieces = [tokens for _, tokens in fragments]
    for order in itertools.permutations(pieces) if len(pieces) <= 4 else [pieces]:
        if [t for piece in order for t in piece] == doc:
            return True
    return False


if __name__ == "__main__":
    main()
