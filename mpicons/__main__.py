"""``python -m mpicons`` and the ``mpicons`` console script.

The signal handlers go in before anything heavy is imported and before MPI starts, so Ctrl-C
or a Slurm signal at any moment of start-up is recorded and ends every rank cleanly.
"""

from .interrupts import install_handlers

install_handlers()


def main() -> None:
    from .cli import run

    run()


if __name__ == "__main__":
    main()
