"""The batch Lightning reads ahead of training is not counted in the checkpoint's loader state, with either
Lightning package (``lightning.pytorch`` and the standalone ``pytorch_lightning``, which the pinned
``lightning`` of the dev extra requires).

A loader without a length (a raw-text ``PackedStream``) makes Lightning's fit loop read one batch ahead;
``StreamLoader.state_dict()`` finds the fit loop saving a checkpoint among its callers
(``integrations/lightning_read_ahead.py``) and counts that batch as not handed out. A loader resumed from
the checkpoint's state then delivers exactly the batches after the last one trained. Each run is a fresh
Python process: importing Lightning changes process-wide state (imports, multiprocessing settings) that
other tests of the suite must not inherit.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from test_packed_text import write_texts

SAVE_AT = 3  # the checkpoint is saved after this many steps

JOB = """
import importlib, sys
import torch
import streamshard as ss

package, path, out, save_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
pl = importlib.import_module(package)


def words(batch):
    return [[sum(w.encode()) % 97 + 1 for w in text.split()] for text in batch]


def stream():
    ps = ss.PackedStream(ss.ParquetStream(path, rank=0, world_size=1), column="text", seq_len=16, batch_size=2,
                         tokenizer=words, eos_id=0)
    return ss.StreamLoader(ps, num_workers=0)


reference = [b["input_ids"].clone() for b in stream()]
assert len(reference) > save_at + 2, len(reference)
trained = []


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def train_dataloader(self):
        return stream()

    def training_step(self, batch, batch_idx):
        trained.append(batch["input_ids"].clone())
        return (self.weight * batch["input_ids"].float().mean()).sum()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if len(trained) == save_at:
            self.trainer.save_checkpoint(out)  # as ModelCheckpoint does

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=save_at + 1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
trainer.fit(Model())
assert trainer.num_training_batches == float("inf")  # no length: Lightning reads one batch ahead
checkpoint = torch.load(out, weights_only=False)  # the file this job just wrote
resumed = stream()
resumed.load_state_dict(checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0])
rest = [b["input_ids"] for b in resumed]
print("rest", len(rest), "of", len(reference))
assert len(rest) == len(reference) - save_at, "the batch read ahead was lost"
assert all(torch.equal(got, want) for got, want in zip(rest, reference[save_at:]))
print("ok")
"""


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_the_batch_lightning_read_ahead_is_delivered_again_after_a_resume(tmp_path, package):
    path = tmp_path / "c"
    write_texts(path, [[12, 10], [14, 9]], seed=3)
    done = subprocess.run([sys.executable, "-c", JOB, package, str(path), str(tmp_path / "step.ckpt"), str(SAVE_AT)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]
