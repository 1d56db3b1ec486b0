"""The "Public API" table of docs/api.md and the package agree: the same names, the same signatures.

The table's first column holds the public names in backticks, with a signature where one is
callable: ``Name(arg, arg=default, *, kw=default)`` (``Name.method(...)`` for a classmethod). A
default shown as ``...`` means "has a default, value not shown". These tests compare that column
with ``streamshard.__all__`` and ``inspect.signature``, so the docs cannot drift from the code.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import streamshard

API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"
SHOWN = object()  # a default written as `...`: some default, value not shown
REQUIRED = inspect.Parameter.empty


def public_api_entries(page: str) -> list[str]:
    """The backticked spans of the first column of the table under the ``## Public API`` heading."""
    section = page.split("\n## Public API", 1)[1]
    entries = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        first = line.split("|")[1]
        if first.strip() == "name":  # the header row
            continue
        entries.extend(re.findall(r"`([^`]+)`", first))
    return entries


def parse_entry(entry: str) -> tuple[str, str | None, str | None]:
    """``"Catalog.build(paths, x=None)"`` -> ``("Catalog", "build", "paths, x=None")``; no call -> None params."""
    match = re.fullmatch(r"([\w.]+?)(?:\.(\w+))?(?:\((.*)\))?", entry.strip())
    assert match, f"cannot read the table entry {entry!r}"
    name, method, params = match.groups()
    if params is None and method is not None and name == "streamshard":  # a module: streamshard.testing
        return f"{name}.{method}", None, None
    return name, method, params


def table_parameters(params: str) -> list[tuple[str, Any, Any]]:
    """``"a, b=1, *, c=..."`` -> ``[(name, kind, default)]`` as :mod:`inspect` names them."""
    args = ast.parse(f"def f({params}): pass").body[0].args
    P = inspect.Parameter
    out: list[tuple[str, Any, Any]] = []
    positional = args.posonlyargs + args.args
    defaults = [REQUIRED] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(positional, defaults):
        kind = P.POSITIONAL_ONLY if arg in args.posonlyargs else P.POSITIONAL_OR_KEYWORD
        out.append((arg.arg, kind, _default(default)))
    if args.vararg:
        out.append((args.vararg.arg, P.VAR_POSITIONAL, REQUIRED))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append((arg.arg, P.KEYWORD_ONLY, REQUIRED if default is None else _default(default)))
    if args.kwarg:
        out.append((args.kwarg.arg, P.VAR_KEYWORD, REQUIRED))
    return out


def _default(node: Any) -> Any:
    if node is REQUIRED:
        return REQUIRED
    value = ast.literal_eval(node)
    return SHOWN if value is Ellipsis else value


def signature_differences(target: Any, shown: list[tuple[str, Any, Any]]) -> list[str]:
    """What the table's parameters get wrong about ``target``'s signature (empty if nothing)."""
    actual = [(p.name, p.kind, p.default) for p in inspect.signature(target).parameters.values()]
    problems = []
    if [(n, k) for n, k, _ in actual] != [(n, k) for n, k, _ in shown]:
        problems.append(f"parameters {_render(actual)} but the table shows {_render(shown)}")
        return problems
    for (name, _, real), (_, _, doc) in zip(actual, shown):
        if doc is SHOWN:
            if real is REQUIRED:
                problems.append(f"{name} is required but the table gives it a default")
        elif doc is REQUIRED and real is not REQUIRED:
            problems.append(f"{name} defaults to {real!r} but the table shows it as required")
        elif doc is not REQUIRED and real != doc:
            problems.append(f"{name} defaults to {real!r} but the table says {doc!r}")
    return problems


def _render(params: list[tuple[str, Any, Any]]) -> str:
    P = inspect.Parameter
    parts, star = [], False
    for name, kind, _ in params:
        if kind == P.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or kind in (P.KEYWORD_ONLY, P.VAR_POSITIONAL)
        parts.append({P.VAR_POSITIONAL: "*", P.VAR_KEYWORD: "**"}.get(kind, "") + name)
    return f"({', '.join(parts)})"


def api_problems(page: str) -> list[str]:
    """Every disagreement between the Public API table of docs/api.md and the package."""
    entries = [parse_entry(e) for e in public_api_entries(page)]
    listed = {name for name, _, _ in entries}
    modules = {name for name in listed if name.startswith("streamshard.")}
    public = set(streamshard.__all__)
    problems = [f"{n} is in streamshard.__all__ but not in the API table" for n in sorted(public - listed)]
    problems += [f"{n} is in the API table but not in streamshard.__all__" for n in sorted(listed - public - modules)]
    for module in sorted(modules):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            problems.append(f"{module} is in the API table but cannot be imported ({exc})")
    for name, method, params in entries:
        if name in modules or not hasattr(streamshard, name):
            continue
        target = getattr(streamshard, name)
        if method is not None:
            if not hasattr(target, method):
                problems.append(f"{name}.{method}: no such attribute")
                continue
            target = getattr(target, method)
        if params is not None:
            label = f"{name}.{method}" if method else name
            problems += [f"{label}: {p}" for p in signature_differences(target, table_parameters(params))]
    return problems


def test_the_public_api_table_lists_exactly_the_public_names_with_their_signatures():
    assert api_problems(API_PAGE.read_text(encoding="utf-8")) == []


# -- the checker itself ---------------------------------------------------------------------------


def test_the_checker_reads_signatures_kinds_and_defaults():
    assert parse_entry("Catalog.build(paths, columns=None)") == ("Catalog", "build", "paths, columns=None")
    assert parse_entry("streamshard.testing") == ("streamshard.testing", None, None)
    assert parse_entry("StateError") == ("StateError", None, None)

    def f(a, b=1, *args, c, d=None, **kw):  # noqa: ANN001, ANN002, ANN003 - a signature to compare
        pass

    assert signature_differences(f, table_parameters("a, b=1, *args, c, d=None, **kw")) == []
    assert signature_differences(f, table_parameters("a, b=..., *args, c, d=..., **kw")) == []
    assert signature_differences(f, table_parameters("a, b=2, *args, c, d=None, **kw")) == [
        "b defaults to 1 but the table says 2"]
    (wrong,) = signature_differences(f, table_parameters("a, b=1, c=..., d=None"))
    assert wrong == "parameters (a, b, *args, c, d, **kw) but the table shows (a, b, c, d)"


@pytest.mark.parametrize("table, problem", [
    ("| `Permutation(n, seed)` | x |",
     "mix_seed is in streamshard.__all__ but not in the API table"),
    ("| `Permutation(n, seed)`, `NoSuchThing` | x |",
     "NoSuchThing is in the API table but not in streamshard.__all__"),
    ("| `Permutation(n, seed, extra=1)` | x |",
     "Permutation: parameters (n, seed) but the table shows (n, seed, extra)"),
])
def test_the_checker_names_what_drifted(table, problem):
    page = f"# x\n\n## Public API\n\n| name | what it is |\n| --- | --- |\n{table}\n\n## Next\n"
    assert problem in api_problems(page)
