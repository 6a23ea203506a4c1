#!/usr/bin/env python3
"""Time torch's consolidation call itself (its import excluded) and write the numbers to RESULT.

Started by ``dense.run_torch_once``: one process runs ``consolidate_safetensors_files``; with
``--every-rank``, under mpiexec, every rank joins a gloo group and runs
``consolidate_safetensors_files_on_every_rank``.

    python benchmarks/workers/torch_consolidate.py IN OUT MAPPING RESULT [--threads N] [--every-rank]

RESULT (written by rank 0) holds ``import_s``, ``call_s`` (the slowest rank), ``sync_s`` (fsync of
the outputs afterwards, which torch does not do and mpicons does), ``peak_rss_mb`` (the largest
rank) and ``error`` (empty, or the exception the call raised).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path

from durability import fsync_paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input_dir")
    parser.add_argument("output_dir")
    parser.add_argument("mapping", help="JSON: tensor name -> output file index from 1")
    parser.add_argument("result", help="JSON file the numbers are written to")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--every-rank", action="store_true")
    args = parser.parse_args(argv)

    began = time.perf_counter()
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as hf

    import_s = time.perf_counter() - began
    mapping = {k: int(v) for k, v in json.loads(Path(args.mapping).read_text()).items()}
    rank, size = 0, 1
    if args.every_rank:
        rank, size = int(os.environ.get("PMI_RANK", "0")), int(os.environ.get("PMI_SIZE", "1"))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(size))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        dist.barrier()
    error = ""
    began = time.perf_counter()
    try:
        if args.every_rank:
            hf.consolidate_safetensors_files_on_every_rank(args.input_dir, args.output_dir, mapping, num_threads=args.threads)
        else:
            hf.consolidate_safetensors_files(
                args.input_dir, args.output_dir, fqn_to_index_mapping=mapping, num_threads=args.threads
            )
    except Exception as exc:  # noqa: BLE001 - reported to the driver (e.g. torch.finfo on int tensors)
        error = f"{type(exc).__name__}: {exc}"
    call_s = time.perf_counter() - began
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.every_rank:
        values = torch.tensor([call_s, rss, float(bool(error))], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        call_s, rss = float(values[0]), float(values[1])
        dist.destroy_process_group()
    if rank == 0:
        sync_s = fsync_paths(sorted(Path(args.output_dir).iterdir()))
        Path(args.result).write_text(
            json.dumps({"import_s": import_s, "call_s": call_s, "sync_s": sync_s, "peak_rss_mb": rss, "error": error})
        )


if __name__ == "__main__":
    main()
