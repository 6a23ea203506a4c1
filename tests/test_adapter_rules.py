"""Adapter rule files and the conversion geometry, on rules and checkpoints written here.

The rule format's checks (every error names ``FILE:LINE``), matching, :func:`plan_conversion`'s
refusals, the built-in torchtitan rules against the Hugging Face names FACTS.md states, and each
transform end to end through :func:`mpicons.consolidate`: the expected tensors are numpy's reshapes
of the full tensor (never mpicons' code), the expected files what safetensors' serializer writes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from helpers import assert_manifest, reference_bytes, run_python

import mpicons
from mpicons.adaptation.apply import plan_conversion
from mpicons.adaptation.rules import choose_rules, parse_rules, target_names
from mpicons.comm import SingleProcess
from mpicons.core.errors import InputError
from mpicons.trainers import trainer
from mpicons.trainers.torchtitan import TORCHTITAN

ORIGIN = "user.rules"
#: Lines before the line under test: a comment, a model_type, a blank line and a good rule (so it is line 5).
PREAMBLE = "# a user's rules\nmodel_type toy\n\nkeep.weight model.keep.weight\n"
BAD_LINE = 5
SHARD = "shard-{rank:05d}-model-00001-of-00001.safetensors"
OUT_FILE = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"
#: The config of the cases run with an assets directory (their rules take literal numbers, which need none).
CONFIG = {"model_type": "toy", "num_hidden_layers": 2}
NUMPY_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F16": np.dtype(np.float16),
    "I8": np.dtype(np.int8),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
DTYPE_NAME = {v: k for k, v in NUMPY_DTYPES.items()}


def rules(line: str) -> str:
    return PREAMBLE + line + "\nlast.weight model.last.weight\n"


# ---------------------------------------------------------------- 1. parsing: every error names FILE:LINE

BAD_RULES = {
    "unknown transform": ("a.weight b.weight frobnicate(1)", "unknown transform 'frobnicate'"),
    "pattern character": ("a$b.weight b.weight", "'a$b.weight'"),
    "unclosed capture": ("a.{N.weight b.weight", "'a.{N.weight'"),
    "capture not a word": ("a.{1x}.weight b.weight", "'{1x}'"),
    "capture twice": ("a.{N}.{N} b.{N}", "capture {N} appears twice"),
    "target capture the source lacks": ("layers.{N}.w model.{M}.w", "uses {M}, which the source does not capture"),
    "target character": ("a.weight b$c.weight", "target 'b$c.weight'"),
    "dash without drop": ("a.weight -", "target '-' (no Hugging Face name) goes only with drop"),
    "dash with unbind": ("a.weight - unbind(E)", "goes only with drop"),
    "unbind without its capture": ("a.weight b.weight unbind(E)", "the target must hold {E}"),
    "unbind of a source capture": ("a.{E}.w b.{E}.w unbind(E)", "{E} is already a capture of the source"),
    "unbind of a number": ("a.w b.{E}.w unbind(1)", "unbind's argument is the target's capture name"),
    "split_rows without parts": ("a.w b.w split_rows(groups=1, sizes=(1, 2))", "split_rows names its parts in the target"),
    "split_rows parts twice": ("a.w {x|y}.{q|k} split_rows(groups=1, sizes=(1, 2))", "names its parts in the target, once"),
    "condition not a key": ("a.w b.w if 1x", "a condition reads 'if KEY' or 'if not KEY'"),
    "condition of two words": ("a.w b.w if tie word", "a condition reads 'if KEY' or 'if not KEY'"),
    "default without =": ("default head_dim", "a default line reads 'default KEY = EXPRESSION'"),
    "default key": ("default 1x = 3", "a default line reads 'default KEY = EXPRESSION'"),
    "default expression": ("default head_dim = 3 +", "'3 +' is not an expression"),
    "default call": ("default head_dim = __import__('os').getpid()", "only whole numbers, config fields"),
    "argument call": ("a.w b.w rope_to_half(__import__('os').getpid(), 2)", "only whole numbers, config fields"),
    "argument builtin": ("a.w b.w rope_to_half(len(heads), 2)", "only whole numbers, config fields"),
    "argument lambda": ("a.w b.w rope_to_half((lambda: 1)(), 2)", "only whole numbers, config fields"),
    "argument subscript": ("a.w b.w rope_to_half(heads[0], 2)", "only whole numbers, config fields"),
    "argument power": ("a.w b.w rope_to_half(2 ** 100000, 2)", "only whole numbers, config fields"),
    "argument true division": ("a.w b.w rope_to_half(4 / 2, 2)", "only whole numbers, config fields"),
    "target offset call": ("a.{N}.w b.{N+len(x)}.w", "only whole numbers, config fields"),
    "too many arguments": ("a.w b.w rope_to_half(1, 2, 3)", "rope_to_half takes 2 argument(s)"),
    "unknown keyword": ("a.w b.w rope_to_half(heads=1, dim=2)", "unexpected or repeated argument 'dim'"),
    "missing argument": ("a.w b.w rope_to_half(1)", "rope_to_half needs head_dim"),
    "drop of a number": ("a.w - drop(1)", "drop(same_as=1): same_as is the saved tensor's dotted name"),
    "drop of a call": ("a.w - drop(same_as=os.getpid())", "same_as is the saved tensor's dotted name"),
    "drop of two names": ("a.w - drop(x.w, y.w)", "drop takes 1 argument(s): same_as"),
    "drop with a keyword": ("a.w - drop(like=x.w)", "unexpected or repeated argument 'like'"),
    "unclosed call": ("a.w b.w rope_to_half(", "expected 'SOURCE TARGET [TRANSFORM] [if [not] KEY]'"),
    "one word": ("lonely", "expected 'SOURCE TARGET [TRANSFORM] [if [not] KEY]'"),
    "model_type without values": ("model_type", "model_type needs at least one value"),
    "skip without patterns": ("skip", "skip needs at least one pattern"),
}


@pytest.mark.parametrize("case", list(BAD_RULES))
def test_a_bad_rule_is_named_by_file_and_line(case: str) -> None:
    line, said = BAD_RULES[case]
    with pytest.raises(InputError) as caught:
        parse_rules(rules(line), ORIGIN)
    message = str(caught.value)
    assert message.startswith(f"{ORIGIN}:{BAD_LINE}: "), message
    assert said in message, message
    assert caught.value.exit_code == 2


#: Arguments that can never be integer expressions over config fields: nothing in them runs (see
#: test_non_config_arguments_are_refused_when_evaluated), but the file's check up front lets them pass.
NOT_INTEGER_EXPRESSIONS = {
    "attribute of a number": "(1).real",
    "attribute of a tuple": "().__class__",
    "string": "'heads'",
    "float": "2.5",
}


@pytest.mark.parametrize("case", list(NOT_INTEGER_EXPRESSIONS))
def test_a_non_config_argument_is_refused_up_front(case: str) -> None:
    text = rules(f"a.w b.w rope_to_half({NOT_INTEGER_EXPRESSIONS[case]}, 2)")
    try:
        parse_rules(text, ORIGIN)
    except InputError as exc:
        assert str(exc).startswith(f"{ORIGIN}:{BAD_LINE}: "), str(exc)
    else:
        raise AssertionError(f"{NOT_INTEGER_EXPRESSIONS[case]!r} accepted as a rule argument")


@pytest.mark.parametrize("case", list(NOT_INTEGER_EXPRESSIONS))
def test_non_config_arguments_are_refused_when_evaluated(case: str) -> None:
    """What the up-front check lets through is still refused when the plan evaluates it, naming the line."""
    try:
        rule_set = parse_rules(rules(f"a.w b.w rope_to_half({NOT_INTEGER_EXPRESSIONS[case]}, 2)"), ORIGIN)
    except InputError:
        return  # refused up front: better still
    with pytest.raises(InputError, match=rf"^{ORIGIN}:{BAD_LINE}: "):
        plan_conversion(["a.w"], [(4, 3)], [False], rule_set, {})


def test_a_call_in_a_rule_is_never_run(tmp_path: Path) -> None:
    """``__import__('os').system(...)`` in an argument, a default or a target is refused, not run."""
    marker = tmp_path / "ran"
    call = f"__import__('os').system('touch {marker}')"
    for line in (f"a.w b.w rope_to_half({call}, 2)", f"default heads = {call}", f"a.{{N}}.w b.{{N+{call}}}.w"):
        with pytest.raises(InputError, match=rf"^{ORIGIN}:{BAD_LINE}: "):
            parse_rules(rules(line), ORIGIN)
    assert not marker.exists()


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "model_type toy\ndefault head_dim = 4\n"])
def test_a_file_without_rules_is_refused(text: str) -> None:
    with pytest.raises(InputError, match=rf"^{ORIGIN}: no rules"):
        parse_rules(text, ORIGIN)


def test_a_bad_rule_file_stops_the_command_with_its_line(tmp_path: Path) -> None:
    """Through the command line: exit 2 naming FILE:LINE, before anything is written."""
    checkpoint = write_checkpoint(tmp_path / "ckpt", {"keep.weight": ("F32", np.ones((2, 2), np.float32), [((0, 0), (2, 2))])})
    rule_file = tmp_path / "bad.rules"
    rule_file.write_text(rules("a.w b.w unbind(E)"))
    proc = run_python("-m", "mpicons", "consolidate", checkpoint, tmp_path / "out", "--adapter", rule_file, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{rule_file}:{BAD_LINE}:" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ---------------------------------------------------------------- 2. matching


def matched(text: str, name: str, config: dict[str, object] | None = None) -> tuple[int, dict[str, str]] | None:
    """The line of the rule that decides ``name``, and its captures (None: no rule)."""
    found = parse_rules(text, ORIGIN).match(name, config or {})
    return None if found is None else (found[0].line, found[1])


def test_the_first_matching_rule_decides() -> None:
    text = "a.{N}.w first.{N}\na.*.w second\na.**.w third\n"
    assert matched(text, "a.3.w") == (1, {"N": "3"})
    assert matched(text, "a.x.w") == (2, {})
    assert matched(text, "a.x.y.w") == (3, {})
    assert matched(text, "b.3.w") is None


def test_conditions_read_the_config() -> None:
    text = "lm_head.weight lm_head.weight drop if tie\nlm_head.weight lm_head.weight\nx.w y.w if not tie\n"
    assert matched(text, "lm_head.weight", {"tie": True}) == (1, {})
    assert matched(text, "lm_head.weight", {"tie": False}) == (2, {})
    assert matched(text, "lm_head.weight", {}) == (2, {})  # a missing key is false
    assert matched(text, "lm_head.weight", {"tie": None}) == (2, {})
    assert matched(text, "x.w", {}) == (3, {})
    assert matched(text, "x.w", {"tie": 0}) == (3, {})
    assert matched(text, "x.w", {"tie": 1}) is None


def test_a_condition_reads_nested_config_keys() -> None:
    text = "a.w b.w if text_config.tie\na.w c.w\n"
    assert matched(text, "a.w", {"text_config": {"tie": True}}) == (1, {})
    assert matched(text, "a.w", {"text_config": {}}) == (2, {})
    assert matched(text, "a.w", {"text_config": 3}) == (2, {})


def test_defaults_fill_missing_and_null_keys() -> None:
    rule_set = parse_rules("default head_dim = hidden_size // num_attention_heads\na.w b.w\n", ORIGIN)
    config = {"hidden_size": 64, "num_attention_heads": 4}
    assert rule_set.config_with_defaults(config)["head_dim"] == 16
    assert rule_set.config_with_defaults({**config, "head_dim": None})["head_dim"] == 16
    assert rule_set.config_with_defaults({**config, "head_dim": 8})["head_dim"] == 8
    with pytest.raises(InputError, match="'num_attention_heads'"):
        rule_set.config_with_defaults({"hidden_size": 64})


def names_of(text: str, name: str, config: dict[str, object]) -> list[str]:
    rule_set = parse_rules(text, ORIGIN)
    found = rule_set.match(name, config)
    assert found is not None, name
    return target_names(found[0], found[1], config, rule_set.where(found[0]))


def test_targets_add_config_values_to_captures() -> None:
    text = "mtp.{M}.w model.layers.{M+num_hidden_layers}.w\nx.{N}.w model.{N+2*num_hidden_layers-1}.w\n"
    assert names_of(text, "mtp.0.w", {"num_hidden_layers": 61}) == ["model.layers.61.w"]
    assert names_of(text, "mtp.3.w", {"num_hidden_layers": 2}) == ["model.layers.5.w"]
    assert names_of(text, "x.4.w", {"num_hidden_layers": 3}) == ["model.9.w"]
    with pytest.raises(InputError, match=rf"^{ORIGIN}:1: .*'num_hidden_layers'"):
        names_of(text, "mtp.0.w", {})


def test_a_target_names_each_part_of_a_split() -> None:
    text = "l.{N}.qkv model.{N}.{q|k|v}_proj.weight split_rows(groups=1, sizes=(1, 1, 1))\n"
    assert names_of(text, "l.7.qkv", {}) == [f"model.7.{p}_proj.weight" for p in "qkv"]


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
        ("a.*.w", "a.x.w", True),
        ("a.*.w", "a.x.y.w", False),  # * stays in one dotted part
        ("a.*.w", "a..w", False),
        ("a.*", "a.x", True),
        ("a.*", "a.x.y", False),
        ("a.**.w", "a.x.w", True),
        ("a.**.w", "a.x.y.w", True),  # ** crosses dots
        ("a.**", "a.x.y.z", True),
        ("a.**.w", "a.w", False),
        ("a_*.w", "a_b.w", True),
        ("layers.{N}.w", "layers.12.w", True),
        ("layers.{N}.w", "layers.x.w", False),  # {N} is digits only
        ("layers.{N}.w", "layers.1a.w", False),
        ("layers.{N}.w", "layers..w", False),
        ("layers.{N}.w", "layers.1.2.w", False),
        ("layers.{N}.w", "layers.-1.w", False),
        ("w{N}", "w12", True),
        ("a.w", "a.w.x", False),  # the whole name
        ("a.w", "xa.w", False),
        ("a-b.w", "a-b.w", True),
        ("a.w", "aXw", False),  # a dot is a dot
    ],
)
def test_pattern_matching(pattern: str, name: str, matches: bool) -> None:
    assert (matched(f"{pattern} out\n", name) is not None) == matches


def test_captures_are_the_digits() -> None:
    assert matched("layers.{N}.experts.{E}.w out.{N}.{E}\n", "layers.10.experts.003.w") == (1, {"N": "10", "E": "003"})
    assert names_of("layers.{N}.w model.{N}.w\n", "layers.007.w", {}) == ["model.7.w"]


# ---------------------------------------------------------------- 3. plan_conversion's refusals


def plan(text: str, tensors: dict[str, tuple[int, ...]], config: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
    return plan_conversion(list(tensors), list(tensors.values()), [False] * len(tensors), parse_rules(text, ORIGIN), config or {})


def test_an_unknown_saved_tensor_is_named_with_the_exclude_hint() -> None:
    with pytest.raises(InputError) as caught:
        plan("a.w b.w\n", {"a.w": (2,), "layers.0.extra.bias": (2,)})
    message = str(caught.value)
    assert "'layers.0.extra.bias'" in message
    assert "--exclude 'layers.0.extra.bias'" in message
    assert "'a.w'" not in message


def test_many_unknown_tensors_are_counted() -> None:
    names = {f"u.{i}": (1,) for i in range(8)}
    with pytest.raises(InputError) as caught:
        plan("a.w b.w\n", {"a.w": (2,), **names})
    message = str(caught.value)
    assert "8 saved tensors" in message and "and 3 more" in message
    assert all(f"'u.{i}'" in message for i in range(5))


def test_two_sources_of_one_target_are_refused_naming_both() -> None:
    text = "a.w model.x.weight\nb.w model.x.weight\n"
    with pytest.raises(InputError) as caught:
        plan(text, {"a.w": (2,), "b.w": (2,)})
    message = str(caught.value)
    assert "'a.w'" in message and "'b.w'" in message and "'model.x.weight'" in message
    assert f"{ORIGIN}:1" in message and f"{ORIGIN}:2" in message


def test_an_unbound_index_colliding_with_a_rename_is_refused() -> None:
    text = "e.w model.{E}.w unbind(E)\none.w model.1.w\n"
    with pytest.raises(InputError, match="would both be 'model.1.w'"):
        plan(text, {"e.w": (3, 2), "one.w": (2,)})


@pytest.mark.parametrize(
    ("transform", "shape", "said"),
    [
        ("rope_to_half(3, 4)", (13, 2), "3 heads of 4 rows is 12 rows, not 13"),
        ("rope_to_interleaved(heads, head_dim)", (10, 2), "2 heads of 4 rows is 8 rows, not 10"),
        ("rope_to_half(3, 5)", (15, 2), "an even head_dim"),
        ("rope_to_half(0, 4)", (0, 2), "positive heads"),
        ("rope_to_half(2, 4)", (), "a scalar has no dim 0"),
    ],
)
def test_rope_geometry_must_fit(transform: str, shape: tuple[int, ...], said: str) -> None:
    with pytest.raises(InputError, match=rf"^{ORIGIN}:1: ") as caught:
        plan(f"w.weight q.weight {transform}\n", {"w.weight": shape}, {"heads": 2, "head_dim": 4})
    assert said in str(caught.value)


@pytest.mark.parametrize(
    ("transform", "rows", "said"),
    [
        ("split_rows(groups=2, sizes=(2, 1, 1))", 9, "2 groups of 2+1+1 rows is 8 rows, not 9"),
        ("split_rows(groups=1, sizes=(2, 1))", 3, "2 sizes for 3 target names"),
        ("split_rows(groups=0, sizes=(1, 1, 1))", 3, "a positive number"),
        ("split_rows(groups=1, sizes=(1, 0, 2))", 3, "positive numbers of rows"),
    ],
)
def test_split_rows_sizes_must_fit(transform: str, rows: int, said: str) -> None:
    with pytest.raises(InputError, match=rf"^{ORIGIN}:1: ") as caught:
        plan(f"f.w {{q|k|v}}.w {transform}\n", {"f.w": (rows, 4)})
    assert said in str(caught.value)


def test_unbind_of_a_vector_is_refused() -> None:
    with pytest.raises(InputError, match=rf"^{ORIGIN}:1: unbind of 'bias' \(shape \[4\]\): one-dimensional"):
        plan("bias model.{E}.bias unbind(E)\n", {"bias": (4,)})


def test_a_sub_byte_vector_is_not_cut() -> None:
    rule_set = parse_rules("w {a|b} split_rows(groups=2, sizes=(1, 1))\n", ORIGIN)
    with pytest.raises(InputError, match="sub-byte"):
        plan_conversion(["w"], [(4,)], [True], rule_set, {})


def test_skips_and_drops_are_listed() -> None:
    text = "skip optimizer.**\nbias_E - drop\nlm_head.weight lm_head.weight drop if tie\na.w model.a.w\n"
    conversion = plan(
        text, {"a.w": (2,), "bias_E": (3,), "lm_head.weight": (2, 2), "optimizer.state.a.w.exp_avg": (2,)}, {"tie": True}
    )
    assert conversion.names == ["model.a.w"]
    assert conversion.dropped_names() == {"lm_head.weight"}
    assert conversion.skipped_counts() == {"optimizer.**": 1}
    assert {d.name for d in conversion.dropped} == {"bias_E", "lm_head.weight", "optimizer.state.a.w.exp_avg"}


def test_rules_that_read_no_config_need_no_assets() -> None:
    """docs/adapter-rules.md: a file with no config fields in its arguments, conditions, targets or defaults."""
    text = (
        "skip optimizer.**\ne.{N}.w x.{N}.{E}.w unbind(E)\nb - drop\nr.w s.w\nm.{M}.w t.{M+2*3}.w\n"
        "wq q.weight rope_to_half(3, 4)\nwk k.weight rope_to_interleaved(1, 2 * 2)\n"
        "f {a|b}.w split_rows(groups=2, sizes=(1, 2))\n"
    )
    assert not choose_rules(ORIGIN, None, text).reads_config
    for reading in ("r.w s.w if tie", "default x = 2", "r.{N}.w s.{N+n}.w", "r.w s.w rope_to_half(h, d)"):
        with pytest.raises(InputError, match="--hf-assets"):
            choose_rules(ORIGIN, None, f"{reading}\nt.w u.w\n")


# ---------------------------------------------------------------- 4. geometry, end to end

Box = tuple[tuple[int, ...], tuple[int, ...]]


def write_checkpoint(directory: Path, tensors: dict[str, tuple[str, np.ndarray, list[Box]]]) -> Path:
    """A DCP-style checkpoint in torch's Hugging Face layout: piece ``k`` of every tensor in training
    rank ``k``'s shard file, its offsets in ``DCP_SHARDING_INFO``, written by safetensors' serializer."""
    directory.mkdir(parents=True)
    by_rank: dict[int, dict[str, tuple[str, list[int], bytes, list[int]]]] = {}
    for name, (dtype, full, boxes) in tensors.items():
        for rank, (offsets, sizes) in enumerate(boxes):
            region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            piece = np.ascontiguousarray(full[region])
            by_rank.setdefault(rank, {})[name] = (dtype, list(sizes), piece.tobytes(), list(offsets))
    for rank, pieces in by_rank.items():
        info = {name: {"saved_offsets": offsets} for name, (_, _, _, offsets) in pieces.items()}
        metadata = {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)}
        blob = reference_bytes({n: (d, s, b) for n, (d, s, b, _) in pieces.items()}, metadata)
        (directory / SHARD.format(rank=rank + 1)).write_bytes(blob)
    return directory


def serialized(tensors: dict[str, np.ndarray]) -> bytes:
    """safetensors' own file for ``tensors``: its numpy front end where it knows the dtypes (not bfloat16).
    Contiguous copies first: the numpy front end reads a strided view's memory as if it were contiguous."""
    tensors = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    if all(a.dtype != NUMPY_DTYPES["BF16"] for a in tensors.values()):
        return safetensors.numpy.save(tensors, metadata={"format": "pt"})
    return reference_bytes({n: (DTYPE_NAME[a.dtype], list(a.shape), a.tobytes()) for n, a in tensors.items()})


