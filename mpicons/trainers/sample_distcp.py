"""The built-in sample in DCP's default format (``.metadata`` + ``__R_0.distcp``), written without torch:
per piece a ``torch.save`` archive whose ``data.pkl`` rebuilds the tensor (or, serialized as
safetensors, one blob per file after the items), and DCP's ``Metadata`` pickled as torch pickles it.
"""

from __future__ import annotations

import io
import json
import math
import os
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.safetensors_codec import DTYPE_BY_NAME, DTYPE_ORDER, build_header
from ..formats.pickle_writer import Call, Global, Obj, dumps
from ..formats.shard_headers import SHARDING_KEY
from ..formats.torch_pickles import METADATA_MODULE, tensor_pickle, torch_size
from .sample_model import ItemIndex, SampleConfig, Spec, full_tensor, non_tensor_entry, placements_of, tensor_specs


def torch_archive(data_pkl: bytes, data: bytes | None, folder: str = "archive") -> bytes:
    """A ``torch.save`` zip archive: stored members under ``folder/`` (torch.save names it after the
    file it writes, e.g. ``common/`` for ``common.pt``; DCP's items use ``archive/``)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{folder}/data.pkl", data_pkl)
        archive.writestr(f"{folder}/byteorder", "little")
        if data is not None:
            archive.writestr(f"{folder}/data/0", data)
        archive.writestr(f"{folder}/version", "3\n")
    return buffer.getvalue()


def write_distcp_ranks(
    directory: str, c: SampleConfig, train_ranks: range, keep: Callable[[str, str], bool], serialization: str, mode: str = "wb"
) -> ItemIndex:
    """Write ``__R_0.distcp`` for training ranks ``train_ranks``, one full tensor at a time (memory is the
    largest tensor, whatever the files' sizes); returns (name, chunk offsets) → (file, offset, length)."""
    if serialization not in ("torch_save", "safetensors"):
        raise ValueError(f"unknown serialization {serialization!r} (torch_save or safetensors)")
    names = {r: f"__{r}_0.distcp" for r in train_ranks}
    handles: dict[int, Any] = {}
    try:
        for r in train_ranks:
            handles[r] = open(os.path.join(directory, names[r]), mode)
    except BaseException:
        for handle in handles.values():
            handle.close()
        raise
    items: ItemIndex = {}
    try:
        if 0 in handles:  # non-tensor items come first, as torch writes them
            archive = torch_archive(dumps(1000), None)
            items[(non_tensor_entry(c), None)] = (names[0], 0, len(archive), ())
            handles[0].write(archive)
        specs = [spec for spec in tensor_specs(c) if keep(spec[0], spec[1])]
        if serialization == "safetensors":  # DCP's safetensors serialization: one blob per file, after the items
            specs.sort(key=lambda spec: (DTYPE_ORDER[spec[1]], spec[0]))
            for r, handle in handles.items():
                items.update(_blob_header(handle, names[r], c, specs, r))
        placements = placements_of(c)
        for name, dtype, shape, placement, _ in specs:
            full = full_tensor(c, name, dtype, shape)
            for r, handle in handles.items():
                box = placements[placement](shape, r // c.tp, r % c.tp)
                if box is None:
                    continue
                offsets, size = box
                data = np.ascontiguousarray(full[tuple(slice(o, o + n) for o, n in zip(offsets, size))]).tobytes()
                if serialization == "torch_save":  # an archive per piece, in the order the tensors come
                    data = torch_archive(tensor_pickle(dtype, tuple(size)), data)
                    items[(name, tuple(offsets))] = (names[r], handle.tell(), len(data), tuple(size))
                handle.write(data)
    finally:
        for handle in handles.values():
            handle.close()
    return items


def _blob_header(handle: Any, file: str, c: SampleConfig, specs: list[Spec], rank: int) -> ItemIndex:
    """Write the header of training rank ``rank``'s safetensors blob (its pieces of ``specs``, in the
    blob's order); every piece's item is the blob, found in it by name."""
    placements = placements_of(c)
    held = []
    for name, dtype, shape, placement, _ in specs:
        box = placements[placement](shape, rank // c.tp, rank % c.tp)
        if box is not None:
            held.append((name, dtype, box))
    if not held:
        return {}
    start = handle.tell()
    info = {name: {"saved_offsets": list(offsets)} for name, _, (offsets, _) in held}
    metadata = {SHARDING_KEY: json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"}
    header, _ = build_header([(name, dtype, tuple(size)) for name, dtype, (_, size) in held], metadata)
    handle.write(header)
    return {
        (name, tuple(offsets)): (file, start, math.prod(size) * DTYPE_BY_NAME[dtype].bits // 8, tuple(size))
        for name, dtype, (offsets, size) in held
    }


def metadata_pickle(
    c: SampleConfig,
    keep: Callable[[str, str], bool],
    items: ItemIndex,
) -> bytes:
    """DCP's ``Metadata`` for the items written, as torch pickles it."""

    def cls(name: str, module: str = METADATA_MODULE) -> Global:
        return Global(module, name)

    entries: dict[str, object] = {}
    planner: dict[str, object] = {}
    storage: dict[object, object] = {}
    specs = [s for s in tensor_specs(c) if keep(s[0], s[1])]
    chunks_of: dict[str, list[tuple[int, ...]]] = {}
    for name, chunk in sorted(items, key=lambda key: (key[0], key[1] or ())):
        if chunk is not None:
            chunks_of.setdefault(name, []).append(chunk)
    for name, dtype, shape, _, _ in specs:
        boxes = [
            Obj(cls("ChunkStorageMetadata"), {"offsets": torch_size(offsets), "sizes": torch_size(items[(name, offsets)][3])})
            for offsets in chunks_of.get(name, [])
        ]
        layout = Call(Global("torch.serialization", "_get_layout"), ("torch.strided",))
        memory = Call(cls("_MEM_FORMAT_ENCODING"), (0,))
        torch_dtype = Global("torch", str(DTYPE_BY_NAME[dtype].torch))
        properties = Obj(cls("TensorProperties"), (torch_dtype, layout, False, memory, False))
        entries[name] = Obj(cls("TensorStorageMetadata"), {"properties": properties, "size": torch_size(shape), "chunks": boxes})
        planner[name] = (name,)
    entries[non_tensor_entry(c)] = Obj(cls("BytesStorageMetadata"))
    planner[non_tensor_entry(c)] = (non_tensor_entry(c),)
    for (name, chunk), (file, offset, length, _) in sorted(items.items(), key=lambda kv: (kv[0][0], kv[0][1] or ())):
        key = Obj(cls("MetadataIndex"), {"fqn": name, "offset": None if chunk is None else torch_size(chunk), "index": 0})
        info = Obj(
            cls("_StorageInfo", "torch.distributed.checkpoint.filesystem"),
            {"relative_path": file, "offset": offset, "length": length},
        )
        storage[key] = info
    return dumps(
        Obj(
            cls("Metadata"),
            {
                "state_dict_metadata": entries,
                "planner_data": planner,
                "storage_data": storage,
                "storage_meta": None,
                "version": "1.0.0",
            },
        )
    )
