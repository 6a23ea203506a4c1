"""Run the mpicons command line and print this process's peak RSS (MB) during the run.

The high-water mark is reset first (``/proc/self/clear_refs``), so start-up (interpreter, numpy,
MPI initialisation, whose memory varies with the MPI transport) is not counted: what remains is
what the consolidation itself needs.
"""

from __future__ import annotations

import sys

from mpi4py import MPI  # noqa: F401 - initialise MPI before the measurement starts

import mpicons.frontends.cli


def high_water_mark_mb() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


reset_high_water_mark()
start = high_water_mark_mb()
code = mpicons.frontends.cli.main(sys.argv[1:])
print(f"PEAK_RSS_MB {high_water_mark_mb():.1f} START_RSS_MB {start:.1f}", flush=True)
sys.exit(code)
