"""A Lightning job over a cold raw-text corpus, written the way a Lightning user writes one.

    python tests/frameworks/lightning_text_job.py --data DIR --gate FILE --record REC --ckpt-dir CKPT
        [--loader streamloader|dataloader] [--sized] [--preempt-at N] [--resume CKPT/epoch=0-step=N.ckpt]

``train_dataloader()`` returns ``ss.StreamLoader(PackedStream(..., tokenizer=tok), num_workers=2)`` or
the package's plain idiom ``DataLoader(ps, batch_size=None, num_workers=2)``; ``Trainer(strategy="ddp",
devices=2).fit(...)`` with a step ``ModelCheckpoint`` (no ``ElasticResume``: not needed on one topology).

The tokenizer is a Python callable (so the loader runs worker processes) whose *counting* of a row
group outside the epoch's first stage (on a ``streamshard-count`` thread) waits until ``--gate``
exists, and the first training step creates it: training must start after the first stage is
counted, with the rest of the count still held back. A job that waits for the whole count before
its first step (Lightning asking ``len()`` of the loader) never opens the gate: the held count gives
up after ``GATE_S`` and the job fails. Reading (tokenizing again on read-ahead threads) is never held.
Each rank records one JSON line per training step: global step, epoch, the real tokens as
``[sample_id, token]`` pairs.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

import streamshard as ss
from preemption import PREEMPTED, exit_together

SEQ, BATCH, EOS = 16, 2, 0
FIRST_STAGE_BYTES = 1500
GATE_S = 25.0


def token(word: str) -> int:
    """The tokenizer's id of a word (the test computes the same)."""
    return sum(word.encode()) % 997 + 1


class GatedWords:
    """Words to ids; counting a row group outside ``free`` (the first stage's texts) waits for ``gate``."""

    def __init__(self, gate: str, free: list[list[str | None]]) -> None:
        self.gate = gate
        self.free = {tuple(t for t in texts if t is not None) for texts in free}

    def __call__(self, batch: list[str]) -> list[list[int]]:
        counting = threading.current_thread().name.startswith("streamshard-count")
        if self.gate and counting and tuple(batch) not in self.free:
            deadline = time.monotonic() + GATE_S
            while not os.path.exists(self.gate):
                if time.monotonic() > deadline:
                    raise RuntimeError("the count of a later stage was needed before the first training step")
                time.sleep(0.02)
        return [[token(w) for w in text.split()] for text in batch]


def make_stream(data: str, tokenizer: Any, sized: bool) -> ss.PackedStream:
    source = ss.ParquetStream(data, shuffle=True, seed=5)
    return ss.PackedStream(source, column="text", seq_len=SEQ, batch_size=BATCH, tokenizer=tokenizer, eos_id=EOS,
                           first_stage_bytes=FIRST_STAGE_BYTES, **({"sized": True} if sized else {}))


def first_stage_texts(data: str) -> list[list[str | None]]:
    """The texts of each row group of epoch 0's first stage (from the catalog and the stage split alone)."""
    probe = make_stream(data, lambda batch: [[] for _ in batch], False)
    catalog = probe.source.catalog
    out = []
    for rg in probe.planner.stages(0).units(0).tolist():
        url, index = catalog.urls[int(catalog.rg_file[rg])], int(catalog.rg_index[rg])
        out.append(pq.ParquetFile(url.removeprefix("file://")).read_row_group(index, columns=["text"])
                   .column("text").to_pylist())
    return out


class Model(L.LightningModule):
    def __init__(self, data: str, gate: str, loader: str, sized: bool, record: str) -> None:
        super().__init__()
        self.data, self.gate, self.loader_kind, self.sized, self.record = data, gate, loader, sized, Path(record)
        self.embed = torch.nn.Embedding(1000, 4)
        self.head = torch.nn.Linear(4, 1)
        self._out = None

    def train_dataloader(self) -> Any:
        ps = make_stream(self.data, GatedWords(self.gate, first_stage_texts(self.data)), self.sized)
        if self.loader_kind == "dataloader":
            return DataLoader(ps, batch_size=None, num_workers=2)
        return ss.StreamLoader(ps, num_workers=2)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        Path(self.gate).touch()  # the first step happened: held counts may go on
        if self._out is None:
            self.record.mkdir(parents=True, exist_ok=True)
            self._out = open(self.record / f"rank{self.global_rank}.jsonl", "a", buffering=1)
        sid, ids = batch["sample_id"].reshape(-1), batch["input_ids"].reshape(-1)
        real = sid >= 0
        self._out.write(json.dumps({"kind": "train", "step": self.global_step, "epoch": self.current_epoch,
                                    "tokens": torch.stack([sid[real], ids[real]], 1).tolist()}) + "\n")
        return self.head(self.embed(batch["input_ids"])).mean()

    def on_train_start(self) -> None:
        self.record.mkdir(parents=True, exist_ok=True)
        with open(self.record / f"start{self.global_rank}.json", "w") as f:
            json.dump({"num_training_batches": float(self.trainer.num_training_batches),
                       "estimated_stepping_batches": float(self.trainer.estimated_stepping_batches)}, f)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Preempt(L.Callback):
    """Kill every rank at the start of global step ``at`` (its checkpoint is written), all ranks together
    (``preemption.exit_together``)."""

    def __init__(self, at: int, directory: Path) -> None:
        self.at, self.directory = at, directory / f"preempt-at-{at}"

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.at:
            exit_together(self.directory, trainer.global_rank, trainer.world_size, PREEMPTED)


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the tests' stacks_then_kill: where a hung job waits
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--gate", default="", help="the gate file (none: counting is never held)")
    parser.add_argument("--record", required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--loader", choices=["streamloader", "dataloader"], default="streamloader")
    parser.add_argument("--sized", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every-n-steps", type=int, default=4)
    parser.add_argument("--preempt-at", type=int)
    parser.add_argument("--resume")
    args = parser.parse_args()
    # No ElasticResume (a resume on the same topology): the StreamLoader's own state in a checkpoint counts
    # the batch Lightning read ahead of training as not handed out.
    callbacks: list[L.Callback] = [
        ModelCheckpoint(dirpath=args.ckpt_dir, filename="{epoch}-{step}", every_n_train_steps=args.every_n_steps,
                        save_top_k=-1),
    ]
    if args.preempt_at is not None:
        callbacks.append(Preempt(args.preempt_at, Path(args.record)))
    model = Model(args.data, args.gate, args.loader, args.sized, args.record)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs, callbacks=callbacks,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=args.ckpt_dir)
    trainer.fit(model, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
