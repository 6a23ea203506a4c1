"""What torch's own pickles say, written without torch (pure): a tensor's ``data.pkl`` as ``torch.save``
writes it, ``torch.Size``, and the module DCP's metadata classes live in. Kept apart from the samples so
that writing a real checkpoint (``mpicons shard``) loads none of their dependencies."""

from __future__ import annotations

from ..core.safetensors_codec import DTYPE_BY_NAME
from .distcp_items import STORAGE_DTYPES
from .pickle_writer import Call, Global, PersistentId, dumps

METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_LEGACY_STORAGE = {dtype: name for name, dtype in STORAGE_DTYPES.items()}


def torch_size(dims: tuple[int, ...]) -> Call:
    return Call(Global("torch", "Size"), (tuple(int(d) for d in dims),))


def tensor_pickle(dtype: str, shape: tuple[int, ...], stride: tuple[int, ...] | None = None, numel: int | None = None) -> bytes:
    """``data.pkl`` of ``torch.save`` of a tensor: legacy typed storages where torch uses them.

    ``stride`` (default: row-major) and ``numel``, the storage's elements (default: the tensor's), write
    what torch writes for views, e.g. a tensor with no elements keeps the strides it had."""
    if stride is None:
        strides, step = [], 1
        for dim in reversed(shape):
            strides.append(step)
            step *= dim
        stride = tuple(reversed(strides))
    if numel is None:
        numel = 1
        for dim in shape:
            numel *= dim
    hooks = Call(Global("collections", "OrderedDict"))
    legacy = _LEGACY_STORAGE.get(dtype)
    if legacy is not None:
        storage = PersistentId(("storage", Global("torch", legacy), "0", "cpu", numel))
        return dumps(Call(Global("torch._utils", "_rebuild_tensor_v2"), (storage, 0, tuple(shape), stride, False, hooks)))
    storage = PersistentId(
        ("storage", Global("torch.storage", "UntypedStorage"), "0", "cpu", numel * DTYPE_BY_NAME[dtype].bits // 8)
    )
    dtype_global = Global("torch", str(DTYPE_BY_NAME[dtype].torch))
    return dumps(
        Call(Global("torch._utils", "_rebuild_tensor_v3"), (storage, 0, tuple(shape), stride, False, hooks, dtype_global))
    )


__all__ = ["METADATA_MODULE", "tensor_pickle", "torch_size"]
