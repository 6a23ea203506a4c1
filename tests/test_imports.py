"""The package's seams: the layer table holds for every import, the import graph has no cycle, and
importing the package starts no MPI.

``LAYERS`` is the rule: each package of mpicons may import itself and the packages it lists, no
other. docs/design.md shows the same table (checked below). Every import counts: ``import``,
``from`` (relative ones resolved), imports inside functions (lazy), and the module names given to
``import_module``.
"""

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

#: Package → the packages below it that it may import (and itself). Lowest first; "mpicons" is the top level.
_ORDER = ["core", "adaptation", "formats", "comm", "io", "trainers", "job", "frontends"]
_BELOW = {"adaptation": ["core"], "formats": ["core"], "comm": ["core"], "io": ["core", "formats", "comm"]}
LAYERS: dict[str, set[str]] = {
    **{f"mpicons.{name}": {f"mpicons.{lower}" for lower in _BELOW.get(name, _ORDER[:i])} for i, name in enumerate(_ORDER)},
    "mpicons": {f"mpicons.{name}" for name in _ORDER},
}
#: The only modules that import mpi4py, and the only ones that import torch.
MPI_MODULES = {"mpicons.comm.mpi", "mpicons.io.mpiio"}
TORCH_MODULES = {"mpicons.comm.torch_group", "mpicons.frontends.torch_dropin", "mpicons.torch"}
#: The only module that imports a storage client (boto3, botocore).
S3_MODULES = {"mpicons.io.s3"}
#: The only module that imports transformers (only when the process has it loaded already; else a child process does).
TRANSFORMERS_MODULES = {"mpicons.job.model_check"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
MODULES = sorted(FILES)


def _package_of(module: str) -> str:
    """The package a module's code runs in (a package's ``__init__`` runs in the package itself)."""
    return module if FILES[module].name == "__init__.py" else module.rpartition(".")[0]


def _layer(module: str) -> str:
    """The layer (a key of LAYERS) a module of mpicons belongs to."""
    head = ".".join(module.split(".")[:2])
    return head if head in LAYERS else "mpicons"


def _resolve(name: str, package: str) -> str:
    """``name`` (``.x``, ``..y.z`` or absolute) as an absolute module name, relative to ``package``."""
    if not name.startswith("."):
        return name
    level = len(name) - len(name.lstrip("."))
    base = package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name.lstrip(".")] if name.lstrip(".") else []))


def _dynamic_imports(module: str) -> set[str]:
    """What a module imports by a computed name: the tables it computes them from."""
    if module == "mpicons":
        import mpicons

        targets = {f"mpicons.{m}" for m in set(mpicons._EXPORTS.values()) | set(mpicons._SUBMODULES)}
        return targets
    if module == "mpicons.comm":
        import mpicons.comm

        names = {adapter.module for adapter in mpicons.comm.ADAPTERS.values()} | {mpicons.comm.DEFAULT_ADAPTER}
        return {_resolve(name, "mpicons.comm") for name in names}
    raise AssertionError(f"{module} imports a module by a computed name: name it in a table this test reads")


def _imports(module: str) -> set[str]:
    """Every module (of any package) that ``module`` imports, at the top or inside functions."""
    tree = ast.parse(FILES[module].read_text())
    package = _package_of(module)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _resolve("." * node.level + (node.module or ""), package) if node.level else (node.module or "")
            for alias in node.names:  # ``from . import x``: x is a module or a name of the package
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in FILES else base)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "import_module":
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                where = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "package"), None)
                anchor = package if isinstance(where, ast.Name) and where.id == "__package__" else module
                found.add(_resolve(first.value, anchor))
            else:
                found |= _dynamic_imports(module)
    return found


def _internal(names: set[str]) -> set[str]:
    """The modules of mpicons among ``names`` (a name of a package's ``__init__`` is that package)."""
    result = set()
    for name in names:
        while name and name not in FILES:
            name = name.rpartition(".")[0]
        if name:
            result.add(name)
    return result


def _prints_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter (nothing imported yet); it must print ``ok``."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


#: The one layer whose modules sit in sub-packages of their own: a trainer's leaf (``trainers/megatron/``).
LEAVES = "mpicons.trainers"


