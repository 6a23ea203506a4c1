"""Run the mpicons command line with a fault injected on one rank (test-only, via monkeypatching).

Usage: inject.py FAULT RANK -- mpicons arguments...
FAULT: ``write-oserror`` (an I/O error while writing), ``bug-after-write`` (an unexpected exception
outside any agreed phase), ``signal-write`` (the rank gets SIGTERM mid-write),
``signal-progress-start`` / ``-finish`` (the rank gets SIGTERM as the progress reporter starts /
finishes, inside the message pattern every rank must complete), ``signal-phase-start`` (the rank
gets SIGTERM as its write phase starts, before the phase's first collective call), ``slow-write``
(every rank writes slowly), ``slow-shard`` (every rank copies slowly in ``mpicons shard``),
``hold-write`` (every rank waits at its first block until the file named by ``MPICONS_TEST_RELEASE``
exists, so a test can act while a run is certainly mid-write),
``fsize-limit`` (RLIMIT_FSIZE of 200 kB on every rank), ``read-error`` (every shard read fails),
``kill-write`` (the rank SIGKILLs itself mid-write), ``publish-STEP-HOW`` (at the publishing step
whose label starts with STEP: ``error`` raises an I/O error, ``kill`` SIGKILLs the process,
``term`` sends it SIGTERM), ``stop-BYTES-HOW`` (every rank records what is durable after each block,
and stops as it starts the block after BYTES bytes of its own: ``kill`` SIGKILLs it, ``term`` sends it
SIGTERM).

The command line runs through ``mpicons.frontends.cli.run`` exactly as the console script does; the rank is
taken from the launcher's environment, so MPI starts where it always does.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import mpicons.frontends.cli
import mpicons.io.journal
import mpicons.job.consolidation
import mpicons.job.writer

fault, victim = sys.argv[1], int(sys.argv[2])
args = sys.argv[sys.argv.index("--") + 1 :]
rank = mpicons.frontends.cli.launcher_rank()

if fault == "fsize-limit":  # every rank, once MPI is up (its shared memory must not hit it): a 200 kB file-size limit
    import resource

    import mpicons.comm

    original_communicator = mpicons.comm.as_communicator

    def limited(comm):
        result = original_communicator(comm)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))
        return result

    mpicons.comm.as_communicator = limited
elif fault == "slow-write":  # every rank: slow writes, so a signal can arrive mid-write
    mpicons.job.writer.block_hook = lambda size: time.sleep(0.05)
elif fault == "slow-shard":  # every rank: slow copies in mpicons shard, so a signal can arrive mid-copy
    import mpicons.job.sharding

    mpicons.job.sharding.copy_hook = lambda size: time.sleep(0.05)
elif fault == "hold-write":  # every rank: hold the first block until the test creates the release file
    release = os.environ["MPICONS_TEST_RELEASE"]
    held = []

    def hold_first(size):
        if not held:
            held.append(size)
            while not os.path.exists(release):
                time.sleep(0.02)

    mpicons.job.writer.block_hook = hold_first
elif fault.startswith("stop-"):  # every rank: records after every block, stopped at a chosen byte
    import mpicons.job.resumption

    _, limit, how = fault.split("-")
    mpicons.job.resumption.RECORD_EVERY = 1
    written = [0]

    def stop_after(size):
        if written[0] >= int(limit):
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGTERM)
            time.sleep(30)
        written[0] += size

    mpicons.job.writer.block_hook = stop_after
elif rank == victim:
    if fault == "write-oserror":

        def failing_run(self):
            raise OSError(5, "Input/output error (injected)", "/injected/path")

        mpicons.job.writer.Writer.run = failing_run
    elif fault == "bug-after-write":

        def failing_stats(*a, **k):
            raise RuntimeError("injected bug outside an agreed phase")

        mpicons.job.consolidation.reduce_stats = failing_stats
    elif fault == "bug-before-s3-commit":  # a bug on this rank alone, outside any phase, once the uploads exist
        import mpicons.job.s3_publish

        def failing_commit(self, *a, **k):
            raise RuntimeError("injected bug before the S3 commit")

        mpicons.job.s3_publish.S3Target.publish = failing_commit
    elif fault == "read-error":  # any shard read fails, including reads for other ranks (node-local mode)
        import mpicons.io.sources

        def failing_read(self, file, offset, target):
            raise OSError(5, "Input/output error (injected)", self.path(file))

        mpicons.io.sources.SourceFiles.read_into = failing_read
    elif fault in ("kill-write", "signal-write"):  # as the rank starts its first block
        calls = []

        def stop_at_first(size):
            calls.append(size)
            if len(calls) == 1:
                if fault == "kill-write":
                    os.kill(os.getpid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)

        mpicons.job.writer.block_hook = stop_at_first
    elif fault == "signal-phase-start":  # the rank gets SIGTERM as its write phase starts, before any message
        import mpicons.job.directory_target

        original_share = mpicons.job.directory_target.write_share

        def signalled_share(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            return original_share(*a, **k)

        mpicons.job.directory_target.write_share = signalled_share
    elif fault in ("signal-progress-start", "signal-progress-finish"):  # the rank gets SIGTERM in the reporter's protocol
        import mpicons.job.progress

        name = "__init__" if fault.endswith("start") else "finish"
        original_method = getattr(mpicons.job.progress.Progress, name)

        def signalled(self, *a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            return original_method(self, *a, **k)

        setattr(mpicons.job.progress.Progress, name, signalled)
    elif fault.startswith("publish-"):
        _, step, how = fault.split("-", 2)
        step = step.replace("_", " ")

        def hook(label: str) -> None:
            if not label.startswith(step):
                return
            if how == "error":
                raise OSError(28, "No space left on device (injected)", f"<{label}>")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "term":
                os.kill(os.getpid(), signal.SIGTERM)

        mpicons.io.journal.step_hook = hook

sys.argv = ["mpicons", *args]
mpicons.frontends.cli.run()
