"""Checks of a consolidated checkpoint's structure and of its comparison with the shards (pure).

Given what was read (the listing, the index, each file's tensors) or compared (differences per
tensor), these say what is wrong as :class:`~mpicons.core.reports.Problem` values, the same on
every rank: no file is opened here, no communicator used. ``verify`` reads and compares; this
decides and words.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..adaptation.hints import KnownRules, adapter_between
from ..core.convert import TARGETS
from ..core.layout import Layout
from ..core.names import INDEX_NAME, plain_file_name
from ..core.reports import Problem, human_bytes
from ..core.reports import count_of as _count
from ..core.safetensors_codec import DTYPE_BY_NAME, HeaderError
from ..io.manifest import MANIFEST_NAME


def file_problem(path: str, tensor: str | None, what: str, *, kind: str) -> Problem:
    """A problem found in a file of the checkpoint (or its index); ``kind`` is one of ``reports.KINDS``."""
    return Problem(what, tensor, path, kind=kind)


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`; identical on every rank. ``ok`` when ``problems`` is empty."""

    output_dir: str
    against: str | None
    ranks: int
    files: list[str]
    tensors: int
    total_bytes: int
    shard_tensors: int = 0
    compared_tensors: int = 0
    compared_bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    #: Entries not read: not regular files (links unless followed, FIFOs, devices), or a lock mpicons
    #: cannot read as its own. The directory cannot be checked as it is (the command line exits 2).
    refused: list[str] = field(default_factory=list)
    #: With ``against`` in DCP's Hugging Face layout (no full shapes recorded): what an OK rests on, or
    #: what could not be known (:func:`~mpicons.core.completeness.caveat`).
    caveat: str | None = None
    #: The directory's SHA256SUMS when it has one (checked, or reported as unusable); None without one.
    manifest: str | None = None
    #: Files the manifest lists, and how many of them have the SHA-256 it lists (the others are problems).
    manifest_files: int = 0
    checksummed: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        """One line per problem: ``path: tensor 'x': what``."""
        return [str(p) for p in self.problems]

    def summary(self) -> str:
        status = "OK" if self.ok else _count(len(self.problems), "problem")
        checked = f"{_count(len(self.files), 'file')}, {_count(self.tensors, 'tensor')}, {human_bytes(self.total_bytes)}"
        manifest = self._manifest_part()
        checked += f"; {manifest}" if manifest else ""
        if self.against is not None:
            checked += (
                f"; {self.compared_tensors} of {_count(self.shard_tensors, 'tensor')} ({human_bytes(self.compared_bytes)}) "
                f"compared with {self.against}"
            )
        if self.refused:
            checked += f"; {_count(len(self.refused), 'entry', 'entries')} not read (see above)"
        line = f"mpicons verify: {status}: {self.output_dir} ({checked}) on {_count(self.ranks, 'rank')}"
        return line if self.caveat is None or not self.ok else f"{line}; {self.caveat}"

    def _manifest_part(self) -> str | None:
        """What the summary says of SHA256SUMS: how many listed files match, or that without one (and without
        ``against``) no file's contents were checked. Nothing for a sharded directory."""
        if any(p.kind == "sharded" for p in self.problems):
            return None
        if self.manifest is None:
            return f"no {MANIFEST_NAME}" + ("" if self.against is not None else ": file contents not checked without --against")
        if not self.manifest_files:
            return f"{MANIFEST_NAME} not usable (see above)"
        verb = "matches" if self.checksummed == 1 else "match"
        if self.checksummed == self.manifest_files:
            return f"{MANIFEST_NAME}: {_count(self.manifest_files, 'file')} {verb}"
        return f"{MANIFEST_NAME}: {self.checksummed} of {_count(self.manifest_files, 'file')} {verb}"

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "output_dir": self.output_dir,
            "against": self.against,
            "ranks": self.ranks,
            "files": list(self.files),
            "tensors": self.tensors,
            "total_bytes": self.total_bytes,
            "shard_tensors": self.shard_tensors,
            "compared_tensors": self.compared_tensors,
            "compared_bytes": self.compared_bytes,
            "problems": [{**p.to_dict(), "kind": p.kind} for p in self.problems],
            "refused": list(self.refused),
            "caveat": self.caveat,
            "manifest": self.manifest,
            "manifest_files": self.manifest_files,
            "checksummed": self.checksummed,
        }


