"""A catalog over object storage makes pyarrow's first pa.array() (which imports pandas, ~0.2 s) in the
background while its listing and footers wait on the store; a local catalog does not (nothing to wait on)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streamshard.testing import write_corpus

SCRIPT = """
import sys, time
from streamshard.io.catalog import Catalog
assert "pandas" not in sys.modules, "imported before the catalog: the test proves nothing"
Catalog.build(sys.argv[1], ["id"], {options})
deadline = time.monotonic() + 10
while "pandas" not in sys.modules and time.monotonic() < deadline and sys.argv[2] == "remote":
    time.sleep(0.01)
print("pandas" in sys.modules)
"""


def _pandas_imported_after_catalog(url: str, options: dict, where: str) -> bool:
    done = subprocess.run([sys.executable, "-c", SCRIPT.replace("{options}", repr(options)), url, where],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


@pytest.mark.slow
def test_a_remote_catalog_warms_pyarrow_and_a_local_one_does_not(seaweedfs, tmp_path):
    pytest.importorskip("pandas")
    write_corpus(str(tmp_path), [[30, 20]])
    url = seaweedfs.upload(str(tmp_path), "streamshard-warm-up", "c")
    assert _pandas_imported_after_catalog(url, seaweedfs.storage_options, "remote")
    assert not _pandas_imported_after_catalog(str(tmp_path), {}, "local")
