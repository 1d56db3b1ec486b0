"""A torchtitan-style job: the data loader checkpointed with ``torch.distributed.checkpoint`` (DCP).

    torchrun --nproc_per_node=2 tests/frameworks/dcp_job.py --data DIR --report REP \
        --save-after 7 MID --save-at-epoch-end EDGE
    torchrun --nproc_per_node=3 tests/frameworks/dcp_job.py --data DIR --report REP --resume MID --epochs 2

The user's part, as torchtitan writes it: one state dict of ``Stateful`` objects, the model's tensors
beside the loader, ``dcp.save(state, checkpoint_id=dir)`` on every rank and ``dcp.load(state,
checkpoint_id=dir)`` into a freshly built job of any size. ``StreamLoader`` is the ``Stateful`` (it has
``state_dict``/``load_state_dict``): its state's shape changes with the history (a resize adds a
segment; a state saved on an epoch's last batch has none), and a segment is a list, which DCP keeps as
one entry. Each rank writes a JSON report of every pass (its epoch, ``len(loader)`` at its start, the
real ``sample_id``s of each step).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel

import streamshard as ss

CLASSES = 7


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--save-after", nargs=2, metavar=("STEPS", "DIR"))
    parser.add_argument("--save-at-epoch-end", metavar="DIR")
    parser.add_argument("--resume", metavar="DIR")
    args = parser.parse_args()
    # a hang shows where every thread of every rank waits (the test reads the output) instead of a bare timeout
    faulthandler.dump_traceback_later(float(os.environ.get("STREAMSHARD_JOB_DUMP_AFTER", "100")), exit=True)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = ss.ParquetStream(args.data, columns=["score", "label"], batch_size=args.batch_size, shuffle=True, seed=3)
    loader = ss.StreamLoader(ds, num_workers=args.num_workers)
    model = DistributedDataParallel(torch.nn.Linear(1, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # torchtitan's shape: every Stateful of the job in one dict, the model's tensors beside the loader
    state = {"model": model.module.state_dict(), "data": loader}
    if args.resume:
        dcp.load(state, checkpoint_id=args.resume)  # loads the tensors in place, then loader.load_state_dict

    passes, steps = [], 0
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)  # keeps a just-loaded position of this epoch
        record = {"epoch": loader.epoch, "len": len(loader), "batches": []}
        passes.append(record)
        for batch in loader:
            real = batch["sample_id"] >= 0
            losses = torch.nn.functional.cross_entropy(model(batch["score"][:, None]), batch["label"], reduction="none")
            loss = (losses * real).sum() / real.sum().clamp(min=1)  # padding rows weigh nothing
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            record["batches"].append(batch["sample_id"][real].tolist())
            steps += 1
            if args.save_after and steps == int(args.save_after[0]):
                dcp.save(state, checkpoint_id=args.save_after[1])
            if args.save_at_epoch_end and len(passes) == 1 and len(record["batches"]) == record["len"]:
                dcp.save(state, checkpoint_id=args.save_at_epoch_end)  # the epoch's last batch; the loop goes on
        record["epoch_after"] = loader.epoch

    dist.barrier()  # every rank got here: nobody hung on unequal steps
    os.makedirs(args.report, exist_ok=True)
    with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
        json.dump({"world": world, "passes": passes, "state": loader.state_dict()}, f)
    # DDP's reducer must not hold the last reference to the gloo group: destroyed from there (GIL held) it
    # waits for a gloo thread that waits for the GIL (torch 2.13; pytorch/pytorch#56297), ~1 run in 8 here
    del model, optimizer, state
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
