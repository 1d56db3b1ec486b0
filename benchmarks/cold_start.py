"""Time to the first batch of a raw-text ``PackedStream`` on a cold corpus (no token counts cached) and a warm one.

Corpus and tokenizer as in ``tokenize_pack.py`` (pseudo-word documents in ``FILES`` Parquet files, a BPE
trained in the run: no download), written once into ``--workdir`` so two package versions measure the same
bytes. Rows, each on a fresh ``StreamLoader(num_workers=2)`` (thread workers):

* ``cold: first batch``: seconds from making the loader to holding its first batch, the count cache empty;
* ``cold: epoch``: that same epoch to its end with a simulated ``STEP_S`` training step per batch
  (``time.sleep``, which releases the GIL as a GPU step's wait does), and the share of it the loop waited;
* ``cold: stage edges``: of that epoch's waits, those for the first batch of each worker in every stage
  plan after the first (where read-ahead stops until the stage is counted): their sum, their share of
  the epoch, and the longest (staged versions only);
* ``warm: first batch``: a new loader over the same corpus once the cache holds every count.

Every token is delivered once (checked). Run it with any version of the package (``PYTHONPATH``): it
passes ``first_stage_bytes`` only where ``PackedStream`` has it.

``--blend`` packs a blend of two text corpora instead (``BlendedStream`` with ``num_samples``: the
corpus's files split into two, hard-linked into ``blend/a`` (the first 6) and ``blend/b``, weighted by
their sequences, ``num_samples`` their sum, so each corpus epoch is delivered once and every token is
checked as above); its stage edges are those of the blend's position plans.

``--ranks N`` runs the same on N ranks (torchrun, gloo on CPU, one machine: the ranks share its
cores), each rank its own ``StreamLoader(num_workers=2)``; every row is per rank, and the tokens
delivered over all ranks are checked.

    flock /tmp/bench.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/cold_start.py --docs 150000 --workdir /tmp/cold_corpus
    flock /tmp/bench.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/cold_start.py --docs 150000 --workdir /tmp/cold_corpus --ranks 2
    flock /tmp/bench.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/cold_start.py --docs 150000 --workdir /tmp/cold_corpus --blend
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tokenize_pack import BATCH, EOS, SEQ, train_bpe, write_corpus  # noqa: E402

import streamshard as ss  # noqa: E402

STEP_S = 0.02


def prepare(workdir: str, docs: int) -> tuple[str, str, int]:
    """The corpus, its tokenizer's JSON and its token count (EOS included), made once per workdir."""
    data, tok_path, meta = (os.path.join(workdir, p) for p in ("text", "tokenizer.json", "meta.json"))
    if os.path.exists(meta):
        with open(meta) as f:
            info = json.load(f)
        if info["docs"] == docs:
            return data, tok_path, info["tokens"]
    shutil.rmtree(workdir, ignore_errors=True)
    texts = write_corpus(data, docs)
    tok = train_bpe(texts)
    tok.save(tok_path)
    total = sum(len(e.ids) + 1 for e in tok.encode_batch(texts, add_special_tokens=False))
    with open(meta, "w") as f:
        json.dump({"docs": docs, "tokens": total}, f)
    return data, tok_path, total


