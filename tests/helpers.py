"""Test helpers that stand apart from mpicons: the reference serializer and reader are safetensors' own."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path

import numpy as np
import pytest
from safetensors import TensorSpec, deserialize, serialize

from mpicons.sample import SampleConfig, full_tensor, tensor_specs

FIXTURES = Path(__file__).parent / "fixtures" / "dcp"
DISTCP_FIXTURES = Path(__file__).parent / "fixtures" / "distcp"
DISTCP_NAMES = sorted(p.name for p in DISTCP_FIXTURES.iterdir() if (p / "expected").is_dir())
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
_VENV_MPIEXEC = Path(sys.executable).parent / "mpiexec"
MPIEXEC = str(_VENV_MPIEXEC) if _VENV_MPIEXEC.exists() else shutil.which("mpiexec")

# safetensors header dtype → the name safetensors.serialize takes (torch-style).
SPEC_DTYPE = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}

Tensors = dict[str, tuple[str, list[int], bytes]]


def load_tensors(path: str | os.PathLike[str]) -> Tensors:
    """name → (dtype, shape, raw bytes), read by safetensors itself."""
    with open(path, "rb") as handle:
        return {name: (d["dtype"], list(d["shape"]), bytes(d["data"])) for name, d in deserialize(handle.read())}


def reference_bytes(tensors: Tensors, metadata: dict[str, str] | None = None) -> bytes:
    """What safetensors' own serializer writes for these tensors with ``{"format": "pt"}``."""
    keep, specs = [], {}
    for name, (dtype, shape, data) in tensors.items():
        buffer = np.frombuffer(data or b"\0", dtype=np.uint8)
        keep.append(buffer)
        spec_dtype = SPEC_DTYPE.get(dtype, dtype)
        spec_shape = list(shape)
        if dtype == "F4":
            spec_dtype = "float4_e2m1fn_x2"
            spec_shape[-1] //= 2
        specs[name] = TensorSpec(dtype=spec_dtype, shape=spec_shape, data_ptr=buffer.ctypes.data, data_len=len(data))
    return serialize(specs, metadata=metadata if metadata is not None else {"format": "pt"})


def fixture_expected(name: str) -> tuple[Tensors, dict[str, int]]:
    folder = FIXTURES / name / "expected"
    mapping = json.loads((folder / "mapping.json").read_text())
    return load_tensors(folder / "full.safetensors"), mapping


def sample_expected(config: SampleConfig) -> Tensors:
    """The full tensors of a ``write_sample`` checkpoint, from the sample's own generator."""
    return {
        name: (dtype, list(shape), np.ascontiguousarray(full_tensor(config, name, dtype, shape)).tobytes())
        for name, dtype, shape, _, _ in tensor_specs(config)
    }