def values(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "I8":
        return rng.integers(-128, 128, shape, dtype=np.int8)
    return rng.standard_normal(shape).astype(NUMPY_DTYPES[dtype])


def boxes(shape: tuple[int, ...], row_cuts: list[int], col_cuts: list[int]) -> list[Box]:
    """The grid of pieces cut at ``row_cuts`` along dim 0 and ``col_cuts`` along dim 1."""
    rows = [0, *row_cuts, shape[0]]
    cols = [0, *col_cuts, shape[1]] if len(shape) > 1 else [None, None]
    found = []
    for r0, r1 in zip(rows, rows[1:]):
        for c0, c1 in zip(cols, cols[1:]):
            if c0 is None or c1 is None:
                found.append(((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:])))
            else:
                found.append(((r0, c0, *[0] * (len(shape) - 2)), (r1 - r0, c1 - c0, *shape[2:])))
    return found


@dataclass
class Case:
    """One transform of one tensor: its rule, the saved tensor, where it is cut, and the numpy reference."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    params: tuple[int, ...]
    row_cuts: list[int] = field(default_factory=list)
    col_cuts: list[int] = field(default_factory=list)
    buffer_size: int = 4096
    seed: int = 0
    assets: bool = False  # consolidate with an assets directory (its config.json copied beside the weights)

    def rule(self) -> str:
        p = self.params
        if self.kind in ("rope_to_half", "rope_to_interleaved"):
            return f"blocks.{{N}}.wq  model.layers.{{N}}.self_attn.q_proj.weight  {self.kind}({p[0]}, {p[1]})"
        if self.kind == "unbind":
            return "blocks.{N}.experts  model.layers.{N}.mlp.experts.{E}.gate_proj.weight  unbind(E)"
        sizes = ", ".join(map(str, p[1:]))
        parts = "|".join("qkv"[: len(p) - 1])
        target = f"model.layers.{{N}}.self_attn.{{{parts}}}_proj.weight"
        return f"blocks.{{N}}.fused  {target}  split_rows(groups={p[0]}, sizes=({sizes},))"

    def source(self) -> str:
        return {"unbind": "blocks.1.experts", "split_rows": "blocks.1.fused"}.get(self.kind, "blocks.1.wq")

    def expected(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """The outputs from the full tensor with numpy's reshapes alone."""
        p = self.params
        if self.kind == "rope_to_half":
            heads, head_dim = p
            out = w.reshape(heads, head_dim // 2, 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)
            return {"model.layers.1.self_attn.q_proj.weight": out}
        if self.kind == "rope_to_interleaved":
            heads, head_dim = p
            out = w.reshape(heads, 2, head_dim // 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)
            return {"model.layers.1.self_attn.q_proj.weight": out}
        if self.kind == "unbind":
            return {f"model.layers.1.mlp.experts.{e}.gate_proj.weight": w[e] for e in range(w.shape[0])}
        groups, sizes = p[0], p[1:]
        grouped = w.reshape(groups, sum(sizes), *w.shape[1:])
        found, start = {}, 0
        for part, size in zip("qkv", sizes):
            found[f"model.layers.1.self_attn.{part}_proj.weight"] = grouped[:, start : start + size].reshape(
                groups * size, *w.shape[1:]
            )
            start += size
        return found


RULE_FILE = """# toy rules around the case's transform
model_type toy
skip optimizer.**
{rule}
blocks.{{N}}.norm  model.layers.{{N}}.input_layernorm.weight
blocks.{{N}}.bias_E  -  drop
"""


def run_case(case: Case, work: Path) -> None:
    """Consolidate ``case`` (plus a rename, a drop and skipped optimizer state) and compare every file."""
    rng = np.random.default_rng(case.seed)
    w = values(rng, case.dtype, case.shape)
    norm = values(rng, case.dtype, (5,))
    first_norm = values(rng, case.dtype, (5,))  # layer 0 of the config's two, as every model has it
    tensors: dict[str, tuple[str, np.ndarray, list[Box]]] = {
        case.source(): (case.dtype, w, boxes(case.shape, case.row_cuts, case.col_cuts)),
        "blocks.1.norm": (case.dtype, norm, [((0,), (2,)), ((2,), (3,))]),
        "blocks.0.norm": (case.dtype, first_norm, [((0,), (5,))]),
        "blocks.1.bias_E": ("F32", values(rng, "F32", (3,)), [((0,), (3,))]),
        "optimizer.state.blocks.1.norm.exp_avg": ("F32", values(rng, "F32", (5,)), [((0,), (5,))]),
    }
    checkpoint = write_checkpoint(work / "ckpt", tensors)
    rule_file = work / "toy.rules"
    rule_file.write_text(RULE_FILE.format(rule=case.rule()))
    assets = None
    if case.assets:
        assets = work / "assets"
        assets.mkdir()
        (assets / "config.json").write_text(json.dumps(CONFIG))
    out = work / "out"
    result = mpicons.consolidate(
        checkpoint, out, adapter=str(rule_file), hf_assets=assets, buffer_size=case.buffer_size, comm=SingleProcess()
    )
    expected = {
        **case.expected(w),
        "model.layers.0.input_layernorm.weight": first_norm,
        "model.layers.1.input_layernorm.weight": norm,
    }
    assert sorted(p.name for p in out.iterdir()) == sorted(["SHA256SUMS", OUT_FILE, INDEX, *(["config.json"] if assets else [])])
    assert_manifest(out)
    index = json.loads((out / INDEX).read_text())
    assert index["weight_map"] == {name: OUT_FILE for name in expected}
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in expected.values())
    got = safetensors.numpy.load_file(out / OUT_FILE) if case.dtype != "BF16" else None
    if got is not None:  # a readable first failure: which tensor
        for name, want in expected.items():
            assert got[name].shape == want.shape and got[name].tobytes() == want.tobytes(), name
    assert (out / OUT_FILE).read_bytes() == serialized(expected)
    if assets is not None:
        assert (out / "config.json").read_bytes() == (assets / "config.json").read_bytes()
    # Its random values are not zero: a warning names it, not the line of entries dropped on purpose.
    assert [line for line in result.warnings if "dropped blocks.1.bias_E" in line and "is not zero in 3 of 3" in line]
    assert not any("blocks.1.bias_E" in line for line in result.adapted), result.adapted
    assert any("optimizer.**" in line for line in result.adapted), result.adapted


KINDS = ("rope_to_half", "rope_to_interleaved", "unbind", "split_rows")
DTYPES = ("F32", "BF16", "F16", "I8", "F64")
#: Every (transform, dtype) pair twice; the rest of each case drawn from its seed.
SEEDS = range(2 * len(KINDS) * len(DTYPES))


def cut_points(rng: np.random.Generator, size: int, most: int = 3) -> list[int]:
    """Up to ``most`` distinct cut points inside ``(0, size)``, anywhere (not on heads, pairs or groups)."""
    if size < 2:
        return []
    count = int(rng.integers(0, min(most, size - 1) + 1))
    return sorted(int(x) for x in rng.choice(np.arange(1, size), count, replace=False))


def random_case(seed: int) -> Case:
    """Case ``seed``: its transform and dtype by the seed, its sizes, cuts, buffer and assets at random.
    Columns of 0 make a 1-d tensor (a rotary bias, a fused bias); 520 or 130 columns make a head or a
    group larger than the 4096-byte buffer."""
    rng = np.random.default_rng([19, seed])
    kind, dtype = KINDS[seed % len(KINDS)], DTYPES[seed // len(KINDS) % len(DTYPES)]
    buffer_size = int(rng.choice([4096, 1 << 20]))
    if kind.startswith("rope"):
        heads, head_dim = int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5))
        params: tuple[int, ...] = (heads, head_dim)
        columns = int(rng.choice([0, 1, 2, 3, 5, 7, 520]))
        shape: tuple[int, ...] = (heads * head_dim, columns) if columns else (heads * head_dim,)
    elif kind == "unbind":
        shape = tuple(int(x) for x in rng.integers(1, 6, int(rng.integers(2, 4))))
        if rng.random() < 0.3:
            shape = (shape[0], 130, *shape[2:])
        params = ()
    else:
        groups, sizes = int(rng.integers(1, 4)), tuple(int(x) for x in rng.integers(1, 4, int(rng.integers(2, 4))))
        params = (groups, *sizes)
        columns = int(rng.choice([0, 1, 3, 4, 130]))
        shape = (groups * sum(sizes), columns) if columns else (groups * sum(sizes),)
    col_cuts = cut_points(rng, shape[1], 2) if len(shape) > 1 else []
    return Case(kind, dtype, shape, params, cut_points(rng, shape[0]), col_cuts, buffer_size, seed, bool(rng.random() < 0.3))


