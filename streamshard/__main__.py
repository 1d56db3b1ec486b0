"""``python -m streamshard``: the same command line as the ``streamshard`` script."""

from .cli import main

raise SystemExit(main())
