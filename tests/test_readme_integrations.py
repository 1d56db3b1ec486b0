"""The snippets of docs/integrations.md run as written (with ``"data/"`` pointing at a generated corpus).

Each ``python`` block of a framework's section is preceded by ``<!-- readme-test: LAUNCH -->``:
``python`` runs the snippet as a script, ``torchrun N`` under torchrun with N processes (gloo, CPU).
The framework tests named on that page drive the same code through preemption and resumes; this
file only proves the snippets themselves work, so the docs cannot drift from what runs (the README
links each framework to its section there).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from streamshard.testing import write_corpus

from launch import check, launch

pytestmark = pytest.mark.slow  # subprocesses: run by make test, skippable with -m "not slow"

PAGE = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
MARKER = re.compile(r"<!-- readme-test: ([^>]+?) -->\n```python\n(.*?)```", re.S)


def snippets() -> list[tuple[str, str, str]]:
    """(heading, launch, code) of every marked block of the page, by its ``##`` section."""
    found = []
    for part in re.split(r"\n## ", PAGE.read_text())[1:]:
        heading = part.splitlines()[0].replace("`", "").strip()
        found.extend((heading, launch, code) for launch, code in MARKER.findall(part))
    return found


def test_the_integrations_section_has_a_run_snippet_per_framework():
    assert {heading for heading, _, _ in snippets()} == {
        "Plain DataLoader", "Lightning", "Accelerate", "torchtitan-style loops and DCP"}


@pytest.mark.parametrize("heading, how, code", snippets(), ids=[s[0] for s in snippets()])
def test_a_readme_snippet_runs_as_written(tmp_path, heading, how, code):
    data = tmp_path / "data"
    write_corpus(str(data), [[90, 60], [45], [], [120, 3]])
    assert '"data/"' in code, f"the {heading} snippet must read its corpus from \"data/\""
    script = tmp_path / "snippet.py"
    script.write_text(code.replace('"data/"', repr(str(data))))
    match = re.fullmatch(r"python|torchrun (\d+)", how)
    assert match, f"unknown launch {how!r}"
    check(launch(int(match[1]) if match[1] else None, script, timeout=240, cwd=tmp_path))
