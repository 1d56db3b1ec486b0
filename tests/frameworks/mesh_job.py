"""Data parallelism inside a model-parallel mesh: 4 processes as 2 data-parallel x 2 tensor-parallel ranks.

    torchrun --nproc_per_node=4 tests/frameworks/mesh_job.py --data DIR --report REP [--epochs 2]

torchtitan's layout: ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``; every process
builds its loader with the data-parallel mesh, ``ParquetStream(..., mesh=mesh["dp"])`` (or, ``--via
explicit``, ``rank=mesh["dp"].get_local_rank(), world_size=mesh["dp"].size()``), so the two
tensor-parallel ranks of a data-parallel group read the same batches. torch.distributed's default
group still has 4 ranks (the catalog reads its footers over it); ``--readers first-tp`` has only one
process of each tensor-parallel group read. Each process writes a JSON report: its dp and tp ranks,
every pass's real ``sample_id``s per step and ``len(loader)``, and the loader's final state.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import streamshard as ss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--via", choices=["mesh", "explicit"], default="mesh",
                        help='mesh: ParquetStream(mesh=mesh["dp"]); explicit: rank= and world_size= from it')
    parser.add_argument("--readers", choices=["all", "first-tp"], default="all",
                        help="first-tp: only tp rank 0 of each dp group reads (and would broadcast to its peers, "
                             "as a pipeline's first stage or Megatron's tp rank 0 does); the others only wait")
    args = parser.parse_args()
    # a hang shows where every thread of every rank waits (the test reads the output) instead of a bare timeout
    faulthandler.dump_traceback_later(float(os.environ.get("STREAMSHARD_JOB_DUMP_AFTER", "100")), exit=True)

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    where = {"mesh": dp} if args.via == "mesh" else {"rank": dp.get_local_rank(), "world_size": dp.size()}
    ds = ss.ParquetStream(args.data, columns=["score", "label"], batch_size=args.batch_size, shuffle=True, seed=3,
                          **where)
    loader = ss.StreamLoader(ds, num_workers=args.num_workers)

    reads = args.readers == "all" or tp.get_local_rank() == 0
    passes = []
    for epoch in range(args.epochs if reads else 0):
        loader.set_epoch(epoch)
        record = {"epoch": loader.epoch, "len": len(loader), "batches": []}
        passes.append(record)
        for batch in loader:
            ids = batch["sample_id"]
            record["batches"].append(ids[ids >= 0].tolist())

    dist.barrier()
    os.makedirs(args.report, exist_ok=True)
    with open(os.path.join(args.report, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"dp": dp.get_local_rank(), "tp": tp.get_local_rank(), "passes": passes,
                   "state": loader.state_dict() if reads else None}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
