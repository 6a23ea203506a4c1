"""Tensor name to output file name, as a user gives it (torch's mapping or a Hugging Face index)."""

from __future__ import annotations

from collections.abc import Mapping

from .errors import InputError
from .names import INDEX_NAME, output_name, plain_file_name


class FileMapping(dict[str, str]):
    """A parsed mapping that remembers where it came from, so the plan's errors about it name the file."""

    def __init__(self, items: Mapping[str, str], source: str) -> None:
        super().__init__(items)
        self.source = source


def parse_mapping(obj: object, source: str = "mapping") -> dict[str, str]:
    """Tensor name → output file name, from torch's ``fqn_to_index_mapping`` or an HF index.

    ``{name: index}`` names files ``model-IIIII-of-NNNNN.safetensors`` with NNNNN the largest index;
    ``{"weight_map": {name: file}}`` names them directly (plain names only, no directories, not
    hidden — mpicons' own files are — and not the index).
    """
    if isinstance(obj, dict) and isinstance(obj.get("weight_map"), dict):
        result = {}
        for name, file_name in obj["weight_map"].items():
            if not plain_file_name(file_name) or file_name.startswith(".") or file_name == INDEX_NAME:
                raise InputError(f"{source}: tensor {name!r} maps to {file_name!r}, which is not a plain file name")
            result[name] = file_name
        return FileMapping(result, source)
    if isinstance(obj, dict) and obj and all(type(v) is int for v in obj.values()):
        if min(obj.values()) < 1:
            raise InputError(f"{source}: file indices start at 1 (got {min(obj.values())})")
        count = max(obj.values())
        return FileMapping({name: output_name(index, count) for name, index in obj.items()}, source)
    raise InputError(f"{source}: expected {{tensor: file index}} or a model.safetensors.index.json with a weight_map")
