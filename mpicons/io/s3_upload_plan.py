"""Multipart uploads planned from the layout: which rank uploads which part of which output object (pure).

An object store takes a large object as numbered parts, each uploaded whole by one client, every part
but the last at least :data:`MIN_PART` bytes, at most :data:`MAX_PARTS` of them. Here each rank
uploads parts of the bytes it writes anyway, so no byte crosses the network twice:
:func:`align_work` first gives every stretch of a file shorter than a part to the rank writing the
stretch after it (a small file ends up whole on one rank), then :func:`plan_uploads` cuts each rank's
stretch into parts near the part size. The first part of a file also holds its header.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.layout import Layout, WorkItem
from ..core.options import DEFAULT_PART_SIZE, MAX_PART, MAX_PARTS, MIN_PART


@dataclass(frozen=True)
class UploadPart:
    """Bytes ``[begin, end)`` of output file ``file``, uploaded as part ``number`` (1-based) by ``rank``."""

    file: int
    number: int
    begin: int
    end: int
    rank: int

    @property
    def size(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class UploadPlan:
    """Every part of every output file, in file order then byte order (the same on every rank)."""

    parts: tuple[UploadPart, ...]

    def of_file(self, file: int) -> list[UploadPart]:
        return [part for part in self.parts if part.file == file]

    def of_rank(self, rank: int) -> list[UploadPart]:
        return [part for part in self.parts if part.rank == rank]


def _stretches(layout: Layout, work: list[list[WorkItem]]) -> dict[int, list[tuple[int, int, int, list[WorkItem]]]]:
    """Per output file, its written stretches in byte order: (begin, end, rank, items), one per run of one rank's items."""
    placed: dict[int, list[tuple[int, int, int, WorkItem]]] = {}
    for rank, items in enumerate(work):
        for item in items:
            tensor = layout.tensors[item.tensor]
            begin = tensor.offset + item.row_begin * tensor.row_bytes
            end = tensor.offset + item.row_end * tensor.row_bytes
            placed.setdefault(tensor.file, []).append((begin, end, rank, item))
    stretches: dict[int, list[tuple[int, int, int, list[WorkItem]]]] = {}
    for file, entries in placed.items():
        runs: list[tuple[int, int, int, list[WorkItem]]] = []
        for begin, end, rank, item in sorted(entries, key=lambda e: (e[0], e[1])):
            if runs and runs[-1][2] == rank and runs[-1][1] == begin:
                runs[-1] = (runs[-1][0], end, rank, runs[-1][3] + [item])
            else:
                runs.append((begin, end, rank, [item]))
        stretches[file] = runs
    return stretches


def align_work(layout: Layout, work: list[list[WorkItem]], min_part: int = MIN_PART) -> list[list[WorkItem]]:
    """``work`` with every stretch of a file that is shorter than ``min_part`` (the file's header counted
    in its first stretch) moved to the rank writing the next stretch, so each rank's stretch can be
    uploaded as parts; the file's last stretch may stay short. Items keep their order in the output."""
    moved: dict[WorkItem, int] = {}
    for runs in _stretches(layout, work).values():
        carried: list[WorkItem] = []
        for index, (begin, end, rank, items) in enumerate(runs):
            begin = 0 if index == 0 else begin
            carried_bytes = sum(_item_bytes(layout, i) for i in carried)
            if index < len(runs) - 1 and end - begin + carried_bytes < min_part:
                carried.extend(items)
                continue
            for item in carried:
                moved[item] = rank
            carried = []
    if not moved:
        return work
    aligned: list[list[WorkItem]] = [[] for _ in work]
    for rank, items in enumerate(work):
        for item in items:
            aligned[moved.get(item, rank)].append(item)
    return [sorted(items, key=lambda i: _position(layout, i)) for items in aligned]


def _item_bytes(layout: Layout, item: WorkItem) -> int:
    return (item.row_end - item.row_begin) * layout.tensors[item.tensor].row_bytes


def _position(layout: Layout, item: WorkItem) -> tuple[int, int]:
    tensor = layout.tensors[item.tensor]
    return tensor.file, tensor.offset + item.row_begin * tensor.row_bytes


def part_size_for(size: int, ranks: int, part_size: int = DEFAULT_PART_SIZE) -> int:
    """The part size for a file of ``size`` bytes: ``part_size``, grown so the file needs at most
    :data:`MAX_PARTS` parts whatever the ranks' stretches (each stretch adds at most one)."""
    room = max(1, MAX_PARTS - ranks)
    return min(MAX_PART, max(part_size, 2 * MIN_PART, -(-size // room)))


def plan_uploads(layout: Layout, work: list[list[WorkItem]], owner: int = 0, part_size: int = DEFAULT_PART_SIZE) -> UploadPlan:
    """The parts of every output file for ``work`` (aligned by :func:`align_work`): each rank's stretch
    cut into near-equal parts of about the part size; a file no rank writes data to (its tensors
    hold no bytes) is one part, its header, uploaded by ``owner``."""
    ranks = len(work)
    stretches = _stretches(layout, work)
    parts: list[UploadPart] = []
    for file, out in enumerate(layout.files):
        size = part_size_for(out.size, ranks, part_size)
        runs = stretches.get(file) or [(0, out.size, owner, [])]
        number = 1
        for index, (begin, end, rank, _) in enumerate(runs):
            begin = 0 if index == 0 else begin
            end = out.size if index == len(runs) - 1 else end
            count = max(1, -(-(end - begin) // size))
            cuts = [begin + (end - begin) * k // count for k in range(count + 1)]
            for low, high in zip(cuts, cuts[1:]):
                parts.append(UploadPart(file, number, low, high, rank))
                number += 1
    return UploadPlan(tuple(parts))


def check_plan(layout: Layout, plan: UploadPlan, min_part: int = MIN_PART) -> None:
    """Assert what an object store requires of the plan: parts tile each file, every part but the last
    is at least ``min_part``, at most :data:`MAX_PARTS` and :data:`MAX_PART` (a planning error otherwise)."""
    for file, out in enumerate(layout.files):
        parts = plan.of_file(file)
        assert parts and parts[0].begin == 0 and parts[-1].end == out.size, (file, parts[:1], parts[-1:])
        assert all(a.end == b.begin for a, b in zip(parts, parts[1:])), f"parts of {out.name} do not tile it"
        assert all(p.size >= min_part for p in parts[:-1]), f"a part of {out.name} is below {min_part} bytes"
        assert len(parts) <= MAX_PARTS and all(p.size <= MAX_PART for p in parts), out.name
