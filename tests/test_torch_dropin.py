# ruff: noqa: F811 - the fixtures ``group`` and ``shared_tmp`` come from test_torch
"""torch's two consolidation functions replaced by mpicons' through ``mpicons.torch.install()``, in a
torchrun job (gloo, CPU): the behaviours PyTorch's own consolidation tests check (one file, two files,
a mapping, rank 0 alone while the others wait, every rank writing one file, dtypes, the output
directory's existence, torch's HF storage writer with consolidation on), checked against the reference
serializer's bytes.

    torchrun --standalone --nproc-per-node 2 -m pytest --only-torch tests/test_torch_dropin.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import pytest
from helpers import assert_consolidated, index_weight_map, load_tensors, subprocess_env

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import torch.distributed.checkpoint as dcp  # noqa: E402
from test_torch import _without_torchrun, agreed, group, on_rank_0, shared_tmp  # noqa: E402,F401 - fixtures
from torch.distributed.checkpoint import HuggingFaceStorageWriter  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

import mpicons.torch as mpicons_torch  # noqa: E402

hf = pytest.importorskip("torch.distributed.checkpoint._consolidate_hf_safetensors")
hf_storage = pytest.importorskip("torch.distributed.checkpoint.hf_storage")

pytestmark = pytest.mark.torch_dist

#: safetensors' dtype names of torch's dtypes.
DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}  # fmt: skip


@pytest.fixture
def installed(group: object) -> Iterator[None]:
    """mpicons' functions in torch's place for one test, torch's back afterwards."""
    mpicons_torch.install()
    yield
    mpicons_torch.uninstall()


