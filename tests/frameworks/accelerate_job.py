"""An Accelerate training job over streamshard, written the way an Accelerate user writes one.

    torchrun --nproc_per_node=2 tests/frameworks/accelerate_job.py --data DIR --report REP \
        --save-after 7 MID --save-at-epoch-end EDGE          # epoch 0, two checkpoints on the way
    torchrun --nproc_per_node=3 tests/frameworks/accelerate_job.py --data DIR --report REP \
        --resume MID --epochs 2                                # the rest of epoch 0, then epoch 1

The user's part: ``accelerator.prepare(model, optimizer, ss.StreamLoader(ds, num_workers=2))`` (prepare
returns the loader unchanged), ``accelerator.register_for_checkpointing(loader)``,
``accelerator.save_state(dir)`` / ``accelerator.load_state(dir)`` and an epoch loop. The observation
the test reads (``tests/test_accelerate.py``): per rank, one JSON report of every pass (its epoch,
``len(loader)`` at its start, the real ``sample_id``s of each step).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os

import torch

import streamshard as ss
from accelerate import Accelerator

CLASSES = 7


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--report", required=True, help="directory for one JSON report per rank")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1, help="run until this epoch is done")
    parser.add_argument("--save-after", nargs=2, metavar=("STEPS", "DIR"),
                        help="save_state(DIR) after this many steps of the run")
    parser.add_argument("--save-at-epoch-end", metavar="DIR",
                        help="save_state(DIR) right after the last batch of the first epoch, before the loop ends")
    parser.add_argument("--resume", metavar="DIR", help="load_state(DIR) before training")
    args = parser.parse_args()
    # a hang shows where every thread of every rank waits (the test reads the output) instead of a bare timeout
    faulthandler.dump_traceback_later(float(os.environ.get("STREAMSHARD_JOB_DUMP_AFTER", "100")), exit=True)

    accelerator = Accelerator(cpu=True)
    ds = ss.ParquetStream(args.data, columns=["score", "label"], batch_size=args.batch_size, shuffle=True, seed=3)
    model = torch.nn.Linear(1, CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, ss.StreamLoader(ds, num_workers=args.num_workers))
    assert type(loader) is ss.StreamLoader  # prepare hands back what it does not know, unchanged
    accelerator.register_for_checkpointing(loader)
    if args.resume:
        accelerator.load_state(args.resume)

    passes, steps = [], 0
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)  # keeps a just-loaded position of this epoch
        record = {"epoch": loader.epoch, "len": len(loader), "batches": []}
        passes.append(record)
        for batch in loader:
            real = batch["sample_id"] >= 0
            logits = model(batch["score"][:, None])
            losses = torch.nn.functional.cross_entropy(logits, batch["label"], reduction="none")
            loss = (losses * real).sum() / real.sum().clamp(min=1)  # padding rows weigh nothing
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            record["batches"].append(batch["sample_id"][real].tolist())
            steps += 1
            if args.save_after and steps == int(args.save_after[0]):
                accelerator.save_state(args.save_after[1])
            if args.save_at_epoch_end and len(passes) == 1 and len(record["batches"]) == record["len"]:
                accelerator.save_state(args.save_at_epoch_end)  # the epoch's last batch; the loop has not ended
        record["epoch_after"] = loader.epoch

    accelerator.wait_for_everyone()  # every rank got here: nobody hung on unequal steps
    os.makedirs(args.report, exist_ok=True)
    with open(os.path.join(args.report, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"world": accelerator.num_processes, "passes": passes}, f)
    # DDP's reducer must not hold the last reference to the gloo group: destroyed from there (GIL held) it
    # waits for a gloo thread that waits for the GIL (torch 2.13; pytorch/pytorch#56297)
    model, optimizer = accelerator.free_memory(model, optimizer)
    accelerator.end_training()


if __name__ == "__main__":
    main()
