"""torch's two consolidation functions, done by mpicons (documented as ``mpicons.torch``), and the switch
that puts them in torch's place.

torch (``torch.distributed.checkpoint._consolidate_hf_safetensors``) has two: ``consolidate_safetensors_files``
(one process; what ``HuggingFaceStorageWriter(enable_consolidation=True).finish()`` calls on the
coordinator alone while the other ranks wait) and ``consolidate_safetensors_files_on_every_rank``
(collective over a group; what torchtitan calls). Both have torch's signatures here; the output is
mpicons': byte-identical to safetensors' serializer, checked, published atomically, the same bytes
from either. :func:`install` replaces torch's functions wherever they were imported by name;
:func:`uninstall` puts them back. The process group becomes a communicator through
:class:`~mpicons.comm.torch_group.TorchComm`.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from ..comm import SingleProcess
from ..comm.torch_group import TorchComm
from ..core.errors import InputError
from ..core.options import Options
from ..formats.shard_headers import list_shards, read_file

#: The module holding torch's functions (torch 2.8 and later).
TORCH_MODULE = "torch.distributed.checkpoint._consolidate_hf_safetensors"
#: The names :func:`install` replaces.
REPLACED = ("consolidate_safetensors_files", "consolidate_safetensors_files_on_every_rank")


class MissingOutputDirectory(InputError, FileNotFoundError):
    """The output directory does not exist: torch's functions write into an existing one (and raise
    ``FileNotFoundError``); so do the drop-ins, before any work, on every member alike."""


def _require_output_dir(output_dir: str, everywhere: Callable[[bool], list[bool]]) -> None:
    """Raise :class:`MissingOutputDirectory` on every member when the output directory is missing on any
    (``everywhere`` gathers each member's answer)."""
    seen = everywhere(os.path.isdir(output_dir))
    if not all(seen):
        rank = seen.index(False)
        raise MissingOutputDirectory(
            errno.ENOENT,
            f"[rank {rank}] output directory does not exist (torch's consolidation functions write into an existing "
            "directory): create it first",
            output_dir,
        )


def _io_threads(num_threads: int, options: dict[str, Any]) -> dict[str, Any]:
    """``num_threads`` as mpicons' background I/O threads (writes and kernel copies in parallel), unless
    ``io_threads`` was given; a count below one is one, as torch's. A keyword that is no option is a
    ``TypeError`` here, before anything is looked at (as torch's functions)."""
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise TypeError(f"num_threads must be an int (got {num_threads!r})")
    changes = {"io_threads": max(1, num_threads), **options}
    Options().with_changes(**changes)
    return changes


def consolidate_safetensors_files_on_every_rank(
    input_dir: str,
    output_dir: str,
    fqn_to_index_mapping: Mapping[str, int],
    num_threads: int = 1,
    process_group: Any = None,
    **options: Any,
) -> Any:
    """torch's ``consolidate_safetensors_files_on_every_rank``, done by mpicons.

    Parameters:
        input_dir: the shards (``shard-*-model-*.safetensors``, as DCP's HuggingFaceStorageWriter saves them).
        output_dir: an existing directory where ``model-IIIII-of-NNNNN.safetensors`` and the index go; may be
            the input's parent (torchtitan's ``CHECKPOINT/sharded`` → ``CHECKPOINT``) or a directory inside the
            input (torch's tests), never the input directory itself.
        fqn_to_index_mapping: tensor name → output file index from 1, as for torch; must name exactly
            the checkpoint's tensors.
        num_threads: background I/O threads per member (writes and kernel copies in parallel).
        process_group: the group whose members call this (default: the default group); a group
            that cannot move CPU tensors (NCCL) is paired with a gloo group once.
        options: any :class:`~mpicons.core.options.Options` field (``force=True`` to replace an existing
            checkpoint in ``output_dir``, ``buffer_size``, ``split``, ...); any other keyword is a ``TypeError``.

    Collective over the group: returns on every member once the files and the index are published. When
    torch.distributed is not initialized, this process alone does the work (as torch's function does
    then), without MPI. Returns the :class:`~mpicons.job.consolidation.ConsolidateResult` (torch's
    returns None); raises :class:`~mpicons.core.errors.InputError` / ``WriteError`` on every member alike
    (a missing output directory: :class:`MissingOutputDirectory`, also a ``FileNotFoundError``).
    """
    from ..job.consolidation import consolidate  # the job loads when it runs, not with mpicons.torch

    changes = _io_threads(num_threads, options)
    alone = process_group is None and not (dist.is_available() and dist.is_initialized())
    comm = SingleProcess() if alone else TorchComm(process_group)
    _require_output_dir(output_dir, comm.allgather)
    result = consolidate(input_dir, output_dir, comm=comm, mapping=dict(fqn_to_index_mapping), inside_input=True, **changes)
    # Every member leaves together, as torch's function does after its final barrier: the owner, which
    # publishes, would otherwise return first, and a caller that removes the directory as soon as its
    # own call returns (torch's own tests do, on every rank) would pull it from under the others.
    comm.allgather(None)
    return result


def consolidate_safetensors_files(
    input_dir: str,
    output_dir: str,
    fqn_to_index_mapping: Mapping[str, int] | None = None,
    num_threads: int = 1,
    **options: Any,
) -> None:
    """torch's ``consolidate_safetensors_files``, done by mpicons in this process alone.

    Never touches a process group, so any one process may call it while the others are busy or wait
    (torch's HuggingFaceStorageWriter calls it on the coordinator only). The parameters are
    :func:`consolidate_safetensors_files_on_every_rank`'s; ``fqn_to_index_mapping=None`` puts every
    tensor in ``model-00001-of-00001.safetensors`` (as torch 2.8 did); ``num_threads`` background
    threads copy and write in parallel. The files are the same bytes as the collective function's.
    Returns None once the files and the index are published.
    """
    from ..job.consolidation import consolidate

    changes = _io_threads(num_threads, options)
    comm = SingleProcess()
    _require_output_dir(output_dir, comm.allgather)
    mapping = dict(fqn_to_index_mapping) if fqn_to_index_mapping is not None else _everything_in_one_file(input_dir)
    consolidate(input_dir, output_dir, comm=comm, mapping=mapping, inside_input=True, **changes)


def _everything_in_one_file(input_dir: str) -> dict[str, int]:
    """Every tensor of the shards directly in ``input_dir`` → file 1 (the mapping torch 2.8 assumed without one)."""
    names: dict[str, int] = {}
    for name in list_shards(input_dir):
        names.update(dict.fromkeys(read_file(os.path.join(input_dir, name), name).names, 1))
    return names


def _torch_module() -> types.ModuleType:
    from torch.distributed.checkpoint import _consolidate_hf_safetensors

    return _consolidate_hf_safetensors


class _Switch:
    """What :func:`install` replaced (module, attribute, torch's function), and how many installs are open."""

    lock = threading.Lock()
    depth = 0
    replaced: list[tuple[Any, str, Any]] = []


def _ours() -> dict[str, Callable[..., Any]]:
    return {
        "consolidate_safetensors_files": consolidate_safetensors_files,
        "consolidate_safetensors_files_on_every_rank": consolidate_safetensors_files_on_every_rank,
    }


def _torch_functions() -> dict[str, Callable[..., Any]]:
    """torch's own functions (also while installed: the originals recorded then); torch 2.8 has only the first."""
    module = _torch_module()
    found = {name: vars(module).get(name) for name in REPLACED}
    for holder, name, original in _Switch.replaced:
        if holder is module:
            found[name] = original
    present = {name: function for name, function in found.items() if function is not None}
    if not present:
        raise ImportError(f"{TORCH_MODULE} has neither {' nor '.join(REPLACED)}: this torch has nothing to replace")
    return present


def install() -> None:
    """Replace torch's two consolidation functions by mpicons' in torch's module and in every module loaded
    so far that imported them by name (torch's ``hf_storage``, torchtitan's checkpointer, ...).

    Modules loaded later that import them from torch's module get mpicons' too. Nested calls are counted:
    torch's functions come back at the last matching :func:`uninstall`. Attributes are compared by
    identity with torch's function objects, through each module's ``__dict__`` (no module code runs).
    """
    with _Switch.lock:
        originals = _torch_functions()
        ours = _ours()
        by_identity = {id(function): name for name, function in originals.items()}
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for name in REPLACED:
                value = namespace.get(name)
                if value is not None and by_identity.get(id(value)) == name:
                    setattr(module, name, ours[name])
                    _Switch.replaced.append((module, name, value))
        _Switch.depth += 1


def uninstall() -> None:
    """Undo :func:`install` (the last of nested ones): torch's functions back wherever they were replaced.
    Without an install open, nothing happens."""
    with _Switch.lock:
        if _Switch.depth == 0:
            return
        _Switch.depth -= 1
        if _Switch.depth:
            return
        ours = _ours()
        for module, name, original in reversed(_Switch.replaced):
            if vars(module).get(name) is ours[name]:  # a module that rebound the name meanwhile keeps its choice
                setattr(module, name, original)
        _Switch.replaced.clear()


def installed() -> bool:
    """Whether mpicons' functions are in torch's module now."""
    return vars(_torch_module()).get(REPLACED[0]) is consolidate_safetensors_files


__all__ = [
    "consolidate_safetensors_files",
    "consolidate_safetensors_files_on_every_rank",
    "install",
    "uninstall",
    "installed",
    "MissingOutputDirectory",
]
