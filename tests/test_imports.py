"""The package's seams: importing it starts no MPI, and docs/design.md's module map matches the imports."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "mpicons"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))
MPI_MODULES = {"_mpi", "mpiio"}  # the only modules that import mpi4py


def _module_map() -> dict[str, tuple[str, str]]:
    """{module: (layer, "may import" text)} from the table in docs/design.md."""
    rows, layer = {}, ""
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 3 or set(cells[0]) <= set("-"):
            continue
        if cells[0].startswith("*"):
            layer = cells[0].strip("*")
        elif cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (layer, cells[2])
    return rows


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(modules imported at the top level, modules imported inside functions), package-relative plus mpi4py."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    top: set[str] = set()
    inner: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else ["__init__"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpi4py"):
            names = ["mpi4py"]
        elif isinstance(node, ast.Import):
            names = ["mpi4py" for alias in node.names if alias.name.startswith("mpi4py")]
        (top if node in tree.body else inner).update(names)
    return top, inner - top


def test_the_module_map_lists_every_module_once() -> None:
    assert sorted(_module_map()) == MODULES


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_only_what_the_map_allows(module: str) -> None:
    layers: dict[str, set[str]] = {}
    for name, (layer, _) in _module_map().items():
        layers.setdefault(layer, set()).add(name)
    layer, allowed_text = _module_map()[module]
    named = {token for token in re.findall(r"[\w.]+", allowed_text.replace("`", "")) if token in MODULES + ["mpi4py"]}
    if "the job layer and the core" in allowed_text:
        named |= layers["job layer"] | layers["pure core"]
    if allowed_text.startswith("everything"):
        named |= set(MODULES)
    top, inner = _imports(module)
    lazily = set(MODULES) if "the rest lazily" in allowed_text else set()
    assert top <= named, f"{module} imports {sorted(top - named)}, not in docs/design.md's map"
    assert inner <= named | lazily, f"{module} imports {sorted(inner - named - lazily)} lazily, not in the map"
    if "mpi4py" in top | inner:
        assert module in MPI_MODULES, f"{module} imports mpi4py"


def test_importing_the_package_and_every_non_mpi_module_starts_no_mpi() -> None:
    plain = [m for m in MODULES if m not in MPI_MODULES | {"__main__"}]
    code = (
        "import importlib, sys\n"
        f"for name in {plain!r}:\n"
        "    importlib.import_module('mpicons' if name == '__init__' else 'mpicons.' + name)\n"
        "    assert 'mpi4py.MPI' not in sys.modules, name\n"
        "import mpicons\n"
        "mpicons.Options, mpicons.Communicator\n"
        "assert 'mpi4py.MPI' not in sys.modules, 'a lazy export'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
