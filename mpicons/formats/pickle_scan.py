"""The opcode pre-scan of a pickle (no MPI, no I/O): one pass over its opcodes, building nothing,
that refuses what would make Python's unpickler take memory or time out of proportion to the file,
or crash, before :mod:`mpicons.formats.unpickling` runs any of it.

Python's unpickler is C code that handles no signal until it returns: whatever it does must be
bounded before it starts. The bounds are on nesting, containers per byte, memo indices, lengths,
and what hashing each dict key or set element costs (a tuple is hashed anew at every use; integer
and tuple hashes are not salted, so keys can be made to collide).
"""

from __future__ import annotations

import pickle


class Bound(Exception):
    """The pickle passes one of the bounds on what reading it may build."""


#: Nesting deeper than this is refused before anything is built: DCP's metadata nests about a dozen
#: levels, and Python's unpickler hashes dict keys recursively (a tuple nested 100,000 deep crashes it).
MAX_DEPTH = 64
#: Empty containers a pickle may make: one per :data:`BYTES_PER_CONTAINER` bytes of it, beyond a few
#: thousand. Checkpoints' pickles spend 24 to 90 bytes per container; two bytes can make an empty set
#: (about 200 bytes of memory), so without a bound a file would take a hundred times its size.
BYTES_PER_CONTAINER, FREE_CONTAINERS = 8, 4096
#: What a dict key or set element may cost to hash: Python hashes a tuple (and an integer) afresh at
#: every use, so a key is at most a tuple of :data:`KEY_PARTS` values that hash at once (names, integers
#: of up to 8 bytes, records) — 40 tuples that share their parts make one key of 2**40 steps. Tuple keys
#: are at most :data:`TUPLE_KEYS` per pickle: their hashes are not salted, so many can be made to
#: collide, and a dict of colliding keys takes quadratic time to build. Checkpoints key by names,
#: small integers and records.
KEY_PARTS, TUPLE_KEYS = 32, 4096

# The pre-scan's value on the stack for each value on the unpickler's stack: its nesting depth times
# 128, plus what hashing it costs (0 for a value that hashes at once, up to 127 meaning "too much").
_COST, _LEVEL = 127, 128
_TOO_DEEP = (MAX_DEPTH + 1) * _LEVEL

