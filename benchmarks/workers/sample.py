#!/usr/bin/env python3
"""Write the mpicons sample checkpoint of about SIZE bytes into DIR, split over MPI.COMM_WORLD.

Started by ``dense.ensure_sample`` under mpiexec, with PYTHONPATH naming the mpicons snapshot:

    mpiexec -n 2 python benchmarks/workers/sample.py DIR SIZE [--float-only]

``--float-only`` leaves out the integer and bool buffers: torch's consolidator calls ``torch.finfo``
on every dtype and so crashes on them; the float tensors are cut and valued exactly as in the full
sample.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from mpi4py import MPI

from mpicons.core.safetensors_codec import DTYPE_BY_NAME
from mpicons.sample import SampleConfig, write_sample


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("size", type=int, help="bytes")
    parser.add_argument("--float-only", action="store_true", help="only the floating-point tensors")
    args = parser.parse_args(argv)
    config = SampleConfig.sized(args.size)
    if args.float_only:
        write_sample(args.directory, config, MPI.COMM_WORLD, keep=lambda name, dtype: DTYPE_BY_NAME[dtype].is_float)
    else:
        write_sample(args.directory, config, MPI.COMM_WORLD)


if __name__ == "__main__":
    main()
