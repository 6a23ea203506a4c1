"""--format hdf5: one HDF5 file, a dataset per tensor, values exact (bf16/fp8 via their raw bits)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import FIXTURE_NAMES, FIXTURES, fixture_expected
from mpi4py import MPI

import mpicons

h5py = pytest.importorskip("h5py")
pytestmark = pytest.mark.mpi

VIEW = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I64": np.int64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
}


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
@pytest.mark.parametrize("io", ["posix", pytest.param("mpiio", marks=pytest.mark.slow)])
def test_hdf5_output_reads_back_exactly(fixture, io, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    out = mpi_tmp_path / "h5"
    result = mpicons.consolidate(FIXTURES / fixture / "sharded", out, comm=comm, output_format="hdf5", io=io, buffer_size=1 << 16)
    assert result.files == ["model.h5"] and result.index_file == ""
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "model.h5"]
    expected, _ = fixture_expected(fixture)
    with h5py.File(out / "model.h5", "r") as handle:
        for name, (dtype, shape, data) in expected.items():
            dataset = handle["/" + name.replace(".", "/")]
            assert dataset.attrs["dtype"] == dtype and dataset.attrs["name"] == name
            assert list(dataset.shape) == shape
            values = dataset[()].view(VIEW[dtype]) if dtype in ("BF16", "F8_E4M3") else dataset[()]
            want = np.frombuffer(data, dtype=VIEW[dtype]).reshape(shape)
            assert values.dtype == want.dtype
            assert np.array_equal(values.view(np.uint8), want.view(np.uint8)), name
            if dtype in ("BF16", "F32", "F16", "F64"):
                assert np.array_equal(values, want, equal_nan=True)


def test_hdf5_with_dtype_conversion(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    out = mpi_tmp_path / "h5"
    mpicons.consolidate(FIXTURES / "tp2d-4ranks" / "sharded", out, comm=comm, output_format="hdf5", dtype="fp32")
    expected, _ = fixture_expected("tp2d-4ranks")
    with h5py.File(out / "model.h5", "r") as handle:
        for name, (dtype, shape, data) in expected.items():
            dataset = handle["/" + name.replace(".", "/")]
            assert dataset.dtype == np.float32 and dataset.attrs["dtype"] == "F32"
            assert np.array_equal(dataset[()], np.frombuffer(data, dtype=VIEW[dtype]).astype(np.float32).reshape(shape))
