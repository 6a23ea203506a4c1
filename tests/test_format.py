"""safetensors format: header bytes identical to the reference serializer, strict parsing."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from helpers import SPEC_DTYPE, reference_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpicons.core.errors import InputError
from mpicons.core.safetensors_codec import (
    DTYPE_BY_NAME,
    DTYPES,
    build_header,
    nbytes_of,
    parse_header,
    read_header,
    reference_order,
)
from mpicons.formats import shard_headers as headers

WHOLE_BYTE_DTYPES = [d.name for d in DTYPES if d.bits % 8 == 0]

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12).filter(
    lambda n: n != "__metadata__"
)
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@st.composite
def tensor_sets(draw):
    chosen = draw(st.dictionaries(names, st.tuples(st.sampled_from(WHOLE_BYTE_DTYPES + ["F4"]), shapes), min_size=1, max_size=8))
    result = {}
    for name, (dtype, shape) in chosen.items():
        if dtype == "F4":
            shape = shape[:-1] + [2 * (shape[-1] if shape else 1)] if shape else [2]
        size = nbytes_of(dtype, shape)
        result[name] = (dtype, shape, bytes(np.random.default_rng(len(name)).integers(0, 256, size, dtype=np.uint8)))
    return result


def _mpicons_bytes(tensors):
    items = [(n, d, s) for n, (d, s, _) in tensors.items()]
    order = reference_order([(n, d) for n, d, _ in items])
    header, _ = build_header([items[i] for i in order], {"format": "pt"})
    return header + b"".join(tensors[items[i][0]][2] for i in order)


@settings(max_examples=300, deadline=None)
@given(tensor_sets())
def test_layout_is_byte_identical_to_reference_serializer(tensors):
    assert _mpicons_bytes(tensors) == reference_bytes(tensors)


def test_every_dtype_round_trips():
    tensors = {
        f"t.{d.name}": (d.name, [2, 4], bytes(range(nbytes_of(d.name, [2, 4]))))
        for d in DTYPES
        if d.name in SPEC_DTYPE or d.name == "F4"
    }
    blob = reference_bytes(tensors)
    (length,) = struct.unpack("<Q", blob[:8])
    header = parse_header(blob[8 : 8 + length], len(blob))
    assert {e.name: (e.dtype, list(e.shape)) for e in header.tensors} == {n: (d, s) for n, (d, s, _) in tensors.items()}
    assert header.metadata == {"format": "pt"}
    assert _mpicons_bytes(tensors) == blob


def test_dtype_order_matches_reference():
    tensors = {
        f"x{i}": (name, [1] if DTYPE_BY_NAME[name].bits % 8 == 0 else [2], b"")
        for i, name in enumerate(reversed(WHOLE_BYTE_DTYPES))
    }
    tensors = {n: (d, s, bytes(nbytes_of(d, s))) for n, (d, s, _) in tensors.items()}
    blob = reference_bytes(tensors)
    (length,) = struct.unpack("<Q", blob[:8])
    ref_order = [tensors[k][0] for k in json.loads(blob[8 : 8 + length]) if k != "__metadata__"]
    assert ref_order == [d for d in WHOLE_BYTE_DTYPES]


def _header(obj, pad=True):
    text = json.dumps(obj).encode()
    return text + (b" " * (-len(text) % 8) if pad else b"")


@pytest.mark.parametrize(
    "raw, data_len, message",
    [
        (b"\xff\xfe", 10, "not UTF-8"),
        (b"{not json", 17, "not valid JSON"),
        (b"[1, 2]", 14, "not a JSON object"),
        (_header({"__metadata__": {"a": 1}}), 0, "__metadata__"),
        (_header({"t": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}), 0, "unknown dtype"),
        (_header({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}), 0, "shape"),
        (_header({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}), 0, "needs 8"),
        (_header({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}), 0, "data_offsets"),
        (
            _header(
                {
                    "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                    "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]},
                }
            ),
            0,
            "overlaps",
        ),
        (
            _header(
                {
                    "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                    "b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]},
                }
            ),
            0,
            "gap",
        ),
        (_header({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}), 3, "truncated"),
        (
            b'{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"t":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
            0,
            "twice",
        ),
        (_header({"t": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}), 0, "whole number of bytes"),
    ],
)
def test_bad_headers_are_clean_errors(raw, data_len, message):
    with pytest.raises(InputError, match=message) as caught:
        parse_header(raw, 8 + len(raw) + data_len, "f.safetensors")
    assert str(caught.value).startswith("f.safetensors: ")


def test_file_length_must_match_header():
    raw = _header({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})
    parse_header(raw, 8 + len(raw) + 4)
    with pytest.raises(InputError, match="trailing"):
        parse_header(raw, 8 + len(raw) + 5)
    with pytest.raises(InputError, match="truncated"):
        parse_header(raw, 8 + len(raw) + 3)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 1000))
def test_any_bytes_parse_or_fail_cleanly(raw, extra):
    try:
        parse_header(raw, 8 + len(raw) + extra)
    except InputError:
        pass


@settings(max_examples=300, deadline=None)
@given(tensor_sets(), st.integers(0, 200), st.integers(0, 255))
def test_mutated_headers_parse_or_fail_cleanly(tensors, position, value):
    blob = bytearray(reference_bytes(tensors))
    (length,) = struct.unpack("<Q", blob[:8])
    if length:
        blob[8 + position % length] = value
    try:
        parse_header(bytes(blob[8 : 8 + length]), len(blob))
    except InputError:
        pass


@st.composite
def damaged_files(draw):
    """Whole files: valid ones damaged anywhere (length prefix included), or arbitrary bytes."""
    blob = bytearray(reference_bytes(draw(tensor_sets())))
    (length,) = struct.unpack("<Q", blob[:8])
    kind = draw(st.sampled_from(["flip", "truncate", "prefix", "append", "arbitrary"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            blob[draw(st.integers(0, min(len(blob), 8 + length + 16) - 1))] = draw(st.integers(0, 255))
    elif kind == "truncate":
        del blob[draw(st.integers(0, len(blob))) :]
    elif kind == "prefix":
        near = st.integers(max(0, length - 16), length + 16)
        blob[:8] = struct.pack("<Q", draw(st.one_of(near, st.integers(0, 2**64 - 1), st.just(100_000_001))))
    elif kind == "append":
        blob += draw(st.binary(min_size=1, max_size=16))
    else:
        blob = bytearray(draw(st.binary(max_size=64)))
    return bytes(blob)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "f.safetensors"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damaged_files())
@pytest.mark.slow
def test_any_file_reads_or_fails_cleanly(scratch, blob):
    """read_header on a file: a header consistent with the file's bytes, or an InputError naming the file."""
    scratch.write_bytes(blob)
    try:
        header = read_header(scratch)
    except InputError as exc:
        assert str(exc).startswith(f"{scratch}: ")
        return
    (length,) = struct.unpack("<Q", blob[:8])
    assert header.data_start == 8 + length and header.file_size == len(blob)
    spans = sorted((e.begin, e.end) for e in header.tensors)
    assert [b for b, _ in spans] == [0] + [e for _, e in spans[:-1]]  # contiguous from 0
    assert header.data_start + (spans[-1][1] if spans else 0) == len(blob)


