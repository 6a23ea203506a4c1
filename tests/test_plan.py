"""The pure plan: full shapes, exact coverage, replicas, mapping, and work splits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpicons.core.errors import InputError
from mpicons.core.mapping import parse_mapping
from mpicons.core.safetensors_codec import DTYPE_ORDER
from mpicons.core.table import Pieces, Table, shard_files, to_storage_units
from mpicons.testing import build_plan

Piece = tuple[str, str, str, list[int], list[int]]  # (file, tensor, dtype, offsets, shape)


def make_table(pieces: list[Piece], file_index: dict[str, int] | None = None) -> Table:
    """A whole-checkpoint table built straight from a list of pieces (no files on disk)."""
    files = sorted({p[0] for p in pieces})
    names = sorted({p[1] for p in pieces})
    width = max(1, max(len(p[4]) for p in pieces))
    shape = np.ones((len(pieces), width), dtype=np.int64)
    offset = np.zeros((len(pieces), width), dtype=np.int64)
    for i, (_, _, _, o, s) in enumerate(pieces):
        shape[i, : len(s)] = s
        offset[i, : len(o)] = o
    index = file_index or {f: 1 for f in files}
    shard = shard_files(files, [0] * len(files), None)
    shard.out_index[:] = [index[f] for f in files]
    shard.out_count[:] = max(index.values())
    shard.is_dcp[:] = True
    table = Pieces(
        tensor=np.array([names.index(p[1]) for p in pieces], dtype=np.int32),
        file=np.array([files.index(p[0]) for p in pieces], dtype=np.int32),
        dtype=np.array([DTYPE_ORDER[p[2]] for p in pieces], dtype=np.int8),
        ndim=np.array([len(p[4]) for p in pieces], dtype=np.int8),
        shape=shape,
        offset=offset,
        begin=np.zeros(len(pieces), dtype=np.int64),
        holder=np.zeros(len(pieces), dtype=np.int32),
    )
    return Table(shard, names, table, to_storage_units(table))


def test_full_shape_is_the_max_extent_and_layout_is_reference_order():
    plan = build_plan(
        make_table(
            [
                ("a", "w", "BF16", [0, 0], [3, 4]),
                ("b", "w", "BF16", [3, 0], [2, 4]),
                ("a", "b", "F32", [0], [5]),
                ("a", "s", "I64", [], []),
                ("b", "e", "F32", [0, 0], [0, 7]),
            ]
        ),
        2,
    )
    shapes = {t.name: t.shape for t in plan.tensors}
    assert shapes == {"w": (5, 4), "b": (5,), "s": (), "e": (0, 7)}
    (out,) = plan.files
    assert out.name == "model-00001-of-00001.safetensors"
    assert [plan.tensors[t].name for t in out.tensors] == ["s", "b", "e", "w"]
    assert plan.total_bytes == 8 + 20 + 0 + 40


def test_hole_names_tensor_and_region():
    table = make_table([("a", "w", "F32", [0, 0], [2, 4]), ("b", "w", "F32", [3, 0], [1, 4])])
    with pytest.raises(InputError, match=r"tensor 'w'.*hole.*\[2:3, 0:4\]"):
        build_plan(table, 1)


def test_overlap_names_both_files():
    table = make_table([("a", "w", "F32", [0, 0], [3, 4]), ("b", "w", "F32", [2, 0], [2, 4])])
    with pytest.raises(InputError, match=r"tensor 'w'.*overlap.*\[2:3, 0:4\].*a at.*b at"):
        build_plan(table, 1)


def test_identical_replicas_count_once():
    # A norm replicated on every rank, next to each rank's own share of a matrix.
    pieces = [(f, "n", "F32", [0], [8]) for f in "abc"] + [(f, "w", "F32", [2 * i], [2]) for i, f in enumerate("abc")]

    def sources(plan):
        # A piece crossing two ranks' rows is in both parts: the files kept, over all parts.
        return {
            t.name: sorted({f for part in plan.parts for f in part.tensor_pieces(i).file.tolist()})
            for i, t in enumerate(plan.tensors)
        }

    plan = build_plan(make_table(pieces), 2)
    kept = sources(plan)
    assert kept["n"] == [0]  # one copy, the first file's
    replicas = [part.replicas for part in plan.parts if part.replicas is not None]
    assert sorted({f for r in replicas for f in r.file.tolist()}) == [0, 1, 2]  # every copy is compared
    assert sources(build_plan(make_table(pieces[::-1]), 2)) == kept  # whatever order the scan gathered rows in


def test_a_file_of_nothing_but_replicas_is_a_copy():
    """A shard saved twice (under another rank number) is an error naming both files; empty pieces do not count."""
    own = [("a", "w", "F32", [0, 0], [2, 4]), ("b", "w", "F32", [2, 0], [2, 4]), ("a", "n", "F32", [0], [4])]
    build_plan(make_table(own + [("c", "w", "F32", [4, 0], [0, 4])]), 1)  # c holds only an empty piece: fine
    copy = [("c", "w", "F32", [2, 0], [2, 4])]
    with pytest.raises(InputError, match=r"^c: every piece in it duplicates .*'w' at \[2:4, 0:4\] is also in b\)"):
        build_plan(make_table(own + copy), 1)


@pytest.mark.parametrize(
    "pieces, message",
    [
        ([("a", "w", "F32", [0], [2]), ("b", "w", "BF16", [2], [2])], "disagree on dtype: F32 in a but BF16 in b"),
        ([("a", "w", "F32", [0], [2]), ("b", "w", "F32", [2, 0], [2, 1])], "disagree on number of dimensions"),
    ],
)
def test_disagreeing_pieces(pieces, message):
    with pytest.raises(InputError, match=message):
        build_plan(make_table(pieces), 1)


def test_pieces_of_one_tensor_in_two_output_files():
    table = make_table([("a", "w", "F32", [0], [2]), ("b", "w", "F32", [2], [2])], {"a": 1, "b": 2})
    with pytest.raises(InputError, match="tensor 'w' has pieces destined for model-00001-of-00002"):
        build_plan(table, 1)


def test_mapping_must_match_the_checkpoint():
    table = make_table([("a", "w", "F32", [0], [2]), ("a", "v", "F32", [0], [2])])
    with pytest.raises(InputError, match="no entry for tensor 'v'"):
        build_plan(table, 1, mapping={"w": "x.safetensors"})
    with pytest.raises(InputError, match="names tensor 'tied', which the checkpoint does not hold"):
        build_plan(table, 1, mapping={"w": "x.safetensors", "v": "x.safetensors", "tied": "x.safetensors"})


def test_parse_mapping_forms():
    assert parse_mapping({"a": 1, "b": 3}) == {
        "a": "model-00001-of-00003.safetensors",
        "b": "model-00003-of-00003.safetensors",
    }
    assert parse_mapping({"metadata": {}, "weight_map": {"a": "x.safetensors"}}) == {"a": "x.safetensors"}
    for bad in ["../x.safetensors", "d/x.safetensors", "..", "", ".hidden.safetensors", "model.safetensors.index.json"]:
        with pytest.raises(InputError, match="not a plain file name"):
            parse_mapping({"weight_map": {"a": bad}})
    with pytest.raises(InputError):
        parse_mapping([1, 2])


@st.composite
def tilings(draw):
    """A random tensor cut into a random grid of pieces, spread over random files."""
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim))
    cuts = [sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3))) - {n}) for n in shape]
    pieces = []
    bounds = [[0, *c, n] for c, n in zip(cuts, shape)]
    for cell in np.ndindex(*[len(b) - 1 for b in bounds]):
        offsets = [bounds[d][cell[d]] for d in range(ndim)]
        sizes = [bounds[d][cell[d] + 1] - bounds[d][cell[d]] for d in range(ndim)]
        pieces.append((f"f{draw(st.integers(0, 3))}", "t", "BF16", offsets, sizes))
    return shape, pieces


@settings(max_examples=200, deadline=None)
@given(tilings(), st.integers(1, 5), st.sampled_from(["bytes", "files"]))
def test_exact_tiling_plans_and_every_byte_is_written_once(tiling, ranks, split):
    shape, pieces = tiling
    plan = build_plan(make_table(pieces), ranks, split=split)
    assert plan.tensors[0].shape == tuple(shape)
    rows = np.zeros(shape[0], dtype=int)
    for items in plan.work:
        for item in items:
            rows[item.row_begin : item.row_end] += 1
    assert (rows == 1).all()
    assert sum(plan.bytes_per_rank()) == plan.total_bytes


@settings(max_examples=200, deadline=None)
@given(tilings(), st.data())
def test_dropping_a_piece_is_a_hole_and_shifting_one_is_an_overlap(tiling, data):
    """Found whichever rank owns the rows: each rank checks the rows it owns (1 to 4 ranks)."""
    ranks = data.draw(st.integers(1, 4))
    shape, pieces = tiling
    if len(pieces) < 2:
        return
    victim = data.draw(st.integers(0, len(pieces) - 1))
    without = pieces[:victim] + pieces[victim + 1 :]
    full_without = [max(o[d] + s[d] for _, _, _, o, s in without) for d in range(len(shape))]
    if full_without == shape:  # still the same extent: must be a hole
        with pytest.raises(InputError, match="hole"):
            build_plan(make_table(without), ranks)
    duplicate = list(pieces[victim])
    other = pieces[(victim + 1) % len(pieces)]
    moved = (duplicate[0], "t", "BF16", other[3], duplicate[4])
    fits = all(o + s <= n for o, s, n in zip(other[3], duplicate[4], shape))
    if fits and tuple(duplicate[4]) != tuple(other[4]):  # an identical box would be a replica
        with pytest.raises(InputError, match="overlap"):
            build_plan(make_table(pieces + [moved]), ranks)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=1, max_size=12), st.integers(1, 8))
def test_byte_split_balances_within_a_row(rows_per_tensor, ranks):
    pieces = [("a", f"t{i}", "F32", [0, 0], [rows, 16]) for i, rows in enumerate(rows_per_tensor)]
    plan = build_plan(make_table(pieces), ranks, split="bytes")
    per_rank = plan.bytes_per_rank()
    assert sum(per_rank) == plan.total_bytes
    assert max(per_rank) <= plan.total_bytes / ranks + 64


def test_coverage_of_a_large_irregular_tiling_uses_pairwise_fallback(monkeypatch):
    import mpicons.core.coverage as coverage_module

    monkeypatch.setattr(coverage_module, "MAX_GRID_CELLS", 4)
    good = [("a", "w", "F32", [0, 0], [2, 3]), ("a", "w", "F32", [2, 0], [2, 3]), ("b", "w", "F32", [0, 3], [4, 2])]
    build_plan(make_table(good), 1)
    with pytest.raises(InputError, match="overlap"):
        build_plan(make_table(good + [("c", "w", "F32", [1, 1], [1, 1])]), 1)
    with pytest.raises(InputError, match="hole"):
        build_plan(make_table(good[:1] + [("a", "w", "F32", [3, 0], [1, 3])] + good[2:]), 1)
