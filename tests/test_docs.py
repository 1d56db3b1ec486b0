"""The docs site builds with ``mkdocs build --strict`` (``make docs``), and a broken link fails it.

``--strict`` turns every mkdocs warning into a failed build: a link to a missing page or anchor, a
page left out of ``nav``, and (through ``mkdocs_hooks.py``) a link to a repository file that does
not exist. The README links into ``docs/``; its relative links are checked here too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the project at ``root`` into ``site``."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def project_copy(tmp_path: Path) -> Path:
    """A project whose ``docs/`` is a copy (to break) and whose other entries link to this repository's."""
    copy = tmp_path / "project"
    shutil.copytree(ROOT / "docs", copy / "docs")
    for entry in ROOT.iterdir():
        if entry.name not in ("docs", ".git", "site"):
            (copy / entry.name).symlink_to(entry)
    return copy


def test_the_docs_build_strict_without_a_warning(tmp_path):
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert pages <= {p.stem for p in (tmp_path / "site").glob("*.html")}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    anchors = re.findall(r"\]\(docs/([\w-]+)\.md#([\w-]+)\)", readme)
    assert anchors, "the README links to sections of the docs pages"
    missing = [f"docs/{page}.md#{anchor}" for page, anchor in anchors
               if f'id="{anchor}"' not in (tmp_path / "site" / f"{page}.html").read_text(encoding="utf-8")]
    assert missing == [], "README links to anchors the docs pages do not have"


@pytest.mark.parametrize("broken", ["[x](concepts.md#no-such-anchor)", "[x](no-such-page.md)",
                                    "[x](../benchmarks/NO_SUCH_FILE.md)"])
def test_a_broken_link_fails_the_build(tmp_path, broken):
    copy = project_copy(tmp_path)
    page = copy / "docs" / "blending.md"
    page.write_text(page.read_text() + f"\n{broken}\n")
    done = build(copy, tmp_path / "site")
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert done.returncode != 0 and len(warnings) == 1, done.stderr
    assert re.sub(r"\[x\]\((\.\./)?|\)", "", broken).split("#")[0] in warnings[0]


def test_a_page_missing_from_nav_fails_the_build(tmp_path):
    copy = project_copy(tmp_path)
    (copy / "docs" / "orphan.md").write_text("# Orphan\n")
    done = build(copy, tmp_path / "site")
    assert done.returncode != 0 and "orphan.md" in done.stderr, done.stderr


def test_every_relative_link_of_the_readme_names_a_file_of_the_repository():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", readme) if not re.match(r"[a-z]+:", t)]
    assert targets, "the README links to its docs pages"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert missing == []