# ---------------------------------------------------------------- accepted exactly when the reference reader accepts


def _reference_accepts(path) -> bool:
    """Whether safetensors' own reader opens the file (it validates the whole header on open)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            return True
    except Exception:  # the reference reader's errors have no common class
        return False


def _mpicons_accepts(path) -> bool:
    """Whether both of mpicons' header readers accept the file; they must agree with each other."""
    from mpicons.formats.shard_headers import read_file

    verdicts = []
    for read in (lambda: read_header(path), lambda: read_file(str(path), "plain.safetensors")):
        try:
            read()
            verdicts.append(True)
        except InputError:
            verdicts.append(False)
    assert verdicts[0] == verdicts[1], f"the strict and the fast header readers disagree on {path.read_bytes()[:200]!r}"
    return verdicts[0]


def _forbidden_by_the_format(header: bytes) -> bool:
    """What the format forbids and the reference reader lets through: a header not starting with
    ``{`` (it accepts leading whitespace) and a name or key given twice (it keeps the last)."""
    if not header.startswith(b"{"):
        return True

    def unique(pairs):
        if len({k for k, _ in pairs}) != len(pairs):
            raise KeyError("twice")
        return dict(pairs)

    try:
        json.loads(header.decode("utf-8"), object_pairs_hook=unique)
    except KeyError:
        return True
    except ValueError:
        return False
    return False


def _agrees(tmp_path, header: bytes, data: bytes) -> None:
    path = tmp_path / "file.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    reference, ours = _reference_accepts(path), _mpicons_accepts(path)
    if reference and not ours:
        assert _forbidden_by_the_format(header), f"mpicons refuses what safetensors reads: {header[:300]!r}"
    else:
        assert ours == reference, f"mpicons {'accepts' if ours else 'refuses'}, safetensors does not: {header[:300]!r}"


_ENTRY = b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'


def _with_field(value: bytes) -> bytes:
    return b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + value + b"}}"


