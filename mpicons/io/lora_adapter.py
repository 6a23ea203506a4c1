"""A LoRA adapter's files: a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``), or the
alpha a trainer records beside LoRA weights it keeps in its own checkpoint (verl's ``lora_train_meta.json``).

The config's merge fields become a :class:`~mpicons.core.value_plan.LoraConfig`; the weights are read by
memory map, a tensor at a time (``A`` and ``B`` whole: ``r`` rows or columns; a module saved whole by rows).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.convert import numpy_dtype
from ..core.errors import InputError
from ..core.safetensors_codec import Header, TensorEntry, build_header, read_header, reference_order
from ..core.value_plan import PEFT_PREFIX, LoraConfig, Shape
from .assets import read_config

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: What verl (0.9 and later) writes beside a LoRA actor's rank files: ``{"r": 8, "lora_alpha": 16, ...}``.
VERL_META_FILE = "lora_train_meta.json"
#: peft fields whose merge mpicons does not do: refused rather than merged wrongly.
#: How many of the adapter's tensors a rank holds in float32 at a time (a module's A, B and magnitude).
_HELD = 4
_UNSUPPORTED = {"lora_bias": "a LoRA bias", "use_qalora": "QA-LoRA", "use_bdlora": "block-diagonal LoRA"}


def lora_config(config: dict[str, Any], path: str) -> LoraConfig:
    """The merge's fields of a peft ``adapter_config.json`` (or verl's meta file), checked."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InputError(f"{path}: peft_type is {peft_type!r}: mpicons merges LoRA adapters only")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise InputError(f"{path}: {key} is set ({what}), which mpicons does not merge yet: merge with peft")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InputError(f"{path}: lora_alpha is {alpha!r}, not a number: the merge's scaling is lora_alpha / r")
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict) or not all(isinstance(v, (int, float)) for v in patterns.values()):
        raise InputError(f"{path}: alpha_pattern is not an object of numbers")
    return LoraConfig(
        alpha=float(alpha),
        use_rslora=bool(config.get("use_rslora", False)),
        alpha_pattern={str(k): float(v) for k, v in patterns.items()},
        fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
        origin=path,
    )


@dataclass(frozen=True)
class AdapterFolder:
    """A peft adapter folder: its config, and its tensors under the base model's names (peft's prefix removed)."""

    directory: str
    config: LoraConfig
    header: Header
    names: dict[str, str]  # the base's name → the stored one

    @property
    def weights(self) -> str:
        return os.path.join(self.directory, WEIGHTS_FILE)

    def shapes(self) -> dict[str, Shape]:
        stored = {t.name: t for t in self.header.tensors}
        return {name: Shape(stored[saved].dtype, stored[saved].shape) for name, saved in self.names.items()}


def read_adapter(directory: str) -> AdapterFolder:
    """The adapter folder at ``directory``: bad input naming the file when it is not one."""
    if directory.startswith("s3://"):
        raise InputError(f"{directory}: --lora reads a local adapter folder: copy it from object storage first")
    config_path, weights = os.path.join(directory, CONFIG_FILE), os.path.join(directory, WEIGHTS_FILE)
    for path in (config_path, weights):
        if not os.path.isfile(path):
            also = " (a .bin adapter: save it with safe_serialization=True)" if path == weights and _has_bin(directory) else ""
            raise InputError(f"{path}: no such file: --lora names a peft adapter folder ({CONFIG_FILE}, {WEIGHTS_FILE}){also}")
    config = lora_config(read_config(config_path), config_path)
    header = read_header(weights)
    names: dict[str, str] = {}
    for entry in header.tensors:
        plain = entry.name.removeprefix(PEFT_PREFIX)
        if plain == entry.name:
            raise InputError(f"{weights}: tensor {entry.name!r} is not named like peft's ({PEFT_PREFIX}<module>...)")
        names[plain] = entry.name
    return AdapterFolder(directory, config, header, names)


def _has_bin(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "adapter_model.bin"))


def peft_adapter_files(tensors: dict[str, np.ndarray], config: LoraConfig) -> dict[str, bytes]:
    """A peft adapter folder's files for LoRA weights named ``<module>.lora_A.weight`` (peft's prefix
    added, in the reference order safetensors writes), with the settings they were trained with."""
    named = {PEFT_PREFIX + name: array for name, array in tensors.items()}
    order = reference_order([(name, dtype_name(array)) for name, array in named.items()])
    entries = [(name, dtype_name(named[name]), named[name].shape) for name in (list(named)[i] for i in order)]
    header, _ = build_header(entries, {"format": "pt"})
    weights = header + b"".join(np.ascontiguousarray(named[name]).tobytes() for name, _, _ in entries)
    ranks = {
        name.removesuffix(".lora_A.weight"): int(a.shape[0]) for name, a in tensors.items() if name.endswith(".lora_A.weight")
    }
    rank = Counter(ranks.values()).most_common(1)[0][0]  # the others in rank_pattern
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(rank),
        "lora_alpha": int(config.alpha) if config.alpha.is_integer() else config.alpha,
        "rank_pattern": {module: r for module, r in sorted(ranks.items()) if r != rank},
        "alpha_pattern": dict(config.alpha_pattern),
        "use_rslora": config.use_rslora,
        "use_dora": False,
        "fan_in_fan_out": config.fan_in_fan_out,
        "bias": "none",
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module in ranks}),
        "base_model_name_or_path": None,
        "inference_mode": True,
    }
    return {WEIGHTS_FILE: weights, CONFIG_FILE: (json.dumps(settings, indent=2, sort_keys=True) + "\n").encode()}


def dtype_name(array: np.ndarray) -> str:
    """The safetensors name of an array's dtype."""
    return next(name for name in ("F64", "F32", "BF16", "F16", "F8_E4M3") if numpy_dtype(name) == array.dtype)


class AdapterTensors:
    """The adapter's tensors by memory map: whole in float32 (cached, they are small), or rows as stored."""

    def __init__(self, folder: AdapterFolder) -> None:
        self.folder = folder
        self.entries: dict[str, TensorEntry] = {t.name: t for t in folder.header.tensors}
        self._map: np.memmap | None = None
        self._whole: dict[str, np.ndarray] = {}

    def _array(self, name: str) -> np.ndarray:
        entry = self.entries[self.folder.names[name]]
        if self._map is None:
            self._map = np.memmap(self.folder.weights, dtype=np.uint8, mode="r")
        start = self.folder.header.data_start
        raw = self._map[start + entry.begin : start + entry.end]
        return raw.view(numpy_dtype(entry.dtype)).reshape(entry.shape)

    def whole(self, name: str) -> np.ndarray:
        if name not in self._whole:
            if len(self._whole) >= _HELD:  # the blocks go tensor by tensor: the last few suffice
                self._whole.pop(next(iter(self._whole)))
            self._whole[name] = np.ascontiguousarray(self._array(name), dtype=np.float32)
        return self._whole[name]

    def rows(self, name: str, begin: int, end: int) -> np.ndarray:
        return np.asarray(self._array(name)[begin:end])


__all__ = [
    "CONFIG_FILE",
    "VERL_META_FILE",
    "WEIGHTS_FILE",
    "AdapterFolder",
    "AdapterTensors",
    "lora_config",
    "peft_adapter_files",
    "read_adapter",
]
