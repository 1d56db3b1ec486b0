"""How many batches Lightning's fit loop has read from a loader and not trained yet, seen from the loader.

Lightning reads one batch *ahead* of training from a loader without a length (its fetcher must know
which batch is the last), so when its fit loop saves a checkpoint mid-epoch the loader has handed out
one batch more than the steps trained. A ``StreamLoader`` counts what it handed out; saved as it is,
that state would make a resume skip the batch no step trained. ``StreamLoader.state_dict()`` asks
:func:`batches_read_ahead` and counts those batches as not handed out, so a Lightning checkpoint holds
the state of the batches trained, with or without ``ElasticResume``.

It looks at its callers' frames for Lightning's fit loop saving its state (``_FitLoop.on_save_checkpoint``,
Lightning 2.x) and counts the batches its fetcher holds. Nothing here imports Lightning: outside
Lightning, or from any other caller, the answer is 0. ``tests/test_lightning_text.py`` resumes a
loader without a length with no callback, so a Lightning release that moves these names fails there.
"""

from __future__ import annotations

import sys
from typing import Any

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")  # the unified package, and the standalone one
_DEPTH = 8  # frames between StreamLoader.state_dict and the fit loop: CombinedLoader._state_dicts, its comprehension


def batches_read_ahead(loader: Any) -> int:
    """Batches of ``loader`` that Lightning's fit loop, saving a checkpoint right now, has read but not trained
    (0 when the caller is not Lightning's fit loop, or it holds none)."""
    if not any(name in sys.modules for name in _PACKAGES):
        return 0
    frame = sys._getframe(1)
    for _ in range(_DEPTH):
        frame = frame.f_back
        if frame is None:
            return 0
        if frame.f_code.co_name != "on_save_checkpoint":
            continue
        fit_loop = frame.f_locals.get("self")
        if not type(fit_loop).__module__.startswith(tuple(f"{name}.loops" for name in _PACKAGES)):
            continue
        combined = getattr(fit_loop, "_combined_loader", None)
        fetcher = getattr(fit_loop, "_data_fetcher", None)
        if combined is None or fetcher is None or not any(it is loader for it in getattr(combined, "flattened", ())):
            return 0
        return len(getattr(fetcher, "batches", None) or ())
    return 0
