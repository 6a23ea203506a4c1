"""The model's ``config.json`` as a check on the checkpoint's shapes, before any work.

DCP's Hugging Face layout records no full shapes, so a checkpoint missing its last training rank's
files would come out short with nothing else to show it. With ``--hf-assets`` (or a ``config.json``
beside the input: in its directory or the directory above), every output tensor whose name the model
has must have the model's shape.

The shapes come from two places. The config fields of a known architecture
(:func:`~mpicons.adaptation.model_shapes.config_shapes`: pure, instant, and the same names and shapes as
transformers' own models, which the tests check) decide first. transformers decides when the fields
do not know the architecture, or when a tensor differs from them: the model the config's
``architectures`` names, built on torch's meta device (no memory, no weights read) in a child process
on rank 0, so no rank of the job holds torch and transformers (a few hundred MB, seconds to import).
Its shapes then count, with the fields adding the names its model lacks (Hugging Face's per-expert
names, which transformers 5 fuses). Without transformers the fields alone decide; for a model neither
knows nothing is checked.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..adaptation.model_shapes import (
    Disagreement,
    Mismatch,
    Shapes,
    check_sizes,
    config_shapes,
    disagreements,
    mismatches,
    stop_message,
)
from ..comm.agreement import Comm, agree, agree_on
from ..core.errors import InputError, MpiconsError
from ..core.layout import Layout
from ..core.reports import Problem, count_of
from ..io.s3 import is_s3
from .scan import rank_directory

if TYPE_CHECKING:
    from ..io.assets import HFAssets

log = logging.getLogger("mpicons")

CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class ModelConfig:
    """A model's config as read (the same on every rank), and the shapes its fields give (None: not a known architecture)."""

    config: dict[str, Any]
    path: str
    fields: Shapes | None


@dataclass(frozen=True)
class ModelShapes:
    """The parameter shapes a model's config gives, and where they come from (for messages)."""

    shapes: Shapes
    source: str


@dataclass(frozen=True)
class Verdict:
    """The checkpoint's tensors against the model: the shapes that decided (None: nothing to compare
    with), the tensors that differ from them, and what the config says that the weights contradict."""

    model: ModelShapes | None
    found: list[Mismatch]
    disagree: list[Disagreement] = field(default_factory=list)
    config_path: str = ""
    names: list[str] = field(default_factory=list)

    def problems(self) -> list[tuple[int | None, Problem]]:
        """(tensor number or None, problem): the config's disagreements, then each tensor that differs."""
        assert self.model is not None or not self.found
        position = {name: t for t, name in enumerate(self.names)}
        said = [(position.get(d.tensor or ""), d.problem(self.config_path)) for d in self.disagree]
        return said + ([(m.tensor, m.problem(self.model.source)) for m in self.found] if self.model is not None else [])

    def checked(self, names: list[str]) -> str | None:
        """``shapes of 21 of 27 tensors checked against PATH, ...``; None when no tensor is one of the model's."""
        matched = 0 if self.model is None else sum(1 for name in names if name in self.model.shapes)
        if not matched:
            return None
        assert self.model is not None
        return f"shapes of {matched} of {count_of(len(names), 'tensor')} checked against {self.model.source}"


def config_beside(input_dir: str) -> str | None:
    """The ``config.json`` beside an input directory (rank 0's, ``{rank}`` resolved): in it, else in its
    parent; None when there is none (or the input is an ``s3://`` prefix)."""
    if is_s3(input_dir):
        return None
    directory = os.path.abspath(rank_directory(input_dir, 0))
    for candidate in (directory, os.path.dirname(directory)):
        path = os.path.join(candidate, CONFIG_NAME)
        if os.path.isfile(path):
            return path
    return None


def _config_of(input_dir: str, assets: HFAssets | None) -> tuple[Mapping[str, Any], str] | None:
    """The config to check against and its path: ``--hf-assets``'s, else the one beside the input.

    One beside the input that cannot be read as a config is passed over with a warning: it was not asked for.
    """
    if assets is not None:
        return None if assets.config is None else (assets.config, assets.config_path)
    path = config_beside(input_dir)
    if path is None:
        return None
    from ..io.assets import read_config

    try:
        return read_config(path), path
    except MpiconsError as exc:
        log.warning("%s (beside the input) not used to check shapes: %s", path, exc)
        return None


#: ``build(config)``: the model a config describes, built on the meta device, as its state dict's shapes.
#: Source text, so that a child process can run it without importing mpicons (:func:`_transformers_shapes`).
_BUILD_ON_META = """
def build(config):
    import warnings

    import torch
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        settings = {k: v for k, v in config.items() if k != "model_type"}
        model_config = transformers.AutoConfig.for_model(config["model_type"], **settings)
        names = config.get("architectures")
        named = isinstance(names, list) and names and isinstance(names[0], str)
        found = getattr(transformers, names[0], None) if named else None
        with torch.device("meta"):
            if isinstance(found, type):
                model = found(model_config)
            else:
                model = transformers.AutoModelForCausalLM.from_config(model_config)
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    return {"model": type(model).__name__, "version": transformers.__version__, "shapes": shapes}
"""
_CHILD = _BUILD_ON_META + "\nimport json, sys\njson.dump(build(json.load(sys.stdin)), sys.stdout)\n"
#: Seconds the child may take (importing torch and transformers takes a few on a busy node).
BUILD_TIMEOUT = 300