def loses_a_partial_run(case: Case) -> bool:
    """Whether a piece of ``case`` has the cut a rotary box once lost rows at: with runs of ``b`` rows
    (the view's last axis: 2 for to_half, head_dim / 2 for to_interleaved), its first run boundary
    after its start is inside a head, before its end, and its end is inside a run of that head."""
    if not case.kind.startswith("rope"):
        return False
    head_dim = case.params[1]
    run = 2 if case.kind == "rope_to_half" else head_dim // 2
    points = [0, *case.row_cuts, case.shape[0]]
    for start, end in zip(points, points[1:]):
        boundary = -(-start // run) * run
        head_end = -(-boundary // head_dim) * head_dim
        if boundary < end and end % run and boundary % head_dim and head_end > end:
            return True
    return False


@pytest.mark.parametrize("seed", SEEDS)
def test_transforms_match_numpy(seed: int, tmp_path: Path) -> None:
    run_case(random_case(seed), tmp_path)


def test_the_cases_cover_the_geometry() -> None:
    """The seeded cases do what they are for: cuts off heads and pairs, column cuts, 1-d tensors, big heads."""
    cases = [random_case(seed) for seed in SEEDS]
    assert {(c.kind, c.dtype) for c in cases} == {(k, d) for k in KINDS for d in DTYPES}
    rope = [c for c in cases if c.kind.startswith("rope")]
    assert any(any(x % 2 for x in c.row_cuts) for c in rope)  # inside a pair
    assert any(c.col_cuts for c in rope) and any(len(c.shape) == 1 for c in rope)
    assert any(
        c.buffer_size == 4096 and c.params[1] * math.prod(c.shape[1:]) * NUMPY_DTYPES[c.dtype].itemsize > 4096 for c in rope
    )
    assert any(c.col_cuts for c in cases if c.kind == "unbind")
    assert any(c.row_cuts and c.row_cuts[0] % sum(c.params[1:]) for c in cases if c.kind == "split_rows")
    assert any(c.assets for c in cases) and not all(c.assets for c in cases)


#: Rotary pieces cut inside a (head, pair) row group or by columns, as FSDP2 with odd row counts and
#: tensor-parallel column cuts do: boxes of the (heads, a, b, columns) view that differ only past dim 1.
ROPE_CUT_ANYWHERE = {
    "to_half, a cut inside a pair": Case("rope_to_half", "F32", (12, 5), (3, 4), [5]),
    "to_interleaved, cuts inside the halves": Case("rope_to_interleaved", "BF16", (16, 3), (2, 8), [3, 9]),
    "to_half, column cuts": Case("rope_to_half", "F16", (8, 6), (2, 4), [], [2]),
    "to_half, a 1-d bias cut at odd rows": Case("rope_to_half", "F64", (12,), (3, 4), [1, 7]),
    "to_half, heads larger than the buffer": Case("rope_to_half", "I8", (16, 600), (2, 8), [3, 11], [], 4096),
    "to_interleaved, a grid, with assets": Case("rope_to_interleaved", "F32", (24, 7), (3, 8), [5, 13], [3], 4096, 1, True),
}


@pytest.mark.parametrize("name", list(ROPE_CUT_ANYWHERE))
def test_rotary_pieces_cut_anywhere(name: str, tmp_path: Path) -> None:
    assert not loses_a_partial_run(ROPE_CUT_ANYWHERE[name])
    run_case(ROPE_CUT_ANYWHERE[name], tmp_path)


@pytest.mark.parametrize(
    "case",
    [
        Case("rope_to_half", "F32", (8, 3), (2, 4), [1, 3]),  # rows 1:3 of a 4-row head: row 2 is lost
        Case("rope_to_interleaved", "F16", (16,), (2, 8), [1, 6]),  # rows 1:6, runs of 4: rows 4 and 5 are lost
    ],
    ids=["to_half", "to_interleaved"],
)
def test_a_rotary_piece_ending_inside_a_run_of_its_head(case: Case, tmp_path: Path) -> None:
    assert loses_a_partial_run(case)
    run_case(case, tmp_path)


def test_to_interleaved_undoes_to_half(tmp_path: Path) -> None:
    """Two consolidations, the second reading the first's output (plain safetensors): the saved tensor back."""
    heads, head_dim = 3, 6
    w = values(np.random.default_rng(7), "BF16", (heads * head_dim, 4))
    numpy_half = w.reshape(heads, head_dim // 2, 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)
    back = numpy_half.reshape(heads, 2, head_dim // 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)
    assert back.tobytes() == w.tobytes()  # the two numpy references are inverses
    first = write_checkpoint(tmp_path / "ckpt", {"wq": ("BF16", w, boxes(w.shape, [2, 8], []))})
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "half.rules").write_text(f"wq q.weight rope_to_half({heads}, {head_dim})\n")
    (tmp_path / "inter.rules").write_text(f"q.weight wq rope_to_interleaved({heads}, {head_dim})\n")
    comm = SingleProcess()
    mpicons.consolidate(first, tmp_path / "half", adapter=str(tmp_path / "half.rules"), hf_assets=assets, comm=comm)
    assert (tmp_path / "half" / OUT_FILE).read_bytes() == serialized({"q.weight": numpy_half})
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes((tmp_path / "half" / OUT_FILE).read_bytes())
    mpicons.consolidate(plain, tmp_path / "back", adapter=str(tmp_path / "inter.rules"), hf_assets=assets, comm=comm)
    written = [p for p in (tmp_path / "back").iterdir() if p.name.endswith(".safetensors")]
    assert len(written) == 1
    assert written[0].read_bytes() == serialized({"wq": w})


def test_rules_without_config_need_no_assets(tmp_path: Path) -> None:
    """unbind, renames, drop and skip read no config: no --hf-assets, and nothing but the weights is written."""
    rng = np.random.default_rng(3)
    experts = values(rng, "F16", (3, 4, 5))
    embed = values(rng, "F32", (6, 4))
    tensors: dict[str, tuple[str, np.ndarray, list[Box]]] = {
        "tok_embeddings.weight": ("F32", embed, boxes(embed.shape, [1], [3])),
        "layers.0.moe.w1_EFD": ("F16", experts, boxes(experts.shape, [1], [1, 3])),
        "layers.0.moe.expert_bias_E": ("F32", values(rng, "F32", (3,)), [((0,), (3,))]),
        "optimizer.state.tok_embeddings.weight.exp_avg": ("F32", values(rng, "F32", (6, 4)), [((0, 0), (6, 4))]),
    }
    checkpoint = write_checkpoint(tmp_path / "ckpt", tensors)
    rule_file = tmp_path / "moe.rules"
    rule_file.write_text(
        "skip optimizer.**\n"
        "tok_embeddings.weight  model.embed_tokens.weight\n"
        "layers.{N}.moe.w1_EFD  model.layers.{N}.mlp.experts.{E}.gate_proj.weight  unbind(E)\n"
        "layers.{N}.moe.expert_bias_E  -  drop\n"
    )
    result = mpicons.consolidate(checkpoint, tmp_path / "out", adapter=str(rule_file), comm=SingleProcess())
    expected = {"model.embed_tokens.weight": embed}
    expected.update({f"model.layers.0.mlp.experts.{e}.gate_proj.weight": experts[e] for e in range(3)})
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["SHA256SUMS", OUT_FILE, INDEX]
    assert (tmp_path / "out" / OUT_FILE).read_bytes() == serialized(expected)
    assert result.assets == []
    assert [line for line in result.warnings if f"{rule_file}:4" in line and "layers.0.moe.expert_bias_E" in line]
    assert any("optimizer.**" in line for line in result.adapted), result.adapted


# ---------------------------------------------------------------- 5. the built-in torchtitan rules


@pytest.mark.parametrize(
    ("model_type", "rule_file"),
    [
        ("llama", "torchtitan-llama.rules"),
        ("qwen3", "torchtitan-qwen3.rules"),
        ("qwen3_moe", "torchtitan-qwen3.rules"),
        ("deepseek_v3", "torchtitan-deepseek-v3.rules"),
    ],
)
def test_the_model_type_chooses_the_rule_file(model_type: str, rule_file: str) -> None:
    assert TORCHTITAN.choose_rules({"model_type": model_type}).origin == f"torchtitan:{rule_file}"


@pytest.mark.parametrize("model_type", ["mistral", "llama4", None, ""])
def test_a_model_type_without_rules_is_refused(model_type: str | None) -> None:
    with pytest.raises(InputError) as caught:
        TORCHTITAN.choose_rules({"model_type": model_type})
    message = str(caught.value)
    assert caught.value.exit_code == 2
    assert repr(model_type) in message
    assert all(known in message for known in ("llama", "qwen3", "qwen3_moe", "deepseek_v3"))


def test_the_builtin_adapter_needs_a_config() -> None:
    with pytest.raises(InputError, match="--hf-assets"):
        TORCHTITAN.choose_rules(None)
    assert trainer("deepspeed") is None  # not a built-in adapter: a rule file's path


def test_unknown_adapter_is_a_missing_rule_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file .*built-in adapters: torchtitan, megatron"):
        mpicons.consolidate(tmp_path, tmp_path / "out", adapter="my-rules", comm=SingleProcess())
    with pytest.raises(InputError, match=r"no such file \(did you mean 'megatron'\? built-in adapters"):
        mpicons.consolidate(tmp_path, tmp_path / "out", adapter="megatorn", comm=SingleProcess())
    # A trainer whose checkpoints hold Hugging Face's names is recognised, never named.
    with pytest.raises(InputError, match="DeepSpeed ZeRO checkpoints are recognised by their files .* leave --adapter out"):
        mpicons.consolidate(tmp_path, tmp_path / "out", adapter="deepspeed", comm=SingleProcess())


#: FACTS.md §3 and §7, typed from it (not from the rule files): a deepseek_v3 layer's native names
#: (after ``layers.N.`` / ``mtp_layers.M.``) and their Hugging Face names (after ``model.layers.L.``).
DEEPSEEK_ATTENTION = {
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
DEEPSEEK_Q_LORA = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
}
DEEPSEEK_Q_PLAIN = {"attention.wq.weight": "self_attn.q_proj.weight"}
DEEPSEEK_DENSE = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
DEEPSEEK_MOE = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias_E": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
#: §5: grouped experts, one Hugging Face tensor per expert.
DEEPSEEK_EXPERTS = {
    "moe.routed_experts.inner_experts.w1_EFD": "gate_proj.weight",
    "moe.routed_experts.inner_experts.w3_EFD": "up_proj.weight",
    "moe.routed_experts.inner_experts.w2_EDF": "down_proj.weight",
}
#: §7: the MTP layer's own entries.
DEEPSEEK_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "mtp_norm.weight": "shared_head.norm.weight",
}


def deepseek_checkpoint(q_lora: bool) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Native names with small shapes (2 main layers, layer 0 dense, layer 1 and MTP layer 0 MoE with
    3 experts; optimizer state beside them) and the Hugging Face names FACTS.md states for them."""
    experts, dim, ffn = 3, 8, 4
    saved: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (16, dim), "norm.weight": (dim,), "lm_head.weight": (16, dim)}
    hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    query = DEEPSEEK_Q_LORA if q_lora else DEEPSEEK_Q_PLAIN

    def layer(native: str, layer_index: int, moe: bool, extra: dict[str, str]) -> None:
        names = {**extra, **DEEPSEEK_ATTENTION, **query, **(DEEPSEEK_MOE if moe else DEEPSEEK_DENSE)}
        for suffix, hf_suffix in names.items():
            saved[f"{native}.{suffix}"] = (experts,) if suffix.endswith("expert_bias_E") else (4, dim)
            hf.append(f"model.layers.{layer_index}.{hf_suffix}")
        if moe:
            for suffix, hf_suffix in DEEPSEEK_EXPERTS.items():
                saved[f"{native}.{suffix}"] = (experts, dim, ffn) if suffix.endswith("EDF") else (experts, ffn, dim)
                hf.extend(f"model.layers.{layer_index}.mlp.experts.{e}.{hf_suffix}" for e in range(experts))

    layer("layers.0", 0, False, {})
    layer("layers.1", 1, True, {})
    layer("mtp_layers.0", 2, True, DEEPSEEK_MTP)  # num_hidden_layers + 0
    for name in list(saved):
        if name.endswith("weight"):
            saved[f"optimizer.state.{name}.exp_avg"] = saved[name]
    return saved, hf


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora_rank>0", "q_lora_rank=0"])
def test_deepseek_v3_names_are_the_facts(q_lora: bool) -> None:
    saved, hf = deepseek_checkpoint(q_lora)
    config: dict[str, object] = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "q_lora_rank": 4 if q_lora else None}
    config["tie_word_embeddings"] = False
    rule_set = TORCHTITAN.choose_rules(config)
    conversion = plan_conversion(list(saved), list(saved.values()), [False] * len(saved), rule_set, config)
    assert sorted(conversion.names) == sorted(hf)
    assert len(conversion.names) == len(set(conversion.names))
    assert not any(".embed_tokens." in n or "shared_head.head" in n for n in conversion.names if n.startswith("model.layers."))
    assert conversion.skipped_counts() == {"optimizer.**": sum(n.startswith("optimizer.") for n in saved)}
    assert conversion.dropped_names() == set()
    kinds = {o.name: (o.kind, o.storage) for o in conversion.outputs}
    assert kinds["model.layers.2.mlp.experts.1.down_proj.weight"] == ("unbind", (8, 4))  # [E, D, F][e]: [D, F]
    assert kinds["model.layers.1.mlp.experts.2.gate_proj.weight"] == ("unbind", (4, 8))
    assert {kind for kind, _ in kinds.values()} == {"rename", "unbind"}  # no rotary permutation (§3)


def test_deepseek_v3_tied_head_is_dropped() -> None:
    saved, hf = deepseek_checkpoint(True)
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "tie_word_embeddings": True}
    conversion = plan_conversion(list(saved), list(saved.values()), [False] * len(saved), TORCHTITAN.choose_rules(config), config)
    assert sorted(conversion.names) == sorted(n for n in hf if n != "lm_head.weight")
    assert conversion.dropped_names() == {"lm_head.weight"}


def test_llama_permutes_q_and_k_with_their_head_counts() -> None:
    """FACTS.md §4: q by num_attention_heads, k by num_key_value_heads, head_dim defaulted; v as saved."""
    config = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2}
    saved = {
        "layers.0.attention.qkv_linear.wq.weight": (16, 16),
        "layers.0.attention.qkv_linear.wk.weight": (8, 16),
        "layers.0.attention.qkv_linear.wv.weight": (8, 16),
    }
    conversion = plan_conversion(list(saved), list(saved.values()), [False] * 3, TORCHTITAN.choose_rules(config), config)
    by_name = {o.name: o for o in conversion.outputs}
    q, k = by_name["model.layers.0.self_attn.q_proj.weight"], by_name["model.layers.0.self_attn.k_proj.weight"]
    assert (q.kind, q.storage) == ("rope_to_half", (4, 2, 2, 16))  # heads, head_dim/2, pairs
    assert (k.kind, k.storage) == ("rope_to_half", (2, 2, 2, 16))
    assert by_name["model.layers.0.self_attn.v_proj.weight"].kind == "rename"


# ---------------------------------------------------------------- 6. --keep-dtype


def test_keep_dtype_keeps_matching_outputs(tmp_path: Path) -> None:
    """``dtype="bf16", keep_dtype=("*norm*",)``: matched by the output name, kept as saved; the other
    floats are ml_dtypes' bfloat16 of the saved values; integers as saved."""
    rng = np.random.default_rng(11)
    saved = {
        "ln": ("F32", values(rng, "F32", (6,))),
        "norm_src.w": ("F32", values(rng, "F32", (4, 3))),  # its source name matches, its output name does not
        "up": ("F16", values(rng, "F16", (5, 3))),
        "wide": ("F64", values(rng, "F32", (4, 2)).astype(np.float64)),  # float32 values: one rounding to bf16
        "codes": ("I8", values(rng, "I8", (7,))),
        "wq": ("F32", values(rng, "F32", (8, 3))),
    }
    tensors = {name: (dtype, w, boxes(w.shape, [2, 4] if name == "wq" else [1, 3], [])) for name, (dtype, w) in saved.items()}
    checkpoint = write_checkpoint(tmp_path / "ckpt", tensors)
    rule_file = tmp_path / "names.rules"
    rule_file.write_text(
        "ln model.norm.weight\nnorm_src.w model.up.weight\nup model.gate.weight\nwide model.wide.weight\n"
        "codes model.codes\nwq model.q_norm_proj.weight rope_to_half(2, 4)\n"
    )
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "out"
    mpicons.consolidate(
        checkpoint, out, adapter=str(rule_file), hf_assets=assets, dtype="bf16", keep_dtype=("*norm*",), comm=SingleProcess()
    )
    bf16 = ml_dtypes.bfloat16
    wq = saved["wq"][1]
    expected = {
        "model.norm.weight": saved["ln"][1],
        "model.up.weight": saved["norm_src.w"][1].astype(bf16),
        "model.gate.weight": saved["up"][1].astype(bf16),
        "model.wide.weight": saved["wide"][1].astype(bf16),
        "model.codes": saved["codes"][1],
        "model.q_norm_proj.weight": wq.reshape(2, 2, 2, -1).transpose(0, 2, 1, 3).reshape(wq.shape),  # kept, permuted
    }
    assert (out / OUT_FILE).read_bytes() == serialized(expected)
    assert json.loads((out / INDEX).read_text())["metadata"]["total_size"] == sum(a.nbytes for a in expected.values())
