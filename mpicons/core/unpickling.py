"""Restricted unpickling for DCP's pickles (no MPI here): a pre-scan of the opcodes, then an
unpickler that hands out only inert, read-only stand-ins.

A trainer that pickles more than the format's own classes (Megatron's save plans in ``.metadata``,
``argparse.Namespace`` in ``common.pt``) names them in an :class:`AllowList`, by exact module and
name; they become inert :class:`Record` or :class:`EnumMember` values, nothing of them imported.

Before anything of a pickle runs, :func:`check_opcodes` walks its opcodes once and refuses what
would make Python's unpickler take memory out of proportion to the file or crash (memo indices
beyond what was stored, lengths past the end, nesting deeper than :data:`MAX_DEPTH`, opcodes DCP
never writes). While it runs, the stand-in functions spend a :class:`Budget` in proportion to the
pickle's size. The readers of ``.metadata`` (:mod:`mpicons.core.distcp_metadata`) and of the items'
``data.pkl`` (:mod:`mpicons.core.distcp_items`) subclass :class:`RestrictedUnpickler`.
"""

from __future__ import annotations

import io
import pickle
import reprlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .errors import InputError
from .format import DTYPES

#: torch dtype attribute names (and the aliases a pickle may use) → safetensors dtype.
TORCH_DTYPES: dict[str, str] = {d.torch: d.name for d in DTYPES if d.torch is not None}
TORCH_DTYPES.update(float="F32", double="F64", half="F16", long="I64", int="I32", short="I16")


class Sealed:
    """A value the unpicklers hand out: a pickle cannot change it (no ``__dict__``; BUILD, the only
    opcode that sets state on an object it did not make, is refused), so what one input does to it
    can never change how the next one is read."""

    __slots__ = ()

    def __setstate__(self, state: object) -> None:
        raise pickle.UnpicklingError(f"the pickle sets state on {self!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")


class TorchDType(Sealed):
    """A torch dtype named by the pickle, as its safetensors name."""

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __repr__(self) -> str:
        return f"torch dtype {self.name}"


#: One read-only stand-in per torch dtype name.
_TORCH_DTYPE_STANDINS = {name: TorchDType(dtype) for name, dtype in TORCH_DTYPES.items()}


class Budget:
    """What the stand-in functions may build for one pickle, in proportion to its size: a pickle
    that names a large value again and again through its memo cannot make them copy it each time."""

    __slots__ = ("left",)

    def __init__(self, data_size: int) -> None:
        self.left = 4 * data_size + (1 << 16)

    def spend(self, amount: int) -> None:
        self.left -= amount
        if self.left < 0:
            raise _Bound("it builds values far larger than the file")


class _Function(Sealed):
    """One of the functions a pickle may call, bound to the budget of the pickle being read."""

    __slots__ = ("function", "budget")
    function: Callable[..., object]
    budget: Budget

    def __init__(self, function: Callable[..., object], budget: Budget) -> None:
        object.__setattr__(self, "function", function)
        object.__setattr__(self, "budget", budget)

    def __call__(self, *args: object) -> object:
        self.budget.spend(len(args))
        return self.function(self.budget, *args)

    def __repr__(self) -> str:
        return f"function {self.function.__name__}"


