"""Output formats: what a layout becomes on disk, and which names a run publishes (no MPI here).

The job (:mod:`mpicons.job.consolidation`) asks the format, never tests for one: ``safetensors``
publishes the files of the layout and the index last; ``hdf5`` lays one ``model.h5`` out with
h5py (on the rank owning the output directory) and publishes that.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

from ..core.errors import InputError
from ..core.layout import Layout
from ..core.names import INDEX_NAME
from .hdf5 import HDF5_NAME, check_names, create_layout, retarget


class OutputFormat(Protocol):
    name: str
    #: Whether an older checkpoint's files (its naming pattern, its index's files) count as replaced entries.
    checkpoint: bool
    #: Whether the staged files exist with their layout before the backends open them.
    preallocated: bool

    def check(self, layout: Layout) -> None:
        """Refuse, before anything is written, a layout this format cannot hold."""

    def target(self, layout: Layout) -> Layout:
        """The layout re-aimed at this format's files (before their offsets are known)."""

    def lay_out(self, staging: str, layout: Layout) -> Layout:
        """Create the staged files that need it (owner rank only) and return the final layout."""

    def final_names(self, layout: Layout) -> list[str]:
        """What a run publishes, in publishing order: the last name is the commit point."""

    def index(self, layout: Layout) -> bytes | None:
        """The index file's bytes (published last), if the format has one."""


class Safetensors:
    """Hugging Face safetensors files and ``model.safetensors.index.json`` (none beside a lone ``model.safetensors``)."""

    name = "safetensors"
    checkpoint = True
    preallocated = False

    def check(self, layout: Layout) -> None:
        pass

    def target(self, layout: Layout) -> Layout:
        return layout

    def lay_out(self, staging: str, layout: Layout) -> Layout:
        return layout  # the backends create the files (header, size)

    def final_names(self, layout: Layout) -> list[str]:
        return [f.name for f in layout.files] + ([INDEX_NAME] if layout.has_index else [])

    def index(self, layout: Layout) -> bytes | None:
        return (json.dumps(layout.index(), indent=2) + "\n").encode() if layout.has_index else None


class HDF5:
    """One ``model.h5`` of contiguous datasets, laid out by h5py, filled by the same offset writes."""

    name = "hdf5"
    checkpoint = False
    preallocated = True

    def check(self, layout: Layout) -> None:
        check_names(layout)

    def target(self, layout: Layout) -> Layout:
        return retarget(layout, [0] * len(layout.tensors), 0)

    def lay_out(self, staging: str, layout: Layout) -> Layout:
        path = os.path.join(staging, HDF5_NAME)
        offsets = create_layout(path, layout)
        return retarget(layout, offsets, os.path.getsize(path))

    def final_names(self, layout: Layout) -> list[str]:
        return [HDF5_NAME]

    def index(self, layout: Layout) -> bytes | None:
        return None


FORMATS: dict[str, OutputFormat] = {"safetensors": Safetensors(), "hdf5": HDF5()}


def output_format(name: str) -> OutputFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise InputError(f"unknown output format {name!r} (choose from {', '.join(FORMATS)})") from None
