"""Restricted unpickling for DCP's pickles (no MPI here): a pre-scan of the opcodes, then an
unpickler that hands out only inert, read-only stand-ins.

A trainer that pickles more than the format's own classes (Megatron's save plans in ``.metadata``,
``argparse.Namespace`` in ``common.pt``) names them in an :class:`AllowList`, by exact module and
name; they become inert :class:`Record` or :class:`EnumMember` values, nothing of them imported.

Before anything of a pickle runs, :func:`~mpicons.formats.pickle_scan.check_opcodes` walks its opcodes
once and refuses what would make Python's unpickler take memory or time out of proportion to the file
or crash (see :mod:`mpicons.formats.pickle_scan`). While it runs, the stand-in functions spend a
:class:`Budget` in proportion to the pickle's size. The readers of ``.metadata``
(:mod:`mpicons.formats.distcp_metadata`) and of the items' ``data.pkl``
(:mod:`mpicons.formats.distcp_items`) subclass :class:`RestrictedUnpickler`.
"""

from __future__ import annotations

import pickle
import reprlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..core.errors import InputError
from ..core.safetensors_codec import DTYPES
from .pickle_scan import Bound, check_opcodes

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
            raise Bound("it builds values far larger than the file")


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


class _Steps:
    """The pickle's bytes as a file whose methods are Python code: the C unpickler reads ahead through
    them every 128 KiB or so, and each call gives Python a moment to act on a signal (SIGTERM, Ctrl-C),
    which a ``BytesIO`` would not give it until the whole pickle is built."""

    __slots__ = ("data", "at")

    def __init__(self, data: bytes) -> None:
        self.data, self.at = memoryview(data), 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.data) if size is None or size < 0 else min(len(self.data), self.at + size)
        chunk, self.at = self.data[self.at : end].tobytes(), end
        return chunk

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), len(self.data) - self.at)
        buffer[:count] = self.data[self.at : self.at + count]
        self.at += count
        return count

    def peek(self, size: int = 0) -> bytes:
        return self.data[self.at : self.at + max(size, 1)].tobytes()

    def readline(self) -> bytes:
        end = bytes(self.data[self.at : self.at + (1 << 16)]).find(b"\n")
        return self.read(end + 1 if end >= 0 else 1 << 16)


class RestrictedUnpickler(pickle.Unpickler):
    """A restricted unpickler: ``find_class`` hands out only read-only stand-ins (functions bound to
    this pickle's budget, made afresh for each pickle), the format's own classes (``others``) and
    what ``allow`` names as records; it refuses every other name."""

    functions: dict[tuple[str, str], Callable[..., object]] = {}
    others: dict[tuple[str, str], object] = {}

    def __init__(self, data: bytes, allow: AllowList = NOTHING) -> None:
        super().__init__(_Steps(data))
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
    except Bound as exc:
        raise InputError(
            f"{path}: {what} is refused: {exc} (a {len(data)}-byte pickle; damaged or not written by torch?)"
        ) from None
    except _UNREADABLE as exc:
        raise InputError(f"{path}: {what} is not a readable pickle ({type(exc).__name__}: {shown(str(exc))})") from None
    except MemoryError:
        raise InputError(f"{path}: {what} is not a readable pickle (it asks for more memory than there is)") from None


__all__ = [
    "NOTHING",
    "TORCH_DTYPES",
    "AllowList",
    "Budget",
    "EnumMember",
    "Record",
    "Refused",
    "RestrictedUnpickler",
    "Sealed",
    "record_class",
    "TorchDType",
    "shown",
    "unpickle",
]
