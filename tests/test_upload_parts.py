"""The multipart plan of an object-store output: parts that S3 accepts, each uploaded by the rank that writes its bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpicons.core.layout import Layout, OutputFile, Tensor, WorkItem
from mpicons.core.split import split_by_bytes, split_by_files
from mpicons.io.s3_upload_plan import MAX_PARTS, MIN_PART, align_work, check_plan, part_size_for, plan_uploads

MiB = 1 << 20


def _layout(files: list[list[tuple[int, int]]], header: int = 96) -> Layout:
    """Files of uint8 tensors (rows, row bytes) laid out one after another behind a header."""
    tensors: list[Tensor] = []
    outs: list[OutputFile] = []
    for f, shapes in enumerate(files):
        offset, ids = header, []
        for rows, width in shapes:
            tensors.append(Tensor(f"t{len(tensors)}", "U8", (rows, width), (rows, width), 1, f, offset))
            ids.append(len(tensors) - 1)
            offset += rows * width
        outs.append(OutputFile(f"model-{f + 1:05d}-of-{len(files):05d}.safetensors", b" " * header, offset, tuple(ids)))
    return Layout([], tensors, outs)


def _bytes_of(layout: Layout, items: list[WorkItem]) -> set[tuple[int, int, int]]:
    spans = set()
    for item in items:
        t = layout.tensors[item.tensor]
        spans.add((t.file, t.offset + item.row_begin * t.row_bytes, t.offset + item.row_end * t.row_bytes))
    return spans


def _check(layout: Layout, work: list[list[WorkItem]], part_size: int = 16 * MiB) -> None:
    aligned = align_work(layout, work, MIN_PART)
    assert sorted(_bytes_of(layout, [i for items in work for i in items])) == sorted(
        _bytes_of(layout, [i for items in aligned for i in items])
    ), "aligning moves items, never changes them"
    plan = plan_uploads(layout, aligned, part_size=part_size)
    check_plan(layout, plan)
    for part in plan.parts:  # a part's data bytes are written by the rank that uploads it
        mine = sorted(s for s in _bytes_of(layout, aligned[part.rank]) if s[0] == part.file)
        covered = sum(max(0, min(end, part.end) - max(begin, part.begin)) for _, begin, end in mine)
        header = len(layout.files[part.file].header)
        assert covered == part.size - max(0, min(header, part.end) - part.begin)


@settings(max_examples=60, deadline=None)
@given(
    files=st.lists(st.lists(st.tuples(st.integers(1, 64), st.sampled_from([1, 4096, 65536, 1 << 20])), min_size=1, max_size=6),
    min_size=1, max_size=4),
    ranks=st.integers(1, 6),
    split=st.sampled_from([split_by_bytes, split_by_files]),
)  # fmt: skip
def test_every_part_is_one_ranks_and_s3_accepts_the_plan(files: list[list[tuple[int, int]]], ranks: int, split: object) -> None:
    layout = _layout(files)
    _check(layout, split(layout, ranks))  # type: ignore[operator]


def test_a_small_file_is_uploaded_whole_by_one_rank() -> None:
    layout = _layout([[(16, 4096)], [(256, 1 << 20)]])  # 64 KiB, then 256 MiB
    aligned = align_work(layout, split_by_bytes(layout, 4))
    plan = plan_uploads(layout, aligned)
    assert len(plan.of_file(0)) == 1
    assert len({p.rank for p in plan.of_file(1)}) > 1, "the large file is uploaded by several ranks"


def test_a_file_without_data_is_its_header_uploaded_by_the_owner() -> None:
    layout = _layout([[(0, 16)]])
    plan = plan_uploads(layout, [[], []], owner=1)
    assert [(p.begin, p.end, p.rank) for p in plan.parts] == [(0, layout.files[0].size, 1)]


@pytest.mark.parametrize("size", [1, 5 * MiB, 50 << 30, 200 << 30])
def test_no_file_needs_more_than_ten_thousand_parts(size: int) -> None:
    part = part_size_for(size, ranks=64)
    assert -(-size // part) + 64 <= MAX_PARTS and part >= 2 * MIN_PART
