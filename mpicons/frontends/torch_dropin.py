"""torch's ``consolidate_safetensors_files_on_every_rank``, done by mpicons (documented as ``mpicons.torch``).

It has the signature of torch's function of that name
(``torch.distributed.checkpoint._consolidate_hf_safetensors``): a torchtitan user switches with one
import. The output is mpicons': byte-identical to safetensors' serializer, split by bytes over the
ranks, checked, published atomically. It lives above the job it calls; the process group becomes a
communicator through :class:`~mpicons.comm.torch_group.TorchComm`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ..comm import SingleProcess
from ..comm.torch_group import TorchComm


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
        output_dir: where ``model-IIIII-of-NNNNN.safetensors`` and the index go; may be the input's parent
            (torchtitan's ``CHECKPOINT/sharded`` → ``CHECKPOINT``), never an input directory nor inside one.
        fqn_to_index_mapping: tensor name → output file index from 1, as for torch; must name exactly
            the checkpoint's tensors.
        num_threads: accepted for compatibility; mpicons' parallelism is the group's ranks (each with
            one background I/O thread).
        process_group: the group whose members call this (default: the default group); a group
            that cannot move CPU tensors (NCCL) is paired with a gloo group once.
        options: any :class:`~mpicons.core.options.Options` field (``force=True`` to replace an existing
            checkpoint in ``output_dir``, ``buffer_size``, ``split``, ...).

    Collective over the group. When torch.distributed is not initialized, this process alone does the
    work (as torch's function does then), without MPI. Returns the :class:`~mpicons.job.consolidation.ConsolidateResult` (torch's
    returns None); raises :class:`~mpicons.core.errors.InputError` / ``WriteError`` on every member alike.
    """
    from ..job.consolidation import consolidate  # the job loads when it runs, not with mpicons.torch

    del num_threads
    alone = process_group is None and not (dist.is_available() and dist.is_initialized())
    comm = SingleProcess() if alone else TorchComm(process_group)
    return consolidate(input_dir, output_dir, comm=comm, mapping=dict(fqn_to_index_mapping), **options)


__all__ = ["consolidate_safetensors_files_on_every_rank"]
