"""The ``streamshard`` command line (``streamshard = "streamshard.cli:main"``, ``python -m streamshard``).

    command  arguments, dispatch, output and exit codes: ``main``
    inspect  ``streamshard inspect``: files, row groups, bytes, schema -> tensors, warnings
    plan     ``streamshard plan``: rows, batches and padding per global worker
    bench    ``streamshard bench``: one epoch through ParquetStream + StreamLoader, timed
"""

from .command import main

__all__ = ["main"]