def test_every_module_is_in_a_layer_one_level_deep() -> None:
    """Layers are one level deep; only the trainers' layer holds leaves one level further (one per trainer)."""
    for module in MODULES:
        depth = 3 if module.startswith(LEAVES + ".") else 2
        assert module.count(".") <= depth, f"{module}: sub-packages are one level deep (a trainer's leaf: two)"
        assert _layer(module) == "mpicons" or module.startswith(_layer(module)), module
    packages = {m for m in MODULES if FILES[m].name == "__init__.py"}
    leaves = {p for p in packages if p.startswith(LEAVES + ".")}
    assert packages - leaves == set(LAYERS), "every package is a layer of LAYERS (or a trainer's leaf), every layer a package"
    for package in packages - {"mpicons"}:
        assert ast.get_docstring(ast.parse(FILES[package].read_text())), f"{package}/__init__.py says what lives there"


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_only_its_layer_and_lower_ones(module: str) -> None:
    layer = _layer(module)
    allowed = LAYERS[layer] | {layer}
    imported = _imports(module)
    for target in sorted(_internal(imported) - {module}):
        assert target != "mpicons" or layer == "mpicons", f"{module} imports the top level mpicons (an upward arrow)"
        assert _layer(target) in allowed, f"{module} imports {target}: {layer} may import only {sorted(allowed)}"
    libraries = {name.split(".")[0] for name in imported}
    if "mpi4py" in libraries:
        assert module in MPI_MODULES, f"{module} imports mpi4py (only {sorted(MPI_MODULES)} may)"
    if "torch" in libraries:
        assert module in TORCH_MODULES, f"{module} imports torch (only {sorted(TORCH_MODULES)} may)"
    if libraries & {"boto3", "botocore"}:
        assert module in S3_MODULES, f"{module} imports a storage client (only {sorted(S3_MODULES)} may)"
    if "transformers" in libraries:
        assert module in TRANSFORMERS_MODULES, f"{module} imports transformers (only {sorted(TRANSFORMERS_MODULES)} may)"


def test_the_import_graph_has_no_cycle() -> None:
    """Lazy imports count: a cycle through a function-level import is still a knot in the design."""
    graph = {module: _internal(_imports(module)) - {module} for module in MODULES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, path + [module])
        done.add(module)

    for module in MODULES:
        visit(module, [])


def _design_layers() -> dict[str, set[str]]:
    """The layer table of docs/design.md: ``| `package` | what lives there | `lower`, ... |`` rows."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = set(re.findall(r"`([\w.]+)`", cells[2]))
    return rows


def test_the_design_doc_shows_the_same_layer_table() -> None:
    assert _design_layers() == LAYERS


def test_the_design_doc_tree_lists_every_module() -> None:
    """docs/design.md's tree names every module of the package, each under its own package."""
    text = (ROOT / "docs" / "design.md").read_text()
    tree = text.split("```text", 1)[1].split("```", 1)[0]
    listed: set[str] = set()
    packages: list[tuple[int, str]] = []  # the open folders: indentation, package
    for line in tree.splitlines():
        match = re.match(r"^(\s*)([\w]+)(/|\.py)", line)
        if not match:
            continue
        indent = len(match.group(1))
        while packages and packages[-1][0] >= indent:
            packages.pop()
        if match.group(3) == "/":
            package = match.group(2) if not packages else f"{packages[-1][1]}.{match.group(2)}"
            packages.append((indent, package))
            listed.add(package)
        else:
            name = match.group(2)
            package = packages[-1][1] if packages else "mpicons"
            listed.add(package if name == "__init__" else f"{package}.{name}")
    assert listed == set(MODULES)


