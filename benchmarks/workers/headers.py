"""Worker of benchmarks/planning.py: write header-only shards, split over the MPI ranks that run it.

python workers/headers.py DIRECTORY TRAINING_RANKS TENSORS OUTPUTS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KINDS = ["rows", "grid", "cols", "rows", "grid", "rows", "cols", "norm", "norm"]


def write_headers(directory: Path, training_ranks: int, tensors: int, outputs: int) -> None:
    """Header-only shards (``_headers`` worker, split over the MPI ranks that run it)."""
    from mpi4py import MPI

    sys.path.insert(0, str(REPO))
    from mpicons.core.names import shard_file_name
    from mpicons.core.safetensors_codec import build_header

    comm = MPI.COMM_WORLD
    directory.mkdir(parents=True, exist_ok=True)
    dp = 1 << (training_ranks.bit_length() // 2)
    while training_ranks % dp:
        dp //= 2
    tp = training_ranks // dp
    for f in range(comm.rank, training_ranks * outputs, comm.size):
        rank, index = divmod(f, outputs)
        pieces, info = [], {}
        for t in range(index * tensors // outputs, (index + 1) * tensors // outputs):
            kind = KINDS[t % len(KINDS)]
            name = f"model.layers.{t // len(KINDS)}.{kind}_{t % len(KINDS)}.weight"
            if kind == "rows":
                dtype, shape, offsets = "BF16", (1, 4), (rank, 0)
            elif kind == "cols":
                dtype, shape, offsets = "BF16", (1, 4), (0, 4 * rank)
            elif kind == "grid":
                dtype, shape, offsets = "BF16", (1, 4), (rank // tp, 4 * (rank % tp))
            else:
                dtype, shape, offsets = "F32", (4,), (4 * rank,)
            pieces.append((name, dtype, shape))
            info[name] = {"saved_offsets": list(offsets)}
        metadata = {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)}
        header, spans = build_header(sorted(pieces, key=lambda p: p[0]), metadata)
        with open(directory / shard_file_name(rank + 1, index + 1, outputs), "wb") as handle:
            handle.write(header)
            handle.truncate(len(header) + (spans[-1][1] if spans else 0))
    comm.Barrier()


if __name__ == "__main__":
    write_headers(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