CRAFTED = {
    "plain": b"{" + _ENTRY + b"}",
    "byte-order mark": b"\xef\xbb\xbf{" + _ENTRY + b"}",
    "leading space": b" {" + _ENTRY + b"}",
    "leading newline": b"\n{" + _ENTRY + b"}",
    "trailing spaces": b"{" + _ENTRY + b"}    ",
    "trailing tab and newline": b"{" + _ENTRY + b"}\t\n\r",
    "trailing NUL": b"{" + _ENTRY + b"}\0",
    "trailing garbage": b"{" + _ENTRY + b"}x",
    "trailing no-break space": b"{" + _ENTRY + b"}\xc2\xa0",
    "a name twice": b"{" + _ENTRY + b"," + _ENTRY + b"}",
    "a name twice, first not an entry": b'{"a":5,' + _ENTRY + b"}",
    "a name twice, last not an entry": b"{" + _ENTRY + b',"a":5}',
    "__metadata__ twice": b'{"__metadata__":{"x":"1"},"__metadata__":{"y":"2"},' + _ENTRY + b"}",
    "a metadata key twice": b'{"__metadata__":{"x":"1","x":"2"},' + _ENTRY + b"}",
    "a field twice": b'{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    "null metadata": b'{"__metadata__":null,' + _ENTRY + b"}",
    "metadata last": b"{" + _ENTRY + b',"__metadata__":{"a":"b"}}',
    "an integer in metadata": b'{"__metadata__":{"x":1},' + _ENTRY + b"}",
    "an extra field": _with_field(b"1"),
    "an extra field nested 125 deep": _with_field(b"[" * 125 + b"]" * 125),
    "an extra field nested 126 deep": _with_field(b"[" * 126 + b"]" * 126),
    "an extra field nested 200 deep": _with_field(b"[" * 200 + b"]" * 200),
    "NaN in an extra field": _with_field(b"NaN"),
    "Infinity in an extra field": _with_field(b"Infinity"),
    "1e400 in an extra field": _with_field(b"1e400"),
    "1e308 in an extra field": _with_field(b"1e308"),
    "a 310-digit integer in an extra field": _with_field(b"1" + b"0" * 309),
    "a 309-digit integer in an extra field": _with_field(b"1" + b"0" * 308),
    "-0 in an extra field": _with_field(b"-0"),
    "a surrogate pair escape": _with_field(b'"\\ud83d\\ude00"'),
    "a lone surrogate escape in a field": _with_field(b'"\\udc00"'),
    "a lone surrogate escape in a name": b'{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    "a lone surrogate escape in metadata": b'{"__metadata__":{"k":"\\ud800"},' + _ENTRY + b"}",
    "an encoded surrogate in a name": b'{"\xed\xa0\x80":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    "invalid UTF-8": b'{"\xff":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    "UTF-16": ("{" + _ENTRY.decode() + "}").encode("utf-16-le"),
    "a control character in a name": b'{"a\x01":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    "an escaped name": b'{"\\u0061":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    "an escaped dtype": b'{"a":{"dtype":"F\\u0033\\u0032","shape":[1],"data_offsets":[0,4]}}',
    "-0 as an offset": b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[-0,4]}}',
    "a float in a shape": b'{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}',
    "an exponent in a shape": b'{"a":{"dtype":"F32","shape":[1e0],"data_offsets":[0,4]}}',
    "a shape of 2**64": b'{"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,4]}}',
    "three offsets": b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,5]}}',
    "no shape": b'{"a":{"dtype":"F32","data_offsets":[0,4]}}',
    "a JSON array": b"[]",
    "spaces around colons": b'{"a" : {"dtype" : "F32", "shape" : [1], "data_offsets" : [0, 4]}}',
}


def _shaped(dtype: str, shape: list[int], end: int = 0) -> bytes:
    return json.dumps({"a": {"dtype": dtype, "shape": shape, "data_offsets": [0, end]}}, separators=(",", ":")).encode()


SHAPES = {
    "elements overflow before a 0": _shaped("U8", [2**62, 2**62, 0]),
    "a 0 before huge dimensions": _shaped("U8", [0, 2**62, 2**62]),
    "bits overflow": _shaped("F64", [2**62]),
    "bits of a 0-element tensor": _shaped("F64", [2**62, 0]),
    "half a byte of F4": _shaped("F4", [3], 2),
    "empty": b"{}",
}


