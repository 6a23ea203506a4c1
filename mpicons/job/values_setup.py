"""The value ops of a job (:mod:`mpicons.core.value_plan`): planned from the scan, the options, the
config and a ``--lora`` adapter; their small tensors read before the writing.

Block FP8 with ``--dtype``: the scales are the checkpoint's tensors, read whole on every rank (4 bytes per
128×128 block: 1/4096 of the FP8 weights). LoRA from ``--lora DIR``: a peft folder, memory-mapped, each
rank reading the ``A`` and ``B`` of the module it writes. LoRA kept inside the checkpoint (peft's wrapped
names, as a verl actor saves them): the base weights lose peft's ``base_model.model.`` and
``.base_layer``; the LoRA weights are read whole on every rank (r × (in + out) per module).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..comm.agreement import Comm, agree, agree_on
from ..core.blocks import Block, segment_bytes, segment_span
from ..core.convert import numpy_dtype
from ..core.errors import InputError
from ..core.layout import Layout
from ..core.options import Options
from ..core.planner import HF_MAX_SHARD_SIZE, build_layout
from ..core.value_plan import PEFT_PREFIX, LoraConfig, Shape, ValuePlan, fp8_plan, lora_module, lora_plan, quantize_plan
from ..core.values import FP8_BLOCK, Quantize, block_amax, scales_of
from ..io.assets import HFAssets, read_config, with_config, with_folder
from ..io.lora_adapter import (
    CONFIG_FILE,
    VERL_META_FILE,
    AdapterFolder,
    AdapterTensors,
    lora_config,
    peft_adapter_files,
    read_adapter,
)
from ..io.places import LocalPlace
from ..io.s3 import is_s3
from ..io.s3_sources import S3Place
from .exchange import feed_blocks
from .scan import Scanned, open_sources, shapes_and_dtypes
from .shares import chosen, distribute, only

#: What peft calls the wrapped base layer of a targeted module.
BASE_LAYER = ".base_layer"
#: Where ``--no-merge`` publishes the LoRA weights, as verl's own merger does.
ADAPTER_FOLDER = "lora_adapter"


@dataclass(frozen=True)
class Values:
    """A job's value ops: the plan, the checkpoint's tensors read for it (not written), the adapter folder,
    and the config to publish instead of the assets' (None: as it is); one line each of what is done."""

    plan: ValuePlan = field(default_factory=ValuePlan)
    read: Scanned | None = None
    adapter: AdapterFolder | None = None
    config: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    #: The checkpoint's weights whose block maxima are measured before the writing (``--dtype fp8``).
    measure: Scanned | None = None
    #: ``--no-merge``: the LoRA settings of the weights kept apart, published as a peft adapter folder.
    kept_apart: LoraConfig | None = None


def read_lora(comm: Comm, options: Options, directory: str | None = None) -> AdapterFolder | LoraConfig | None:
    """``--lora``'s folder, read on rank 0 and agreed: a peft adapter, or its config alone (for LoRA weights
    the checkpoint holds); without it, the LoRA settings a trainer records in the checkpoint's ``directory``
    (verl's ``lora_train_meta.json``), when it does."""
    lora = options.lora
    if lora is None:
        return None if directory is None else agree_on(comm, 0, lambda: _recorded_lora(directory, options.s3_endpoint))
    path = os.fspath(lora)

    def read() -> AdapterFolder | LoraConfig:
        if os.path.isdir(path) and not os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            config_path = os.path.join(path, CONFIG_FILE)
            if os.path.isfile(config_path):
                return lora_config(read_config(config_path), config_path)
        return read_adapter(path)

    return agree_on(comm, 0, read)


def plan_values(
    scanned: Scanned, options: Options, config: dict[str, Any] | None, lora: AdapterFolder | LoraConfig | None
) -> tuple[Scanned, Values]:
    """The scan of the tensors written, and the value ops (pure: every rank computes the same)."""
    scanned, merging = _lora_values(scanned, lora, options.no_merge)
    plan, notes = merging.plan, list(merging.notes)
    published, measure = None, None
    if options.dtype is not None:
        shapes = _shapes(scanned)
        if options.dtype == "fp8":
            precision = quantize_plan(shapes, options.keep_dtype, _block(config))
            if not precision.ops:
                raise InputError(
                    f"{scanned.directory}: --dtype fp8 found no weight to quantize (a 2-D bf16, fp16 or fp32 '.weight' "
                    "of a decoder layer, '.layers.' in its name, that --keep-dtype does not keep)"
                )
            done = f"quantized {len(precision.computed)} weights to block FP8 (E4M3, a float32 scale per block)"
            quantization = {**FP8_CONFIG, "weight_block_size": list(_block(config))}
            changed = None if config is None else {**config, "quantization_config": quantization}
        else:
            precision = fp8_plan(shapes, options.dtype, options.keep_dtype, _block(config))
            done = f"dequantized {precision.dequantized} block-FP8 weights to {options.dtype}; their scales are not written"
            changed = None if config is None else {k: v for k, v in config.items() if k != "quantization_config"}
        if precision.ops:
            plan = _joined(plan, precision)
            notes.append(done)
            published = changed
            position = {name: t for t, name in enumerate(scanned.names)}
            weights = [position[weight] for weight, _ in precision.computed.values()]
            measure = only(scanned, weights) if weights else None
    read = None
    if plan.read_only & set(scanned.names):
        index = {n: t for t, n in enumerate(scanned.names)}
        read = only(scanned, [index[n] for n in sorted(plan.read_only & set(index))])
        scanned = only(scanned, [t for t, n in enumerate(scanned.names) if n not in plan.read_only])
    return scanned, Values(plan, read, merging.adapter, published, tuple(notes), measure, merging.kept_apart)


#: What ``--dtype fp8`` writes in the config (DeepSeek-V3's ``quantization_config``; the block from the plan).
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}


def _joined(first: ValuePlan, second: ValuePlan) -> ValuePlan:
    clash = sorted(set(first.ops) & set(second.ops))
    if clash:
        raise InputError(
            f"{clash[0]}: --lora and --dtype fp8 both change it: merge in one run, then quantize the merged model "
            "in another (--dtype fp8)"
        )
    return ValuePlan(
        {**first.ops, **second.ops},
        first.read_only | second.read_only,
        second.dequantized,
        first.merged,
        first.replaced,
        {**first.computed, **second.computed},
    )


def _lora_values(scanned: Scanned, lora: AdapterFolder | LoraConfig | None, apart: bool = False) -> tuple[Scanned, Values]:
    """The LoRA merge: of the weights the checkpoint holds (peft's wrapped names), else of ``--lora``'s adapter;
    ``apart`` (``--no-merge``): the checkpoint's own kept apart, unmerged."""
    scanned, inside = _peft_wrapped(scanned)
    if apart and not inside:
        raise InputError(
            f"{scanned.directory}: --no-merge keeps the LoRA weights a checkpoint holds apart from its base, and "
            "this one holds none (a peft adapter folder is merged with --lora DIR, or left out with no option)"
        )
    if inside and apart and not isinstance(lora, AdapterFolder):
        if not isinstance(lora, LoraConfig):
            raise _no_recorded_alpha(scanned)
        said = f"kept LoRA apart, unmerged: {ADAPTER_FOLDER}/ holds it as a peft adapter (scaling from {lora.origin})"
        return scanned, Values(ValuePlan(read_only=frozenset(inside)), notes=(said,), kept_apart=lora)
    if inside:
        if isinstance(lora, AdapterFolder):
            raise InputError(
                f"{scanned.directory}: holds LoRA weights itself, and --lora {lora.directory} holds others: give "
                f"--lora a folder with the training's {CONFIG_FILE} alone (for its lora_alpha), or the base model"
            )
        if not isinstance(lora, LoraConfig):
            raise _no_recorded_alpha(scanned)
        settings = lora
        shapes = _shapes(scanned)
        base = {n: s for n, s in shapes.items() if n not in inside}
        plan = lora_plan(base, {n: shapes[n] for n in inside}, settings, scanned.directory)
        return scanned, Values(plan, notes=(f"merged LoRA into {plan.merged} weights (scaling from {settings.origin})",))
    if isinstance(lora, AdapterFolder):
        plan = replace(lora_plan(_shapes(scanned), lora.shapes(), lora.config, lora.directory), read_only=frozenset())
        replaced = f", {plan.replaced} replaced (modules_to_save)" if plan.replaced else ""
        return scanned, Values(
            plan, adapter=lora, notes=(f"merged LoRA from {lora.directory} into {plan.merged} weights{replaced}",)
        )
    if isinstance(lora, LoraConfig) and not lora.recorded:
        raise InputError(f"{lora.origin}: the folder has no adapter_model.safetensors, and the checkpoint holds no LoRA weights")
    return scanned, Values()


def _block(config: dict[str, Any] | None) -> tuple[int, int]:
    """``quantization_config.weight_block_size``: DeepSeek-V3's [128, 128] when the config names none."""
    block = ((config or {}).get("quantization_config") or {}).get("weight_block_size")
    if block is None:
        return FP8_BLOCK
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise InputError(f"config.json: quantization_config.weight_block_size is {block!r}, not two positive integers")
    return (block[0], block[1])


def _peft_wrapped(scanned: Scanned) -> tuple[Scanned, set[str]]:
    """A checkpoint of a peft-wrapped model (``base_model.model.…``, ``.base_layer``, ``lora_A.default``):
    renamed to the base's names and the LoRA parameters' (adapter name removed); and the LoRA parameters."""
    names = scanned.names
    if not names or not all(n.startswith(PEFT_PREFIX) for n in names) or not any(lora_module(n) for n in names):
        return scanned, set()
    renamed, inside = [], set()
    for name in names:
        plain = name.removeprefix(PEFT_PREFIX)
        found = lora_module(plain)
        if found is not None:
            module, kind = found
            plain = f"{module}.{kind}" + ("" if kind == "lora_magnitude_vector" else ".weight")
            inside.add(plain)
        else:
            plain = plain.replace(BASE_LAYER + ".", ".")
        renamed.append(plain)
    return chosen(scanned, list(range(len(names))), renamed, "peft's wrapped names"), inside


def _recorded_lora(directory: str, endpoint: str | None) -> LoraConfig | None:
    """The LoRA settings a trainer records beside the weights (verl's ``lora_train_meta.json``), or None."""
    place = S3Place.at(directory, endpoint) if is_s3(directory) else LocalPlace(directory)
    if not place.is_file(VERL_META_FILE):
        return None
    label = f"{directory.rstrip('/')}/{VERL_META_FILE}"
    text = place.read_small(VERL_META_FILE, "verl's LoRA settings")
    try:
        settings = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{label}: not valid JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise InputError(f"{label}: holds a JSON {type(settings).__name__}, not an object")
    return replace(lora_config(settings, label), recorded=True)


def _no_recorded_alpha(scanned: Scanned) -> InputError:
    return InputError(
        f"{scanned.directory}: holds LoRA weights but no {VERL_META_FILE}, so their lora_alpha is unknown: give the "
        f"training's adapter config with --lora DIR (a folder with {CONFIG_FILE}: r, lora_alpha)"
    )


def _shapes(scanned: Scanned) -> dict[str, Shape]:
    shapes, dtypes = shapes_and_dtypes(scanned)
    return {name: Shape(dtype, shape) for name, shape, dtype in zip(scanned.names, shapes, dtypes)}


def published_assets(assets: HFAssets | None, values: Values | None) -> HFAssets | None:
    """The assets as published: with the config the value ops call for (no ``quantization_config`` once
    dequantized), and ``--no-merge``'s adapter folder (named now, filled by :func:`adapter_folder`)."""
    if values is not None and values.kept_apart is not None:
        assets = with_folder(assets, ADAPTER_FOLDER, {})
    if assets is None or values is None or values.config is None:
        return assets
    return with_config(assets, values.config)


def adapter_folder(comm: Comm, assets: HFAssets | None, values: Values, buffer_size: int) -> HFAssets | None:
    """``--no-merge``: the LoRA weights gathered whole (collective) and made a peft adapter folder
    (``adapter_model.safetensors`` in their saved dtype, ``adapter_config.json``) in the assets."""
    if values.kept_apart is None or values.read is None:
        return assets
    arrays = gather_whole(comm, values.read, buffer_size, as_float32=False)
    return with_folder(assets, ADAPTER_FOLDER, peft_adapter_files(arrays, values.kept_apart))


class Gathered:
    """The auxiliary tensors: the checkpoint's (whole, in memory) and an adapter folder's (memory-mapped)."""

    def __init__(self, arrays: dict[str, np.ndarray], adapter: AdapterFolder | None) -> None:
        self.arrays = arrays
        self.adapter = None if adapter is None else AdapterTensors(adapter)

    def whole(self, name: str) -> np.ndarray:
        if name in self.arrays:
            return self.arrays[name]
        assert self.adapter is not None, name
        return self.adapter.whole(name)

    def rows(self, name: str, begin: int, end: int) -> np.ndarray:
        if name in self.arrays:
            return self.arrays[name][begin:end]
        assert self.adapter is not None, name
        return self.adapter.rows(name, begin, end)


def auxiliary(comm: Comm, values: Values, buffer_size: int) -> Gathered | None:
    """What the value ops read (collective): the checkpoint's tensors gathered whole onto every rank."""
    if not values.plan.ops:
        return None
    arrays = {} if values.read is None else gather_whole(comm, values.read, buffer_size)
    if values.measure is not None:
        arrays.update(measure_scales(comm, values.measure, values.plan, buffer_size))
    return Gathered(arrays, values.adapter)


def measure_scales(comm: Comm, sub: Scanned, plan: ValuePlan, buffer_size: int) -> dict[str, np.ndarray]:
    """Every quantized weight's block scales on every rank: each rank takes the block maxima of its share of
    the rows, then one maximum over the ranks for all of them (a block's rows may be several ranks')."""
    scales_name = {weight: name for name, (weight, _) in plan.computed.items()}
    grids: dict[int, np.ndarray] = {}  # each weight's block maxima: views of one array, reduced at once
    maxima: list[np.ndarray] = []

    def sink_for(layout: Layout) -> Callable[[Block, np.ndarray], None]:
        shapes = [plan.computed[scales_name[tensor.name]][1] for tensor in layout.tensors]
        flat = np.zeros(sum(int(np.prod(shape)) for shape in shapes), dtype=np.float32)
        starts = np.cumsum([0] + [int(np.prod(shape)) for shape in shapes])
        grids.update({t: flat[starts[t] : starts[t + 1]].reshape(shape) for t, shape in enumerate(shapes)})
        maxima.append(flat)

        def take(block: Block, assembled: np.ndarray) -> None:
            position = 0
            for segment in block.segments:
                tensor, size = layout.tensors[segment.tensor], segment_bytes(layout, segment)[0]
                rows, cols = segment_span(layout, segment)
                values = assembled[position : position + size].view(numpy_dtype(tensor.dtype)).reshape(rows[1] - rows[0], -1)
                position += size
                op = plan.ops[tensor.name]
                if values.size and isinstance(op, Quantize):
                    row_blocks, col_blocks, grid = block_amax(values, rows, cols, op.block)
                    held = grids[segment.tensor][row_blocks, col_blocks]
                    np.maximum(held, grid, out=held)

        return take

    layout = _read_whole(comm, sub, buffer_size, sink_for)
    comm.allreduce_array(maxima[0], "max")
    return {scales_name[tensor.name]: scales_of(grids[t]) for t, tensor in enumerate(layout.tensors)}


def gather_whole(comm: Comm, sub: Scanned, buffer_size: int, as_float32: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of ``sub`` whole on every rank (in float32, or ``as_float32=False`` as saved): each rank
    assembles its share of the rows, then one sum over the ranks (each byte is one rank's) gives everyone
    all of them."""
    data: list[np.ndarray] = []

    def sink_for(layout: Layout) -> Callable[[Block, np.ndarray], None]:
        data.extend(np.zeros(f.size, dtype=np.uint8) for f in layout.files)

        def keep(block: Block, assembled: np.ndarray) -> None:
            data[block.file][block.offset : block.offset + block.size] = assembled[: block.size]

        return keep

    layout = _read_whole(comm, sub, buffer_size, sink_for)
    for array in data:
        comm.allreduce_array(array, "sum")
    result = {}
    for tensor in layout.tensors:
        raw = data[tensor.file][tensor.offset : tensor.offset + tensor.nbytes]
        values = raw.view(numpy_dtype(tensor.dtype)).reshape(tensor.shape)
        result[tensor.name] = values.astype(np.float32) if as_float32 else values
    return result


def _read_whole(
    comm: Comm, sub: Scanned, buffer_size: int, sink_for: Callable[[Layout], Callable[[Block, np.ndarray], None]]
) -> Layout:
    """Each rank's share of the rows of every tensor of ``sub`` assembled (collective) and handed to the sink
    ``sink_for`` makes for their layout; the layout."""
    layout = agree(comm, lambda: build_layout(sub.files, sub.names, sub.facts, comm.size, max_shard_size=HF_MAX_SHARD_SIZE))
    part = distribute(comm, sub, layout)
    sink = sink_for(layout)
    sources = open_sources(sub)
    try:
        agree(comm, lambda: feed_blocks(comm, sub, layout, part, sources, buffer_size, sink), collective=True)
    finally:
        sources.close()
    return layout


__all__ = [
    "ADAPTER_FOLDER",
    "Gathered",
    "adapter_folder",
    "published_assets",
    "Values",
    "auxiliary",
    "gather_whole",
    "plan_values",
    "read_lora",
]