# Opcode kinds of the pre-scan (see :func:`check_opcodes`).
_ATOM, _COUNTED, _LINE, _EMPTY, _MEMOIZE, _GET, _PUT, _TUPLE_N, _FROM_MARK, _INTO_MARK = range(10)
_MARK, _REDUCE, _BUILD, _APPEND, _SETITEM, _POP, _POP_MARK, _DUP, _STACK_GLOBAL, _PERSID = range(10, 20)
_NEWOBJ, _NEWOBJ_EX, _GLOBAL, _INST, _FRAME, _PROTO, _STOP, _LONG, _GET_TEXT = range(20, 29)
_KIND: dict[bytes, tuple[int, int]] = {  # opcode → (kind, argument bytes or length-prefix bytes)
    **{op: (_ATOM, 0) for op in (b"N", b"\x88", b"\x89")},
    b"K": (_ATOM, 1), b"M": (_ATOM, 2), b"J": (_ATOM, 4), b"G": (_ATOM, 8),
    **{op: (_COUNTED, 1) for op in (b"\x8c", b"C", b"U")},
    **{op: (_COUNTED, 4) for op in (b"X", b"B", b"T")},
    **{op: (_COUNTED, 8) for op in (b"\x8d", b"\x8e", b"\x96")},
    b"\x8a": (_LONG, 1), b"\x8b": (_LONG, 4),
    **{op: (_LINE, 0) for op in (b"I", b"L", b"F", b"S", b"V")},
    **{op: (_EMPTY, 0) for op in (b"]", b")", b"}", b"\x8f")},
    b"\x94": (_MEMOIZE, 0), b"g": (_GET_TEXT, -1), b"h": (_GET, 1), b"j": (_GET, 4),
    b"p": (_PUT, -1), b"q": (_PUT, 1), b"r": (_PUT, 4),
    b"\x85": (_TUPLE_N, 1), b"\x86": (_TUPLE_N, 2), b"\x87": (_TUPLE_N, 3),
    **{op: (_FROM_MARK, 0) for op in (b"t", b"l", b"d", b"\x91", b"o")},
    **{op: (_INTO_MARK, 0) for op in (b"e", b"u", b"\x90")},
    b"(": (_MARK, 0), b"R": (_REDUCE, 0), b"b": (_BUILD, 0), b"a": (_APPEND, 0), b"s": (_SETITEM, 0),
    b"0": (_POP, 0), b"1": (_POP_MARK, 0), b"2": (_DUP, 0), b"\x93": (_STACK_GLOBAL, 0),
    b"P": (_PERSID, -1), b"Q": (_PERSID, 0), b"\x81": (_NEWOBJ, 0), b"\x92": (_NEWOBJ_EX, 0),
    b"c": (_GLOBAL, 0), b"i": (_INST, 0), b"\x95": (_FRAME, 8), b"\x80": (_PROTO, 1), b".": (_STOP, 0),
}  # fmt: skip
_KINDS = [_KIND.get(bytes([op]), (-1, 0)) for op in range(256)]
#: The kinds :func:`_walk` handles inline, bound to local names there: its loop runs once per opcode.
_HOT_KINDS = (_MEMOIZE, _GET, _ATOM, _MARK, _EMPTY, _TUPLE_N, _REDUCE, _NEWOBJ, _BUILD, _FROM_MARK, _INTO_MARK, _COUNTED)
#: Opcodes that hash what they take from the stack: DICT, SETITEMS, FROZENSET, ADDITEMS (keys every
#: other value for the dict ones); TUPLE makes a value whose hash costs what its parts cost.
_KEYED = {ord("d"): 2, ord("u"): 2, 0x91: 1, 0x90: 1}
_TUPLE = ord("t")
#: The rare kinds that read an argument from the data, and STOP.
_READING = frozenset((_PERSID, _LONG, _LINE, _GLOBAL, _INST, _FRAME, _PROTO, _STOP))


class _Stop(Exception):
    """The pre-scan reached STOP: the pickle's end, every bound held."""


def check_opcodes(data: bytes) -> None:
    """Walk the pickle's opcodes once, without building anything, and refuse what would make the
    unpickler take memory or time out of proportion to the file or crash: a memo index beyond the
    entries stored so far (the unpickler grows its memo array to the largest index), a length reaching
    past the end of the data, nesting deeper than :data:`MAX_DEPTH`, more containers than the file
    could hold in a checkpoint, dict keys costly to hash or many tuple keys (:data:`KEY_PARTS`),
    opcodes DCP's pickles never use (extension registry, out-of-band buffers). Linear: one step per
    opcode, the common ones inline."""
    try:
        _walk(data)
    except _Stop:
        return
    except IndexError:
        raise pickle.UnpicklingError("the pickle takes more values from its stack or memo than it put there") from None