class Record:
    """An object of a class the reader allows, as data: the arguments its pickle built it with
    (``NEWOBJ`` or a call) and the state it set (``BUILD``, once: a dict of fields, a tuple, or
    ``(dict, slots)`` as ``copyreg`` pickles slotted objects); no code of the class is imported or
    run. ``kind`` names the class; one subclass per kind, made by :func:`record_class`."""

    __slots__ = ("args", "state")
    kind = ""
    args: tuple[object, ...]
    state: object

    def __new__(cls, *args: object) -> Record:
        record = object.__new__(cls)
        object.__setattr__(record, "args", args)
        object.__setattr__(record, "state", None)
        return record

    def __init__(self, *args: object) -> None:
        """Only ``NEWOBJ`` makes a record (``cls.__new__``): a pickle calling the class is refused."""
        raise pickle.UnpicklingError(f"the pickle calls {self.kind}")

    def __setstate__(self, state: object) -> None:
        if self.state is not None:
            raise pickle.UnpicklingError(f"the pickle sets state on a {self.kind} twice")
        object.__setattr__(self, "state", state)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{self.kind} is read-only")

    def field(self, name: str, default: object = None) -> object:
        """A field of the pickled state (its dict part, else its slots part)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2:
            found = state[1].get(name, default) if isinstance(state[1], dict) else default
            return state[0].get(name, found) if isinstance(state[0], dict) else found
        return state.get(name, default) if isinstance(state, dict) else default

    def __repr__(self) -> str:
        return f"{self.kind}({shown(self.args)[1:-1]})" if self.args else f"{self.kind} record"


_RECORD_CLASSES: dict[str, type[Record]] = {}


def record_class(kind: str) -> type[Record]:
    """The :class:`Record` class of ``kind`` (one per kind, made on first use, shared: a class a
    pickle cannot change, since BUILD on it finds ``__setstate__`` unbound and fails)."""
    found = _RECORD_CLASSES.get(kind)
    if found is None:
        found = _RECORD_CLASSES[kind] = type(kind.rpartition(".")[2] or "Record", (Record,), {"__slots__": (), "kind": kind})
    return found


class EnumMember(Sealed):
    """A member of an allowed enum class, as its class's name and its value (``WriteItemType(2)``)."""

    __slots__ = ("kind", "value")
    kind: str
    value: int | str

    def __init__(self, kind: str, value: int | str) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "value", value)

    def __repr__(self) -> str:
        return f"{self.kind}({self.value!r})"


@dataclass(frozen=True)
class AllowList:
    """Classes a trainer's pickles name beyond a format's own, each by its exact module and name. Nothing
    is imported: a class of ``records`` becomes a :class:`Record` of its pickled state, a class of ``enums``
    an :class:`EnumMember` of the value it is called with. ``source`` says whose classes they are (messages)."""

    records: frozenset[tuple[str, str]] = frozenset()
    enums: frozenset[tuple[str, str]] = frozenset()
    source: str = ""

    @classmethod
    def of(cls, source: str, records: Iterable[str] = (), enums: Iterable[str] = ()) -> AllowList:
        """An allow-list from dotted names (``module.Class``)."""
        return cls(frozenset(map(_split_name, records)), frozenset(map(_split_name, enums)), source)

    def __or__(self, other: AllowList) -> AllowList:
        source = " and ".join(s for s in (self.source, other.source) if s)
        return AllowList(self.records | other.records, self.enums | other.enums, source)

    def __bool__(self) -> bool:
        return bool(self.records or self.enums)

    def names(self) -> list[str]:
        """Every class allowed, as ``module.Class``, sorted."""
        return sorted(f"{module}.{name}" for module, name in self.records | self.enums)


def _split_name(dotted: str) -> tuple[str, str]:
    module, _, name = dotted.rpartition(".")
    if not module or not name:
        raise ValueError(f"{dotted!r} is not a module and class name")
    return module, name


#: Nothing beyond a format's own classes.
NOTHING = AllowList()


def _enum_member(kind: str) -> Callable[..., EnumMember]:
    def member(budget: Budget, value: object) -> EnumMember:
        if type(value) not in (int, str):
            raise pickle.UnpicklingError(f"{kind} of {shown(value)}")
        budget.spend(1)
        return EnumMember(kind, value)  # type: ignore[arg-type]

    member.__name__ = kind
    return member


class Refused(Exception):
    """The pickle names something mpicons does not stand in for."""


class _Bound(Exception):
    """The pickle passes one of the bounds on what reading it may build."""


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxtuple, _SHOWN.maxlist, _SHOWN.maxdict = 3, 80, 80, 8, 8, 8


