"""--dtype conversion (round to nearest even), --max-shard-size re-sharding, plain safetensors input."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from helpers import (
    FIXTURES,
    assert_consolidated,
    fixture_expected,
    index_weight_map,
    load_tensors,
    reference_bytes,
    run_python,
)
from mpi4py import MPI

import mpicons
from mpicons.core.convert import convert

NUMPY = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "F8_E4M3": ml_dtypes.float8_e4m3fn}
FLOATS = set(NUMPY)


def nearest_even(values: np.ndarray, target) -> np.ndarray:
    """Oracle: the finite 16-bit value nearest each float64, ties to the even bit pattern (table search)."""
    with np.errstate(invalid="ignore"):
        table = np.arange(1 << 16, dtype=np.uint16).view(target).astype(np.float64)
    finite = np.isfinite(table)
    patterns = np.arange(1 << 16, dtype=np.uint16)[finite]
    table = table[finite]
    order = np.lexsort((patterns, table))
    table, patterns = table[order], patterns[order]
    table, unique_at = np.unique(table, return_index=True)  # +0/-0: keep the lower pattern
    patterns = patterns[unique_at]
    high = np.clip(np.searchsorted(table, values), 1, len(table) - 1)
    low = high - 1
    down, up = values - table[low], table[high] - values
    pick_high = (up < down) | ((up == down) & (patterns[high] % 2 == 0))
    result = np.where(pick_high, patterns[high], patterns[low]).astype(np.uint16)
    zero = values == 0
    result[zero] = np.where(np.signbit(values[zero]), 0x8000, 0)
    return result.view(target)


def reference_convert(dtype: str, data: bytes, target: str) -> tuple[str, bytes]:
    if dtype not in FLOATS:
        return dtype, data
    values = np.frombuffer(data, dtype=NUMPY[dtype]).astype(np.float64)  # exact
    if target == "F32":
        return "F32", b"".join(struct.pack("<f", v) for v in values.tolist())
    return target, nearest_even(values, NUMPY[target]).tobytes()


@pytest.mark.parametrize("target", ["BF16", "F16"])
@pytest.mark.parametrize("source", ["F64", "F32", "F16", "BF16"])
def test_rounding_is_nearest_even(source, target):
    rng = np.random.default_rng(7)
    values = np.concatenate(
        [
            rng.standard_normal(20_000) * 10.0 ** rng.integers(-4, 4, 20_000),
            # exact ties and just-off ties around 1 for both targets (bf16 ulp 2^-7, f16 ulp 2^-10)
            1 + np.array([2**-8, 3 * 2**-8, 2**-8 + 2**-30, 2**-8 - 2**-30, 2**-11, 3 * 2**-11, 2**-11 + 2**-40]),
            [0.0, -0.0, 1e-3, -65504.0, 3.0e38],
        ]
    )
    values = values[np.abs(values) < (65504 if target == "F16" or source == "F16" else 3.0e38)]
    source_values = values.astype(NUMPY[source])
    out = np.empty(len(values), dtype=NUMPY[target])
    convert(source_values, out)
    expected = nearest_even(source_values.astype(np.float64), NUMPY[target])
    assert out.view(np.uint16).tolist() == expected.view(np.uint16).tolist()


def test_float64_to_bfloat16_rounds_once():
    out = np.empty(3, dtype=ml_dtypes.bfloat16)
    convert(np.array([1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-40), 1e39]), out)
    assert out.astype(np.float64).tolist() == [1 + 2**-7, -(1 + 2**-7), float("inf")]


@pytest.mark.mpi
@pytest.mark.parametrize("target, option", [("BF16", "bf16"), ("F32", "fp32"), ("F16", "fp16")])
def test_consolidate_with_dtype_conversion(target, option, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    expected, mapping = fixture_expected("edge-3ranks")
    out = mpi_tmp_path / "out"
    mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", out, comm=comm, dtype=option, buffer_size=1 << 16)
    converted = {}
    for name, (dtype, shape, data) in expected.items():
        new_dtype, new_data = reference_convert(dtype, data, target)
        converted[name] = (new_dtype, shape, new_data)
    assert {d for d, _, _ in converted.values()} >= {"I64", "BOOL", "U8", target}
    assert_consolidated(out, converted, index_weight_map(mapping))


@pytest.mark.mpi
def test_max_shard_size_reshards_like_hugging_face(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    expected, _ = fixture_expected("fsdp2-3ranks")
    limit = 60_000
    out = mpi_tmp_path / "out"
    result = mpicons.consolidate(FIXTURES / "fsdp2-3ranks" / "sharded", out, comm=comm, max_shard_size=limit)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    count = len(result.files)
    assert result.files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    sizes = {f: 0 for f in result.files}
    members: dict[str, list[str]] = {f: [] for f in result.files}
    for name, file_name in index["weight_map"].items():
        sizes[file_name] += len(expected[name][2])
        members[file_name].append(name)
    for file_name in result.files:
        assert sizes[file_name] <= limit or len(members[file_name]) == 1
    assert_consolidated(out, expected, index["weight_map"])


@pytest.mark.mpi
def test_plain_safetensors_checkpoint_is_copied_or_resharded(mpi_tmp_path):
    """No DCP_SHARDING_INFO: each tensor is whole; outputs equal the reference serializer's files."""
    comm = MPI.COMM_WORLD
    expected, _ = fixture_expected("tp2d-4ranks")
    names = sorted(expected)
    plain = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    source = mpi_tmp_path / "plain"
    if comm.rank == 0:
        source.mkdir()
        for file_name, members in plain.items():
            (source / file_name).write_bytes(reference_bytes({n: expected[n] for n in members}))
    comm.Barrier()
    mpicons.consolidate(source, mpi_tmp_path / "same", comm=comm)
    assert_consolidated(mpi_tmp_path / "same", expected, {n: f for f, members in plain.items() for n in members})
    for file_name in plain:
        assert (mpi_tmp_path / "same" / file_name).read_bytes() == (source / file_name).read_bytes()
    result = mpicons.consolidate(source, mpi_tmp_path / "resharded", comm=comm, max_shard_size=100_000, dtype="fp32")
    assert len(result.files) > 2
    index = json.loads((mpi_tmp_path / "resharded" / "model.safetensors.index.json").read_text())
    converted = {
        n: (lambda d: (d[0], expected[n][1], d[1]))(reference_convert(expected[n][0], expected[n][2], "F32")) for n in names
    }
    assert_consolidated(mpi_tmp_path / "resharded", converted, index["weight_map"])
    assert all(load_tensors(mpi_tmp_path / "resharded" / f) for f in result.files)


_SLOW_ML_DTYPES = """
import json, sys, time
import mpicons
from mpicons.comm import SingleProcess

class SlowImport:  # ml_dtypes takes 0.5-2 s to import on a loaded node: make that unmistakable
    def find_spec(self, name, path=None, target=None):
        if name == "ml_dtypes":
            time.sleep(float(sys.argv[3]))
        return None

sys.meta_path.insert(0, SlowImport())
result = mpicons.consolidate(sys.argv[1], sys.argv[2], comm=SingleProcess(), dtype="bf16")
seconds = {phase: spread.max for phase, spread in result.stats.phases.items()}
print(json.dumps({"phases": seconds, "total": result.stats.elapsed.max, "loaded": "ml_dtypes" in sys.modules}))
"""


def test_the_ml_dtypes_import_is_not_counted_as_writing(tmp_path):
    """Its import at the first converted block made a small checkpoint's write rate look 10x slower."""
    delay = 2.0
    proc = run_python("-c", _SLOW_ML_DTYPES, FIXTURES / "edge-3ranks" / "sharded", tmp_path / "out", delay, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["loaded"]  # the conversion needed it
    assert report["phases"]["write"] < delay / 2 and report["total"] < delay, report
