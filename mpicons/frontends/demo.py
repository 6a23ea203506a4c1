"""``mpicons demo``'s directory: written only where nothing of anyone else's can be lost.

The demo writes into a directory that is new or empty, or over its own earlier sample, which it
recognises by the marker ``DIR/.mpicons-demo``: every file it made, with the size, modification time
and inode it had when made (a file changed since is no longer the demo's). The names of a sample's
files are recorded before they are created (exclusively), so a run stopped half-way leaves files
the next run still knows as its own. Anything else in the directory is bad input, found by rank 0
and agreed by every rank before a byte is written. The consolidated output follows
``consolidate``'s rules: a checkpoint there that the demo did not make is replaced only with
``--force``, and then in consolidate's one transaction.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..comm import Communicator
from ..comm.agreement import agree_on
from ..core.errors import InputError
from ..core.names import plain_file_name
from ..io.journal import describe_names
from ..io.outdir import checkpoint_entries, refuse_sharded
from ..io.regular_files import read_own_file, write_new_file

#: The demo's record of what it made in its directory.
MARKER = ".mpicons-demo"
#: The marker's next version while it is written (renamed over the marker).
_MARKER_NEW = MARKER + ".new"
#: Where the demo's sample is consolidated to.
OUTPUT = "consolidated"
_MARKER_LIMIT = 1 << 20
_MADE_BY = "mpicons demo"

#: A file's (size, modification time in ns, inode) when the demo made it; None while it is being made.
Stamp = list[int]


def _stamp(info: os.stat_result) -> Stamp:
    return [info.st_size, info.st_mtime_ns, info.st_ino]


def _parse(data: bytes) -> dict[str, Stamp | None] | None:
    """The marker's files, or None when ``data`` is not a marker the demo wrote."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("made_by") != _MADE_BY or not isinstance(obj.get("files"), dict):
        return None
    for relative, stamp in obj["files"].items():
        parts = relative.split("/")
        if len(parts) != 2 or not all(plain_file_name(part) for part in parts):
            return None
        if stamp is not None and not (isinstance(stamp, list) and len(stamp) == 3 and all(type(x) is int for x in stamp)):
            return None
    files: dict[str, Stamp | None] = obj["files"]
    return files


@dataclass
class Marker:
    """What the demo made in ``directory``: path relative to it → the file's stamp when made."""

    directory: str
    files: dict[str, Stamp | None] = field(default_factory=dict)

    @classmethod
    def read(cls, directory: str) -> Marker:
        """The directory's marker (an empty one when there is none); bad input when it is not the demo's."""
        path = os.path.join(directory, MARKER)
        found = read_own_file(path, _MARKER_LIMIT + 1)
        if found is None:
            return cls(directory)
        files = _parse(found.data) if found.kind == "regular file" and len(found.data) <= _MARKER_LIMIT else None
        if files is None:
            what = "not a marker mpicons demo wrote" if found.kind == "regular file" else f"{found.kind}, not the demo's marker"
            raise InputError(
                f"{path}: {what}, so the demo cannot tell its own files in {directory} from anyone else's; "
                "nothing was written. Give the demo another directory (mpicons demo NEW_DIR)"
            )
        return cls(directory, dict(files))

    def owns(self, relative: str) -> bool:
        """``relative`` is a regular file the demo made (or was making) and nobody has changed since."""
        if relative not in self.files:
            return False
        try:
            info = os.lstat(os.path.join(self.directory, relative))
        except FileNotFoundError:
            return False
        stamp = self.files[relative]
        return stat.S_ISREG(info.st_mode) and (stamp is None or stamp == _stamp(info))

    def subdirectories(self) -> set[str]:
        """The directories holding the demo's samples (its output aside)."""
        return {relative.split("/")[0] for relative in self.files} - {OUTPUT}

    def record(self, relatives: Iterable[str]) -> None:
        """Stamp the files ``relatives`` as they are now (those absent are forgotten)."""
        for relative in relatives:
            try:
                self.files[relative] = _stamp(os.lstat(os.path.join(self.directory, relative)))
            except FileNotFoundError:
                self.files.pop(relative, None)

    def write(self) -> None:
        """Replace the marker by one rename: a run stopped meanwhile leaves the old marker or the new one."""
        new = os.path.join(self.directory, _MARKER_NEW)
        try:
            os.unlink(new)  # left by a run stopped while writing it (the survey saw a regular file)
        except FileNotFoundError:
            pass
        text = json.dumps({"made_by": _MADE_BY, "files": self.files}, indent=1, sort_keys=True) + "\n"
        write_new_file(new, text.encode())
        os.replace(new, os.path.join(self.directory, MARKER))


@dataclass(frozen=True)
class Survey:
    """What rank 0 found in the demo's directory, before anything is written."""

    #: The demo's own files of an earlier sample where the new one goes: removed before it is written.
    stale: list[str]
    #: Consolidate with ``force``: the output holds the demo's own checkpoint, or ``--force`` was given.
    replace: bool


def _is_regular(path: str) -> bool:
    return stat.S_ISREG(os.lstat(path).st_mode)


