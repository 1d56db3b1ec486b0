"""A Lightning training job over streamshard, written the way a Lightning user writes one.

    python tests/frameworks/lightning_job.py --data DIR --devices 2 --epochs 2 --ckpt-dir CKPT --record REC
    python tests/frameworks/lightning_job.py ... --preempt-at 6           # killed after step 6's checkpoint
    python tests/frameworks/lightning_job.py ... --devices 3 --resume CKPT/steps/epoch=0-step=6.ckpt

The user's part is ``StreamModel`` (a ``LightningModule`` whose ``train_dataloader()`` and
``val_dataloader()`` return ``ss.StreamLoader``s) or ``StreamData`` (a ``LightningDataModule`` that
builds its dataset in ``__init__``, before Lightning starts the DDP processes), two
``ModelCheckpoint``s (every N training steps, and at every epoch end), streamshard's ``ElasticResume``
callback (``--plain`` leaves it out) and ``Trainer(strategy="ddp").fit(model, ckpt_path=...)``.
Everything else here is the observation the test reads (``tests/test_lightning.py``): per rank, one
JSON line per training step (global step, epoch, the real ``sample_id``s), per validation batch, and
every warning raised in the process.

Preemption is a hard kill (``os._exit``, what a lost spot instance or the scheduler's SIGKILL looks
like): every rank exits at the start of the step after the checkpoint of ``--preempt-at`` was written
(``ModelCheckpoint`` writes it at the end of that step, behind a barrier), with the loader's
read-ahead batches in flight and no teardown, so nothing outside the checkpoint can carry over.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

import streamshard as ss
from streamshard.integrations.lightning import ElasticResume
from preemption import PREEMPTED, exit_together  # exit status 75 (EX_TEMPFAIL): the test tells it from a crash

CLASSES = 7


class Record:
    """Append-only JSON lines: one file per rank once the rank is known, one per process before."""

    def __init__(self, directory: str | None) -> None:
        self.directory = Path(directory) if directory else None
        self.rank: int | None = None
        self._files: dict[str, Any] = {}

    def write(self, **entry: Any) -> None:
        if self.directory is None:
            return
        name = f"rank{self.rank}.jsonl" if self.rank is not None else f"process{os.getpid()}.jsonl"
        if name not in self._files:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._files[name] = open(self.directory / name, "a", buffering=1)  # line-buffered: survives os._exit
        self._files[name].write(json.dumps({"pid": os.getpid(), **entry}) + "\n")


RECORD = Record(None)


def record_warnings() -> None:
    """Every warning raised in this process goes to the record (the test checks streamshard's)."""

    package = os.path.dirname(ss.__file__) + os.sep

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' signature
        # ``filename`` is where ``stacklevel`` points (often the caller's code); the frame that called
        # warnings.warn says whose warning it is.
        stack = traceback.extract_stack()[:-1]
        while stack and stack[-1].filename == warnings.__file__:
            stack.pop()
        raised_in = stack[-1].filename if stack else filename
        RECORD.write(kind="warning", category=category.__name__, message=str(message), filename=filename,
                     lineno=lineno, raised_in=raised_in, streamshard=raised_in.startswith(package))

    warnings.showwarning = show


def real_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    ids = batch["sample_id"]
    return ids[ids >= 0].tolist()  # -1 marks padding rows


class Model(L.LightningModule):
    """A tiny classifier of ``label`` from ``score``; records what every step trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(1, CLASSES)
        self.validations = 0  # validation runs of this process (the sanity check is the first)

    def setup(self, stage: str) -> None:
        RECORD.rank = self.global_rank

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        RECORD.write(kind="train", step=self.global_step, epoch=self.current_epoch, batch_idx=batch_idx,
                     ids=real_ids(batch), rows=int(batch["sample_id"].numel()))
        return self._loss(batch)

    def on_validation_epoch_start(self) -> None:
        self.validations += 1

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        RECORD.write(kind="val", run=self.validations, sanity=self.trainer.sanity_checking,
                     epoch=self.current_epoch, ids=real_ids(batch))
        self._loss(batch)

    def on_train_start(self) -> None:
        RECORD.write(kind="start", epoch=self.current_epoch, step=self.global_step,
                     num_training_batches=self.trainer.num_training_batches)

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        real = (batch["sample_id"] >= 0).float()  # padding rows carry no weight
        logits = self.head(batch["score"][:, None].float())
        losses = torch.nn.functional.cross_entropy(logits, batch["label"], reduction="none")
        return (losses * real).sum() / real.sum().clamp(min=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def train_stream(data: str, batch_size: int) -> ss.ParquetStream:
    return ss.ParquetStream(data, columns=["score", "label"], batch_size=batch_size, shuffle=True, seed=0)


def val_stream(data: str, batch_size: int) -> ss.ParquetStream:
    return ss.ParquetStream(data, columns=["score", "label"], batch_size=batch_size)


class StreamModel(Model):
    """The usual way: the loaders are made in the module's dataloader hooks, in every DDP process."""

    def __init__(self, data: str, batch_size: int) -> None:
        super().__init__()
        self.data, self.batch_size = data, batch_size

    def train_dataloader(self) -> ss.StreamLoader:
        return ss.StreamLoader(train_stream(self.data, self.batch_size), num_workers=2)

    def val_dataloader(self) -> ss.StreamLoader:
        return ss.StreamLoader(val_stream(self.data, self.batch_size), num_workers=1)


class StreamData(L.LightningDataModule):
    """The dataset made in ``__init__``: in the launching process before the Trainer starts the DDP
    processes, in the others before ``init_process_group`` (``WORLD_SIZE`` and ``LOCAL_RANK`` set, no ``RANK``)."""

    def __init__(self, data: str, batch_size: int) -> None:
        super().__init__()
        self.train, self.val = train_stream(data, batch_size), val_stream(data, batch_size)

    def train_dataloader(self) -> ss.StreamLoader:
        return ss.StreamLoader(self.train, num_workers=2)

    def val_dataloader(self) -> ss.StreamLoader:
        return ss.StreamLoader(self.val, num_workers=1)


class Preempt(L.Callback):
    """Kill every rank at the start of the step after global step ``at`` (its checkpoint is written), all
    ranks together (``preemption.exit_together``, in ``directory``)."""

    def __init__(self, at: int, directory: Path) -> None:
        self.at, self.directory = at, directory / f"preempt-at-{at}"

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.at:
            RECORD.write(kind="preempted", step=trainer.global_step, epoch=trainer.current_epoch)
            exit_together(self.directory, trainer.global_rank, trainer.world_size, PREEMPTED)


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the tests' stacks_then_kill: where a hung job waits
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the corpus (a directory of Parquet files)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--every-n-steps", type=int, default=4, help="a step checkpoint every N training steps")
    parser.add_argument("--ckpt-dir", required=True, help="checkpoints: steps/ (every N steps), epochs/ (epoch ends)")
    parser.add_argument("--resume", help="a .ckpt to resume from (trainer.fit(ckpt_path=...))")
    parser.add_argument("--preempt-at", type=int, help="kill every rank once the checkpoint of this step is written")
    parser.add_argument("--record", help="directory for the JSON-lines records")
    parser.add_argument("--datamodule", action="store_true", help="the dataset is made in LightningDataModule.__init__")
    parser.add_argument("--plain", action="store_true", help="leave out ElasticResume (to see why it is there)")
    args = parser.parse_args()

    RECORD.directory = Path(args.record) if args.record else None
    record_warnings()
    callbacks: list[L.Callback] = [
        ElasticResume(),  # Lightning's batch count after a resume on another number of devices
        ModelCheckpoint(dirpath=os.path.join(args.ckpt_dir, "steps"), filename="{epoch}-{step}",
                        every_n_train_steps=args.every_n_steps, save_top_k=-1),
        ModelCheckpoint(dirpath=os.path.join(args.ckpt_dir, "epochs"), filename="{epoch}-{step}",
                        every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True),
    ]
    if args.plain:
        callbacks = callbacks[1:]
    if args.preempt_at is not None:
        callbacks.append(Preempt(args.preempt_at, Path(args.record or args.ckpt_dir)))

    if args.datamodule:
        datamodule = StreamData(args.data, args.batch_size)  # before the Trainer exists, as users write it
        model: Model = Model()
    else:
        datamodule, model = None, StreamModel(args.data, args.batch_size)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", max_epochs=args.epochs,
                        callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=args.ckpt_dir)
    trainer.fit(model, datamodule=datamodule, ckpt_path=args.resume)
    RECORD.write(kind="end", epoch=trainer.current_epoch, step=trainer.global_step)


if __name__ == "__main__":
    main()
