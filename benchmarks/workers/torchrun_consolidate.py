#!/usr/bin/env python3
"""Inside a torchrun job (gloo): save a checkpoint with torch's writer, or one consolidation by
mpicons' drop-ins or torch's own functions.

Started by ``benchmarks/torch_dropin.py``:

    torchrun --standalone --nproc-per-node 2 benchmarks/workers/torchrun_consolidate.py save OUT BYTES TENSORS
    torchrun --standalone --nproc-per-node 2 benchmarks/workers/torchrun_consolidate.py \\
        {mpicons,mpicons-no-sync,torch,mpicons-one,torch-one} IN OUT MAPPING RESULT [--threads N]

``save``: ``TENSORS`` float32/bf16 tensors of about ``BYTES`` in all, row-sharded over the processes,
saved by DCP's ``HuggingFaceStorageWriter(save_distributed=True)`` (``shard-*-model-00001-of-00001``).
``mpicons``/``torch``: every process calls ``consolidate_safetensors_files_on_every_rank``; ``-one``:
rank 0 alone calls ``consolidate_safetensors_files`` while the others wait in a barrier (what torch's
writer does with ``enable_consolidation``). Every process waits at a barrier before and after the call;
the slowest process's call time is kept. RESULT (written by rank 0) holds ``call_s``, ``sync_s``
(fsync of the outputs afterwards, for torch, which does not fsync), ``startup_s``, ``rss_mb`` (each
process's peak) and ``mpi_imported``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from durability import fsync_paths

CASES = ["mpicons", "mpicons-no-sync", "torch", "mpicons-one", "torch-one"]


def save(output_dir: str, total: int, count: int) -> None:
    """A torch-written sharded checkpoint: each process saves its rows of every tensor."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    size, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (size,))
    columns = 1024
    rows = max(size, total // (count * columns * 4))
    generator = torch.Generator().manual_seed(rank)
    state = {}
    for i in range(count):
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        shape = (rows + i % size, columns)  # some tensors split unevenly
        local = (shape[0] + size - 1) // size
        mine = max(0, min(local, shape[0] - rank * local))
        piece = torch.randn(mine, columns, generator=generator).to(dtype)
        state[f"layers.{i}.weight"] = DTensor.from_local(piece, mesh, [Shard(0)], shape=shape, stride=(columns, 1))
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(output_dir, save_distributed=True))
    dist.barrier()
    dist.destroy_process_group()


def consolidate(args: argparse.Namespace) -> None:
    began = time.perf_counter()
    import torch  # noqa: F401 - its import is start-up, for both sides
    import torch.distributed as dist

    if args.which.startswith("torch"):
        from torch.distributed.checkpoint import _consolidate_hf_safetensors as functions
    else:
        import mpicons.job.consolidation  # noqa: F401 - imported before the clock starts, as torch's module is
        import mpicons.torch as functions  # type: ignore[no-redef]

    mapping = {k: int(v) for k, v in json.loads(Path(args.mapping).read_text()).items()}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(args.output_dir)  # torch's functions (and so the drop-ins) write into an existing directory
    options = {"sync": False} if args.which == "mpicons-no-sync" else {}
    dist.barrier()
    startup_s = time.perf_counter() - began
    began = time.perf_counter()
    if args.which.endswith("-one"):
        if rank == 0:
            functions.consolidate_safetensors_files(args.input_dir, args.output_dir, mapping, num_threads=args.threads)
    else:
        functions.consolidate_safetensors_files_on_every_rank(
            args.input_dir, args.output_dir, mapping, num_threads=args.threads, **options
        )
    dist.barrier()
    call_s = time.perf_counter() - began
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gathered: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * dist.get_world_size()
    dist.all_gather_object(gathered, (call_s, rss, startup_s))
    mpi_imported = "mpi4py.MPI" in sys.modules
    dist.destroy_process_group()
    if rank == 0:
        sync_s = fsync_paths(sorted(Path(args.output_dir).iterdir())) if args.which.startswith("torch") else 0.0
        numbers = {
            "call_s": max(g[0] for g in gathered),
            "rss_mb": [g[1] for g in gathered],
            "startup_s": max(g[2] for g in gathered),
        }
        Path(args.result).write_text(json.dumps(numbers | {"sync_s": sync_s, "mpi_imported": mpi_imported}))


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "save":
        save(argv[1], int(argv[2]), int(argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=CASES)
    parser.add_argument("input_dir")
    parser.add_argument("output_dir")
    parser.add_argument("mapping", help="JSON: tensor name -> output file index from 1")
    parser.add_argument("result", help="JSON file the numbers are written to")
    parser.add_argument("--threads", type=int, default=1, help="num_threads of the call")
    consolidate(parser.parse_args(argv))


if __name__ == "__main__":
    main()