def as_expected(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    """Full tensors as (safetensors dtype, shape, raw bytes)."""
    return {
        name: (DTYPES[t.dtype], list(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        for name, t in tensors.items()
    }


def full_tensors() -> dict[str, torch.Tensor]:
    """torch's tests' pair (a 4×4 arange saved row-wise and column-wise), made uneven for any group size."""
    size = dist.get_world_size()
    return {
        "dtensor": torch.arange((4 * size + 1) * 6, dtype=torch.float32).view(4 * size + 1, 6),
        "dtensor_col": torch.arange(5 * (4 * size + 1) + 3, dtype=torch.float32)[3:].view(5, 4 * size + 1),
    }


def save_sharded(directory: Path, tensors: dict[str, torch.Tensor], placements: dict[str, int] | None = None,
                 **writer: object) -> None:  # fmt: skip
    """DCP's Hugging Face writer saves ``tensors`` sharded over the group (dimension per name: ``placements``,
    default row-wise for ``dtensor`` and column-wise for ``dtensor_col``)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dims = placements or {"dtensor_col": 1}
    state = {name: _sharded(t, mesh, dims.get(name, 0)) for name, t in tensors.items()}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(path=str(directory), save_distributed=True, **writer))
    dist.barrier()


def _sharded(tensor: torch.Tensor, mesh: object, dim: int) -> object:
    """This rank's piece of ``tensor`` split along ``dim`` as DTensor's ``Shard`` splits it (``torch.chunk``, empty
    pieces last), made without communication (gloo cannot scatter every dtype)."""
    size, rank = dist.get_world_size(), dist.get_rank()
    pieces = list(tensor.chunk(size, dim))
    local = pieces[rank] if rank < len(pieces) else tensor.narrow(dim, tensor.shape[dim], 0)
    return DTensor.from_local(local.clone(), mesh, [Shard(dim)], shape=tensor.shape, stride=tensor.stride())


def output_inside(checkpoint: Path) -> Path:
    """torch's tests' output directory: ``consolidated`` inside the shards' directory, made beforehand."""
    output = checkpoint / "consolidated"
    if dist.get_rank() == 0:
        output.mkdir(parents=True)
    dist.barrier()
    return output


@pytest.mark.parametrize("mapping", [{"dtensor": 1, "dtensor_col": 1}, {"dtensor": 1, "dtensor_col": 2}])
def test_rank_0_alone_consolidates_while_the_others_wait(installed: None, shared_tmp: Path, mapping: dict[str, int]) -> None:
    """torch's one-file and two-file tests: ``consolidate_safetensors_files`` (found in torch's module) on
    rank 0 only, the others in a barrier; the output inside the shards' directory."""
    tensors = full_tensors()
    save_sharded(shared_tmp, tensors)
    output = output_inside(shared_tmp)
    if dist.get_rank() == 0:
        assert hf.consolidate_safetensors_files(str(shared_tmp), str(output), fqn_to_index_mapping=mapping) is None
    dist.barrier()
    agreed(on_rank_0(lambda: assert_consolidated(output, as_expected(tensors), index_weight_map(mapping))))


@pytest.mark.parametrize("files", [1, 2, 5])
def test_every_rank_reads_the_files_as_soon_as_the_call_returns(installed: None, shared_tmp: Path, files: int) -> None:
    """torch's on-every-rank tests (two files; one file, so that some rank has nothing to write): no
    barrier after the call, every rank loads the published files and the index at once."""
    tensors = {f"t{i}": torch.arange(16 * dist.get_world_size() + i, dtype=torch.float32)[i:].view(-1, 4) for i in range(5)}
    save_sharded(shared_tmp, tensors)
    output = output_inside(shared_tmp)
    mapping = {f"t{i}": 1 + i % files for i in range(5)}
    hf.consolidate_safetensors_files_on_every_rank(str(shared_tmp), str(output), fqn_to_index_mapping=mapping)
    agreed(lambda: assert_consolidated(output, as_expected(tensors), index_weight_map(mapping)))


def test_torchs_storage_writer_consolidates_through_mpicons(installed: None, shared_tmp: Path) -> None:
    """``HuggingFaceStorageWriter(enable_consolidation=True)``: shards in PATH/sharded, the files in PATH,
    written by mpicons' one-process function in ``finish`` on the coordinator while the others wait; every
    dtype (torch's own function cannot size integer or bool tensors, and its files are not the reference
    serializer's bytes: what is checked here is mpicons' work)."""
    tensors = {
        f"w.{DTYPES[dtype].lower()}": (torch.arange(8 * dist.get_world_size() * 3) % 7).to(dtype).view(-1, 3) for dtype in DTYPES
    }
    mapping = {name: 1 + i % 3 for i, name in enumerate(sorted(tensors))}
    step = shared_tmp / "step-10"
    save_sharded(step, tensors, placements={}, fqn_to_index_mapping=mapping, enable_consolidation=True)
    # The shards stay in step-10/sharded: not published, not in SHA256SUMS.
    agreed(on_rank_0(lambda: assert_consolidated(step, as_expected(tensors), index_weight_map(mapping), unpublished=["sharded"])))


def test_both_functions_write_the_same_bytes(installed: None, shared_tmp: Path) -> None:
    """One process with four I/O threads and the whole group: the same files, byte for byte."""
    tensors = full_tensors()
    save_sharded(shared_tmp / "shards", tensors)
    mapping = {"dtensor": 2, "dtensor_col": 1}
    alone, together = shared_tmp / "alone", shared_tmp / "together"
    if dist.get_rank() == 0:
        alone.mkdir()
        together.mkdir()
        mpicons_torch.consolidate_safetensors_files(str(shared_tmp / "shards"), str(alone), mapping, num_threads=4)
    dist.barrier()
    mpicons_torch.consolidate_safetensors_files_on_every_rank(str(shared_tmp / "shards"), str(together), mapping, 2)

    def same() -> None:
        assert sorted(p.name for p in alone.iterdir()) == sorted(p.name for p in together.iterdir())
        for path in alone.iterdir():
            assert path.read_bytes() == (together / path.name).read_bytes(), path.name

    agreed(on_rank_0(same))


def test_a_missing_output_directory_is_torchs_error_on_every_rank(installed: None, shared_tmp: Path) -> None:
    """torch writes into an existing directory (``FileNotFoundError`` otherwise): so do the drop-ins,
    before any work, on every member; nothing is created."""
    save_sharded(shared_tmp / "shards", full_tensors())
    missing = shared_tmp / "missing"
    mapping = {"dtensor": 1, "dtensor_col": 1}

    def raises() -> None:
        with pytest.raises(FileNotFoundError, match="output directory does not exist") as caught:
            hf.consolidate_safetensors_files_on_every_rank(str(shared_tmp / "shards"), str(missing), mapping)
        assert isinstance(caught.value, mpicons_torch.MissingOutputDirectory) and caught.value.filename == str(missing)
        if dist.get_rank() == 0:
            with pytest.raises(FileNotFoundError, match="output directory does not exist"):
                hf.consolidate_safetensors_files(str(shared_tmp / "shards"), str(missing), mapping)
        assert not missing.exists()

    agreed(raises)


def test_torchs_keywords_are_accepted_and_others_refused(installed: None, shared_tmp: Path) -> None:
    """Every keyword of torch 2.8-2.13's functions by name; an unknown one is a ``TypeError``, as torch's."""
    save_sharded(shared_tmp / "shards", full_tensors())
    out = output_inside(shared_tmp / "shards")
    mapping = {"dtensor": 1, "dtensor_col": 1}
    hf.consolidate_safetensors_files_on_every_rank(
        input_dir=str(shared_tmp / "shards"), output_dir=str(out), fqn_to_index_mapping=mapping, num_threads=3,
        process_group=dist.group.WORLD,
    )  # fmt: skip

    def refused() -> None:
        for function in (hf.consolidate_safetensors_files, hf.consolidate_safetensors_files_on_every_rank):
            with pytest.raises(TypeError, match="thread_count"):
                function(str(shared_tmp / "shards"), str(out), mapping, thread_count=2)
        if dist.get_rank() == 0:
            again = out.parent / "again"
            again.mkdir()
            hf.consolidate_safetensors_files(
                input_dir=str(shared_tmp / "shards"), output_dir=str(again), fqn_to_index_mapping=None, num_threads=2
            )
            assert sorted(p.name for p in again.iterdir()) == [
                "SHA256SUMS",
                "model-00001-of-00001.safetensors",
                "model.safetensors.index.json",
            ]

    agreed(refused)


def test_install_and_uninstall_replace_torchs_functions_wherever_imported(group: object) -> None:
    """torch's module, torch's HF writer and a trainer's module that imported them by name before the switch;
    nested installs; a second uninstall changes nothing."""
    originals = {
        name: vars(hf)[name] for name in ("consolidate_safetensors_files", "consolidate_safetensors_files_on_every_rank")
    }
    trainer = types.ModuleType("a_trainer_checkpointer")
    trainer.consolidate_safetensors_files_on_every_rank = originals["consolidate_safetensors_files_on_every_rank"]
    sys.modules[trainer.__name__] = trainer
    try:

        def switched() -> None:
            ours = mpicons_torch.consolidate_safetensors_files_on_every_rank
            assert not mpicons_torch.installed()
            mpicons_torch.install()
            mpicons_torch.install()
            assert hf.consolidate_safetensors_files is mpicons_torch.consolidate_safetensors_files
            assert hf.consolidate_safetensors_files_on_every_rank is ours
            assert hf_storage.consolidate_safetensors_files is mpicons_torch.consolidate_safetensors_files
            assert trainer.consolidate_safetensors_files_on_every_rank is ours
            mpicons_torch.uninstall()
            assert mpicons_torch.installed(), "nested: still installed after the first uninstall"
            mpicons_torch.uninstall()
            mpicons_torch.uninstall()
            assert not mpicons_torch.installed()
            for name, original in originals.items():
                assert vars(hf)[name] is original
            assert hf_storage.consolidate_safetensors_files is originals["consolidate_safetensors_files"]
            assert trainer.consolidate_safetensors_files_on_every_rank is originals["consolidate_safetensors_files_on_every_rank"]

        agreed(switched)
    finally:
        del sys.modules[trainer.__name__]


_ALONE = """
import json, os, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
import mpicons.torch
dist.init_process_group("gloo")
mpicons.torch.install()
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
base = sys.argv[1]
tensors = {"a": torch.arange(24.0).view(6, 4), "b": torch.arange(10)}
dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(base, save_distributed=True))
dist.barrier()
if dist.get_rank() == 0:
    os.makedirs(os.path.join(base, "out"))
    consolidate_safetensors_files(base, os.path.join(base, "out"), {"a": 1, "b": 2})
    print("rank 0 returned", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_rank_0_alone_returns_while_the_others_wait_in_a_barrier(group: object, shared_tmp: Path) -> None:
    """A torchrun job of its own (2 processes, a subprocess timeout): rank 0 calls the one-process function
    while rank 1 waits in a barrier; it returns with the right files and the job ends."""

    def alone() -> None:
        script = shared_tmp / "alone.py"
        script.write_text(_ALONE)
        (shared_tmp / "ckpt").mkdir()
        proc = subprocess.run(
            [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script),
             str(shared_tmp / "ckpt")],
            capture_output=True, text=True, timeout=180, env=_without_torchrun(subprocess_env(OMP_NUM_THREADS="1")),
        )  # fmt: skip
        assert proc.returncode == 0 and "rank 0 returned" in proc.stdout, proc.stdout + proc.stderr
        out = shared_tmp / "ckpt" / "out"
        got = {**load_tensors(out / "model-00001-of-00002.safetensors"), **load_tensors(out / "model-00002-of-00002.safetensors")}
        assert got == as_expected({"a": torch.arange(24.0).view(6, 4), "b": torch.arange(10)})
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}

    agreed(on_rank_0(alone))


def _torch_test_files() -> list[Path]:
    """PyTorch's own consolidation tests, where they can be found without the network: a PyTorch checkout
    named by ``MPICONS_PYTORCH_TESTS`` (its ``test/distributed/checkpoint``), else beside the installed torch."""
    names = ("test_consolidate_hf_safetensors.py", "test_hf_safetensor_e2e.py")
    given = os.environ.get("MPICONS_PYTORCH_TESTS")
    roots = [Path(given)] if given else []
    roots.append(Path(torch.__file__).parent.parent / "test" / "distributed" / "checkpoint")
    return [root / name for root in roots for name in names if (root / name).is_file()]


_SITECUSTOMIZE = """
import os
if os.environ.get("MPICONS_INSTALL") == "1":
    import mpicons.torch
    mpicons.torch.install()
from torch.testing._internal.distributed._tensor import common_dtensor
_skip = common_dtensor.skip_if_lt_x_gpu
common_dtensor.skip_if_lt_x_gpu = lambda x, *a, **k: _skip(x, *a, **{**k, "allow_cpu": True})
"""


def _passed(path: Path, site: Path, install: bool, report: Path) -> set[str]:
    """The tests of torch's file ``path`` that pass on CPU/gloo, with mpicons installed or torch's own functions."""
    env = _without_torchrun(subprocess_env(OMP_NUM_THREADS="1", MPICONS_INSTALL="1" if install else "0"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env["PYTHONPATH"], os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), f"--junitxml={report}"],
        capture_output=True, text=True, timeout=900, env=env, cwd=site,
    )  # fmt: skip
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = ElementTree.parse(report).getroot().iter("testcase")
    failed = ("failure", "error", "skipped")
    return {f"{c.get('classname')}.{c.get('name')}" for c in cases if not any(x.tag in failed for x in c)}


@pytest.mark.slow
def test_pytorchs_own_tests_pass_with_mpicons_installed(group: object, shared_tmp: Path) -> None:
    """PyTorch's test files, when present (the wheel ships none: then skipped), on CPU/gloo (``allow_cpu``):
    every test that passes with torch's functions passes with both replaced by mpicons' (a
    ``sitecustomize`` installs them in every process the tests start). Up to three runs with mpicons':
    ``test_consolidate_one_file_with_two_ranks`` has every rank remove the directory as soon as its own
    check is done, without a barrier, so a rank still reading can fail, under torch's functions too."""
    files = _torch_test_files()
    if not files:
        pytest.skip("PyTorch's consolidation tests are not here: MPICONS_PYTORCH_TESTS names their directory")
    if importlib.util.find_spec("expecttest") is None:
        pytest.skip("PyTorch's test utilities need expecttest, which is not installed")

    def passes() -> None:
        site = shared_tmp / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        for path in files:
            theirs = _passed(path, site, False, shared_tmp / f"{path.stem}-torch.xml")
            ours: set[str] = set()
            for run in range(3):  # see the docstring: one of torch's tests races with itself
                ours |= _passed(path, site, True, shared_tmp / f"{path.stem}-mpicons-{run}.xml")
                if theirs <= ours:
                    break
            assert ours, f"{path.name}: no test passed with mpicons installed"
            assert theirs <= ours, f"{path.name}: pass with torch's functions only: {sorted(theirs - ours)}"

    agreed(on_rank_0(passes))


def test_the_environment_is_torchrun() -> None:
    """Guard: these tests mean something only inside a torchrun job."""
    assert "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    assert importlib.util.find_spec("safetensors") is not None