def test_importing_the_package_and_every_non_mpi_module_starts_no_mpi() -> None:
    optional = TORCH_MODULES if importlib.util.find_spec("torch") is None else set()
    plain = [m for m in MODULES if m not in MPI_MODULES | {"mpicons.__main__"} | optional]
    code = (
        "import importlib, sys\n"
        f"for name in {plain!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'mpi4py.MPI' not in sys.modules, name\n"
        "import mpicons\n"
        "mpicons.Options, mpicons.Communicator\n"
        "assert 'mpi4py.MPI' not in sys.modules, 'a lazy export'\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def test_the_pure_core_loads_no_mpi_and_no_torch() -> None:
    core = [m for m in MODULES if _layer(m) == "mpicons.core"]
    code = (
        "import importlib, sys\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        "assert not {'mpi4py', 'mpi4py.MPI', 'torch'} & set(sys.modules), sorted(sys.modules)\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def test_the_communicator_layer_and_the_start_up_modules_import_light() -> None:
    """``python -m mpicons`` checks the room numpy needs after the signal handlers and the machine
    facts load: neither they nor ``mpicons.comm`` may import numpy first."""
    code = (
        "import sys\n"
        "import mpicons.comm, mpicons.comm.interrupts, mpicons.core.machine\n"
        "assert not {'numpy', 'mpi4py', 'torch'} & set(sys.modules), sorted(sys.modules)\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def test_the_job_does_not_import_ml_dtypes_until_a_conversion_needs_it() -> None:
    """ml_dtypes 0.7 takes about 0.7 s to import: a job without --dtype must not pay it on every rank."""
    code = (
        "import sys\n"
        "import mpicons.job.consolidation, mpicons.frontends.verification, mpicons.frontends.inspection\n"
        "assert 'ml_dtypes' not in sys.modules\n"
        "from mpicons.core.convert import numpy_dtype\n"
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
        "assert not {'boto3', 'botocore'} & set(sys.modules), 'a storage client loaded for local files'\n"
        "print('ok')\n"
    )
    _prints_ok(code)
    expected, mapping = fixture_expected("tp2d-4ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))


def test_no_module_is_named_like_an_exported_name() -> None:
    """``import mpicons.x`` binds ``mpicons.x`` to the module: a function of that name would be shadowed."""
    import mpicons

    top = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    assert not top & set(mpicons.__all__)
    assert set(mpicons._SUBMODULES) <= top - set(mpicons.__all__)
    for package in LAYERS:  # nor inside a package: a package's name and one of its modules' names
        exported = set(getattr(importlib.import_module(package), "__all__", ()))
        modules = {m.rpartition(".")[2] for m in MODULES if m.rpartition(".")[0] == package}
        assert not exported & modules, f"{package} exports a name that is also one of its modules"


def test_the_communicator_adapters_are_found_by_table() -> None:
    """``as_communicator`` names no library: each adapter of ``ADAPTERS`` is a module of mpicons.comm with ``adapt``."""
    import mpicons.comm

    tree = ast.parse(FILES["mpicons.comm"].read_text())
    for name in ("as_communicator", "_recognised"):
        function = next(n for n in tree.body if getattr(n, "name", "") == name)
        named = {n.value for n in ast.walk(function) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not {v for v in named if re.fullmatch(r"(mpi4py|torch)(\.\w+)*", v)}, f"{name} names a library"
        assert not [n for n in ast.walk(function) if isinstance(n, (ast.Import, ast.ImportFrom))], f"{name} imports"
    for adapter in mpicons.comm.ADAPTERS.values():
        assert _resolve(adapter.module, "mpicons.comm") in FILES
        assert "def adapt(" in FILES[_resolve(adapter.module, "mpicons.comm")].read_text()


def test_verify_and_inspect_stay_functions_whatever_was_imported(tmp_path: Path) -> None:
    from helpers import FIXTURES

    shards = str(FIXTURES / "tp2d-4ranks" / "sharded")
    code = (
        "import mpicons.frontends.verification, mpicons.frontends.inspection\n"
        "from mpicons.frontends.verification import verify\n"
        "from mpicons.frontends.inspection import inspect\n"
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


def test_the_documented_import_paths_work() -> None:
    """README.md's and docs/'s paths: the layers moved the code, not the names users import."""
    code = (
        "import mpicons\n"
        "from mpicons.comm import SingleProcess, Communicator, as_communicator\n"
        "from mpicons.sample import SampleConfig, write_sample, check_sample\n"
        "assert callable(SampleConfig.sized) and mpicons.Communicator is Communicator\n"
        + (
            "from mpicons.torch import TorchComm, consolidate_safetensors_files_on_every_rank\n"
            "assert mpicons.torch.TorchComm is TorchComm\n"
            if importlib.util.find_spec("torch") is not None
            else ""
        )
        + "print('ok')\n"
    )
    _prints_ok(code)


def test_rooms_stay_small_enough_to_hold_in_ones_head() -> None:
    """No module over 600 lines, no function over 60: a module is one concern, a function one step."""
    too_long = [f"{module}: {len(FILES[module].read_text().splitlines())} lines" for module in MODULES
                if len(FILES[module].read_text().splitlines()) > 600]  # fmt: skip
    for module in MODULES:
        for node in ast.walk(ast.parse(FILES[module].read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                too_long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []
