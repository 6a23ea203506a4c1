"""Which tensors get a value op (:mod:`.values`), decided from names, dtypes and shapes alone (pure).

Block FP8: a float8 weight beside ``<name>_scale_inv`` converted by ``--dtype`` is dequantized, its
scales read, not written. LoRA: a base weight ``M.weight`` with an adapter's ``M.lora_A.weight`` and
``M.lora_B.weight`` is merged (peft's names, the adapter's own name such as ``default`` removed); an
adapter tensor ``M.<param>`` that is no LoRA parameter replaces the base's (``modules_to_save``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .convert import converted_dtype, keep_dtype_matches
from .errors import InputError
from .values import FP8_BLOCK, Computed, Dequantize, Merge, Quantize, Replace, ValueOp

#: What block-FP8 checkpoints (DeepSeek-V3's layout) call a weight's scales: ``<weight>_scale_inv``.
SCALE_SUFFIX = "_scale_inv"
#: The prefix peft gives every adapter tensor (the model wrapped twice: ``PeftModel`` → ``LoraModel``).
PEFT_PREFIX = "base_model.model."
_LORA_PART = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_magnitude_vector|lora_embedding_A|lora_embedding_B)(\.[^.]+)?(\.weight|\.bias)?$"
)


@dataclass(frozen=True)
class Shape:
    """A tensor's dtype and shape, as the plan needs them."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LoraConfig:
    """What of peft's ``LoraConfig`` changes a merge (``adapter_config.json``; verl's ``lora_train_meta.json``)."""

    alpha: float
    use_rslora: bool = False
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    fan_in_fan_out: bool = False
    origin: str = "adapter_config.json"
    recorded: bool = False  # found in the checkpoint (a trainer's record), not given with --lora


@dataclass(frozen=True)
class ValuePlan:
    """Per output tensor, its value op; the tensors read for them and not written (scales, LoRA weights)."""

    ops: dict[str, ValueOp] = field(default_factory=dict)
    read_only: frozenset[str] = frozenset()
    dequantized: int = 0
    merged: int = 0
    replaced: int = 0
    #: Tensors no piece holds, computed before the writing: name → (the weight it follows, its shape).
    computed: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)


def fp8_plan(
    tensors: Mapping[str, Shape], dtype: str | None, keep: Sequence[str], block: tuple[int, int] = FP8_BLOCK
) -> ValuePlan:
    """Every float8 weight with ``<name>_scale_inv`` that ``dtype`` converts (and ``keep`` does not keep) is
    dequantized; its scales are read, not written."""
    ops: dict[str, ValueOp] = {}
    for name, info in tensors.items():
        scales = tensors.get(name + SCALE_SUFFIX)
        if scales is None or not info.dtype.startswith("F8") or len(info.shape) != 2:
            continue
        if keep_dtype_matches(name, keep) or converted_dtype(info.dtype, dtype) == info.dtype:
            continue
        grid = (-(-info.shape[0] // block[0]), -(-info.shape[1] // block[1]))
        if scales.shape != grid:
            raise InputError(
                f"tensor {name + SCALE_SUFFIX!r} has shape {list(scales.shape)}, but {name} {list(info.shape)} in "
                f"{block[0]}x{block[1]} blocks has {list(grid)}: the config's quantization_config.weight_block_size "
                "is not the checkpoint's (or the scales are another weight's)"
            )
        ops[name] = Dequantize(name + SCALE_SUFFIX, block)
    return ValuePlan(ops, frozenset(op.scales for op in ops.values() if isinstance(op, Dequantize)), dequantized=len(ops))


#: What ``--dtype fp8`` leaves as it is, as DeepSeek-V3 does: embeddings, norms, the output layer, routers.
FP8_KEPT = ("*embed*", "*norm*", "lm_head.*", "*.mlp.gate.weight", "*.router.*", "*_scale_inv")


def quantize_plan(tensors: Mapping[str, Shape], keep: Sequence[str], block: tuple[int, int] = FP8_BLOCK) -> ValuePlan:
    """``--dtype fp8``: the 2-D floating-point ``.weight`` of every decoder layer (``.layers.`` in its name)
    but the ones :data:`FP8_KEPT` or ``keep`` name becomes E4M3 with a float32 ``<name>_scale_inv`` per block."""
    ops: dict[str, ValueOp] = {}
    computed: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, info in tensors.items():
        if (
            len(info.shape) != 2
            or not name.endswith(".weight")
            or ".layers." not in name
            or info.dtype not in ("F32", "BF16", "F16")
        ):
            continue
        if keep_dtype_matches(name, (*FP8_KEPT, *keep)):
            continue
        scales = name + SCALE_SUFFIX
        if scales in tensors:
            raise InputError(f"tensor {scales!r} is in the checkpoint already: is {name} quantized? (leave out --dtype fp8)")
        ops[name] = Quantize(scales, block)
        ops[scales] = Computed(scales)
        computed[scales] = (name, (-(-info.shape[0] // block[0]), -(-info.shape[1] // block[1])))
    return ValuePlan(ops, computed=computed)


def lora_module(name: str) -> tuple[str, str] | None:
    """``(module, kind)`` of a LoRA parameter's name (``lora_A``, ``lora_B``, ``lora_magnitude_vector``), else None."""
    found = _LORA_PART.match(name)
    return None if found is None else (found["module"], found["kind"])


def lora_plan(base: Mapping[str, Shape], adapter: Mapping[str, Shape], config: LoraConfig, where: str) -> ValuePlan:
    """The merge of an adapter's tensors (names without peft's prefix) into the base's, checked; bad input
    names the adapter tensor and what to do."""
    parts: dict[str, dict[str, str]] = {}
    replacements: dict[str, str] = {}
    for name in adapter:
        found = lora_module(name)
        if found is None:
            replacements[name] = name
            continue
        module, kind = found
        if kind.startswith("lora_embedding") or name.endswith(".bias"):
            what = "an embedding" if kind.startswith("lora_embedding") else "a LoRA bias (lora_bias)"
            raise InputError(f"{where}: {name} is {what}, which mpicons does not merge yet: merge this adapter with peft")
        parts.setdefault(module, {})[kind] = name
    ops: dict[str, ValueOp] = {}
    for module, kinds in sorted(parts.items()):
        weight = module + ".weight"
        ops[weight] = _merge_op(module, kinds, base.get(weight), adapter, config, where)
    for name in sorted(replacements):
        target = base.get(name)
        if target is None:
            raise InputError(
                f"{where}: holds {name} (a module saved whole), which the base model does not hold: is it this base's adapter?"
            )
        if target.shape != adapter[name].shape:
            raise InputError(f"{where}: {name} has shape {list(adapter[name].shape)} but the base's is {list(target.shape)}")
        if name in ops:
            raise InputError(f"{where}: {name} is both merged and saved whole")
        ops[name] = Replace(name)
    merged = len(ops) - len(replacements)
    return ValuePlan(ops, frozenset(adapter), merged=merged, replaced=len(replacements))


def _merge_op(
    module: str, kinds: Mapping[str, str], weight: Shape | None, adapter: Mapping[str, Shape], config: LoraConfig, where: str
) -> Merge:
    if "lora_A" not in kinds or "lora_B" not in kinds:
        missing = "lora_A" if "lora_A" not in kinds else "lora_B"
        raise InputError(f"{where}: {module} has no {missing}: the adapter is incomplete")
    if weight is None:
        raise InputError(
            f"{where}: targets {module}, whose weight {module}.weight the base model does not hold: is it this base's adapter?"
        )
    if weight.dtype not in ("F64", "F32", "BF16", "F16"):
        raise InputError(
            f"{where}: targets {module}.weight, which is {weight.dtype}: merge into a bf16, fp16 or fp32 base "
            "(a block-FP8 base: dequantize it first with --dtype bf16, then merge its output)"
        )
    a, b = adapter[kinds["lora_A"]], adapter[kinds["lora_B"]]
    rows, cols = weight.shape if not config.fan_in_fan_out else weight.shape[::-1]
    if (
        len(weight.shape) != 2
        or len(a.shape) != 2
        or len(b.shape) != 2
        or a.shape[0] != b.shape[1]
        or (b.shape[0], a.shape[1]) != (rows, cols)
    ):
        raise InputError(
            f"{where}: {module}: lora_B {list(b.shape)} @ lora_A {list(a.shape)} does not make its weight's shape "
            f"{list(weight.shape)}{' (fan_in_fan_out)' if config.fan_in_fan_out else ''}: is it this base's adapter?"
        )
    rank = a.shape[0]
    if rank == 0:
        raise InputError(f"{where}: {module}'s lora_A has no rows (r 0): an adapter that changes nothing")
    alpha = _pattern_value(config.alpha_pattern, module, config.alpha)
    scaling = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
    magnitude = kinds.get("lora_magnitude_vector")
    if magnitude is not None and config.fan_in_fan_out:
        raise InputError(f"{where}: DoRA with fan_in_fan_out, which mpicons does not merge yet: merge with peft")
    if magnitude is not None and adapter[magnitude].shape != (rows,):
        raise InputError(f"{where}: {magnitude} has shape {list(adapter[magnitude].shape)}, not [{rows}]")
    return Merge(kinds["lora_A"], kinds["lora_B"], scaling, magnitude, config.fan_in_fan_out)


#: What an ``alpha_pattern`` key may be: a module name with regex alternatives and wildcards, short, and
#: with no quantified group (a pattern such as ``(a+)+`` takes exponential time to fail to match).
_SAFE_PATTERN = re.compile(r"^[\w.\-^$|*+?()\[\]\\]{1,256}$")
_NESTED_QUANTIFIER = re.compile(r"\)[*+?{]")


def _pattern_value(patterns: Mapping[str, float], module: str, default: float) -> float:
    """peft's per-module override: the first pattern that is the module's name or matches its end (a regex)."""
    for pattern, value in patterns.items():
        if pattern == module:
            return float(value)
        if not _SAFE_PATTERN.match(pattern) or _NESTED_QUANTIFIER.search(pattern):
            raise InputError(f"alpha_pattern key {pattern[:80]!r}: not a module name or a simple pattern of one")
        try:
            if re.match(rf"(.*\.)?({pattern})$", module):
                return float(value)
        except re.error as exc:
            raise InputError(f"alpha_pattern key {pattern!r}: not a regular expression ({exc})") from None
    return default


__all__ = [
    "FP8_KEPT",
    "PEFT_PREFIX",
    "SCALE_SUFFIX",
    "LoraConfig",
    "Shape",
    "ValuePlan",
    "fp8_plan",
    "lora_module",
    "lora_plan",
    "quantize_plan",
]
