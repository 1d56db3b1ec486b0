"""What every embedded object store hands a test: its endpoint, fsspec options, and an upload helper."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class LocalObjectStore:
    """A running local object-storage endpoint and the fsspec options that reach it.

    Subclasses name their fsspec ``protocol`` and their ``storage_options``; everything else goes
    through fsspec, as the library does.
    """

    endpoint_url: str
    pid: int | None = None  # the server process, so benchmarks can account for its CPU time

    protocol: ClassVar[str] = ""
    _filesystem: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def storage_options(self) -> dict[str, Any]:
        raise NotImplementedError

    def filesystem(self) -> Any:
        """This store's fsspec filesystem: one client, kept for the life of this object.

        Not fsspec's cached instance, and never left for the garbage collector while the store is
        in use: a forked DataLoader worker that drops or collects an inherited s3fs instance closes
        its client on the worker's own event loop and prints "Task exception was never retrieved
        ... attached to a different loop" (the close_session problem of fsspec/s3fs#781).
        """
        if self._filesystem is None:
            import fsspec

            self._filesystem = fsspec.filesystem(self.protocol, skip_instance_cache=True, **self.storage_options)
        return self._filesystem

    def upload(self, local_dir: str, bucket: str, prefix: str = "") -> str:
        """Create ``bucket`` and copy every file of ``local_dir`` under ``prefix``; return the URL."""
        fs = self.filesystem()
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        target = f"{bucket}/{prefix}".rstrip("/")
        names = sorted(os.listdir(local_dir))
        fs.put([os.path.join(local_dir, name) for name in names], [f"{target}/{name}" for name in names])
        return f"{self.protocol}://{target}"