def shown(value: object) -> str:
    """A value from an input, shortened for a message (a hostile value can be huge or deeply nested)."""
    try:
        return _SHOWN.repr(value)
    except Exception:  # a stand-in's repr cannot fail, but a message must never be what fails
        return f"a {type(value).__name__}"


def _torch_dtype(module: str, name: str) -> TorchDType | None:
    return _TORCH_DTYPE_STANDINS.get(name) if module == "torch" else None


class RestrictedUnpickler(pickle.Unpickler):
    """A restricted unpickler: ``find_class`` hands out only read-only stand-ins (functions bound to
    this pickle's budget, made afresh for each pickle), the format's own classes (``others``) and
    what ``allow`` names as records; it refuses every other name."""

    functions: dict[tuple[str, str], Callable[..., object]] = {}
    others: dict[tuple[str, str], object] = {}

    def __init__(self, data: bytes, allow: AllowList = NOTHING) -> None:
        super().__init__(io.BytesIO(data))
        budget = Budget(len(data))
        self._found = {key: _Function(_enum_member(".".join(key)), budget) for key in allow.enums}
        self._found.update({key: _Function(function, budget) for key, function in self.functions_for(allow).items()})
        self._records = {key: record_class(".".join(key)) for key in allow.records if key not in self._found}

    def functions_for(self, allow: AllowList) -> dict[tuple[str, str], Callable[..., object]]:
        """The functions the pickle may call: the format's own (a subclass may add some ``allow`` names)."""
        return self.functions

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        found = self._found.get(key) or self.others.get(key) or self._records.get(key) or _torch_dtype(module, name)
        if found is None:
            raise Refused(f"{module}.{name}")
        return found


_UNREADABLE = (
    pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, RecursionError,
    OverflowError, UnicodeError,
)  # fmt: skip


