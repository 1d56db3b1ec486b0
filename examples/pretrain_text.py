"""Pretrain a tiny language model on raw text, tokenized and packed inside the pipeline (CPU).

    python examples/pretrain_text.py

Writes a small Parquet corpus of raw ``text`` (no token column), trains a BPE tokenizer on it with
the ``tokenizers`` library, and streams it with ``ss.PackedStream(source, column="text",
tokenizer=tok, eos_id=...)``: the first ``set_epoch`` counts the tokens of the epoch's first stage
of row groups and a background thread the rest (each row group once, kept in the catalog cache
directory, so the resumed run below starts warm; a text pack has no ``len()``, which frameworks would
ask before the first step, and ``ps.epoch_length(num_workers)`` waits for the whole count), then the
loader's thread workers tokenize beside training and pack into [4, 128] batches. A bigram model trains on
next-token pairs inside one document (``sample_id`` equal). Halfway through the epoch the loader's
state is saved as JSON and a fresh stream and loader resume from it. At the end the example checks
that every token of every document was trained on exactly once, in order, EOS included.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import streamshard as ss

SEQ, BATCH, VOCAB = 128, 4, 300
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "big", "red", "house", "then", "slept"]


def write_corpus(directory: str) -> list[str]:
    """Texts that follow a learnable chain (each word mostly picks from two successors), a few null or empty."""
    rng = np.random.default_rng(0)
    texts: list[str | None] = []
    for n in np.clip(rng.lognormal(3.5, 0.9, 400), 1, 300).astype(int):
        words = [int(rng.integers(len(WORDS)))]
        while len(words) < n:
            words.append((words[-1] * 3 + int(rng.integers(2))) % len(WORDS))
        texts.append(" ".join(WORDS[w] for w in words))
    texts[7], texts[50] = None, ""  # a null row is no document; an empty text is a document of just EOS
    for f, part in enumerate((texts[:250], texts[250:260], texts[260:])):
        pq.write_table(pa.table({"text": pa.array(part, pa.string())}), f"{directory}/part-{f}.parquet", row_group_size=60)
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([t for t in texts if t], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["[EOS]", "[UNK]"],
                                                                         show_progress=False))
    return tok


def stream(directory: str, cache: str, tok: Tokenizer) -> ss.PackedStream:
    source = ss.ParquetStream(directory, shuffle=True, seed=0, rank=0, world_size=1, catalog_cache=cache)
    return ss.PackedStream(source, column="text", seq_len=SEQ, batch_size=BATCH, tokenizer=tok,
                           eos_id=tok.token_to_id("[EOS]"))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    ids, sid = batch["input_ids"], batch["sample_id"]
    pairs = (sid[:, 1:] == sid[:, :-1]) & (sid[:, 1:] >= 0)  # next token of the same document
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits[pairs], ids[:, 1:][pairs]) if pairs.any() else logits.sum() * 0
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def main() -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        directory, cache = os.path.join(root, "data"), os.path.join(root, "cache")  # the cache outside the data
        os.makedirs(directory)
        texts = write_corpus(directory)
        tok = train_tokenizer(texts)
        eos = tok.token_to_id("[EOS]")
        docs = [[] if t is None else e.ids + [eos]
                for t, e in zip(texts, tok.encode_batch([t or "" for t in texts], add_special_tokens=False))]
        model = torch.nn.Sequential(torch.nn.Embedding(tok.get_vocab_size(), 32), torch.nn.Linear(32, tok.get_vocab_size()))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        seen: dict[int, list[list[int]]] = defaultdict(list)  # document -> its fragments' tokens

        def consume(batch: dict[str, torch.Tensor]) -> float:
            for row_ids, row_sid, row_pos in zip(batch["input_ids"].tolist(), batch["sample_id"].tolist(),
                                                 batch["position_ids"].tolist()):
                for i, (s, p) in enumerate(zip(row_sid, row_pos)):
                    if s >= 0 and (p == 0 or i == 0):  # a fragment starts
                        seen[s].append([])
                    if s >= 0:
                        seen[s][-1].append(row_ids[i])
            return train_step(model, optimizer, batch)

        start = time.perf_counter()
        ps = stream(directory, cache, tok)
        ps.set_epoch(0)  # cold: counts the first stage's row groups (the rest in the background; all cached)
        cold = time.perf_counter() - start
        loader = ss.StreamLoader(ps, num_workers=2)
        total = ps.epoch_length(num_workers=2)  # exact: waits for the background count
        losses = [consume(b) for b in itertools.islice(loader, total // 2)]
        checkpoint = json.dumps(loader.state_dict())  # preemption: the data state goes with the model's
        print(f"{ps.num_tokens:,} tokens counted in {cold:.2f} s (cold); {total} batches of {BATCH}x{SEQ}; "
              f"stopped after {total // 2}; checkpoint {len(checkpoint)} bytes")

        start = time.perf_counter()
        again = stream(directory, cache, tok)
        again.set_epoch(0)  # warm: the counts come from the cache, nothing is tokenized before training
        resumed = ss.StreamLoader(again, num_workers=2)
        resumed.load_state_dict(json.loads(checkpoint))
        print(f"resumed from the checkpoint; counts read from the cache in {time.perf_counter() - start:.3f} s (warm)")
        losses += [consume(b) for b in resumed]
        tokens = sum(len(d) for d in docs)
        padding = 1 - tokens / (total * BATCH * SEQ)
        print(f"trained on {tokens:,} tokens in {total} steps ({padding:.1%} padding); "
              f"loss {np.mean(losses[:3]):.2f} -> {np.mean(losses[-3:]):.2f}")
        exact = tokens == ps.num_tokens and all(_covers(seen.get(s, []), d) for s, d in enumerate(docs))
        print(f"every token of every document once, in order, across the checkpoint: {exact}")
        if not exact or np.mean(losses[-3:]) >= np.mean(losses[:3]):
            raise SystemExit("packing lost, repeated or reordered tokens, or the model did not learn")


def _covers(fragments: list[list[int]], doc: list[int]) -> bool:
    """The fragments are contiguous slices of ``doc`` that tile it exactly once (with 2 workers a document
    cut at the boundary of two workers' blocks can arrive tail first; each fragment is its own segment)."""
    for order in itertools.permutations(fragments) if len(fragments) <= 4 else [fragments]:
        if [t for piece in order for t in piece] == doc:
            return True
    return False


if __name__ == "__main__":
    main()
