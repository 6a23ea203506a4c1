"""``verify OUT`` with a ``SHA256SUMS``: every listed file hashed over the ranks, every file present accounted for.

Rank 0 reads the manifest as verify reads an index (a regular file, bounded, through a link only with
``follow_links``), looks at every file it lists and lists the regular files present. A listed file is
opened only as verify opens anything: a regular file inside the directory, the folders on its way
real folders (a link to a folder is never followed, so nothing outside the directory is read). The
ranks then hash the listed files, each whole by one rank, spread by bytes
(:func:`~mpicons.job.checksums.hash_over_ranks`). What is wrong travels as
:class:`~mpicons.core.reports.Problem` values: ``checksum``, ``missing file``, ``unlisted``,
``manifest``, ``refused``, ``unreadable``. ``inspect`` only says how many files a manifest lists.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..comm.agreement import Comm, agree, agree_on
from ..core.errors import WriteError
from ..core.reports import Problem
from ..core.reports import count_of as _count
from ..io.manifest import MANIFEST_LIMIT, MANIFEST_NAME, parse_manifest
from ..io.regular_files import NotRegular, kind_of, read_bounded
from ..io.s3 import is_s3
from ..job.checksums import hash_over_ranks
from .output_reading import Unreadable, open_regular, refusal
from .verify_checks import file_problem


@dataclass
class _Found:
    """What rank 0 found: the manifest's digests, the listed files verify may hash (name → size), and
    the problems of the rest (the manifest unusable, listed files missing or not opened, unlisted files)."""

    path: str
    digests: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # names not opened: links, FIFOs, devices, folders


@dataclass(frozen=True)
class ManifestCheck:
    """The outcome of :func:`check_manifest`, the same on every rank: ``path`` is None without a manifest."""

    path: str | None
    listed: int = 0  # files the manifest lists
    matched: int = 0  # listed files whose SHA-256 is the manifest's
    problems: list[Problem] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # names relative to the directory, not opened


def _shown(path: str) -> str:
    """``path`` as a report can print it: a name that is not UTF-8 or not printable (a newline) escaped."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return ascii(path)[1:-1]
    return path if path.isprintable() else ascii(path)[1:-1]


def read_manifest(directory: str, follow_links: bool) -> dict[str, str] | Problem | None:
    """The digests of ``directory``'s SHA256SUMS (None when there is none), or the problem with it: read only
    as a regular file (through a link only with ``follow_links``), at most MANIFEST_LIMIT bytes."""
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        fd = open_regular(path, follow_links)
    except FileNotFoundError:
        return None
    except Unreadable as exc:
        return file_problem(path, None, exc.what, kind=exc.kind)
    except OSError as exc:
        return file_problem(path, None, f"cannot be read ({exc.strerror})", kind="unreadable")
    try:
        raw = read_bounded(fd, MANIFEST_LIMIT)
    except OSError as exc:
        return file_problem(path, None, f"cannot be read ({exc.strerror})", kind="unreadable")
    finally:
        os.close(fd)
    if raw is None:
        return file_problem(path, None, f"is larger than the {MANIFEST_LIMIT}-byte limit (not a manifest?)", kind="manifest")
    digests = parse_manifest(raw)
    if isinstance(digests, str):
        what = f"is not a manifest in sha256sum's format ({digests})"
        return file_problem(path, None, what, kind="manifest")
    return digests


def _folder_refusal(directory: str, name: str) -> str | None:
    """Why the listed ``name`` is not opened because of a folder on its way (a link, followed or not, could
    lead outside the directory), or None; FileNotFoundError when a folder on the way is not there."""
    parts = name.split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        folder = "/".join(parts[:depth])
        info = os.lstat(os.path.join(directory, folder))
        if stat.S_ISLNK(info.st_mode):
            target = os.readlink(os.path.join(directory, folder))
            return f"is inside {folder}, a symbolic link to {target}: verify never enters a linked folder"
        if not stat.S_ISDIR(info.st_mode):
            raise FileNotFoundError(name)  # as sha256sum sees it: no such file
    return None


def _listed(directory: str, name: str, follow_links: bool) -> int | Problem:
    """The size of the listed file ``name`` when verify may hash it, else its problem."""
    path = os.path.join(directory, name)
    try:
        why = _folder_refusal(directory, name) or refusal(path, follow_links)
        if why is None:
            return os.stat(path).st_size  # a regular file, or with ``follow_links`` a link to one
    except FileNotFoundError:
        return file_problem(path, None, f"listed in {MANIFEST_NAME} but missing", kind="missing file")
    except OSError as exc:
        return file_problem(path, None, f"cannot be looked at ({exc.strerror})", kind="unreadable")
    return file_problem(path, None, why, kind="refused")