def unpickle(
    data: bytes,
    unpickler: type[RestrictedUnpickler],
    path: str,
    what: str,
    allow: AllowList = NOTHING,
    format_name: str = "DCP's checkpoint format",
) -> object:
    """``data`` unpickled with ``unpickler`` (and the classes ``allow`` names) after :func:`check_opcodes`;
    every failure is bad input. ``format_name``: what the pickle belongs to, for the refusal."""
    try:
        check_opcodes(data)
        return unpickler(data, allow).load()
    except Refused as exc:
        beside = f" nor among the classes {allow.source} adds" if allow.source else ""
        raise InputError(
            f"{path}: unsupported: {what} names {exc}, which is not part of {format_name}{beside} "
            "(refused without running anything)"
        ) from None
    except _Bound as exc:
        raise InputError(
            f"{path}: {what} is refused: {exc} (a {len(data)}-byte pickle; damaged or not written by torch?)"
        ) from None
    except _UNREADABLE as exc:
        raise InputError(f"{path}: {what} is not a readable pickle ({type(exc).__name__}: {shown(str(exc))})") from None
    except MemoryError:
        raise InputError(f"{path}: {what} is not a readable pickle (it asks for more memory than there is)") from None


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
_NEWOBJ, _NEWOBJ_EX, _GLOBAL, _INST, _FRAME, _PROTO, _STOP, _LONG = range(20, 28)
_KIND: dict[bytes, tuple[int, int]] = {  # opcode → (kind, argument bytes or length-prefix bytes)
    **{op: (_ATOM, 0) for op in (b"N", b"\x88", b"\x89")},
    b"K": (_ATOM, 1), b"M": (_ATOM, 2), b"J": (_ATOM, 4), b"G": (_ATOM, 8),
    **{op: (_COUNTED, 1) for op in (b"\x8c", b"C", b"U")},
    **{op: (_COUNTED, 4) for op in (b"X", b"B", b"T")},
    **{op: (_COUNTED, 8) for op in (b"\x8d", b"\x8e", b"\x96")},
    b"\x8a": (_LONG, 1), b"\x8b": (_LONG, 4),
    **{op: (_LINE, 0) for op in (b"I", b"L", b"F", b"S", b"V")},
    **{op: (_EMPTY, 0) for op in (b"]", b")", b"}", b"\x8f")},
    b"\x94": (_MEMOIZE, 0), b"g": (_GET, -1), b"h": (_GET, 1), b"j": (_GET, 4),
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
            elif arg == 4:
                stack.append(memo[from_bytes(data[at : at + 4], "little")])
                at += 4
            else:
                index, at = _opcode_index(data, at, arg)
                stack.append(memo[index])
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
            arguments = stack.pop()
            stack[-1] = arguments if arguments >= 128 else 128  # what a stand-in returns may hash like its arguments
        elif kind == newobj:
            arguments = stack.pop()
            stack[-1] = arguments & -128 or 128  # a record: hashed by identity
        elif kind == build:
            level = (stack.pop() | 127) + 1
            if level > stack[-1]:
                stack[-1] = (level if level < too_deep else _deep(level)) | (stack[-1] & 127)
        elif kind == from_mark or kind == into_mark:
            start = marks.pop()
            parts = stack[start:]
            del stack[start:]
            level = (max(parts, default=0) | 127) + 1
            op = data[at - 1]
            if op in _KEYED:
                keys = parts[:: _KEYED[op]]
                if keys and max(keys):
                    _check_keys(keys, tuple_keys)
            if kind == into_mark:
                stack[-1] = _deep(max(stack[-1], level))
            elif op == _TUPLE:
                stack.append(_deep(level | min(127, 1 + len(parts) + sum(part & 127 for part in parts))))
            else:
                stack.append(_deep(level))
        elif kind == counted:
            at += arg + from_bytes(data[at : at + arg], "little")
            if at > size:
                raise pickle.UnpicklingError("a value reaches past the end of the pickle")
            stack.append(0)
        else:
            at = _rare_opcode(data, at, data[at - 1], kind, arg, stack, marks, memo, tuple_keys)
    raise pickle.UnpicklingError("the pickle ends without a STOP")


def _check_keys(keys: list[int], tuple_keys: list[int]) -> None:
    """Refuse dict keys (or set elements) that cost too much to hash, or too many tuples as keys."""
    costs = [key & 127 for key in keys if key & 127]
    if not costs:
        return
    if max(costs) > KEY_PARTS + 1:
        raise _Bound(
            f"a dict key or set element costs more than {KEY_PARTS + 1} steps to hash (a tuple of more than {KEY_PARTS} "
            "values, tuples nested in it, or an integer of more than 8 bytes), and Python hashes it anew at every use"
        )
    tuple_keys[0] += len(costs)
    if tuple_keys[0] > TUPLE_KEYS:
        raise _Bound(f"it uses more than {TUPLE_KEYS} tuples as dict keys or set elements, whose hashes can collide")


def _too_many(containers: int, size: int) -> None:
    raise _Bound(
        f"it makes more than {containers - 1} containers from {size} bytes (a checkpoint's pickle spends "
        f"{BYTES_PER_CONTAINER} bytes or more on each): its objects would take memory out of proportion to the file"
    )


def _deep(level: int) -> int:
    if level >= _TOO_DEEP:
        raise _Bound(f"it nests values more than {MAX_DEPTH} deep")
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
    if kind == _PUT:
        index, at = _opcode_index(data, at, arg)
        if index > len(memo):
            raise _Bound(f"it stores memo entry {index} after {len(memo)} entries")
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
    elif kind == _PERSID:
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
    elif kind == _STOP:
        raise _Stop
    else:
        raise pickle.UnpicklingError(f"opcode {bytes([op])!r}, which DCP's pickles do not use")
    return at


__all__ = [
    "BYTES_PER_CONTAINER",
    "FREE_CONTAINERS",
    "KEY_PARTS",
    "MAX_DEPTH",
    "NOTHING",
    "TORCH_DTYPES",
    "TUPLE_KEYS",
    "AllowList",
    "Budget",
    "EnumMember",
    "Record",
    "Refused",
    "RestrictedUnpickler",
    "Sealed",
    "record_class",
    "TorchDType",
    "check_opcodes",
    "shown",
    "unpickle",
]
