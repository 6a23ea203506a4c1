"""Chained adapter transforms (``unbind(N) | split_rows(...)``) and ``crop_rows``.

The rule format's checks for chains (every error names ``FILE:LINE``), the plan's refusals, and the
piece geometry as a property: random chains over random shapes, the saved tensor cut into random
pieces (some stored column-major, as a view's pieces are), each converted piece read back from the
pieces' bytes and placed in its output. Every output must be covered exactly once, every converted
piece must lie inside one saved piece's bytes (a byte range, no buffer), and the result must equal
numpy's slicing and reshapes of the whole tensor (never mpicons' code).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from mpicons.adaptation.apply import Conversion, convert_pieces, plan_conversion
from mpicons.adaptation.rules import parse_rules
from mpicons.core.errors import InputError
from mpicons.core.table import Pieces

ORIGIN = "chain.rules"
#: Lines before the line under test: a comment, a model_type, a blank line and a good rule (so it is line 5).
PREAMBLE = "# a user's rules\nmodel_type toy\n\nkeep.weight model.keep.weight\n"
BAD_LINE = 5


def rules(line: str) -> str:
    return PREAMBLE + line + "\nlast.weight model.last.weight\n"


# ---------------------------------------------------------------- 1. parsing chains: errors name FILE:LINE

BAD_CHAINS = {
    "split_rows before unbind": ("a.w b.{N}.{x|y} split_rows(groups=1, sizes=(1, 1)) | unbind(N)", "split_rows must be the last"),
    "rotary before crop": ("a.w b.w rope_to_half(2, 4) | crop_rows(4)", "rope_to_half must be the last"),
    "two splits": ("a.w b.{x|y} split_rows(groups=1, sizes=(1, 1)) | split_rows(groups=1, sizes=(1, 1))", "must be the last"),
    "drop in a chain": ("a.w b.{N} unbind(N) | drop", "drop leaves the tensor out"),
    "one index twice": ("a.w b.{N}.{N} unbind(N) | unbind(N)", "unbind(N) appears twice"),
    "second index not in the target": ("a.w b.{N}.w unbind(N) | unbind(E)", "the target must hold {E}"),
    "unbind of a source capture in a chain": ("a.{E}.w b.{E}.{N} unbind(N) | unbind(E)", "{E} is already a capture"),
    "unknown transform in a chain": ("a.w b.{N}.w unbind(N) | frobnicate(1)", "unknown transform 'frobnicate'"),
    "a call in a chain": ("a.w b.{N}.w unbind(N) | crop_rows(__import__('os').getpid())", "only whole numbers, config fields"),
    "crop_rows without rows": ("a.w b.w crop_rows()", "crop_rows needs rows"),
    "crop_rows with two": ("a.w b.w crop_rows(1, 2)", "crop_rows takes 1 argument(s)"),
    "crop_rows of a string": ("a.w b.w crop_rows('vocab_size')", "only whole numbers, config fields"),
    "a dangling bar": ("a.w b.{N}.w unbind(N) |", "expected 'SOURCE TARGET [TRANSFORM] [if [not] KEY]'"),
    "two bars": ("a.w b.{N}.w unbind(N) || crop_rows(1)", "a '|' joins two transforms, and one of them is missing"),
    "a bar first": ("a.w b.w | crop_rows(1)", "expected 'SOURCE TARGET [TRANSFORM] [if [not] KEY]'"),
    "split parts missing after unbind": ("a.w b.{N}.w unbind(N) | split_rows(groups=1, sizes=(1, 1))", "names its parts"),
}


@pytest.mark.parametrize("case", list(BAD_CHAINS))
def test_a_bad_chain_is_named_by_file_and_line(case: str) -> None:
    line, said = BAD_CHAINS[case]
    with pytest.raises(InputError) as caught:
        parse_rules(rules(line), ORIGIN)
    message = str(caught.value)
    assert message.startswith(f"{ORIGIN}:{BAD_LINE}: "), message
    assert said in message, message
    assert caught.value.exit_code == 2


def test_a_chain_parses_with_or_without_spaces_and_a_condition() -> None:
    for line in (
        "a.w b.{N}.{E}.{x|y} unbind(N)|unbind(E)|split_rows(groups=1, sizes=(f, f)) if f",
        "a.w b.{N}.{E}.{x|y}  unbind(N)  |  unbind(E)  |  split_rows(groups=1, sizes=(f, f))  if f",
    ):
        rule = parse_rules(rules(line), ORIGIN).rules[1]
        assert rule.kind == "unbind | unbind | split_rows"
        assert rule.unbound == ("N", "E")
        assert rule.condition == "f"


def test_a_chain_that_reads_the_config_needs_assets() -> None:
    rule_set = parse_rules("a.w b.{N} unbind(N) | crop_rows(vocab_size)\n", ORIGIN)
    assert rule_set.reads_config
    assert not parse_rules("a.w b.{N}.{E} unbind(N) | unbind(E) | crop_rows(3)\n", ORIGIN).reads_config


# ---------------------------------------------------------------- 2. the plan's refusals


def plan(line: str, shape: tuple[int, ...], config: dict[str, object] | None = None, sub_byte: bool = False) -> Conversion:
    return plan_conversion(["w"], [shape], [sub_byte], parse_rules(line + "\n", ORIGIN), config or {})


@pytest.mark.parametrize(
    ("line", "shape", "said"),
    [
        ("w out crop_rows(vocab_size)", (8, 4), "crop_rows(9) of 'w' (shape [8, 4]): keeps 1 to 8 rows"),
        ("w out crop_rows(0)", (8, 4), "keeps 1 to 8 rows"),
        ("w out crop_rows(0 - 1)", (8, 4), "keeps 1 to 8 rows"),
        ("w out.{N} unbind(N) | crop_rows(5)", (2, 4, 3), "(shape [4, 3] after unbind): keeps 1 to 4 rows"),
        ("w out.{N}.{E} unbind(N) | unbind(E)", (2, 4), "unbind of 'w' (shape [4] after unbind): one-dimensional"),
        (
            "w out.{N}.{x|y} unbind(N) | split_rows(groups=2, sizes=(1, 2))",
            (3, 7, 2),
            "(shape [7, 2] after unbind): 2 groups of 1+2 rows is 6 rows, not 7",
        ),
        ("w out.{N} unbind(N) | rope_to_half(2, 4)", (3, 6, 2), "2 heads of 4 rows is 8 rows, not 6"),
        ("w out crop_rows(2)", (), "a scalar has no dim 0"),
    ],
)
def test_a_chain_must_fit_the_shape(line: str, shape: tuple[int, ...], said: str) -> None:
    with pytest.raises(InputError, match=rf"^{ORIGIN}:1: ") as caught:
        plan(line, shape, {"vocab_size": 9})
    assert said in str(caught.value)


def test_a_sub_byte_vector_is_not_cropped() -> None:
    with pytest.raises(InputError, match="sub-byte"):
        plan("w out crop_rows(2)", (4,), sub_byte=True)
    assert plan("w out crop_rows(2)", (4, 3), sub_byte=True).outputs[0].storage == (2, 3)


def test_a_chain_names_its_outputs_in_order() -> None:
    conversion = plan("w m.{N}.e{E+1}.{gate|up} unbind(N) | unbind(E) | split_rows(groups=1, sizes=(2, 2))", (2, 3, 4, 5))
    by_index = sorted(conversion.outputs, key=lambda o: o.index)
    names = [f"m.{n}.e{e + 1}.{part}" for n in range(2) for e in range(3) for part in ("gate", "up")]
    assert [o.name for o in by_index] == names
    assert {o.storage for o in conversion.outputs} == {(2, 5)}
    assert {o.kind for o in conversion.outputs} == {"unbind | unbind | split_rows"}


def test_a_crop_that_keeps_every_row_is_a_copy() -> None:
    conversion = plan("w out crop_rows(4)", (4, 3))
    assert [(o.name, o.storage) for o in conversion.outputs] == [("out", (4, 3))]


# ---------------------------------------------------------------- 3. the geometry against numpy


@dataclass
class Chain:
    """A random rule chain: its calls, the numpy steps, the saved shape and how it is cut."""

    calls: list[str]
    steps: list[tuple[object, ...]]
    shape: tuple[int, ...]
    parts: int  # split_rows parts (0: none)


def random_chain(rng: np.random.Generator) -> Chain:
    """Up to three unbind/crop_rows steps, then split_rows, a rotary order or nothing; the saved shape
    built backwards from the last step so that every step fits."""
    prefix = [str(rng.choice(["unbind", "crop"])) for _ in range(int(rng.integers(0, 4)))]
    last = str(rng.choice(["none", "split", "rope_to_half", "rope_to_interleaved"]))
    if last == "none" and not prefix:
        prefix = ["unbind"]
    rest = tuple(int(x) for x in rng.integers(1, 5, int(rng.integers(0, 3))))
    steps: list[tuple[object, ...]] = []
    calls: list[str] = []
    parts = 0
    if last == "split":
        groups, sizes = int(rng.integers(1, 4)), tuple(int(x) for x in rng.integers(1, 4, int(rng.integers(2, 4))))
        parts = len(sizes)
        shape = (groups * sum(sizes), *rest)
        steps.append(("split", groups, sizes))
        calls.append(f"split_rows(groups={groups}, sizes=({', '.join(map(str, sizes))}))")
    elif last.startswith("rope"):
        heads, head_dim = int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4))
        shape = (heads * head_dim, *rest)
        steps.append((last, heads, head_dim))
        calls.append(f"{last}({heads}, {head_dim})")
    else:
        shape = (int(rng.integers(1, 6)), *rest)
    unbinds = prefix.count("unbind")
    for kind in reversed(prefix):
        if kind == "unbind":
            unbinds -= 1
            shape = (int(rng.integers(1, 5)), *shape)
            steps.insert(0, ("unbind",))
            calls.insert(0, f"unbind(U{unbinds})")
        else:
            kept = shape[0]
            shape = (kept + int(rng.integers(0, 4)), *shape[1:])
            steps.insert(0, ("crop", kept))
            calls.insert(0, f"crop_rows({kept})")
    return Chain(calls, steps, shape, parts)


def target(chain: Chain) -> str:
    fields = "".join(f".{{U{k}}}" for k in range(sum(s[0] == "unbind" for s in chain.steps)))
    split = "" if not chain.parts else ".{" + "|".join(f"p{k}" for k in range(chain.parts)) + "}"
    return f"out{fields}{split}.w"


def numpy_outputs(w: np.ndarray, chain: Chain) -> dict[str, np.ndarray]:
    """The chain applied to the whole tensor with numpy's indexing and reshapes."""
    items: list[tuple[tuple[int, ...], np.ndarray]] = [((), w)]
    found: dict[str, np.ndarray] = {}
    for step in chain.steps:
        if step[0] == "unbind":
            items = [(index + (i,), a[i]) for index, a in items for i in range(a.shape[0])]
        elif step[0] == "crop":
            items = [(index, a[: int(step[1])]) for index, a in items]  # type: ignore[call-overload]
        elif step[0] == "split":
            groups, sizes = int(step[1]), tuple(step[2])  # type: ignore[arg-type, call-overload]
            for index, a in items:
                grouped = a.reshape(groups, sum(sizes), *a.shape[1:])
                starts = np.cumsum([0, *sizes])
                for k, size in enumerate(sizes):
                    name = "out" + "".join(f".{i}" for i in index) + f".p{k}.w"
                    found[name] = grouped[:, starts[k] : starts[k] + size].reshape(groups * size, *a.shape[1:])
            return found
        else:
            heads, head_dim = int(step[1]), int(step[2])  # type: ignore[call-overload]
            split = (head_dim // 2, 2) if step[0] == "rope_to_half" else (2, head_dim // 2)
            items = [(i, a.reshape(heads, *split, -1).transpose(0, 2, 1, 3).reshape(a.shape)) for i, a in items]
    return {"out" + "".join(f".{i}" for i in index) + ".w": a for index, a in items}


def random_pieces(rng: np.random.Generator, w: np.ndarray) -> tuple[Pieces, bytes]:
    """``w`` cut into a grid of boxes at random points of every dim; each box's bytes in one buffer,
    row-major or (some of them) column-major with its strides given, as torch saves a view."""
    cuts = []
    for size in w.shape:
        count = int(rng.integers(0, min(2, size - 1) + 1)) if size > 1 else 0
        points = sorted(int(x) for x in rng.choice(np.arange(1, size), count, replace=False)) if count else []
        cuts.append(list(zip([0, *points], [*points, size])))
    boxes = list(itertools.product(*cuts))
    buffer = bytearray()
    rows: dict[str, list[object]] = {"shape": [], "offset": [], "begin": [], "stride": []}
    strided = False
    for box in boxes:
        region = w[tuple(slice(a, b) for a, b in box)]
        column_major = bool(rng.random() < 0.3) and region.ndim > 1
        data = np.asfortranarray(region) if column_major else np.ascontiguousarray(region)
        strided |= column_major
        buffer += bytes(-len(buffer) % 8)
        rows["begin"].append(len(buffer))
        buffer += data.tobytes(order="F" if column_major else "C")
        rows["shape"].append([b - a for a, b in box])
        rows["offset"].append([a for a, _ in box])
        rows["stride"].append([s // w.itemsize for s in data.strides])
    n, width = len(boxes), w.ndim
    pieces = Pieces(
        np.zeros(n, np.int32),
        np.zeros(n, np.int32),
        np.zeros(n, np.int8),
        np.full(n, width, np.int8),
        np.array(rows["shape"], np.int64).reshape(n, width),
        np.array(rows["offset"], np.int64).reshape(n, width),
        np.array(rows["begin"], np.int64),
        np.zeros(n, np.int32),
        np.array(rows["stride"], np.int64).reshape(n, width) if strided else None,
    )
    return pieces, bytes(buffer)


def assembled(conversion: Conversion, pieces: Pieces, saved: Pieces, buffer: bytes, dtype: np.dtype) -> dict[str, np.ndarray]:
    """Each output read back from the converted pieces' bytes; every element exactly once, every piece
    inside one saved piece's bytes."""
    data = np.frombuffer(buffer, dtype=dtype)
    unit = dtype.itemsize
    saved_end = saved.begin + np.prod(saved.shape, axis=1) * unit
    strides = pieces.strides()
    result = {}
    for t, output in enumerate(conversion.outputs):
        rank = len(output.storage)
        out = np.zeros(output.storage, dtype=dtype)
        seen = np.zeros(output.storage, dtype=np.int64)
        for i in np.flatnonzero(pieces.tensor == t):
            assert (pieces.shape[i, rank:] == 1).all() and (pieces.offset[i, rank:] == 0).all()
            shape, offset, stride = pieces.shape[i, :rank], pieces.offset[i, :rank], strides[i, :rank]
            begin = int(pieces.begin[i])
            last = begin + int(((shape - 1) * stride).sum()) * unit + unit
            inside = (saved.begin <= begin) & (last <= saved_end)
            assert begin % unit == 0 and inside.any(), f"piece {i} of {output.name} reads outside the saved pieces"
            block = as_strided(data[begin // unit :], tuple(int(s) for s in shape), tuple(int(s) * unit for s in stride))
            region = tuple(slice(int(o), int(o + s)) for o, s in zip(offset, shape))
            out[region] = block
            seen[region] += 1
        assert (seen == 1).all(), f"{output.name}: covered {seen.min()} to {seen.max()} times"
        result[output.name] = out if output.view is None else out.transpose(output.view.axes).reshape(output.view.shape)
    return result


@pytest.mark.parametrize("seed", range(120))
def test_chains_match_numpy(seed: int) -> None:
    rng = np.random.default_rng([25, seed])
    chain = random_chain(rng)
    dtype = np.dtype(f"<u{int(rng.choice([1, 2, 4, 8]))}")
    w = rng.integers(0, np.iinfo(dtype).max, chain.shape, dtype=dtype, endpoint=True)
    rule_set = parse_rules(f"w  {target(chain)}  {' | '.join(chain.calls)}\n", ORIGIN)
    conversion = plan_conversion(["w"], [chain.shape], [False], rule_set, {})
    pieces, buffer = random_pieces(rng, w)
    converted = convert_pieces(pieces, conversion, lambda code: 8 * dtype.itemsize)
    got = assembled(conversion, converted, pieces, buffer, dtype)
    want = numpy_outputs(w, chain)
    assert sorted(got) == sorted(want), (chain.calls, chain.shape)
    for name, array in want.items():
        assert got[name].shape == array.shape and got[name].tobytes() == array.tobytes(), (name, chain.calls, chain.shape)


def test_the_random_chains_cover_the_geometry() -> None:
    """The seeded chains do what they are for: every step kind, long chains, crops that cut and that keep all."""
    chains = [random_chain(np.random.default_rng([25, seed])) for seed in range(120)]
    kinds = {str(step[0]) for chain in chains for step in chain.steps}
    assert kinds == {"unbind", "crop", "split", "rope_to_half", "rope_to_interleaved"}
    assert any(len(chain.steps) >= 4 for chain in chains)
    assert any(sum(s[0] == "unbind" for s in chain.steps) >= 2 and chain.parts for chain in chains)
    crops = [(chain, i) for chain in chains for i, s in enumerate(chain.steps) if s[0] == "crop"]
    assert any(i > 0 for _, i in crops)  # a crop after an unbind
    assert any(c.shape[0] > c.steps[0][1] for c, i in crops if i == 0)  # type: ignore[operator]
    assert any(c.shape[0] == c.steps[0][1] for c, i in crops if i == 0)


def test_crop_keeps_a_byte_range_of_each_piece() -> None:
    """A [Vpad, H] embedding cut in two over the rows: the kept rows are the first bytes of each piece."""
    w = np.arange(12 * 3, dtype=np.uint16).reshape(12, 3)
    pieces = Pieces(
        np.zeros(2, np.int32), np.zeros(2, np.int32), np.zeros(2, np.int8), np.full(2, 2, np.int8),
        np.array([[6, 3], [6, 3]]), np.array([[0, 0], [6, 0]]), np.array([0, 36]), np.zeros(2, np.int32),
    )  # fmt: skip
    conversion = plan("w out crop_rows(10)", (12, 3))
    converted = convert_pieces(pieces, conversion, lambda code: 16)
    assert converted.shape.tolist() == [[6, 3], [4, 3]]
    assert converted.begin.tolist() == [0, 36]
    three = convert_pieces(pieces, plan("w out crop_rows(5)", (12, 3)), lambda code: 16)
    assert three.shape.tolist() == [[5, 3]] and three.begin.tolist() == [0]  # the second piece is not read
    assert assembled(conversion, converted, pieces, w.tobytes(), w.dtype)["out"].tobytes() == w[:10].tobytes()
