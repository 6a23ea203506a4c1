"""The package's seams: importing it starts no MPI, and docs/design.md's module map matches the imports."""

from __future__ import annotations

import ast
import importlib.util
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


def _prints_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter (nothing imported yet); it must print ``ok``."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


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
    if module != "torch":
        tree = ast.parse((PACKAGE / f"{module}.py").read_text())
        absolute = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        absolute |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        assert not {m for m in absolute if m.split(".")[0] == "torch"}, f"{module} imports torch (only mpicons.torch may)"


def test_importing_the_package_and_every_non_mpi_module_starts_no_mpi() -> None:
    optional = {"torch"} if importlib.util.find_spec("torch") is None else set()  # mpicons.torch needs torch
    plain = [m for m in MODULES if m not in MPI_MODULES | {"__main__"} | optional]
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
    _prints_ok(code)


def test_the_job_does_not_import_ml_dtypes_until_a_conversion_needs_it() -> None:
    """ml_dtypes 0.7 takes about 0.7 s to import: a job without --dtype must not pay it on every rank."""
    code = (
        "import sys\n"
        "import mpicons.consolidation, mpicons.verification, mpicons.inspection\n"
        "assert 'ml_dtypes' not in sys.modules\n"
        "from mpicons.convert import numpy_dtype\n"
        "assert numpy_dtype('BF16').name == 'bfloat16' and 'ml_dtypes' in sys.modules\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def test_one_process_consolidates_without_mpi(tmp_path: Path) -> None:
    """``comm=SingleProcess()``: the whole job in this process, MPI never started."""
    from helpers import FIXTURES, assert_consolidated, fixture_expected, index_weight_map

    out = tmp_path / "out"
    code = (
        "import sys, mpicons\n"
        "from mpicons.comm import SingleProcess\n"
        f"result = mpicons.consolidate({str(FIXTURES / 'tp2d-4ranks' / 'sharded')!r}, {str(out)!r}, comm=SingleProcess())\n"
        "assert result.stats.ranks == 1 and 'mpi4py.MPI' not in sys.modules\n"
        "print('ok')\n"
    )
    _prints_ok(code)
    expected, mapping = fixture_expected("tp2d-4ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))


def test_no_module_is_named_like_an_exported_name() -> None:
    """``import mpicons.x`` binds ``mpicons.x`` to the module: a function of that name would be shadowed."""
    import mpicons

    assert not set(MODULES) & set(mpicons.__all__)
    assert set(mpicons._SUBMODULES) <= set(MODULES) - set(mpicons.__all__)


def test_verify_and_inspect_stay_functions_whatever_was_imported(tmp_path: Path) -> None:
    from helpers import FIXTURES

    shards = str(FIXTURES / "tp2d-4ranks" / "sharded")
    code = (
        "import mpicons.verification, mpicons.inspection\n"
        "from mpicons.verification import verify\n"
        "from mpicons.inspection import inspect\n"
        "import mpicons\n"
        "from mpicons.comm import SingleProcess\n"
        f"mpicons.consolidate({shards!r}, {str(tmp_path / 'out')!r}, comm=SingleProcess())\n"
        f"assert mpicons.inspect({shards!r}, comm=SingleProcess()).ok\n"
        f"assert mpicons.verify({str(tmp_path / 'out')!r}, against={shards!r}, comm=SingleProcess()).ok\n"
        "assert mpicons.verify is verify and mpicons.inspect is inspect\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def test_public_submodules_need_no_import_of_their_own() -> None:
    """``import mpicons`` then ``mpicons.comm.SingleProcess()``: the submodule loads on first use, MPI stays off."""
    code = (
        "import sys, mpicons\n"
        "assert 'mpicons.comm' not in sys.modules and 'comm' in dir(mpicons)\n"
        "mpicons.comm.Communicator, mpicons.comm.SingleProcess(), mpicons.sample.SampleConfig\n"
        "assert 'mpi4py.MPI' not in sys.modules, 'a lazy submodule'\n"
        "print('ok')\n"
    )
    _prints_ok(code)