def _present(directory: str, follow_links: bool, listed: Iterable[str]) -> tuple[list[str], list[Problem]]:
    """The regular files in ``directory`` and in the sub-folders the manifest lists files of (names relative
    to it, ``/`` between folders; ``lora_adapter/``), without the manifest and the hidden entries at the top
    (mpicons' lock and staging folders). Other folders are not the checkpoint's (torchtitan's shards in
    ``STEP/sharded`` beside the model it consolidates into ``STEP``); folders reached through a link are
    not entered. A folder that cannot be listed is a problem."""
    published = {name.split("/", 1)[0] for name in listed if "/" in name}
    found: list[str] = []
    problems: list[Problem] = []
    folders = [""]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(os.path.join(directory, folder)) as scan:
                entries = list(scan)
        except OSError as exc:
            what = f"cannot be listed ({exc.strerror}): its files were not compared with {MANIFEST_NAME}"
            problems.append(file_problem(_shown(os.path.join(directory, folder)), None, what, kind="unreadable"))
            continue
        for entry in entries:
            name = f"{folder}/{entry.name}" if folder else entry.name
            if not folder and (entry.name.startswith(".") or entry.name == MANIFEST_NAME):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    if folder or name in published:
                        folders.append(name)
                elif entry.is_file(follow_symlinks=follow_links):
                    found.append(name)
            except OSError:
                continue  # gone meanwhile, or cannot be looked at: not a file verify could read
    return sorted(found), problems


def _look(directory: str, follow_links: bool) -> _Found | None:
    """Rank 0: the manifest and where each file it lists stands, and the files it does not list (None: no manifest)."""
    digests = read_manifest(directory, follow_links)
    if digests is None:
        return None
    found = _Found(os.path.join(directory, MANIFEST_NAME))
    if isinstance(digests, Problem):
        found.problems.append(digests)
        found.refused += [MANIFEST_NAME] if digests.kind == "refused" else []
        return found
    found.digests = digests
    for name in sorted(digests):
        looked = _listed(directory, name, follow_links)
        if isinstance(looked, int):
            found.sizes[name] = looked
            continue
        found.problems.append(looked)
        found.refused += [name] if looked.kind == "refused" else []
    present, unlistable = _present(directory, follow_links, digests)
    what = f"not listed in {MANIFEST_NAME} (added after it was written?)"
    found.problems += unlistable
    found.problems += [
        file_problem(_shown(os.path.join(directory, name)), None, what, kind="unlisted")
        for name in present
        if name not in digests
    ]
    return found


def _failure(exc: Exception) -> str:
    """Why a listed file could not be hashed, from what :func:`~mpicons.io.manifest.hash_file` raised."""
    cause = exc.__context__ if isinstance(exc, WriteError) else exc
    if isinstance(cause, NotRegular):
        return f"is now {kind_of(cause.mode)}, not a regular file (it changed while verify looked at it); not read"
    if isinstance(cause, OSError):
        return f"cannot be read to hash it ({cause.strerror or cause})"
    return f"cannot be hashed ({exc})"


def check_manifest(comm: Comm, directory: str, follow_links: bool) -> ManifestCheck:
    """Collective: every file ``directory``'s SHA256SUMS lists hashed (each by one rank, spread by bytes) and
    compared with it; files it lists that are missing or not opened, and files it does not list, as problems."""
    found: _Found | None = agree_on(comm, 0, lambda: _look(directory, follow_links))
    if found is None:
        return ManifestCheck(None)
    names = sorted(found.sizes)
    failed: dict[str, str] = {}

    def on_error(path: str, exc: Exception) -> None:
        failed[path] = _failure(exc)

    paths = [os.path.join(directory, name) for name in names]
    digests = hash_over_ranks(comm, paths, [found.sizes[n] for n in names], follow_links, on_error)
    for part in agree(comm, lambda: failed, gather=True):
        failed.update(part)
    problems = list(found.problems)
    matched = 0
    for name, path, digest in zip(names, paths, digests):
        if digest is None:
            problems.append(file_problem(path, None, failed.get(path, "could not be hashed"), kind="unreadable"))
        elif digest == found.digests[name]:
            matched += 1
        else:
            what = f"SHA-256 {digest[:16]}... differs from the {found.digests[name][:16]}... {MANIFEST_NAME} lists"
            problems.append(file_problem(path, None, what, kind="checksum"))
    return ManifestCheck(found.path, len(found.digests), matched, problems, found.refused)


def manifest_summary(comm: Comm, directory: str) -> str | None:
    """Collective: for ``inspect``, one line on the SHA256SUMS in ``directory`` (how many files it lists), or
    None without one. Nothing is hashed: ``mpicons verify`` checks the files."""

    def look() -> str | None:
        if is_s3(directory) or not os.path.isdir(directory):
            return None
        digests = read_manifest(directory, follow_links=False)
        if digests is None:
            return None
        if isinstance(digests, Problem):
            return f"{MANIFEST_NAME} {digests.message}"
        return f"{MANIFEST_NAME} lists {_count(len(digests), 'file')} (not hashed here; mpicons verify checks them)"

    summary: str | None = agree_on(comm, 0, look)
    return summary


__all__ = ["ManifestCheck", "check_manifest", "manifest_summary", "read_manifest"]
