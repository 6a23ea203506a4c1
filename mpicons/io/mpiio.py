"""The MPI-IO output backend: files created collectively with ``MPI.File`` (hints such as Lustre striping
apply at creation), written with independent ``Write_at`` through per-rank handles."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from mpi4py import MPI

from ..comm.interrupts import deferred
from ..core.errors import WriteError
from .outputs import MAX_OPEN_OUTPUTS, _bounce_copy, _Output
from .sources import MAX_TRANSFER, CachedHandles, HandleCache, SourceFiles


class MpiioOutput(_Output, CachedHandles):
    """Outputs created collectively with ``MPI.File`` on the communicator (hints such as striping apply
    there), then written with independent ``Write_at`` through per-rank handles opened when needed
    (at most ``MAX_OPEN_OUTPUTS`` at once)."""

    name = "mpiio"
    threaded = False

    def __init__(self, *args: object, hints: Mapping[str, str] | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.hints = dict(hints or {})
        self._cache: HandleCache[MPI.File] = HandleCache(self._open, self._retire, MAX_OPEN_OUTPUTS)
        self._in_effect: dict[str, str] = {}

    def _info(self) -> MPI.Info:
        info = MPI.Info.Create()
        for key, value in self.hints.items():
            info.Set(key, value)
        return info

    def create(self) -> None:
        """Collectively create every output exclusively, size it and write its header (rank 0), one at a time.

        Collective calls every rank must complete: a signal is only recorded meanwhile (raised after).
        """
        with deferred():
            self._create_all()

    def _create_all(self) -> None:
        info = self._info()
        try:
            for path, header, size in zip(self.paths, self.headers, self.sizes):
                try:
                    mode = MPI.MODE_WRONLY | (0 if self.preallocated else MPI.MODE_CREATE | MPI.MODE_EXCL)
                    handle = MPI.File.Open(self.comm.mpi, path, mode, info)  # type: ignore[attr-defined]
                except MPI.Exception as exc:
                    raise WriteError(f"{path}: cannot create output with MPI-IO ({mpi_error_text(exc)})") from None
                try:
                    if not self._in_effect:
                        self._in_effect = _info_items(handle)
                    if not self.preallocated:
                        handle.Set_size(size)
                        if self.comm.rank == 0:
                            handle.Write_at(0, header)
                except MPI.Exception as exc:
                    raise WriteError(f"{path}: cannot size output with MPI-IO ({mpi_error_text(exc)})") from None
                finally:
                    handle.Close()
        finally:
            info.Free()

    def hints_in_effect(self) -> dict[str, str]:
        """The hints the MPI library reported for the first output (unknown hints are dropped silently)."""
        return dict(self._in_effect)

    def _handle(self, file: int) -> MPI.File:
        return self._cache.get(file)

    def _open(self, file: int) -> MPI.File:
        info = self._info()
        try:
            return MPI.File.Open(MPI.COMM_SELF, self.paths[file], MPI.MODE_WRONLY, info)
        except MPI.Exception as exc:
            raise WriteError(f"{self.paths[file]}: cannot open output with MPI-IO ({mpi_error_text(exc)})") from None
        finally:
            info.Free()

    def _retire(self, file: int, handle: MPI.File) -> None:
        try:
            self._sync_one(file, handle)
        finally:
            handle.Close()

    def open(self, file: int) -> None:
        self._handle(file)

    def write(self, file: int, offset: int, data: memoryview) -> None:
        handle = self._handle(file)
        for start in range(0, len(data), MAX_TRANSFER):
            try:
                handle.Write_at(offset + start, data[start : start + MAX_TRANSFER])
            except MPI.Exception as exc:
                raise WriteError(f"{self.paths[file]}: write failed at byte {offset + start} ({mpi_error_text(exc)})") from None

    def copy(
        self, sources: SourceFiles, src: int, src_offset: int, file: int, offset: int, length: int, bounce: np.ndarray
    ) -> None:
        _bounce_copy(self, sources, src, src_offset, file, offset, length, bounce)

    def _sync_one(self, file: int, handle: MPI.File) -> None:
        if not self.durable:
            return
        try:
            handle.Sync()
        except MPI.Exception as exc:
            raise WriteError(f"{self.paths[file]}: sync failed ({mpi_error_text(exc)})") from None

    def sync(self) -> None:
        for file, handle in self._cache.handles.items():
            self._sync_one(file, handle)

    def close(self) -> None:
        while self._cache.handles:
            self._cache.handles.popitem()[1].Close()


def _info_items(handle: MPI.File) -> dict[str, str]:
    info = handle.Get_info()
    try:
        return {info.Get_nthkey(i): info.Get(info.Get_nthkey(i)) or "" for i in range(info.Get_nkeys())}
    finally:
        info.Free()


#: MPI error classes with a plain cause; others are reduced to the innermost line of the MPI error stack.
_MPI_CAUSES = {
    "ERR_NO_SPACE": "No space left on device",
    "ERR_QUOTA": "Disk quota exceeded",
    "ERR_READ_ONLY": "Read-only file system",
    "ERR_ACCESS": "Permission denied",
    "ERR_FILE_EXISTS": "File exists",
    "ERR_NO_SUCH_FILE": "No such file or directory",
    "ERR_FILE_IN_USE": "File in use",
}


def mpi_error_text(exc: MPI.Exception) -> str:
    """One line for an MPI error: the cause, not MPICH's multi-line error stack."""
    error_class = exc.Get_error_class()
    for name, text in _MPI_CAUSES.items():
        if error_class == getattr(MPI, name, None):
            return text
    lines = [line.strip(" ,") for line in exc.Get_error_string().splitlines() if line.strip()]
    return lines[-1] if lines else f"MPI error class {error_class}"
