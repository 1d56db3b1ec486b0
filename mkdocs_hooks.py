"""mkdocs hooks: links from docs/ pages to the repository's other files, checked like links between pages.

The pages link to files outside ``docs/`` (``../benchmarks/RESULTS.md#...``, ``../examples/demo.py``).
mkdocs only knows the files under ``docs/``, so it would call each of them not found. This hook checks
that every such file exists in the repository (a missing one is a warning, which ``--strict`` turns
into a failed build), hides the link from mkdocs' own check behind a ``repo:`` marker, and puts the
relative path back into the HTML, where it resolves from ``site/`` as from ``docs/``
(``use_directory_urls: false`` keeps every page one level below the repository root).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.streamshard")
REPO_LINK = re.compile(r"(\]\()\.\./([^)#\s]+)(#[^)\s]*)?\)")
MARKER = "repo:"


def on_page_markdown(markdown: str, page, config, files) -> str:
    """``](../path#anchor)`` -> ``](repo:path#anchor)``, warning for each path the repository lacks."""
    root = Path(config["docs_dir"]).resolve().parent

    def mark(match: re.Match) -> str:
        path = match.group(2)
        if not (root / path).exists():
            log.warning("%s links to '../%s', which is not a file of the repository", page.file.src_uri, path)
        return f"{match.group(1)}{MARKER}{path}{match.group(3) or ''})"

    return REPO_LINK.sub(mark, markdown)


def on_page_content(html: str, page, config, files) -> str:
    """The marked links back to paths relative to the page: ``href="../path"``, ``src="../path"``."""
    return re.sub(rf'(href|src)="{MARKER}', r'\1="../', html)
