"""The pure core: epoch order, batches, resume and state, blends, packing. No I/O, no torch."""
