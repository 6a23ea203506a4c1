#!/usr/bin/env python3
"""One consolidation inside a torchrun job (gloo): mpicons' drop-in or torch's own function.

Started by ``benchmarks/torch_dropin.py``:

    torchrun --standalone --nproc-per-node 2 benchmarks/workers/torchrun_consolidate.py \
        {mpicons,mpicons-no-sync,torch} IN OUT MAPPING RESULT

Every process joins the default gloo group, waits at a barrier, makes the call, and the slowest
process's call time is kept. RESULT (written by rank 0) holds ``call_s``, ``sync_s`` (fsync of the
outputs afterwards, for torch, which does not fsync; mpicons does unless ``-no-sync``),
``startup_s`` (imports and the group), ``peak_rss_mb`` (the largest process) and ``mpi_imported``.
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


def main(argv: Sequence[str] | None = None) -> None:
    began = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=["mpicons", "mpicons-no-sync", "torch"])
    parser.add_argument("input_dir")
    parser.add_argument("output_dir")
    parser.add_argument("mapping", help="JSON: tensor name -> output file index from 1")
    parser.add_argument("result", help="JSON file the numbers are written to")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    if args.which == "torch":
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
    else:
        import mpicons.job.consolidation  # noqa: F401 - imported before the clock starts, as torch's module is
        from mpicons.torch import consolidate_safetensors_files_on_every_rank

    mapping = {k: int(v) for k, v in json.loads(Path(args.mapping).read_text()).items()}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.which == "torch" and rank == 0:
        os.makedirs(args.output_dir)  # torch's function writes into an existing directory
    options = {"sync": False} if args.which == "mpicons-no-sync" else {}
    dist.barrier()
    startup_s = time.perf_counter() - began
    began = time.perf_counter()
    consolidate_safetensors_files_on_every_rank(args.input_dir, args.output_dir, mapping, **options)
    dist.barrier()
    call_s = time.perf_counter() - began
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    values = torch.tensor([call_s, rss, startup_s], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    mpi_imported = "mpi4py.MPI" in sys.modules
    dist.destroy_process_group()
    if rank == 0:
        sync_s = fsync_paths(sorted(Path(args.output_dir).iterdir())) if args.which == "torch" else 0.0
        numbers = {"call_s": float(values[0]), "peak_rss_mb": float(values[1]), "startup_s": float(values[2])}
        Path(args.result).write_text(json.dumps(numbers | {"sync_s": sync_s, "mpi_imported": mpi_imported}))


if __name__ == "__main__":
    main()
