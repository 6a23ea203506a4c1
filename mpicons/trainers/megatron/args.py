"""``common.pt``'s ``args`` as the config derivation reads them (no MPI here): each field's type checked
where it is read, a wrong one bad input naming the field (:mod:`.config`, :mod:`.config_deepseek`)."""

from __future__ import annotations

from collections.abc import Mapping

from ...core.errors import InputError
from ...formats.unpickling import EnumMember, shown


class Args:
    """``common.pt``'s ``args`` (an ``argparse.Namespace`` record's fields), read with their types
    checked: a wrong one is bad input naming the field."""

    def __init__(self, values: Mapping[str, object], path: str) -> None:
        self.values, self.path = values, path

    def bad(self, name: str, wanted: str) -> InputError:
        return InputError(f"{self.path}: args.{name} is {shown(self.values.get(name))}, expected {wanted}")

    def whole(self, name: str, default: int | None = None) -> int:
        value = self.values.get(name, default)
        if value is None and default is not None:
            value = default
        if type(value) is not int or value <= 0:
            raise self.bad(name, "a positive whole number")
        return value

    def maybe_whole(self, name: str) -> int | None:
        return None if self.values.get(name) is None else self.whole(name)

    def flag(self, name: str) -> bool:
        value = self.values.get(name, False)
        if value is None:
            return False
        if type(value) is not bool:
            raise self.bad(name, "true or false")
        return value

    def number(self, name: str) -> int | float:
        value = self.values.get(name)
        if type(value) not in (int, float):
            raise self.bad(name, "a number")
        return value  # type: ignore[return-value]

    def text(self, name: str) -> str | None:
        value = self.values.get(name)
        if isinstance(value, EnumMember):
            return str(value.value)
        if value is not None and type(value) is not str:
            raise self.bad(name, "text")
        return value


__all__ = ["Args"]
