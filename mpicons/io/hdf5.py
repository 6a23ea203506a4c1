"""``--format hdf5``: one HDF5 file, a contiguous dataset per tensor, filled by offset writes.

Rank 0 lays the file out with h5py (contiguous datasets, space allocated at creation) and reads
each dataset's byte offset in the file; the plan is then re-targeted at those offsets and every
rank writes its share exactly as for safetensors. Dataset paths are the tensor names with ``.``
as ``/``. Each dataset carries its safetensors dtype in the ``dtype`` attribute; dtypes HDF5 has
no type for (BF16, F8_*, F4, F6) are stored as raw unsigned integers of the same width, so
``dataset[()].view(ml_dtypes.bfloat16)`` gives back the exact values.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..core.errors import InputError, WriteError
from ..core.layout import Layout, OutputFile
from ..core.safetensors_codec import DTYPE_BY_NAME

HDF5_NAME = "model.h5"
_RAW = {8: np.uint8, 16: np.uint16}


def storage_dtype(dtype: str) -> np.dtype:
    """The HDF5-storable numpy dtype whose bytes equal the tensor's raw bytes."""
    kind = DTYPE_BY_NAME[dtype]
    if kind.bits % 8 or dtype.startswith("F8") or dtype == "BF16":
        return np.dtype(_RAW.get(kind.bits, np.uint8))
    return np.dtype(kind.numpy)


def dataset_path(name: str) -> str:
    return "/" + name.replace(".", "/")


def check_names(plan: Layout) -> None:
    """Every tensor name must make a distinct HDF5 dataset path that no other dataset needs as a group.

    Checked before anything is written (pure): NUL characters, empty path components
    (``a..b``), ``.``/``..`` components, names that are not valid UTF-8, and clashes such as
    ``a.b`` beside ``a/b`` (same path) or ``a`` beside ``a.b`` (``/a`` would be a group and a dataset).
    """
    by_path: dict[str, str] = {}
    for tensor in plan.tensors:
        name = tensor.name
        path = dataset_path(name)
        parts = path[1:].split("/")
        if "\0" in name or any(p in ("", ".", "..") for p in parts):
            raise InputError(
                f"tensor {name!r}: cannot be an HDF5 dataset (its path {path!r} has an empty, '.', '..' or NUL part)"
            )
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"tensor {name!r}: cannot be an HDF5 dataset (the name is not valid UTF-8)") from None
        if path in by_path:
            raise InputError(f"tensors {by_path[path]!r} and {name!r} would both be the HDF5 dataset {path}")
        by_path[path] = name
    for path, name in by_path.items():
        parts = path.split("/")
        for depth in range(2, len(parts)):
            group = "/".join(parts[:depth])
            if group in by_path:
                raise InputError(
                    f"tensors {by_path[group]!r} and {name!r} clash in HDF5: {group} would be both a dataset and a group"
                )


def create_layout(path: str, plan: Layout) -> list[int]:
    """Create the HDF5 file at ``path`` and return each tensor's data offset in it (rank 0 only)."""
    try:
        import h5py
    except ImportError:
        raise InputError("--format hdf5 needs h5py: pip install 'mpicons[hdf5]'") from None
    offsets = [0] * len(plan.tensors)
    try:
        with h5py.File(path, "x", libver="latest") as handle:
            for index, tensor in enumerate(plan.tensors):
                shape = tensor.storage[: len(tensor.shape)] if DTYPE_BY_NAME[tensor.dtype].bits % 8 else tensor.shape
                create = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                create.set_layout(h5py.h5d.CONTIGUOUS)
                create.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                create.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
                try:
                    dataset = handle.create_dataset(
                        dataset_path(tensor.name), shape=shape, dtype=storage_dtype(tensor.dtype), dcpl=create
                    )
                except (ValueError, TypeError) as exc:
                    raise InputError(
                        f"tensor {tensor.name!r}: cannot be an HDF5 dataset at {dataset_path(tensor.name)} ({exc})"
                    ) from None
                dataset.attrs["dtype"] = tensor.dtype
                dataset.attrs["name"] = tensor.name
                offset = dataset.id.get_offset()
                offsets[index] = int(offset) if offset is not None else 0
                if tensor.nbytes and offset is None:
                    raise WriteError(f"{path}: HDF5 did not allocate dataset {dataset_path(tensor.name)}")
    except OSError as exc:
        raise WriteError(f"{path}: cannot create HDF5 file ({exc})") from None
    return offsets


def retarget(plan: Layout, offsets: list[int], size: int) -> Layout:
    """The same plan, writing every tensor into one already laid-out file at the given offsets."""
    tensors = [replace(t, file=0, offset=offsets[i]) for i, t in enumerate(plan.tensors)]
    out = OutputFile(HDF5_NAME, b"", size, tuple(range(len(tensors))))
    return replace(plan, tensors=tensors, files=[out])
