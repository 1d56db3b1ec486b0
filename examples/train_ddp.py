"""Train a tiny model with DistributedDataParallel over a ParquetStream (CPU, gloo).

    torchrun --nproc_per_node=2 examples/train_ddp.py [--data DIR_OR_GLOB] [--epochs 2]

Preemption and elastic resume: stop mid-epoch with a data checkpoint, then continue on any
number of ranks, each remaining row still delivered exactly once:

    torchrun --nproc_per_node=2 examples/train_ddp.py --stop-after 5 --save-state ckpt.json
    torchrun --nproc_per_node=3 examples/train_ddp.py --resume ckpt.json

Every rank runs the same number of steps (padding rows carry sample_id -1 and are masked out
of the loss), so no rank waits forever in an all-reduce. With --report, each rank writes the
sample ids it trained on, to check exactly-once coverage.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import streamshard as ss
from streamshard.testing import write_corpus

VOCAB, CLASSES = 50_000, 7


class TinyClassifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, CLASSES)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        valid = torch.arange(tokens.shape[1]) < lengths[:, None]
        pooled = (self.embed(tokens) * valid[..., None]).sum(1) / lengths.clamp(min=1)[:, None]
        return self.head(pooled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="file, directory or glob (default: a generated skewed corpus)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--report", help="directory for one JSON report per rank")
    parser.add_argument("--stop-after", type=int, help="stop after this many steps of the first epoch")
    parser.add_argument("--save-state", help="where rank 0 writes the data checkpoint when stopping")
    parser.add_argument("--resume", help="a data checkpoint written by --save-state (any world size)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = args.data or _shared_demo_corpus(rank)

    ds = ss.ParquetStream(data, columns=["input_ids", "label"], batch_size=args.batch_size, shuffle=True, seed=0)
    loader = ss.StreamLoader(ds, num_workers=args.num_workers, persistent_workers=args.num_workers > 0)
    model = DistributedDataParallel(TinyClassifier())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    first_epoch = 0
    if args.resume:
        with open(args.resume) as f:
            state = json.load(f)
        loader.load_state_dict(state)  # the same state serves every rank, whatever the world size
        first_epoch = loader.epoch

    report = {"rank": rank, "world_size": world, "epochs": []}
    for epoch in range(first_epoch, args.epochs):
        loader.set_epoch(epoch)  # keeps a resumed position in its own epoch
        steps, seen, start = 0, [], time.perf_counter()
        for batch in loader:
            real = batch["sample_id"] >= 0
            logits = model(batch["input_ids"], batch["input_ids_lengths"])
            losses = torch.nn.functional.cross_entropy(logits, batch["label"], reduction="none")
            loss = (losses * real).sum() / real.sum().clamp(min=1)  # padding rows weigh nothing
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            seen.extend(batch["sample_id"][real].tolist())
            if args.stop_after is not None and steps == args.stop_after:
                break  # the loader's state counts exactly the batches trained on
        elapsed = time.perf_counter() - start
        report["epochs"].append({"epoch": epoch, "steps": steps, "sample_ids": seen, "seconds": elapsed})
        print(f"rank {rank}: epoch {epoch}: {steps} steps, {len(seen)} rows, {len(seen) / elapsed:,.0f} rows/s", flush=True)
        if args.stop_after is not None:
            if rank == 0 and args.save_state:
                with open(args.save_state, "w") as f:
                    json.dump(loader.state_dict(), f)  # the loader counted the batches itself
            break
    dist.barrier()  # reaching this on every rank is the proof that nobody hung
    if args.report:
        os.makedirs(args.report, exist_ok=True)
        with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    del model  # DDP's reducer must not hold the last reference to the gloo group while it is destroyed
    gc.collect()  # (torch 2.13 + gloo can deadlock joining a thread that waits for the GIL: pytorch#56297)
    dist.destroy_process_group()


def _shared_demo_corpus(rank: int) -> str:
    """Rank 0 writes a skewed corpus (one huge file, many tiny, one empty) that every rank reads."""
    path = os.path.join(tempfile.gettempdir(), "streamshard-ddp-demo")
    if rank == 0:
        write_corpus(path, [[4000, 3000, 5000]] + [[7]] * 20 + [[]] + [[1, 0, 90]])
    dist.barrier()
    return path


if __name__ == "__main__":
    main()
