"""Test helpers that stand apart from mpicons: the reference serializer and reader are safetensors' own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, deserialize, serialize

FIXTURES = Path(__file__).parent / "fixtures" / "dcp"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
_VENV_MPIEXEC = Path(sys.executable).parent / "mpiexec"
MPIEXEC = str(_VENV_MPIEXEC) if _VENV_MPIEXEC.exists() else shutil.which("mpiexec")

# safetensors header dtype → the name safetensors.serialize takes (torch-style).
SPEC_DTYPE = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
    "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "F64": "float64",
    "I64": "int64", "U64": "uint64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
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


def assert_consolidated(output_dir: str | os.PathLike[str], expected: Tensors, weight_map: dict[str, str]) -> None:
    """Every output file equals the reference serializer's bytes; tensors and index as expected."""
    output_dir = Path(output_dir)
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
        assert data == reference_bytes({n: expected[n] for n in names}), f"{file_name}: bytes differ from the reference serializer"
    leftovers = [p.name for p in output_dir.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def index_weight_map(mapping: dict[str, int]) -> dict[str, str]:
    count = max(mapping.values())
    return {name: f"model-{index:05d}-of-{count:05d}.safetensors" for name, index in mapping.items()}


def mpirun(ranks: int, args: list[str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``mpiexec -n ranks python ARGS`` with this checkout importable; returns the process and its seconds."""
    start = time.monotonic()
    proc = subprocess.run(
        [MPIEXEC, "-n", str(ranks), sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    return proc, time.monotonic() - start


def writing_started(out: Path) -> bool:
    """A run into ``out`` has created an output file in its private staging directory."""
    return any(any(d.iterdir()) for d in out.glob(".mpicons-staging-*")) if out.is_dir() else False
