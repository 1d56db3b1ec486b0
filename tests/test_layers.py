"""The layer rules of docs/api.md's Layout table, checked against every module's imports.

docs/api.md says: "The pure core has no I/O and no torch; I/O is in the reader and the delivery engine;
torch only at the edges", and its Layout table gives each module (or subpackage) a layer. This test reads
that table (the table is the source of truth: a module without a row fails here, by name) and parses every
module of ``streamshard`` with ``ast``, module-level and function-level imports alike (a lazy import is
still a dependency), then checks:

- every module of the package has a row with a layer, and every row names a module that exists;
- ``pure`` modules import no torch (or torch-based frameworks), no storage clients (fsspec, s3fs, gcsfs,
  obstore, deltalake, botocore), no stdlib modules that do process or network I/O, and no streamshard
  module whose layer is not ``pure``; numpy and pyarrow are allowed (``decoded_size`` reads footers' sizes
  through pyarrow objects);
- ``I/O`` modules import no torch and no streamshard module of the ``torch`` layer ("I/O imports no
  tensors");
- the library never imports ``streamshard.cli`` or ``streamshard.testing`` (the command line and the test
  helpers import the library, never the other way), and nothing in the package imports ``tests`` or
  ``benchmarks``.

Today's breaks of these rules are listed in KNOWN_EXCEPTIONS, each with why; an exception that is no
longer needed fails the test too, so the list only shrinks.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "streamshard"
API_DOC = ROOT / "docs" / "api.md"

# Units: a top-level module is "name.py"; a subpackage is one unit, "name/".
SUBPACKAGES = ("cache", "cli", "integrations", "testing")
# Not in the table on purpose: the package's re-exports and ``python -m streamshard``.
ENTRY_POINTS = {"__init__.py": "library", "__main__.py": "cli"}
EDGE_UNITS = {"cli/", "testing/", "__main__.py"}  # what may import the library, never imported by it

TORCH = {"torch", "lightning", "pytorch_lightning", "accelerate", "transformers"}
STORAGE_CLIENTS = {"fsspec", "s3fs", "gcsfs", "obstore", "deltalake", "botocore", "boto3", "adlfs"}
OS_IO = {"socket", "subprocess", "fcntl", "tempfile", "shutil", "http", "multiprocessing", "resource",
         "urllib.request", "ssl", "mmap", "signal"}

# (module unit, imported name) -> why the rule is broken today. Keep short; each must still be needed.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("topology.py", "torch"): (
        "pure arithmetic of rank/world/worker, but it must ask torch.distributed and the DataLoader "
        "worker info where the process stands; both imports are inside the functions that ask"),
    ("errors.py", "streamshard.io.storage"): (
        "every error redacts the credentials storage knows of (storage.REDACTION); imported inside "
        "__init__ because storage imports the errors through retry"),
    ("delivery.py", "torch"): (
        "the delivery engine is where reads become tensors: it converts each read once and gathers "
        "batches (docs/api.md: 'I/O is in the reader and the delivery engine'); its row says I/O"),
    ("delivery.py", "streamshard.convert.batches"): "as delivery.py -> torch: it builds the torch batches",
    ("delivery.py", "streamshard.convert.gather"): ("as delivery.py -> torch: it gathers the torch batches",),
    ("delivery.py", "streamshard.convert.tensors"): "as delivery.py -> torch: it converts reads to tensors",
    ("text_counts.py", "streamshard.cli"): (
        "the counting pass shows cli.progress's terminal bar; imported inside the function so that "
        "importing the package does not import the command line. Moving progress.py out of cli/ "
        "(a module move, issue 28 item 1) removes this"),
}


def _layout_rows() -> list[tuple[list[str], list[str]]]:
    """(units, layers) per row of docs/api.md's Layout table."""
    text = API_DOC.read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("module", "---"):
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        dirs = [n for n in names if n.endswith("/")]
        units = dirs if dirs else [n for n in names if n.endswith(".py")]
        # "torch (`index`, `host`: numpy)" -> torch; "torch / pure" -> one layer per unit, in order.
        layer_text = re.sub(r"\(.*?\)", "", cells[1]).strip()
        layers = [w.strip() for w in layer_text.split(" / ")] if layer_text else []
        rows.append((units, layers))
    return rows


def layer_of_unit() -> dict[str, str]:
    table: dict[str, str] = {}
    for units, layers in _layout_rows():
        assert units, "a Layout row of docs/api.md names no module"
        for i, unit in enumerate(units):
            layer = layers[i] if len(layers) == len(units) else (layers[0] if len(layers) == 1 else "")
            assert layer, f"docs/api.md Layout: {unit} has no layer (or the row's layers do not match its modules)"
            assert unit not in table, f"docs/api.md Layout: {unit} has two rows"
            table[unit] = layer
    return table


