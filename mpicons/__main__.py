"""``python -m mpicons`` and the ``mpicons`` console script.

The signal handlers go in before anything heavy is imported and before MPI starts, so Ctrl-C
or a Slurm signal at any moment of start-up is recorded and ends every rank cleanly. Memory
running out while the command line itself loads is the same one line as anywhere later.
"""

import os
import signal
import sys


def main() -> None:
    try:
        from .comm.interrupts import install_handlers

        install_handlers()
        # mpicons does no linear algebra: one BLAS thread spares each rank the other threads' buffers.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        from .core.machine import NUMPY_START_ROOM, check_room_to_start

        if "numpy" not in sys.modules:
            check_room_to_start("numpy", NUMPY_START_ROOM)
        from .frontends.cli import run
    except BaseException as exc:  # noqa: BLE001 - nothing may escape as a traceback
        sys.exit(_could_not_start(exc))
    run()


def _could_not_start(exc: BaseException) -> int:
    """The exit code for a failure before the runner is there (out of memory, most likely)."""
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else 1
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C before the handlers were in: end as Ctrl-C does
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signal.SIGINT)
    try:
        from .core.machine import memory_exhausted, out_of_memory_line
        from .core.messages import ERROR
    except BaseException:  # noqa: BLE001 - not even that loads: memory is what is missing (the tag spelt out)
        sys.stderr.write("mpicons: error: out of memory\n")
        return 1
    if memory_exhausted(exc):
        what = out_of_memory_line()
    else:
        what = f"cannot start: {type(exc).__name__}: {exc}"
    sys.stderr.write(f"{ERROR}{what}\n")
    return 1


if __name__ == "__main__":
    main()
