"""A plain ``DataLoader`` of a stream handed to ``accelerator.prepare``, in each of Accelerate's configurations.

    torchrun --nproc_per_node=2 tests/frameworks/accelerate_plain.py --data DIR --report REP default no-dispatch ...
    python tests/frameworks/accelerate_plain.py --data DIR --report REP default no-dispatch   # one process

Each configuration either trains its epoch (the report holds every step's ``sample_id``s and whether
each row's data matched its id) or raises; the report says where (``prepare`` or at which step) and
what. Every rank appends one JSON line per configuration to ``REP/rank{r}.jsonl`` as it finishes it,
so a configuration that hangs leaves the earlier ones readable.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os

import torch
from torch.utils.data import DataLoader

import streamshard as ss
from accelerate import Accelerator, DataLoaderConfiguration, PartialState

LISTS, FIXED = ["id", "input_ids"], ["id", "label", "score"]
VOCAB = 50_000  # streamshard.testing.write_corpus: row i holds tokens i % VOCAB

# name: (DataLoaderConfiguration, Accelerator arguments, columns, lists, num_workers, multiprocessing context)
CONFIGS = {
    "default": ({}, {}, LISTS, "padded", 0, None),  # dispatch_batches=True: Accelerate's default here
    "default-fixed-width": ({}, {}, FIXED, "padded", 0, None),
    "default-flat-lists": ({}, {}, LISTS, "flat", 0, None),
    "default-workers-fork": ({}, {}, LISTS, "padded", 2, "fork"),
    "default-workers-spawn": ({}, {}, FIXED, "padded", 2, "spawn"),
    "no-dispatch": ({"dispatch_batches": False}, {}, LISTS, "padded", 0, None),
    "no-dispatch-flat-lists": ({"dispatch_batches": False}, {}, LISTS, "flat", 0, None),
    "no-dispatch-workers-spawn": ({"dispatch_batches": False}, {}, FIXED, "padded", 2, "spawn"),
    "split-batches": ({"split_batches": True}, {}, LISTS, "padded", 0, None),
    "stateful-dataloader": ({"use_stateful_dataloader": True}, {}, LISTS, "padded", 0, None),
    "no-device-placement": ({}, {"device_placement": False}, LISTS, "padded", 0, None),
}


def rows_match(batch: dict) -> bool:
    """Whether every real row's data is that row's (a cut or shifted list column shows here)."""
    real = batch["sample_id"] >= 0
    if not torch.equal(batch["id"][real], batch["sample_id"][real]):
        return False
    if "input_ids" not in batch:
        return True
    lengths = batch["input_ids_lengths"]
    values = batch["input_ids"]
    if values.dim() == 1:  # lists="flat": the rows' values one after another
        if int(lengths.sum()) != len(values):
            return False
        rows = torch.split(values, lengths.tolist())
    else:
        rows = [values[i, : lengths[i]] for i in range(len(lengths))]
    return all(bool(torch.all(row == int(i) % VOCAB)) for row, i, r in zip(rows, batch["id"], real) if r)


def run(name: str, data: str, batch_size: int) -> dict:
    loader_config, accelerator_args, columns, lists, workers, context = CONFIGS[name]
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**loader_config), **accelerator_args)
    ds = ss.ParquetStream(data, columns=columns, batch_size=batch_size, lists=lists)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=context)
    result: dict = {"config": name, "stage": "prepare", "batches": [], "rows_match": True}
    try:
        prepared = accelerator.prepare(loader)
        result["stage"] = "iterate"
        result["wrapper"] = type(prepared).__name__
        for batch in prepared:
            result["batches"].append(batch["sample_id"][batch["sample_id"] >= 0].tolist())
            result["rows_match"] &= rows_match(batch)
        result["stage"] = "done"
    except Exception as exc:  # noqa: BLE001 - the report is the observation
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("configs", nargs="+", choices=sorted(CONFIGS))
    args = parser.parse_args()
    # a hang shows where every thread of every rank waits (the test reads the output) instead of a bare timeout
    faulthandler.dump_traceback_later(float(os.environ.get("STREAMSHARD_JOB_DUMP_AFTER", "100")), exit=True)
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(args.report, exist_ok=True)
    with open(os.path.join(args.report, f"rank{rank}.jsonl"), "a", buffering=1) as out:
        for name in args.configs:
            print(f"rank {rank}: {name}", flush=True)
            out.write(json.dumps(run(name, args.data, args.batch_size)) + "\n")
    PartialState().destroy_process_group()  # gloo's threads stopped before the interpreter finalizes


if __name__ == "__main__":
    main()