def _walk(data: bytes) -> None:
    kinds, size, at, from_bytes, too_deep = _KINDS, len(data), 0, int.from_bytes, _TOO_DEEP
    memoize, get, atom, mark, empty, tuple_n, reduce, newobj, build, from_mark, into_mark, counted = _HOT_KINDS
    stack: list[int] = []  # depth and hashing cost of each value on the unpickler's stack (see _LEVEL)
    marks: list[int] = []
    memo: list[int] = []
    containers, allowed = 0, FREE_CONTAINERS + size // BYTES_PER_CONTAINER
    tuple_keys = [0]
    while at < size:
        kind, arg = kinds[data[at]]
        at += 1
        if kind == memoize:
            memo.append(stack[-1])
        elif kind == get:
            if arg == 1:
                stack.append(memo[data[at]])
                at += 1
            else:
                stack.append(memo[from_bytes(data[at : at + 4], "little")])
                at += 4
        elif kind == atom:
            stack.append(0)
            at += arg
        elif kind == mark:
            marks.append(len(stack))
        elif kind == empty:
            stack.append(128)
            containers += 1
            if containers > allowed:
                _too_many(containers, size)
        elif kind == tuple_n:
            if len(stack) < arg:
                raise IndexError
            parts = stack[-arg:]
            del stack[-arg:]
            cost = arg + 1
            for part in parts:
                cost += part & 127
            level = (max(parts) | 127) + 1
            if level >= too_deep:
                _deep(level)
            stack.append(level | cost if cost < 127 else level | 127)
        elif kind == reduce:
            stack[-1] = max(stack.pop(), 128)  # what a stand-in returns may hash like its arguments
        elif kind == newobj:
            stack[-1] = stack.pop() & -128 or 128  # a record: hashed by identity
        elif kind == build:
            level = (stack.pop() | 127) + 1
            if level > stack[-1]:
                stack[-1] = (level if level < too_deep else _deep(level)) | (stack[-1] & 127)
        elif kind == from_mark or kind == into_mark:
            _close_mark(data[at - 1], kind == into_mark, stack, marks, tuple_keys)
        elif kind == counted:
            at += arg + from_bytes(data[at : at + arg], "little")
            if at > size:
                raise pickle.UnpicklingError("a value reaches past the end of the pickle")
            stack.append(0)
        else:
            at = _rare_opcode(data, at, data[at - 1], kind, arg, stack, marks, memo, tuple_keys)
    raise pickle.UnpicklingError("the pickle ends without a STOP")


def _close_mark(op: int, into: bool, stack: list[int], marks: list[int], tuple_keys: list[int]) -> None:
    """An opcode that takes the values since the last MARK: into the container below them (``into``:
    APPENDS, SETITEMS, ADDITEMS) or into a new one (TUPLE, LIST, DICT, FROZENSET, OBJ); the keys of the
    dict and set ones weighed first."""
    start = marks.pop()
    parts = stack[start:]
    del stack[start:]
    level = ((max(parts) if parts else 0) | 127) + 1
    if op in _KEYED:
        keys = parts[:: _KEYED[op]]
        if any(keys):
            _check_keys(keys, tuple_keys)
    if into:
        stack[-1] = _deep(max(stack[-1], level))
    elif op == _TUPLE:
        stack.append(_deep(level | min(127, 1 + len(parts) + sum(part & 127 for part in parts))))
    else:
        stack.append(_deep(level))


def _check_keys(keys: list[int], tuple_keys: list[int]) -> None:
    """Refuse dict keys (or set elements) that cost too much to hash, or too many tuples as keys."""
    costs = [key & 127 for key in keys if key & 127]
    if not costs:
        return
    if max(costs) > KEY_PARTS + 1:
        raise Bound(
            f"a dict key or set element costs more than {KEY_PARTS + 1} steps to hash (a tuple of more than {KEY_PARTS} "
            "values, tuples nested in it, or an integer of more than 8 bytes), and Python hashes it anew at every use"
        )
    tuple_keys[0] += len(costs)
    if tuple_keys[0] > TUPLE_KEYS:
        raise Bound(f"it uses more than {TUPLE_KEYS} tuples as dict keys or set elements, whose hashes can collide")


def _too_many(containers: int, size: int) -> None:
    raise Bound(
        f"it makes more than {containers - 1} containers from {size} bytes (a checkpoint's pickle spends "
        f"{BYTES_PER_CONTAINER} bytes or more on each): its objects would take memory out of proportion to the file"
    )


def _deep(level: int) -> int:
    if level >= _TOO_DEEP:
        raise Bound(f"it nests values more than {MAX_DEPTH} deep")
    return level


def _opcode_index(data: bytes, at: int, width: int) -> tuple[int, int]:
    """A memo index: ``width`` little-endian bytes, or a decimal line when ``width`` is -1."""
    if width > 0:
        if at + width > len(data):
            raise pickle.UnpicklingError("the pickle is truncated")
        return int.from_bytes(data[at : at + width], "little"), at + width
    end = data.find(b"\n", at)
    if end < 0 or not data[at:end].isdigit() or end - at > 18:
        raise pickle.UnpicklingError("a malformed memo index")
    return int(data[at:end]), end + 1


def _pop(stack: list[int], count: int) -> int:
    """Remove ``count`` values; the deepest of them."""
    if len(stack) < count:
        raise pickle.UnpicklingError("stack underflow")
    deepest = max(stack[len(stack) - count :], default=0)
    del stack[len(stack) - count :]
    return deepest


