"""Checking a consolidated checkpoint: file structure, index, and tensor values."""

from __future__ import annotations

import json
import os

import numpy as np

from .errors import InputError
from .format import Header, read_header
from .parallel import Comm, agree
from .plan import INDEX_NAME


def read_index(output_dir: str) -> dict[str, object]:
    path = os.path.join(output_dir, INDEX_NAME)
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as exc:
        raise InputError(f"{path}: cannot read index ({exc.strerror})") from None
    except ValueError as exc:
        raise InputError(f"{path}: index is not valid JSON ({exc})") from None


def tensor_bytes(path: str, header: Header, name: str) -> bytes:
    """The raw bytes of tensor ``name`` of the file at ``path``."""
    entry = next(e for e in header.tensors if e.name == name)
    with open(path, "rb") as handle:
        handle.seek(header.data_start + entry.begin)
        return handle.read(entry.end - entry.begin)


def check_sample(output_dir: str, config: object, comm: Comm) -> int:
    """Compare every tensor of a consolidated sample with its generated full value; returns the count."""
    from .sample import full_tensor, tensor_specs

    specs = tensor_specs(config)  # type: ignore[arg-type]

    def work() -> int:
        weight_map = read_index(output_dir)["weight_map"]
        headers: dict[str, Header] = {}
        for name, dtype, shape, _, _ in specs[comm.rank :: comm.size]:
            file_name = weight_map[name]  # type: ignore[index]
            path = os.path.join(output_dir, file_name)
            header = headers.get(path) or headers.setdefault(path, read_header(path))
            entry = next(e for e in header.tensors if e.name == name)
            if entry.dtype != dtype or entry.shape != tuple(shape):
                raise InputError(f"{path}: tensor {name!r} is {entry.dtype}{list(entry.shape)}, expected {dtype}{list(shape)}")
            expected = np.ascontiguousarray(full_tensor(config, name, dtype, shape)).tobytes()  # type: ignore[arg-type]
            if tensor_bytes(path, header, name) != expected:
                raise InputError(f"{path}: tensor {name!r} differs from the sample's value")
        return 1

    agree(comm, work)
    return len(specs)