# ---------------------------------------------------------------- what was found


@dataclass
class Listing:
    """What rank 0 found in the directory and the index, shared with every rank."""

    found: list[str]  # regular, non-hidden *.safetensors files
    leftovers: list[str]  # staging directories of interrupted consolidations
    weight_map: dict[str, str] | None
    total_size: int | None
    listed_existing: list[str]  # files named by the weight map that are regular files (any extension)
    listed_missing: list[str]
    problems: list[Problem]
    sharded: bool = False  # the directory is a sharded checkpoint, not a consolidated one
    refused: list[str] = field(default_factory=list)  # present but not opened: links, FIFOs, devices
    hdf5: FileResult | None = None  # the datasets of an HDF5 output (``--format hdf5``)


@dataclass
class FileResult:
    """One output file's header: its tensors ``(name, dtype, shape, begin, end)``, None when unreadable."""

    name: str
    tensors: list[tuple[str, str, tuple[int, ...], int, int]] | None
    data_start: int
    problems: list[Problem]
    refused: bool = False  # not opened: not a regular file (or a link not followed)


@dataclass(frozen=True)
class Located:
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset of the tensor's data in its file
    nbytes: int


@dataclass
class Diff:
    """Differences found in part of one tensor: how many storage units, and the first one (C order)."""

    count: int = 0
    first: tuple[int, ...] | None = None
    got: bytes = b""
    want: bytes = b""
    error: str | None = None

    def add(self, count: int, first: tuple[int, ...], got: bytes, want: bytes) -> None:
        self.count += count
        if self.first is None or first < self.first:
            self.first, self.got, self.want = first, got, want

    def merge(self, other: Diff) -> None:
        if other.count:
            self.add(other.count, other.first, other.got, other.want)  # type: ignore[arg-type]
        self.error = self.error or other.error


def parse_index(index_path: str, obj: object) -> tuple[dict[str, str] | None, int | None, list[Problem]]:
    """The weight map (plain file names only) and total size of a parsed index, leniently."""
    problems: list[Problem] = []
    weight_map: dict[str, str] | None = None
    raw_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(raw_map, dict):
        problems.append(file_problem(index_path, None, "index has no weight_map object", kind="index"))
    else:
        weight_map = {}
        for tensor, file_name in raw_map.items():
            if plain_file_name(file_name):
                weight_map[tensor] = file_name
            else:
                what = f"weight_map value {file_name!r} is not a plain file name"
                problems.append(file_problem(index_path, tensor, what, kind="index"))
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    size = metadata.get("total_size") if isinstance(metadata, dict) else None
    if type(size) is not int:
        what = f"index has no integer metadata.total_size (got {size!r})"
        problems.append(file_problem(index_path, None, what, kind="index"))
        size = None
    return weight_map, size, problems


def header_problem(error: HeaderError) -> Problem:
    """A header error as a Problem: its path and the tensor it concerns (if any) carried as values."""
    return file_problem(error.path, error.tensor, error.what, kind="header")


def cross_check(output_dir: str, listing: Listing, results: list[FileResult]) -> tuple[dict[str, Located], list[Problem]]:
    """Where every tensor is, and the problems between the files and the index (pure, same on every rank)."""
    join = lambda name: os.path.join(output_dir, name)  # noqa: E731
    problems = list(listing.problems) + [p for r in results for p in r.problems]
    located: dict[str, Located] = {}
    listed = set(listing.weight_map.values()) if listing.weight_map is not None else set()
    # Files the index lists come first, so a tensor duplicated in a stray file is located where it belongs.
    for result in sorted(results, key=lambda r: (r.name not in listed, r.name)):
        for tensor, dtype, shape, begin, end in result.tensors or ():
            if tensor in located:
                what = f"also in {located[tensor].file}; a tensor must be in one file"
                problems.append(file_problem(join(result.name), tensor, what, kind="duplicate"))
                continue
            located[tensor] = Located(result.name, dtype, shape, result.data_start + begin, end - begin)
    left = "left by an interrupted consolidation; the next 'mpicons consolidate' into this directory finishes or undoes it"
    problems += [file_problem(join(n), None, left, kind="leftover") for n in listing.leftovers]
    if listing.weight_map is not None:
        problems += _index_problems(output_dir, listing, results, located)
    return located, problems