def _transformers_shapes(config: Mapping[str, Any]) -> tuple[Shapes, str] | None:
    """The state dict's shapes of the model the config describes, as transformers builds it on the meta
    device; None when transformers (or torch) is not installed or cannot build it.

    A child process does it (importing torch and transformers costs about 300 MB and a few seconds,
    none of which the job's rank keeps), unless this process has both loaded already (the torch
    drop-in in a training job): then it is done here, transformers' log level left as it was.
    """
    if not isinstance(config.get("model_type"), str):
        return None
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        return None
    key = json.dumps(dict(config), sort_keys=True, default=str)
    if key not in _BUILT:
        _BUILT[key] = _build(config)
        while len(_BUILT) > BUILT_KEPT:
            _BUILT.pop(next(iter(_BUILT)))
    return _BUILT[key]


#: The shapes of the last few configs built, so a process consolidating the same model again (a training job's
#: drop-in, a test suite) does not build it again; a config that changes is another key.
_BUILT: dict[str, tuple[Shapes, str] | None] = {}
BUILT_KEPT = 4


def _build(config: Mapping[str, Any]) -> tuple[Shapes, str] | None:
    try:
        answer = _build_here(config) if {"torch", "transformers"} <= set(sys.modules) else _build_in_child(config)
        shapes = {str(name): tuple(int(x) for x in shape) for name, shape in answer["shapes"].items()}
        return shapes, f"{answer['model']}, transformers {answer['version']}"
    except Exception:  # noqa: BLE001 - a model transformers cannot build here is checked by its fields, if known
        return None


def _build_in_child(config: Mapping[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    command = [sys.executable, "-c", _CHILD]
    done = subprocess.run(command, input=json.dumps(dict(config)), capture_output=True, text=True, timeout=BUILD_TIMEOUT, env=env)
    if done.returncode != 0:
        raise ValueError(done.stderr[-500:])
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def _build_here(config: Mapping[str, Any]) -> dict[str, Any]:
    import transformers

    namespace: dict[str, Any] = {}
    exec(_BUILD_ON_META, namespace)  # our own constant source text, the child's too
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        answer: dict[str, Any] = namespace["build"](dict(config))
    finally:
        transformers.logging.set_verbosity(verbosity)
    return answer


def load_model_config(comm: Comm, input_dir: str, assets: HFAssets | None) -> ModelConfig | None:
    """The model's config (``--hf-assets``', else the one beside the input), read on rank 0 and shared."""

    def find() -> ModelConfig | None:
        found = _config_of(input_dir, assets)
        if found is None:
            return None
        config, path = found
        check_sizes(config, path)  # before anything is sized by the config's numbers
        return ModelConfig(dict(config), path, config_shapes(config))

    return agree_on(comm, 0, find)


def judge(comm: Comm, tensors: Iterable[tuple[str, tuple[int, ...]]], model: ModelConfig | None, whole: bool = True) -> Verdict:
    """The tensors ``(name, shape)`` against the model (collective: every rank passes the same tensors);
    ``whole``: no tensor was left out on purpose (``--include``, ``--exclude``), so every one the model
    has must be there.

    The config's fields decide when they know the architecture and every tensor agrees; otherwise rank
    0 asks transformers (a child process), whose shapes decide when it can build the model.
    """
    if model is None:
        return Verdict(None, [])
    listed = list(tensors)
    names = [name for name, _ in listed]
    said = (disagreements(model.config, names, whole), model.path, names)
    family = model.config.get("model_type")
    fields = None if model.fields is None else ModelShapes(model.fields, f"{model.path}, its {family} fields")
    found = [] if fields is None else mismatches(listed, fields.shapes)
    if fields is not None and not found:
        return Verdict(fields, [], *said)
    built = agree_on(comm, 0, lambda: _transformers_shapes(model.config))
    if built is None:
        if fields is None:
            log.info("%s: model_type %r is not one mpicons knows without transformers: shapes not checked", model.path, family)
        return Verdict(fields, found, *said)
    shapes = ModelShapes({**(model.fields or {}), **built[0]}, f"{model.path}, {built[1]}")
    return Verdict(shapes, mismatches(listed, shapes.shapes), *said)


def layout_tensors(layout: Layout) -> list[tuple[str, tuple[int, ...]]]:
    return [(t.name, t.shape) for t in layout.tensors]


def check_model_shapes(comm: Comm, layout: Layout, model: ModelConfig | None, whole: bool = True) -> None:
    """Bad input on every rank when the config contradicts the weights or an output tensor's shape is not
    the model's (the layout is everyone's)."""
    verdict = judge(comm, layout_tensors(layout), model, whole)

    def check() -> None:
        if verdict.disagree:
            raise InputError(verdict.disagree[0].problem(verdict.config_path).message)
        if verdict.found:
            assert verdict.model is not None
            raise InputError(stop_message(verdict.found, verdict.model.source))

    agree(comm, check)


__all__ = [
    "ModelConfig",
    "ModelShapes",
    "Verdict",
    "config_beside",
    "load_model_config",
    "judge",
    "layout_tensors",
    "check_model_shapes",
]
