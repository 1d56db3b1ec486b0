"""Raw text -> packed tokens: streamshard's ``PackedStream(tokenizer=)`` against Hugging Face ``datasets``.

Corpus: ``DOCS`` documents of pseudo-words (Zipf-distributed vocabulary, log-normal lengths), in
``FILES`` Parquet files of uneven row groups, one ``text`` column. A byte-level-free BPE tokenizer
(``tokenizers`` library, vocabulary ``VOCAB``) is trained inside the benchmark on that corpus: no
download. Both pipelines tokenize with that same ``tokenizers.Tokenizer`` (``encode_batch``, no
special tokens, EOS appended) and pack into ``[BATCH, SEQ]`` batches with ``position_ids``
restarting per document; both deliver every token once (checked).

Rows:

* ``streamshard cold count``: the whole counting pass over a cold corpus (``set_epoch`` + ``num_tokens``;
  ``catalog_cache`` empty), in tokens/s (training waits only for the first stage: ``cold_start.py``);
* ``streamshard warm start``: the same with the count cache filled;
* ``streamshard epoch``: one epoch through ``StreamLoader(num_workers=2)`` (thread workers; tokenizing
  on their read-ahead threads), counts already known;
* ``datasets streaming``: ``load_dataset("parquet", data_files=..., streaming=True)`` +
  ``map(tokenize, batched=True)`` + the same packing (``pack_documents`` below), one process;
* each epoch also with a simulated training step of ``STEP_S`` seconds per batch (``time.sleep``,
  which releases the GIL like a GPU step's wait does): ``stall`` is the share of the epoch's wall
  time the loop spent waiting for data, i.e. tokenizing *between* steps instead of beside them.

    flock /tmp/bench.lock .venv/bin/python benchmarks/tokenize_pack.py [--docs 30000] [--json benchmarks/out/tokenize_pack.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import streamshard as ss

FILES, SEQ, BATCH, VOCAB, STEP_S = 8, 1024, 8, 8000, 0.02
EOS = 0


def write_corpus(directory: str, docs: int, seed: int = 0) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, int(rng.integers(2, 11)))) for _ in range(20_000)]
    lengths = np.clip(rng.lognormal(4.5, 1.0, docs), 1, 4000).astype(np.int64)
    picks = np.minimum(rng.zipf(1.3, int(lengths.sum())), len(words)) - 1
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    texts = [" ".join(words[i] for i in picks[bounds[d]:bounds[d + 1]]) for d in range(docs)]
    cuts = np.sort(rng.choice(np.arange(1, docs), FILES - 1, replace=False))
    for f, part in enumerate(np.split(np.arange(docs), cuts)):
        table = pa.table({"text": pa.array([texts[i] for i in part], pa.string())})
        pq.write_table(table, os.path.join(directory, f"part-{f}.parquet"), row_group_size=int(rng.integers(200, 800)))
    return texts


def train_bpe(texts: list[str]) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["[EOS]", "[UNK]"],
                                                       show_progress=False))
    return tok


def pack_documents(docs: Iterable[list[int]]) -> Iterator[dict[str, np.ndarray]]:
    """Greedy packing, as PackedStream lays tokens: documents end to end in [BATCH, SEQ], positions per document."""
    slots = BATCH * SEQ
    ids, pos = np.zeros(slots, np.int64), np.zeros(slots, np.int64)
    fill = 0
    for doc in docs:
        doc = np.asarray(doc, dtype=np.int64)
        at = 0
        while at < len(doc):
            take = min(len(doc) - at, slots - fill)
            ids[fill:fill + take] = doc[at:at + take]
            pos[fill:fill + take] = np.arange(take)
            fill, at = fill + take, at + take
            if fill == slots:
                yield {"input_ids": ids.reshape(BATCH, SEQ).copy(), "position_ids": pos.reshape(BATCH, SEQ).copy(),
                       "real": slots}
                fill = 0
    if fill:
        ids[fill:], pos[fill:] = 0, 0
        yield {"input_ids": ids.reshape(BATCH, SEQ).copy(), "position_ids": pos.reshape(BATCH, SEQ).copy(), "real": fill}


def timed_epoch(batches: Iterator[dict[str, Any]], real_tokens, step_s: float) -> dict[str, float]:
    """Iterate ``batches`` with a simulated step of ``step_s``; tokens/s and the share of time spent waiting."""
    tokens = waited = 0.0
    steps = 0
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        batch = next(batches, None)
        waited += time.perf_counter() - t0
        if batch is None:
            break
        tokens += real_tokens(batch)
        steps += 1
        if step_s:
            time.sleep(step_s)
    seconds = time.perf_counter() - start
    return {"tokens": int(tokens), "steps": steps, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "stall": waited / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=30_000)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "out", "tokenize_pack.json"))
    args = parser.parse_args()
    from datasets import load_dataset

    with tempfile.TemporaryDirectory() as root:
        data, cache = os.path.join(root, "text"), os.path.join(root, "cache")
        t0 = time.perf_counter()
        texts = write_corpus(data, args.docs)
        tok = train_bpe(texts)
        prepared = time.perf_counter() - t0
        total = sum(len(e.ids) + 1 for e in tok.encode_batch(texts, add_special_tokens=False))
        rows: dict[str, dict[str, float]] = {}

        def make() -> ss.PackedStream:
            return ss.PackedStream(ss.ParquetStream(data, catalog_cache=cache), column="text", seq_len=SEQ,
                                   batch_size=BATCH, tokenizer=tok, eos_id=EOS)

        for label in ("streamshard cold count", "streamshard warm start"):
            ps, t0 = make(), time.perf_counter()
            ps.set_epoch(0)
            counted = ps.num_tokens  # every stage
            seconds = time.perf_counter() - t0
            assert counted == total, (counted, total)
            rows[label] = {"tokens": total, "seconds": seconds, "tokens_per_s": total / seconds}

        def streamshard_epoch(step_s: float) -> dict[str, float]:
            ps = make()
            ps.set_epoch(0)
            out = timed_epoch(iter(ss.StreamLoader(ps, num_workers=2)), lambda b: int((b["sample_id"] >= 0).sum()), step_s)
            assert out["tokens"] == total, "streamshard: every token once"
            return out

        def hf_epoch(step_s: float) -> dict[str, float]:
            files = sorted(os.path.join(data, f) for f in os.listdir(data))
            stream = load_dataset("parquet", data_files=files, split="train", streaming=True)

            def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
                return {"input_ids": [e.ids + [EOS] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

            tokenized = stream.map(tokenize, batched=True, remove_columns=["text"])
            out = timed_epoch(pack_documents(row["input_ids"] for row in tokenized), lambda b: b["real"], step_s)
            assert out["tokens"] == total, "datasets: every token once"
            return out

        for label, run in (("streamshard epoch", streamshard_epoch), ("datasets streaming", hf_epoch)):
            rows[label] = run(0.0)
            rows[f"{label}, {STEP_S * 1000:.0f} ms step"] = run(STEP_S)

    print(f"corpus: {args.docs} documents, {total:,} tokens (BPE vocab {VOCAB}), {FILES} files; "
          f"[{BATCH}, {SEQ}] batches; setup {prepared:.1f} s")
    print(f"{'pipeline':<38} {'seconds':>8} {'tokens/s':>12} {'stall':>7}")
    for label, row in rows.items():
        stall = f"{row['stall']:.0%}" if "stall" in row else ""
        print(f"{label:<38} {row['seconds']:>8.2f} {row['tokens_per_s']:>12,.0f} {stall:>7}")
    result = {"docs": args.docs, "tokens": total, "seq_len": SEQ, "batch_size": BATCH, "vocab": VOCAB,
              "step_s": STEP_S, "cpus": os.cpu_count(), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