def _listed_file_problems(output_dir: str, listing: Listing, weight_map: dict[str, str]) -> list[Problem]:
    """Files the index does not list (strays), and files it lists that are missing."""
    listed = set(weight_map.values())
    counts: dict[str, int] = {}
    for file_name in weight_map.values():
        counts[file_name] = counts.get(file_name, 0) + 1
    problems = [
        file_problem(os.path.join(output_dir, n), None, "not listed in the index (stray file)", kind="extra file")
        for n in listing.found
        if n not in listed
    ]
    for n in listing.listed_missing:
        what = f"listed in the index for {_count(counts[n], 'tensor')} but missing"
        problems.append(file_problem(os.path.join(output_dir, n), None, what, kind="missing file"))
    return problems


def _index_problems(output_dir: str, listing: Listing, results: list[FileResult], located: dict[str, Located]) -> list[Problem]:
    """What the index says that the files do not: stray and missing files, tensors it places elsewhere
    or leaves out, a total size that is not the files'."""
    join = lambda name: os.path.join(output_dir, name)  # noqa: E731
    index_path, weight_map = join(INDEX_NAME), listing.weight_map or {}
    listed = set(weight_map.values())
    problems = _listed_file_problems(output_dir, listing, weight_map)
    readable = {r.name for r in results if r.tensors is not None}
    for tensor, file_name in weight_map.items():
        where = located.get(tensor)
        if where is None:
            if file_name in readable:
                what = f"weight_map names {file_name}, which does not hold the tensor"
                problems.append(file_problem(index_path, tensor, what, kind="index mismatch"))
        elif where.file != file_name:
            what = f"weight_map names {file_name} but the tensor is in {where.file}"
            problems.append(file_problem(index_path, tensor, what, kind="index mismatch"))
    for tensor, where in located.items():
        if tensor not in weight_map and where.file in listed:
            problems.append(file_problem(join(where.file), tensor, "not in the index's weight_map", kind="index mismatch"))
    if listing.total_size is not None and listed <= readable:
        actual = sum(w.nbytes for w in located.values() if w.file in listed)
        if actual != listing.total_size:
            what = f"metadata.total_size is {listing.total_size} but the files hold {actual} bytes of tensor data"
            problems.append(file_problem(index_path, None, what, kind="index mismatch"))
    return problems


def _element_index(storage_index: tuple[int, ...], dtype: str, ndim: int) -> list[int]:
    """A storage-unit index as an element index: padding dims dropped, sub-byte last dims in elements."""
    index = list(storage_index[:ndim])
    bits = DTYPE_BY_NAME[dtype].bits
    if bits % 8 and index:
        index[-1] = index[-1] * 8 // bits
    return index


def against_checks(
    plan: Layout,
    against: str,
    output_dir: str,
    listing: Listing,
    results: list[FileResult],
    located: dict[str, Located],
    known: KnownRules = (),
) -> tuple[set[int], list[Problem]]:
    """Tensors present on both sides with the same dtype and shape (comparable), and the problems of the rest
    (``known``: the built-in rule sets asked whether the names differ as an adapter would make them)."""
    join = lambda name: os.path.join(output_dir, name)  # noqa: E731
    unreadable = set(listing.listed_missing) | set(listing.refused) | {r.name for r in results if r.tensors is None}
    weight_map = listing.weight_map or {}
    sole = results[0].name if listing.weight_map is None and len(results) == 1 else None  # model.safetensors, model.h5
    problems: list[Problem] = []
    comparable: set[int] = set()
    names = set()
    for t, info in enumerate(plan.tensors):
        names.add(info.name)
        where = located.get(info.name)
        if where is None:
            if weight_map.get(info.name, sole) not in unreadable:  # else its file's problem says it all
                problems.append(
                    file_problem(
                        output_dir,
                        info.name,
                        f"in the shards ({info.dtype}{list(info.shape)}) but in no output file",
                        kind="missing tensor",
                    )
                )
        elif (where.dtype, where.shape) != (info.dtype, info.shape):
            problems.append(
                file_problem(
                    join(where.file),
                    info.name,
                    f"is {where.dtype}{list(where.shape)} but the shards hold {info.dtype}{list(info.shape)}",
                    kind="mismatch",
                )
            )
        else:
            comparable.add(t)
    for tensor, where in located.items():
        if tensor not in names:
            problems.append(file_problem(join(where.file), tensor, f"not in the shards in {against}", kind="extra tensor"))
    return comparable, _options_hints(plan, output_dir, located, problems, known)


