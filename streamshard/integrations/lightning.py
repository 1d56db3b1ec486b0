"""Lightning: a resume on another number of devices trains the rest of the epoch, and every later epoch, in full.

    from streamshard.integrations.lightning import ElasticResume

    trainer = L.Trainer(strategy="ddp", devices=3, callbacks=[ModelCheckpoint(...), ElasticResume()])
    trainer.fit(model, ckpt_path="epoch=0-step=6.ckpt")   # saved on 2 devices

A ``StreamLoader`` from ``train_dataloader()`` needs nothing else on the topology that saved the
checkpoint. On another one, Lightning 2.6 counts the resumed epoch with numbers that cannot all be right:

* ``fit_loop.setup_data`` reads ``len(loader)`` *before* it loads the loader's state (a fresh epoch on
  the new topology, ``L``) and again after (``k + r``: the ``k`` batches per rank the old topology
  consumed, which is Lightning's restored batch index, plus the ``r`` the resumed pass yields), and keeps
  ``n = min(L, k + r)`` as ``trainer.num_training_batches`` for the whole fit; the resumed epoch ends
  when its batch index, restored to ``k``, reaches ``n``.
* On more devices ``k + r > L``: the resumed epoch stops after ``L - k`` of its ``r`` batches (2 -> 3
  devices, preempted at step 6 of 18: 6 of 8 steps, 40 of 400 rows never trained).
* On fewer devices ``k + r < L``: the resumed epoch is right, but every later epoch stops after
  ``k + r`` of its ``L`` batches (2 -> 1: 28 of 34 steps, 64 rows of each later epoch never trained).

No ``len`` can be both the new topology's epoch and ``k +`` the rest, because ``k`` counts the old
topology's batches. So this callback puts Lightning's count into the new topology's terms, which has no
public API in Lightning 2.6 and touches two counters of its fit loop:

* ``on_train_start`` (after the loader's state is loaded, before the first batch): the restored batch
  index (``trainer.fit_loop.epoch_loop.batch_progress.current``) becomes ``n - r``, so Lightning runs
  exactly the ``r`` batches of the resumed pass and flags the last of them (epoch-end validation,
  schedulers and checkpoints run where they should). It is ``n - r`` already on the same topology and
  on a fresh start: nothing changes there. (2 -> 3 above: index 4 of a 12-batch epoch, 8 to go.)
* ``on_train_epoch_start`` (every epoch Lightning starts afresh): ``trainer.fit_loop.max_batches``
  becomes ``len(loader)``, the new topology's epoch.

A loader without a length (a raw-text ``PackedStream``, whose length needs the whole token count:
``len()`` raises ``TypeError``, so Lightning trains the epoch until the loader ends, starting after
the first counted stage) needs none of this: ``trainer.num_training_batches`` is ``inf`` and the two
hooks leave it alone. Lightning reads one batch ahead of training from such a loader, which the
loader's own state in a checkpoint accounts for (``integrations/lightning_read_ahead.py``).

It acts only on a single ``StreamLoader`` over a stream returned by ``train_dataloader()`` and with
``limit_train_batches`` left at 1.0; anything else is left to Lightning. Imported only by the user:
streamshard itself never imports Lightning.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from ..loader.stream_loader import StreamLoader

_PROGRESS = ("ready", "started", "processed", "completed")  # Lightning's in-epoch batch counters


class ElasticResume(pl.Callback):
    """Keeps Lightning's batch count in the terms of the topology a ``StreamLoader`` resumed on."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = _stream_loader(trainer)
        counted = trainer.num_training_batches
        if loader is None or not isinstance(counted, int):
            return
        rest = loader.batches_left()  # the pass Lightning is about to run, resumed or whole
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        shift = max(counted - rest, 0) - progress.ready
        if shift:
            for name in _PROGRESS:
                setattr(progress, name, getattr(progress, name) + shift)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = _stream_loader(trainer)
        if loader is not None and isinstance(trainer.num_training_batches, int):
            trainer.fit_loop.max_batches = len(loader)  # set_epoch(e) came first: the whole of epoch e


def _stream_loader(trainer: pl.Trainer) -> Any:
    """The ``StreamLoader`` over a stream that ``train_dataloader()`` returned, if that is all it returned."""
    loader = trainer.train_dataloader
    limit = trainer.limit_train_batches
    whole = isinstance(limit, float) and limit == 1.0  # an int limit is a batch count
    if whole and isinstance(loader, StreamLoader) and callable(getattr(loader.dataset, "steps_per_epoch", None)):
        return loader  # a stream: map-style datasets (ElasticSampler) are left to Lightning
    return None
