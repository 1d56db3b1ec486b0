"""StreamLoader and what moves batches: thread workers, worker processes' shared-memory hand-off, device prefetch."""