def _line_end(data: bytes, at: int, lines: int = 1) -> int:
    for _ in range(lines):
        end = data.find(b"\n", at)
        if end < 0:
            raise pickle.UnpicklingError("the pickle is truncated")
        at = end + 1
    return at


def _rare_opcode(
    data: bytes, at: int, op: int, kind: int, arg: int, stack: list[int], marks: list[int], memo: list[int], tuple_keys: list[int]
) -> int:
    """:func:`check_opcodes` for the opcodes that are not in every piece's record; raises :class:`_Stop` at STOP."""
    if kind in _READING:
        return _rare_value(data, at, op, kind, arg, stack, marks)
    if kind == _GET_TEXT:
        index, at = _opcode_index(data, at, arg)
        stack.append(memo[index])
    elif kind == _PUT:
        index, at = _opcode_index(data, at, arg)
        if index > len(memo):
            raise Bound(f"it stores memo entry {index} after {len(memo)} entries")
        if not stack:
            raise pickle.UnpicklingError("PUT on an empty stack")
        memo.append(stack[-1]) if index == len(memo) else memo.__setitem__(index, stack[-1])
    elif kind in (_NEWOBJ_EX, _STACK_GLOBAL):
        deepest = _pop(stack, 3 if kind == _NEWOBJ_EX else 2)
        stack.append(0 if kind == _STACK_GLOBAL else deepest & -128 or 128)
    elif kind in (_APPEND, _SETITEM):
        if kind == _SETITEM and len(stack) >= 2 and stack[-2]:
            _check_keys(stack[-2:-1], tuple_keys)
        level = (_pop(stack, 2 if kind == _SETITEM else 1) | 127) + 1
        if not stack:
            raise pickle.UnpicklingError("stack underflow")
        stack[-1] = _deep(max(stack[-1], level))
    elif kind == _POP:
        if marks and marks[-1] == len(stack):
            marks.pop()
        else:
            _pop(stack, 1)
    elif kind == _POP_MARK:
        if not marks:
            raise pickle.UnpicklingError("no MARK")
        del stack[marks.pop() :]
    elif kind == _DUP:
        stack.append(stack[-1])
    else:
        raise pickle.UnpicklingError(f"opcode {bytes([op])!r}, which DCP's pickles do not use")
    return at


def _rare_value(data: bytes, at: int, op: int, kind: int, arg: int, stack: list[int], marks: list[int]) -> int:
    """The rare opcodes that read their argument from the data (and STOP)."""
    if kind == _PERSID:
        if arg < 0:
            at = _line_end(data, at)
            stack.append(128)
        else:
            stack.append(_pop(stack, 1) & -128 or 128)
    elif kind == _LONG:
        length = int.from_bytes(data[at : at + arg], "little")
        at += arg + length
        if at > len(data):
            raise pickle.UnpicklingError("a value reaches past the end of the pickle")
        stack.append(0 if length <= 8 else 127)  # a longer integer is hashed digit by digit at every use
    elif kind in (_LINE, _GLOBAL):
        start, at = at, _line_end(data, at, 2 if kind == _GLOBAL else 1)
        stack.append(127 if op in b"IL" and at - start > 21 else 0)
    elif kind == _INST:
        at = _line_end(data, at, 2)
        if not marks:
            raise pickle.UnpicklingError("no MARK")
        start = marks.pop()
        level = (max(stack[start:], default=0) | 127) + 1
        del stack[start:]
        stack.append(_deep(level))
    elif kind == _FRAME:
        if at + 8 > len(data) or at + 8 + int.from_bytes(data[at : at + 8], "little") > len(data):
            raise pickle.UnpicklingError("a frame reaches past the end of the pickle")
        at += 8
    elif kind == _PROTO:
        at += 1
    else:
        raise _Stop
    return at


__all__ = ["BYTES_PER_CONTAINER", "FREE_CONTAINERS", "KEY_PARTS", "MAX_DEPTH", "TUPLE_KEYS", "Bound", "check_opcodes"]