@pytest.fixture(params=["installed", "json"])
def decoder(request, monkeypatch):
    """The header decoder: orjson where it is installed (else json), and json's fallback alike."""
    monkeypatch.setattr(headers, "FAST_JSON_MIN", 0)  # the crafted headers are short: orjson for every one
    if request.param == "json":
        monkeypatch.setattr(
            headers, "_fast_loads", lambda raw: json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
        )
    return request.param


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_header_is_accepted_exactly_when_the_reference_reader_accepts_it(tmp_path, case, decoder):
    _agrees(tmp_path, CRAFTED[case], b"\0" * 4)


@pytest.mark.parametrize("case", list(SHAPES))
def test_shapes_overflow_where_the_reference_reader_overflows(tmp_path, case, decoder):
    _agrees(tmp_path, SHAPES[case], b"\0\0" if case == "half a byte of F4" else b"")


def test_a_byte_order_mark_is_refused_with_a_clear_message(tmp_path):
    path = tmp_path / "bom.safetensors"
    header = CRAFTED["byte-order mark"]
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(InputError, match="starting with '{'"):
        read_header(path)


_TOKENS = [
    *(b" ", b"\n", b"\t", b",", b":", b"{", b"}", b"[", b"]", b'"', b"\\", b"\\u", b"\\ud800", b"-", b"-0", b"0", b"1"),
    *(b"e5", b".5", b"NaN", b"null", b"true", b'"a"', b'"a":', b'"x":1,', b"\xef\xbb\xbf", b"\xed\xa0\x80", b"\xff", b"\0"),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensor_sets(), st.lists(st.tuples(st.integers(0, 400), st.sampled_from(_TOKENS), st.booleans()), min_size=1, max_size=3))
@pytest.mark.slow
def test_edited_headers_are_accepted_exactly_when_the_reference_reader_accepts_them(tmp_path, tensors, edits):
    """Valid headers with JSON tokens inserted or overwritten anywhere: mpicons and safetensors agree."""
    blob = reference_bytes(tensors)
    (length,) = struct.unpack("<Q", blob[:8])
    header, data = bytearray(blob[8 : 8 + length]), blob[8 + length :]
    for position, token, overwrite in edits:
        at = position % (len(header) + 1)
        header[at : at + (len(token) if overwrite else 0)] = token
    _agrees(tmp_path, bytes(header), data)


# ---------------------------------------------------------------- the 8-byte length prefix, read alike everywhere

PREFIXES = {
    "an empty file": (b"", "file is 0 bytes, too short for a safetensors header"),
    "7 bytes": (b"\2\0\0\0\0\0\0", "file is 7 bytes, too short for a safetensors header"),
    "a length past the end": (struct.pack("<Q", 3) + b"{}", "header length 3 runs past the end of the 10-byte file"),
    "a length over the limit": (
        struct.pack("<Q", 100_000_001) + b"{}",
        "header length 100000001 exceeds the safetensors limit of 100000000 bytes",
    ),
    "a length that fits": (struct.pack("<Q", 2) + b"{}", None),
}


@pytest.mark.parametrize("case", list(PREFIXES))
def test_every_reader_refuses_a_bad_length_prefix_alike_and_as_the_reference_reader(tmp_path, case):
    """The strict, the fast and verify's header readers: same verdict as safetensors, same words."""
    from mpicons.formats.shard_headers import read_file
    from mpicons.frontends.output_reading import Unreadable, _read_header

    blob, expected = PREFIXES[case]
    path = tmp_path / "file.safetensors"
    path.write_bytes(blob)
    assert _reference_accepts(path) == (expected is None)
    said = []
    for read, refusal in (
        (lambda: read_header(path), InputError),
        (lambda: read_file(str(path), "plain.safetensors"), InputError),
        (lambda: _read_header(str(path), False), Unreadable),
    ):
        try:
            read()
            said.append(None)
        except refusal as exc:
            said.append(str(exc).removeprefix(f"{path}: "))
    if expected is None:
        assert said == [None, None, None]
    else:
        assert all(s is not None and s.startswith(expected) for s in said), said


def test_orjson_is_asked_only_for_a_long_header(monkeypatch) -> None:
    """orjson is imported (and used) only for a header of at least ``FAST_JSON_MIN`` bytes: on small
    headers its import costs more than it saves. Both decoders give the same objects."""
    asked: list[int] = []

    def recording() -> object:
        asked.append(1)
        return json.loads

    monkeypatch.setattr(headers, "_orjson_loads", recording)
    assert headers._fast_loads(b'{"a": [1, 2]}') == {"a": [1, 2]} and not asked
    long = json.dumps({str(i): [i, i + 1] for i in range(headers.FAST_JSON_MIN // 8)}).encode()
    assert headers._fast_loads(long) == json.loads(long) and asked