def _is_directory(path: str) -> bool:
    """A directory itself, not a link to one: the demo made its directories itself."""
    return stat.S_ISDIR(os.lstat(path).st_mode)


def survey(directory: str, sample: str, force: bool) -> Survey:
    """Refuse, before anything is written, a directory holding what the demo did not make.

    ``sample`` is the subdirectory the sample goes to: it may be absent, empty or hold the demo's own
    files. Other samples of the demo may be there too (left as they are), and its output directory,
    which follows consolidate's rules (:func:`_output_replace`). Anything else is bad input.
    """
    if not os.path.lexists(directory):
        return Survey([], force)
    if not os.path.isdir(directory):
        raise InputError(f"{directory}: exists and is not a directory; mpicons demo needs a new or empty directory")
    marker = Marker.read(directory)
    foreign: list[str] = []
    stale: list[str] = []
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if entry in (MARKER, OUTPUT) or (entry == _MARKER_NEW and _is_regular(path)):
            continue
        if (entry != sample and entry not in marker.subdirectories()) or not _is_directory(path):
            foreign.append(entry)
            continue
        for name in sorted(os.listdir(path)):
            relative = f"{entry}/{name}"
            if not marker.owns(relative):
                foreign.append(relative)
            elif entry == sample:
                stale.append(relative)
    if foreign:
        raise InputError(
            f"{directory}: holds {describe_names(foreign)}, which mpicons demo did not write; the demo writes only "
            "into a new or empty directory or over its own earlier sample, and has written nothing. Give it another "
            "directory (mpicons demo NEW_DIR), or move those away"
        )
    return Survey(stale, _output_replace(directory, marker, force))


def _output_replace(directory: str, marker: Marker, force: bool) -> bool:
    """Whether the consolidation may replace the checkpoint in the output directory: refused up front
    (as consolidate would refuse it, but before the sample is written) when the demo did not make it."""
    output = os.path.join(directory, OUTPUT)
    if not os.path.lexists(output):
        return force
    if not os.path.isdir(output):
        raise InputError(
            f"{output}: exists and is not a directory, so the demo cannot consolidate into it; nothing was written. "
            "Move it away, or give the demo another directory (mpicons demo NEW_DIR)"
        )
    refuse_sharded(output)
    present = checkpoint_entries(output)
    theirs = [name for name in present if not marker.owns(f"{OUTPUT}/{name}")]
    if theirs and not force:
        raise InputError(
            f"{output}: already holds a checkpoint the demo did not make ({describe_names(theirs)}); nothing was "
            "written. Use --force to replace it (in one transaction, as mpicons consolidate does), or give the "
            "demo another directory (mpicons demo NEW_DIR)"
        )
    return force or bool(present)


def prepare(directory: str, sample: str, found: Survey, names: Iterable[str]) -> None:
    """Make the directories, remove the demo's own earlier sample where the new one goes, and record the
    new sample's file names before they are created."""
    os.makedirs(os.path.join(directory, sample), exist_ok=True)
    marker = Marker.read(directory)
    for relative in found.stale:
        if marker.owns(relative):  # looked at again just before: only the demo's own files go
            os.unlink(os.path.join(directory, relative))
            marker.files.pop(relative)
    marker.files.update({f"{sample}/{name}": None for name in names})
    marker.write()


@dataclass(frozen=True)
class DemoDirectory:
    """The demo's directory: ``path/<sample>`` for the sample, ``path/consolidated`` for its consolidation."""

    path: str
    sample_name: str

    @property
    def sample(self) -> str:
        return os.path.join(self.path, self.sample_name)

    @property
    def output(self) -> str:
        return os.path.join(self.path, OUTPUT)

    def claim(self, comm: Communicator, names: list[str], force: bool) -> bool:
        """Rank 0 surveys the directory and makes it ready for a sample of files ``names``, or every rank
        raises the same :class:`InputError` with nothing written. Returns whether the consolidation may
        replace what is in the output directory (``force`` for :func:`~mpicons.consolidate`)."""

        def work() -> bool:
            found = survey(self.path, self.sample_name, force)
            prepare(self.path, self.sample_name, found, names)
            return found.replace

        return agree_on(comm, 0, work)

    def record_sample(self, comm: Communicator, names: list[str]) -> None:
        """Stamp the sample's files now that they are written."""
        agree_on(comm, 0, lambda: self._record([f"{self.sample_name}/{name}" for name in names]))

    def record_output(self, comm: Communicator, names: list[str]) -> None:
        """Stamp the consolidated checkpoint's files (``names``), forgetting those of an earlier one."""
        agree_on(comm, 0, lambda: self._record([f"{OUTPUT}/{name}" for name in names], forget=OUTPUT))

    def _record(self, relatives: list[str], forget: str | None = None) -> None:
        marker = Marker.read(self.path)
        if forget is not None:
            marker.files = {r: s for r, s in marker.files.items() if r.split("/")[0] != forget}
        marker.record(relatives)
        marker.write()


__all__ = ["DemoDirectory", "Marker", "MARKER", "OUTPUT", "survey"]
