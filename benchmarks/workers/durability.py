"""What the workers share: flushing a consolidator's outputs after it returns.

torch does not fsync what it writes (mpicons does before it publishes), so the workers time an
fsync of torch's outputs separately, for a durable comparison.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path


def fsync_paths(paths: Iterable[Path]) -> float:
    """fsync every file in ``paths``; returns the seconds it took."""
    began = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - began