def _options_hints(
    plan: Layout, output_dir: str, located: dict[str, Located], problems: list[Problem], known: KnownRules
) -> list[Problem]:
    """An output written with ``--dtype`` or ``--adapter`` and checked without it: one problem saying which
    option to give, in place of a problem per tensor."""
    hint = _dtype_hint(plan, located)
    if hint:
        converted = {info.name for info in plan.tensors if _converted_float(info.dtype, info.shape, located.get(info.name))}
        problems = [p for p in problems if not (p.kind == "mismatch" and p.tensor in converted)]
        problems.append(file_problem(output_dir, None, hint, kind="dtype option"))
    missing = [p.tensor for p in problems if p.kind == "missing tensor" and p.tensor]
    extra = [p.tensor for p in problems if p.kind == "extra tensor" and p.tensor]
    adapter = adapter_between(missing, extra, known) if missing and extra else None
    if adapter is not None:
        problems = [p for p in problems if p.kind not in ("missing tensor", "extra tensor")]
        what = (
            f"{_count(len(missing), 'tensor')} of the shards are in no output file and {_count(len(extra), 'output tensor')} "
            f"are not in the shards: the shards hold {adapter}'s names and the output Hugging Face's. If it was written "
            f"with --adapter {adapter}, verify with --adapter {adapter} --hf-assets DIR, as it was written"
        )
        problems.append(file_problem(output_dir, None, what, kind="adapter option"))
    return problems


def _converted_float(dtype: str, shape: tuple[int, ...], found: Located | None) -> bool:
    """Whether an output tensor is a shard tensor of the same shape, turned from one float dtype into another."""
    return found is not None and found.shape == shape and found.dtype != dtype and DTYPE_BY_NAME[dtype].is_float


def _dtype_hint(plan: Layout, located: dict[str, Located]) -> str | None:
    """When every float tensor that differs in dtype was turned into one dtype, the output was written with --dtype."""
    targets = {v: k for k, v in TARGETS.items()}
    changed = {
        (info.dtype, located[info.name].dtype)
        for info in plan.tensors
        if _converted_float(info.dtype, info.shape, located.get(info.name))
    }
    written = {after for _, after in changed}
    if len(written) != 1 or next(iter(written)) not in targets:
        return None
    dtype = next(iter(written))
    was = "/".join(sorted(before for before, _ in changed))
    if plan.tensors and any(t.source_dtype != t.dtype for t in plan.tensors):
        return None  # verify was given --dtype already
    count = sum(1 for info in plan.tensors if _converted_float(info.dtype, info.shape, located.get(info.name)))
    return (
        f"the output's floating-point tensors ({count} of them) are {dtype} where the shards hold {was}: if it was "
        f"written with --dtype {targets[dtype]}, verify with --dtype {targets[dtype]}"
    )


def diff_problems(plan: Layout, output_dir: str, located: dict[str, Located], diffs: dict[int, Diff]) -> list[Problem]:
    problems = []
    for t in sorted(diffs):
        diff, info = diffs[t], plan.tensors[t]
        path = os.path.join(output_dir, located[info.name].file)
        if diff.error:
            problems.append(file_problem(path, info.name, diff.error, kind="unreadable"))
        if diff.count:
            units = int(np.prod(info.storage, dtype=np.int64))
            noun = "elements" if info.unit * 8 == DTYPE_BY_NAME[info.dtype].bits else "bytes"
            index = _element_index(diff.first, info.dtype, len(info.shape))  # type: ignore[arg-type]
            problems.append(
                file_problem(
                    path,
                    info.name,
                    f"differs from the shards in {diff.count} of {units} {noun}; first at {index} "
                    f"(output bytes {diff.got.hex()}, shards {diff.want.hex()})",
                    kind="values",
                )
            )
    return problems
