"""The batch Lightning reads ahead of training is not counted in the checkpoint's loader state, with either
Lightning package (``lightning.pytorch`` and the standalone ``pytorch_lightning``), in process.

A loader without a length (a raw-text ``PackedStream``) makes Lightning's fit loop read one batch ahead;
``StreamLoader.state_dict()`` finds the fit loop saving a checkpoint among its callers
(``integrations/lightning_read_ahead.py``) and counts that batch as not handed out. A loader resumed from
the checkpoint's state then delivers exactly the batches after the last one trained.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import streamshard as ss

from test_packed_text import write_texts

SAVE_AT = 3  # the checkpoint is saved after this many steps


def words(batch):
    return [[sum(w.encode()) % 97 + 1 for w in text.split()] for text in batch]


def stream(path):
    ps = ss.PackedStream(ss.ParquetStream(path, rank=0, world_size=1), column="text", seq_len=16, batch_size=2,
                         tokenizer=words, eos_id=0)
    return ss.StreamLoader(ps, num_workers=0)


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_the_batch_lightning_read_ahead_is_delivered_again_after_a_resume(tmp_path, package):
    pl = pytest.importorskip(package)
    importlib.import_module(package)
    path = tmp_path / "c"
    write_texts(path, [[12, 10], [14, 9]], seed=3)
    reference = [b["input_ids"].clone() for b in stream(str(path))]
    assert len(reference) > SAVE_AT + 2
    trained = []

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def train_dataloader(self):
            return stream(str(path))

        def training_step(self, batch, batch_idx):
            trained.append(batch["input_ids"].clone())
            return (self.weight * batch["input_ids"].float().mean()).sum()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if len(trained) == SAVE_AT:
                self.trainer.save_checkpoint(tmp_path / "step.ckpt")  # as ModelCheckpoint does

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=SAVE_AT + 1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(Model())
    assert trainer.num_training_batches == float("inf")  # no length: Lightning reads one batch ahead
    checkpoint = torch.load(tmp_path / "step.ckpt", weights_only=False)  # the file this test just wrote
    state = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    resumed = stream(str(path))
    resumed.load_state_dict(state)
    rest = [b["input_ids"] for b in resumed]
    assert len(rest) == len(reference) - SAVE_AT  # the batch read ahead is delivered again
    for got, want in zip(rest, reference[SAVE_AT:]):
        assert torch.equal(got, want)
