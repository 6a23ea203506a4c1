"""Run the mpicons command line with a fault injected on one rank (test-only, via monkeypatching).

Usage: inject.py FAULT RANK -- mpicons arguments...
FAULT: ``write-oserror`` (an I/O error while writing), ``bug-after-write`` (an unexpected exception
outside any agreed phase), ``hang-write`` (the rank sleeps instead of writing), ``kill-write``
(the rank SIGKILLs itself mid-write).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from mpi4py import MPI

import mpicons.cli
import mpicons.consolidation
import mpicons.copy

fault, victim = sys.argv[1], int(sys.argv[2])
args = sys.argv[sys.argv.index("--") + 1 :]
rank = MPI.COMM_WORLD.rank

if rank == victim:
    if fault == "write-oserror":
        def failing_run(self, items):
            raise OSError(5, "Input/output error (injected)", "/injected/path")

        mpicons.copy.Executor.run = failing_run
    elif fault == "bug-after-write":
        def failing_stats(*a, **k):
            raise RuntimeError("injected bug outside an agreed phase")

        mpicons.consolidation.reduce_stats = failing_stats
    elif fault == "kill-write":
        original = mpicons.copy.Executor.write_item

        def killing_write(self, item):
            original(self, item)
            os.kill(os.getpid(), signal.SIGKILL)

        mpicons.copy.Executor.write_item = killing_write
    elif fault == "signal-write":
        original = mpicons.copy.Executor.write_item

        def signalled_write(self, item):
            original(self, item)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)

        mpicons.copy.Executor.write_item = signalled_write

sys.exit(mpicons.cli.main(args))
