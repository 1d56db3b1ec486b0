"""The layer rules of docs/api.md's Layout table, checked against every module's imports.

docs/api.md says: "The pure core has no I/O and no torch; I/O is in the reader and the delivery engine;
torch only at the edges", and its Layout table gives each module (or subpackage) a layer. This test reads
that table (the table is the source of truth: a module without a row fails here, by name) and parses every
module of ``streamshard`` with ``ast``, module-level and function-level imports alike (a lazy import is
still a dependency), then checks:

- every module of the package has a row with a layer, and every row names a module that exists;
- the folders show the layers: every module lives in a layer folder (``plan/`` and ``format/`` pure, ``io/``
  I/O, ``convert/``, ``streams/`` and ``loader/`` torch) or an edge subpackage, and none is less pure than its
  folder;
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

# Units: a module is its path under streamshard/ ("plan/epoch_plan.py", "errors.py"); an edge subpackage
# (the cache, the command line, the integrations, the test helpers) is one unit, "name/".
SUBPACKAGES = ("cache", "cli", "integrations", "testing")
# The layer subpackages: the folder says the layer. A module in it may be purer than its folder, never less
# pure (pure < I/O < torch); a new folder needs a layer here and a line in docs/api.md.
FOLDER_LAYERS = {"plan": "pure", "format": "pure", "io": "I/O", "convert": "torch", "streams": "torch",
                 "loader": "torch"}
ORDER = {"pure": 0, "i/o": 1, "torch": 2}
# Not in the table on purpose: the package's re-exports, ``python -m streamshard``, the folders' docstrings.
ENTRY_POINTS = {"__init__.py": "library", "__main__.py": "cli",
                **{f"{folder}/__init__.py": layer for folder, layer in FOLDER_LAYERS.items()}}
EDGE_UNITS = {"cli/", "testing/", "__main__.py"}  # what may import the library, never imported by it

TORCH = {"torch", "lightning", "pytorch_lightning", "accelerate", "transformers"}
STORAGE_CLIENTS = {"fsspec", "s3fs", "gcsfs", "obstore", "deltalake", "botocore", "boto3", "adlfs"}
OS_IO = {"socket", "subprocess", "fcntl", "tempfile", "shutil", "http", "multiprocessing", "resource",
         "urllib.request", "ssl", "mmap", "signal"}

# (module unit, imported name) -> why the rule is broken today. Keep short; each must still be needed.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("plan/topology.py", "torch"): (
        "pure arithmetic of rank/world/worker, but it must ask torch.distributed and the DataLoader "
        "worker info where the process stands; both imports are inside the functions that ask"),
    ("errors.py", "streamshard.io.storage"): (
        "every error redacts the credentials storage knows of (storage.REDACTION); imported inside "
        "__init__ because storage imports the errors through retry"),
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
    """Unit name -> its files: each module (top level or in a layer folder), each edge subpackage as one."""
    units: dict[str, list[Path]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in SUBPACKAGES:
            units.setdefault(rel.parts[0] + "/", []).append(path)
        else:
            units[rel.as_posix()] = [path]
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
    """streamshard.x.y -> its unit ("x/y.py", "x/__init__.py", "x.py" or an edge "x/"); None otherwise."""
    parts = name.split(".")
    if parts[0] != "streamshard" or len(parts) < 2:
        return None
    if parts[1] in SUBPACKAGES:
        return parts[1] + "/"
    path = PACKAGE.joinpath(*parts[1:])
    if path.is_dir():
        return "/".join(parts[1:]) + "/__init__.py"
    if path.with_suffix(".py").exists():
        return "/".join(parts[1:]) + ".py"
    return None


def _key(target: str) -> str:
    """A unit as the dotted name an exception lists: "io/storage.py" -> "streamshard.io.storage"."""
    return "streamshard." + target.removesuffix(".py").removesuffix("/__init__").rstrip("/").replace("/", ".")


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
        folder = unit.split("/")[0] if "/" in unit and unit.split("/")[0] not in SUBPACKAGES else None
        if folder is not None and folder not in FOLDER_LAYERS:
            problems.append(f"{folder}/: a folder of streamshard without a layer (FOLDER_LAYERS, docs/api.md)")
        elif folder is not None and unit in table:
            if ORDER.get(table[unit].lower(), 3) > ORDER[FOLDER_LAYERS[folder].lower()]:
                problems.append(f"{unit}: layer {table[unit]} in the {FOLDER_LAYERS[folder]} folder {folder}/")
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
        if unit.endswith("/__init__.py") and imports_of(files[0]) - {"__future__"}:
            problems.append(f"{unit}: a layer folder's __init__ holds its docstring only (no imports)")
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
                        broken(unit, rel, imported, _key(target),
                               f"a pure module imports only pure modules ({target} is {shown})")
                elif layer == "i/o":
                    if top in TORCH:
                        broken(unit, rel, imported, top, "an I/O module imports no torch (I/O imports no tensors)")
                    elif target and target_layer == "torch":
                        broken(unit, rel, imported, _key(target),
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
    assert "streamshard.progress" in imports_of(PACKAGE / "io" / "text_counts.py")
    assert "torch.distributed" in imports_of(PACKAGE / "plan" / "topology.py")
    assert "streamshard.io.collective" in imports_of(PACKAGE / "io" / "catalog.py")  # from . import collective


def test_folders_show_the_layers() -> None:
    """Every module of the library lives in a layer folder, but the package's own few (errors, progress)."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "errors.py", "progress.py"], top
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == sorted([*FOLDER_LAYERS, *SUBPACKAGES]), folders