def package_units() -> dict[str, list[Path]]:
    """Unit name -> its files: each top-level module, each subpackage as one unit."""
    units: dict[str, list[Path]] = {}
    for path in sorted(PACKAGE.glob("*.py")):
        units[path.name] = [path]
    for sub in sorted(p for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        units[sub.name + "/"] = sorted(sub.rglob("*.py"))
    return units


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Absolute dotted names this file imports, wherever in the file (relative imports resolved)."""
    module = _dotted(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            for alias in node.names:  # "from . import catalog" imports the module streamshard.io.catalog
                if (ROOT / target.replace(".", "/")).is_dir():
                    found.add(f"{target}.{alias.name}")
    return found


def _unit_of_dotted(name: str) -> str | None:
    """streamshard.x.y -> its unit ("x.py" or "x/"); None for the package itself or non-modules."""
    parts = name.split(".")
    if parts[0] != "streamshard" or len(parts) < 2:
        return None
    head = parts[1]
    if (PACKAGE / head).is_dir():
        return head + "/"
    if (PACKAGE / f"{head}.py").exists():
        return f"{head}.py"
    return None


def _matches(imported: str, names: set[str]) -> str | None:
    for name in names:
        if imported == name or imported.startswith(name + "."):
            return name
    return None


def violations() -> tuple[list[str], set[tuple[str, str]]]:
    table = layer_of_unit()
    units = package_units()
    problems: list[str] = []
    used_exceptions: set[tuple[str, str]] = set()

    for unit in units:
        if unit not in table and unit not in ENTRY_POINTS:
            problems.append(f"{unit}: no row in docs/api.md's Layout table (add it with its layer)")
    for unit in table:
        if unit not in units:
            problems.append(f"docs/api.md Layout names {unit}, which is not a module of streamshard")

    def broken(unit: str, rel: Path, imported: str, key: str, rule: str) -> None:
        if (unit, key) in KNOWN_EXCEPTIONS:
            used_exceptions.add((unit, key))
        else:
            problems.append(f"{rel}: imports {imported} -- {rule}")

    for unit, files in units.items():
        layer = table.get(unit, ENTRY_POINTS.get(unit, "")).lower()
        for path in files:
            rel = path.relative_to(ROOT)
            for imported in sorted(imports_of(path)):
                top = imported.split(".")[0]
                target = _unit_of_dotted(imported)
                target_layer = table.get(target, "").lower() if target else ""
                shown = table.get(target, "unlisted") if target else ""
                if top in ("tests", "benchmarks"):
                    broken(unit, rel, imported, top, "the package never imports the test suite or benchmarks")
                if target in ("cli/", "testing/") and unit not in EDGE_UNITS and target != unit:
                    broken(unit, rel, imported, "streamshard." + target.rstrip("/"),
                           f"the library never imports streamshard.{target.rstrip('/')} (it imports the library)")
                if target == "cli/" and unit == "testing/":
                    broken(unit, rel, imported, "streamshard.cli", "the test helpers never import the command line")
                if layer == "pure":
                    if top in TORCH:
                        broken(unit, rel, imported, top, "a pure module imports no torch")
                    elif top in STORAGE_CLIENTS:
                        broken(unit, rel, imported, top, "a pure module imports no storage client (no I/O)")
                    elif _matches(imported, OS_IO):
                        broken(unit, rel, imported, _matches(imported, OS_IO), "a pure module does no OS or network I/O")
                    elif target and target != unit and target_layer != "pure" and target not in ("cli/", "testing/"):
                        broken(unit, rel, imported, "streamshard." + target.removesuffix(".py").rstrip("/"),
                               f"a pure module imports only pure modules ({target} is {shown})")
                elif layer == "i/o":
                    if top in TORCH:
                        broken(unit, rel, imported, top, "an I/O module imports no torch (I/O imports no tensors)")
                    elif target and target_layer == "torch":
                        broken(unit, rel, imported, "streamshard." + target.removesuffix(".py").rstrip("/"),
                               f"an I/O module imports no torch-layer module ({target} is torch)")
    return problems, used_exceptions


def test_layout_table_covers_every_module_and_the_layer_rules_hold() -> None:
    problems, used = violations()
    assert not problems, "layer rules of docs/api.md broken:\n" + "\n".join(problems)
    stale = sorted(set(KNOWN_EXCEPTIONS) - used)
    assert not stale, f"KNOWN_EXCEPTIONS no longer needed (remove them): {stale}"


def test_table_layers_are_known() -> None:
    layers = set(layer_of_unit().values())
    assert layers <= {"pure", "I/O", "torch", "cli", "testing"}, layers


def test_imports_are_read_wherever_they_are() -> None:
    """The parser sees a function-level import and resolves relative ones (what the lazy exceptions rely on)."""
    module = PACKAGE / "text_counts.py"
    assert "streamshard.progress" in imports_of(module)
    assert "torch.distributed" in imports_of(PACKAGE / "topology.py")
