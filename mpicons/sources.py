"""Reading shard files: read-only handles in a bounded cache, reads below 2 GiB each (no MPI here)."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable, Sequence

from .errors import WriteError

#: Largest single read, write or copy_file_range call (below the C ``int`` limit of many MPI builds and kernels).
MAX_TRANSFER = 1 << 30


class SourceFiles:
    """Read-only handles on the shard files, opened on first use and kept in a bounded cache."""

    def __init__(self, directory: str, names: Sequence[str], max_open: int = 256) -> None:
        self.directory = directory
        self.names = names
        self.max_open = max_open
        self._open: OrderedDict[int, int] = OrderedDict()
        #: Called before a handle is closed to make room, so background I/O never loses its file.
        self.before_close: Callable[[], None] = lambda: None

    def path(self, file: int) -> str:
        return os.path.join(self.directory, self.names[file])

    def fd(self, file: int) -> int:
        fd = self._open.get(file)
        if fd is not None:
            self._open.move_to_end(file)
            return fd
        try:
            fd = os.open(self.path(file), os.O_RDONLY)
        except OSError as exc:
            raise WriteError(f"{self.path(file)}: cannot open shard ({exc.strerror})") from None
        self._open[file] = fd
        if len(self._open) > self.max_open:
            self.before_close()
            _, old = self._open.popitem(last=False)
            os.close(old)
        return fd

    def read_into(self, file: int, offset: int, target: memoryview) -> None:
        """Fill ``target`` with the bytes at ``offset`` of shard ``file``."""
        fd = self.fd(file)
        done, total = 0, len(target)
        while done < total:
            try:
                got = os.preadv(fd, [target[done : done + MAX_TRANSFER]], offset + done)
            except OSError as exc:
                raise WriteError(f"{self.path(file)}: read failed at byte {offset + done} ({exc.strerror})") from None
            if got == 0:
                raise WriteError(f"{self.path(file)}: ends before byte {offset + total} (file truncated since the scan?)")
            done += got

    def close(self) -> None:
        while self._open:
            os.close(self._open.popitem()[1])