def prepare_blend(workdir: str, data: str, tok_path: str) -> tuple[list[str], list[int]]:
    """Two corpora of the corpus's files (hard links: no copy) and each one's sequences, made once."""
    from tokenizers import Tokenizer
    import pyarrow.parquet as pq

    meta = os.path.join(workdir, "blend", "meta.json")
    dirs = [os.path.join(workdir, "blend", name) for name in ("a", "b")]
    if os.path.exists(meta):
        with open(meta) as f:
            return dirs, json.load(f)["sequences"]
    files = sorted(os.listdir(data))
    tok = Tokenizer.from_file(tok_path)
    sequences = []
    for directory, part in zip(dirs, (files[:6], files[6:])):
        os.makedirs(directory, exist_ok=True)
        tokens = 0
        for name in part:
            os.link(os.path.join(data, name), os.path.join(directory, name))
            texts = pq.read_table(os.path.join(data, name), columns=["text"]).column("text").to_pylist()
            tokens += sum(len(e.ids) + 1 for e in tok.encode_batch(texts, add_special_tokens=False))
        sequences.append(-(-tokens // SEQ))
    with open(meta, "w") as f:
        json.dump({"sequences": sequences}, f)
    return dirs, sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=150_000)
    parser.add_argument("--workdir", default="/tmp/streamshard_cold_corpus")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "out", "cold_start.json"))
    parser.add_argument("--ranks", type=int, default=1, help="ranks (torchrun, gloo on CPU); 1: one process")
    parser.add_argument("--blend", action="store_true", help="a blend of two text corpora with num_samples")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    ranked = "RANK" in os.environ
    if not ranked:  # the corpus and an empty count cache, once, before any rank starts
        data, tok_path, _ = prepare(args.workdir, args.docs)
        if args.blend:
            prepare_blend(args.workdir, data, tok_path)
        shutil.rmtree(os.path.join(args.workdir, "cache"), ignore_errors=True)
    if args.ranks > 1 and not ranked:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
                        "--master_addr=127.0.0.1", "--master_port=29517", os.path.abspath(__file__), *sys.argv[1:]],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return
    rank, world = 0, 1
    if ranked:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    data, tok_path, total = prepare(args.workdir, args.docs)
    tok = Tokenizer.from_file(tok_path)
    cache = os.path.join(args.workdir, "cache")
    staged = "first_stage_bytes" in inspect.signature(ss.PackedStream).parameters
    compressed = sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data))
    blend_dirs, sequences = prepare_blend(args.workdir, data, tok_path) if args.blend else ([], [])

    made: list = []

    def loader() -> ss.StreamLoader:
        source: ss.ParquetStream | ss.BlendedStream = ss.ParquetStream(data, catalog_cache=cache)
        if args.blend:
            corpora = {name: ss.ParquetStream(d, catalog_cache=cache) for name, d in zip("ab", blend_dirs)}
            source = ss.BlendedStream(corpora, {n: float(s) for n, s in zip("ab", sequences)}, batch_size=BATCH,
                                      num_samples=sum(sequences))
        ps = ss.PackedStream(source, column="text", seq_len=SEQ, batch_size=BATCH, tokenizer=tok, eos_id=EOS)
        made.append(ps)
        return ss.StreamLoader(ps, num_workers=2)

    rows: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    it = iter(loader())
    first = next(it)
    rows["cold: first batch"] = {"seconds": time.perf_counter() - t0}
    tokens, waited, steps, waits = int((first["sample_id"] >= 0).sum()), 0.0, 1, [rows["cold: first batch"]["seconds"]]
    while True:
        time.sleep(STEP_S)
        w0 = time.perf_counter()
        batch = next(it, None)
        waited += time.perf_counter() - w0
        waits.append(time.perf_counter() - w0)
        if batch is None:
            break
        tokens += int((batch["sample_id"] >= 0).sum())
        steps += 1
    seconds = time.perf_counter() - t0
    if ranked:
        import torch.distributed as dist

        every: list = [None] * world
        dist.all_gather_object(every, tokens)
        tokens = sum(every)
    assert tokens == total, (tokens, total)
    rows["cold: epoch"] = {"seconds": seconds, "steps": steps, "stall": (waited + rows["cold: first batch"]["seconds"])
                           / seconds}
    staged = staged and hasattr(made[0].planner, "stages")  # a blend in stages only with plan/blend_stages.py
    edges = stage_edges(made[0], 2, world) if staged else []
    if staged:
        at_edges = [waits[i] for i in edges if i < len(waits)]
        rows["cold: stage edges"] = {"seconds": sum(at_edges), "stall": sum(at_edges) / seconds, "edges": len(edges),
                                     "longest": max(at_edges, default=0.0)}
    t0 = time.perf_counter()
    next(iter(loader()))
    rows["warm: first batch"] = {"seconds": time.perf_counter() - t0}

    if ranked:
        import torch.distributed as dist

        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, rows)
        dist.destroy_process_group()
        if rank:
            return
    else:
        per_rank = [rows]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(ss.__file__)).stdout.strip()
    print(f"streamshard {commit} ({'staged' if staged else 'whole-corpus'} count) from {os.path.dirname(ss.__file__)}")
    what = f"a blend of 2 corpora ({sequences[0]:,} + {sequences[1]:,} sequences), " if args.blend else ""
    print(f"{what}corpus: {args.docs} documents, {total:,} tokens, {compressed / 2**20:.1f} MiB of Parquet; "
          f"[{BATCH}, {SEQ}] batches; {STEP_S * 1000:.0f} ms step; {os.cpu_count()} cpus; {world} rank(s)")
    print(f"{'row':<30} {'seconds':>9} {'stall':>7}")
    for r, mine in enumerate(per_rank):
        for label, row in mine.items():
            stall = f"{row['stall']:.0%}" if "stall" in row else ""
            more = f"  ({row['edges']} edges, longest {row['longest']:.2f} s)" if "edges" in row else ""
            name = f"rank {r}: {label}" if world > 1 else label
            print(f"{name:<30} {row['seconds']:>9.2f} {stall:>7}{more}")
    result = {"commit": commit, "staged": staged, "blend": args.blend, "docs": args.docs, "tokens": total, "parquet_bytes": compressed,
              "seq_len": SEQ, "batch_size": BATCH, "step_s": STEP_S, "cpus": os.cpu_count(), "ranks": world,
              "rows": per_rank[0], "rows_per_rank": per_rank}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")


def stage_edges(ps: ss.PackedStream, num_workers: int, world: int = 1) -> list[int]:
    """The loop's batch indices (the first batch is 0) of each worker's first batch in every stage plan
    after the first: the loader hands batches round robin over its workers (every worker of every
    rank has the same batches per plan)."""
    from streamshard.plan.packing_stages import StagePlans

    planner = ps.planner  # (a blend's planner has no counts of its own: its stages count their corpora)
    plans = StagePlans(planner.stages(0), planner.counts, planner.config, 0, world * num_workers)
    plans.steps  # every plan built (the counts are all in hand after the epoch)
    return [start * num_workers + w for start in plans.starts[1:-1] for w in range(num_workers)]


if __name__ == "__main__":
    main()
