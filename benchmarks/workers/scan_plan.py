"""Worker of benchmarks/planning.py: time scan + plan under MPI; rank 0 writes the slowest times and the largest peak.

python workers/scan_plan.py DIRECTORY RESULT_JSON
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def measure(directory: Path, result: Path) -> None:
    """``_measure`` worker: scan and plan under MPI; rank 0 writes the slowest times and the largest peak."""
    import resource

    from mpi4py import MPI

    sys.path.insert(0, str(REPO))
    from mpicons.comm import as_communicator
    from mpicons.core.planner import build_layout
    from mpicons.job.scan import scan
    from mpicons.job.shares import distribute

    comm = MPI.COMM_WORLD
    wrapped = as_communicator(comm)  # mpicons' communicator interface over the same MPI communicator
    comm.Barrier()
    began = time.perf_counter()
    scanned = scan(str(directory), wrapped)
    scanned_at = time.perf_counter()
    layout = build_layout(scanned.files, scanned.names, scanned.facts, comm.size)
    part = distribute(wrapped, scanned, layout)
    planned = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    values = comm.gather((scanned_at - began, planned - scanned_at, rss, len(part.pieces)), root=0)
    if comm.rank == 0:
        result.write_text(
            json.dumps(
                {
                    "scan_s": max(v[0] for v in values),
                    "plan_s": max(v[1] for v in values),
                    "peak_rss_mb": max(v[2] for v in values),
                    "pieces_per_rank": [v[3] for v in values],
                    "pieces": int(scanned.facts.count.sum()),
                    "files": len(scanned.files),
                    "tensors": len(scanned.names),
                }
            )
        )


if __name__ == "__main__":
    measure(Path(sys.argv[1]), Path(sys.argv[2]))