def assert_consolidated(
    output_dir: str | os.PathLike[str], expected: Tensors, weight_map: dict[str, str], unpublished: Collection[str] = ()
) -> None:
    """Every output file equals the reference serializer's bytes; tensors and index as expected; ``SHA256SUMS``
    lists every published file (see assert_manifest, and there for ``unpublished``)."""
    output_dir = Path(output_dir)
    if set(weight_map.values()) == {"model.safetensors"}:  # Hugging Face writes no index for a lone file
        assert not (output_dir / "model.safetensors.index.json").exists()
    else:
        index = json.loads((output_dir / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == weight_map
        assert index["metadata"]["total_size"] == sum(len(data) for _, _, data in expected.values())
    by_file: dict[str, list[str]] = {}
    for tensor, file_name in weight_map.items():
        by_file.setdefault(file_name, []).append(tensor)
    produced = sorted(p.name for p in output_dir.iterdir() if p.name.endswith(".safetensors"))
    assert produced == sorted(by_file)
    for file_name, names in by_file.items():
        data = (output_dir / file_name).read_bytes()
        got = load_tensors(output_dir / file_name)
        assert set(got) == set(names)
        for tensor in names:
            assert got[tensor] == expected[tensor], f"{file_name}: {tensor} differs"
        assert data == reference_bytes({n: expected[n] for n in names}), (
            f"{file_name}: bytes differ from the reference serializer"
        )
    leftovers = [p.name for p in output_dir.iterdir() if p.name.startswith(".")]
    assert leftovers == []
    assert_manifest(output_dir, unpublished)


def assert_manifest(output_dir: str | os.PathLike[str], unpublished: Collection[str] = ()) -> None:
    """``SHA256SUMS`` lists every published file (hidden entries aside) with its SHA-256, as ``sha256sum -c`` reads it.
    ``unpublished``: top-level entries of ``output_dir`` the run did not write (torchtitan's layout keeps the
    input's ``sharded/`` in the output directory), left out of the comparison."""
    output_dir = Path(output_dir)
    lines = (output_dir / "SHA256SUMS").read_text().splitlines()
    listed = dict(reversed(line.split("  ", 1)) for line in lines)
    files = sorted(
        str(p.relative_to(output_dir))
        for p in output_dir.rglob("*")
        if p.is_file()
        and p.name != "SHA256SUMS"
        and not str(p.relative_to(output_dir)).startswith(".")
        and p.relative_to(output_dir).parts[0] not in unpublished
    )
    assert sorted(listed) == files
    for name, digest in listed.items():
        assert hashlib.sha256((output_dir / name).read_bytes()).hexdigest() == digest, f"{name}: its SHA-256 differs"


def index_weight_map(mapping: dict[str, int]) -> dict[str, str]:
    count = max(mapping.values())
    return {name: f"model-{index:05d}-of-{count:05d}.safetensors" for name, index in mapping.items()}


ROOT = Path(__file__).parent.parent


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess: this checkout importable, plus ``extra``."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def mpirun(ranks: int, args: list[str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``mpiexec -n ranks python ARGS`` with this checkout importable; returns the process and its seconds."""
    start = time.monotonic()
    proc = subprocess.run(
        [MPIEXEC, "-n", str(ranks), sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=subprocess_env()
    )
    return proc, time.monotonic() - start


def cli(ranks: int, *args: object, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run the ``mpicons`` command line at ``ranks`` ranks."""
    return mpirun(ranks, ["-m", "mpicons", *map(str, args)], timeout=timeout)


def start(ranks: int, *args: object, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``mpiexec -n ranks python ARGS`` in its own session, to be signalled or waited for."""
    return subprocess.Popen(
        [MPIEXEC, "-n", str(ranks), sys.executable, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or subprocess_env(),
        start_new_session=True,
    )


def run_python(*args: object, timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` without a launcher (a singleton MPI job)."""
    return subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=subprocess_env()
    )


def writing_started(out: Path) -> bool:
    """A run into ``out`` has created an output file in its private staging directory."""
    return any(any(d.iterdir()) for d in out.glob(".mpicons-staging-*")) if out.is_dir() else False


# ---------------------------------------------------------------- random sharded checkpoints

#: dtypes of random checkpoints, with their element sizes in bits.
RANDOM_DTYPES = {
    "F32": 32,
    "BF16": 16,
    "F16": 16,
    "F64": 64,
    "I64": 64,
    "I32": 32,
    "U8": 8,
    "BOOL": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F4": 4,
}
FLOATS = {"F32", "BF16", "F16", "F64", "F8_E4M3"}


def _chunks(size: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's pieces of ``size`` in ``parts``: (start, length), the last ones possibly empty."""
    step = -(-size // parts) if size else 0
    return [(min(size, i * step), min(size, i * step + step) - min(size, i * step)) for i in range(parts)]


def random_checkpoint(rng: np.random.Generator, directory: Path, ranks: int, files: int = 2) -> tuple[Tensors, dict[str, str]]:
    """A DCP-shaped checkpoint of random tensors cut the ways trainers cut them, written with safetensors'
    own serializer (pieces in its order, DCP_SHARDING_INFO in the metadata), one file per training rank and
    output file. Returns the full tensors (dtype, shape, bytes) and the expected weight map."""
    directory.mkdir(parents=True, exist_ok=True)
    cuts = ["whole", "replicated", "rows", "columns", "grid", "last", "tiny"]
    expected: Tensors = {}
    weight_map: dict[str, str] = {}
    shards: dict[tuple[int, int], dict[str, tuple[str, list[int], bytes, list[int]]]] = {}
    # Every training rank holds rows of an anchor in every output file: no file is nothing but replicas.
    specs = [(f"anchor.{index}", "F32", [ranks * 3, 5], "rows", index) for index in range(1, files + 1)]
    for i in range(int(rng.integers(4, 14))):
        dtype = str(rng.choice(sorted(RANDOM_DTYPES)))
        ndim = int(rng.integers(0 if dtype != "F4" else 1, 4))
        shape = [int(rng.integers(0 if rng.random() < 0.1 else 1, 9)) for _ in range(ndim)]
        cut = str(rng.choice(cuts))
        if dtype == "F4":  # two elements a byte: cut only where whole bytes stay whole
            shape[-1] = 2 * max(1, shape[-1])
            cut = cut if cut in ("whole", "replicated") or (cut in ("rows", "tiny") and ndim >= 2) else "whole"
        specs.append((f"layers.{i}.w", dtype, shape, cut, 1 + int(rng.integers(0, files))))
    for name, dtype, shape, cut, index in specs:
        bits = RANDOM_DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        data = rng.integers(0, 256, count * bits // 8, dtype=np.uint8)
        if dtype == "BOOL":
            data &= 1
        expected[name] = (dtype, list(shape), data.tobytes())
        weight_map[name] = f"model-{index:05d}-of-{files:05d}.safetensors"
        # Element boxes are cut on the element grid; F4 counts bytes on its last dimension.
        unit_shape = list(shape) if bits >= 8 else shape[:-1] + [shape[-1] // 2]
        full = data.reshape(unit_shape + [max(1, bits // 8)]) if unit_shape else data.reshape(1, max(1, bits // 8))
        for rank, box in _boxes(rng, shape, cut, ranks):
            offsets, sizes = box
            units = (offsets, sizes) if bits >= 8 else (offsets[:-1] + [offsets[-1] // 2], sizes[:-1] + [sizes[-1] // 2])
            region = tuple(slice(o, o + s) for o, s in zip(*units)) if shape else (slice(0, 1),)
            piece = np.ascontiguousarray(full[region]).tobytes()
            shards.setdefault((rank, index), {})[name] = (dtype, list(sizes), piece, list(offsets))
    for (rank, index), pieces in shards.items():
        info = {name: {"saved_offsets": offsets} for name, (_, _, _, offsets) in pieces.items()}
        blob = reference_bytes(
            {n: (d, s, b) for n, (d, s, b, _) in pieces.items()},
            {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)},
        )
        (directory / f"shard-{rank + 1:05d}-model-{index:05d}-of-{files:05d}.safetensors").write_bytes(blob)
    return expected, weight_map


def _boxes(rng: np.random.Generator, shape: list[int], cut: str, ranks: int) -> list[tuple[int, tuple[list[int], list[int]]]]:
    """(training rank, (offsets, sizes)) of every piece of a tensor of ``shape`` cut as ``cut``."""
    ndim = len(shape)
    whole = ([0] * ndim, list(shape))
    if cut == "replicated" or ndim == 0:
        holders = sorted(set(rng.integers(0, ranks, int(rng.integers(1, ranks + 1))).tolist()))
        return [(r, whole) for r in holders]
    if cut == "whole":
        return [(int(rng.integers(0, ranks)), whole)]
    if cut == "grid" and ndim >= 2:
        a = max(1, ranks // 2)
        b = max(1, ranks // a)
        rows, cols = _chunks(shape[0], a), _chunks(shape[1], b)
        return [
            (i * b + j, ([r0, c0] + [0] * (ndim - 2), [rn, cn] + shape[2:]))
            for i, (r0, rn) in enumerate(rows)
            for j, (c0, cn) in enumerate(cols)
        ]
    if cut in ("columns", "last") and ndim >= 2:
        dim = 1 if cut == "columns" else ndim - 1
        step = 2 if shape[-1] % 2 == 0 and dim == ndim - 1 else 1  # F4: keep whole bytes
        pieces = _chunks(shape[dim] // step, ranks)
        return [
            (r, ([0] * dim + [o * step] + [0] * (ndim - dim - 1), shape[:dim] + [n * step] + shape[dim + 1 :]))
            for r, (o, n) in enumerate(pieces)
        ]
    if cut == "tiny" and 0 < shape[0] <= ranks:  # one row per piece, each on its own rank: many small pieces
        return [(row, ([row] + [0] * (ndim - 1), [1] + shape[1:])) for row in range(shape[0])]
    return [(r, ([o] + [0] * (ndim - 1), [n] + shape[1:])) for r, (o, n) in enumerate(_chunks(shape[0], ranks))]


def slow_beyond(values: list, fast: int) -> list:
    """Parameters for ``parametrize``: the first ``fast`` run by default, the rest only in slow runs
    (a tuple is the values of several arguments)."""
    slow = pytest.mark.slow
    return [
        value if i < fast else pytest.param(*value, marks=slow) if isinstance(value, tuple) else pytest.param(value, marks=slow)
        for i, value in enumerate(values)
    ]


_REFERENCE_LOGITS = """
import json, sys
import torch
from transformers import AutoModelForCausalLM

for pair in sys.argv[1:]:  # OUT=LOGITS
    out, logits_path = pair.split("=", 1)
    want = torch.load(logits_path, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = (torch.arange(want.shape[1]) % model.config.vocab_size).reshape(1, -1)
    with torch.no_grad():
        got = model(ids).logits
    print(json.dumps({"out": out, "equal": bool(torch.equal(got, want)), "max_diff": (got - want).abs().max().item()}))
"""


def reference_logits_reports(pairs: list[tuple[Path, Path]], timeout: float = 300) -> list[dict]:
    """Each output loaded by transformers in float32 (a child process), its logits on ``arange(n) % vocab``
    against a fixture's ``ref_logits.pt`` (``pairs``: output, logits file): equal, and by how much they differ.
    Skips the test without torch or transformers."""
    import importlib.util

    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    arguments = [f"{out}={logits}" for out, logits in pairs]
    proc = subprocess.run(
        [sys.executable, "-c", _REFERENCE_LOGITS, *arguments], capture_output=True, text=True, timeout=timeout,
        env=subprocess_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == len(pairs), proc.stdout + proc.stderr
    return reports


#: Loads outputs with transformers beside an expected model, in a child process (importing torch and
#: transformers is most of the time, and would weigh on every later test of the process).
_TRANSFORMERS_LOAD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM

for group in sys.argv[1:]:  # EXPECTED=OUT,OUT,...
    expected_dir, outputs = group.split("=", 1)
    want_model = AutoModelForCausalLM.from_pretrained(expected_dir, dtype=torch.float32)
    ids = (torch.arange(48) * 37 % want_model.config.vocab_size).reshape(2, 24)
    with torch.no_grad():
        want = want_model(ids).logits
    for out in outputs.split(","):
        model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
        with torch.no_grad():
            got = model(ids).logits
        report = {key: sorted(map(str, info[key])) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        mine, theirs = model.config.to_dict(), want_model.config.to_dict()
        report["config_differs"] = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        report.update(cls=type(model).__name__, equal=bool(torch.equal(got, want)), max_diff=(got - want).abs().max().item())
        print(json.dumps(report))
"""


def transformers_reports(groups: list[tuple[Path, list[Path]]], timeout: float = 300) -> list[dict]:
    """What transformers makes of each output beside its expected model directory (``groups``: expected,
    outputs), one report per output in order: missing/unexpected/mismatched keys, the model class, the
    config fields that differ, whether the logits are equal (and by how much they differ). Skips the test
    without torch or transformers."""
    import importlib.util

    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    arguments = [f"{expected}=" + ",".join(map(str, outputs)) for expected, outputs in groups]
    proc = subprocess.run(
        [sys.executable, "-c", _TRANSFORMERS_LOAD, *arguments], capture_output=True, text=True, timeout=timeout,
        env=subprocess_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == sum(len(outputs) for _, outputs in groups), proc.stdout + proc.stderr
    return reports
