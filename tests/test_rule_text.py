"""Rule files that compose: ``include`` (with prefixes and arguments), ``define`` (named transform chains)
and ``[N]`` (a stacked axis or one key per index), and every built-in family file read through them.

The expansions are compared with the rules written out by hand, parsed by the same parser: a part, a
named chain or a bracket must mean exactly what its long form means.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers import load_tensors, reference_bytes, run_python
from megatron_cases import checkpoint, expected_dir, hf_assets

import mpicons
from mpicons.adaptation.rule_text import expand
from mpicons.adaptation.rules import Rule, RuleSet, parse_rules
from mpicons.comm import SingleProcess
from mpicons.core.errors import InputError
from mpicons.trainers import TRAINERS


def described(rule_set: RuleSet) -> list[tuple[str, str | None, list[str], str | None, bool]]:
    """What each rule says, in order, whatever file it was written in."""
    return [
        (
            r.source,
            r.target,
            [f"{s.kind}{sorted((k, ast.dump(v)) for k, v in s.args.items())}" for s in r.steps],
            r.condition,
            r.skip,
        )
        for r in rule_set.rules
    ]


def files(texts: dict[str, str]):  # type: ignore[no-untyped-def]
    """A resolver over named texts (the parts a test includes)."""

    def include(name: str, including: str) -> tuple[str, str]:
        if name not in texts:
            raise InputError(f"{including}: include {name!r}: no such file")
        return name, texts[name]

    return include


GATE_UP = "split_rows(groups=1, sizes=(intermediate_size, intermediate_size))"
QKV = "split_rows(groups=num_key_value_heads, sizes=(num_attention_heads // num_key_value_heads * head_dim, head_dim, head_dim))"


def test_a_bracket_is_the_stacked_rule_and_the_keyed_one() -> None:
    short = parse_rules(f"decoder.layers.[N].qkv.weight  model.layers.{{N}}.{{q|k|v}}.weight  {QKV}\n", "f")
    long = parse_rules(
        f"decoder.layers.qkv.weight  model.layers.{{N}}.{{q|k|v}}.weight  unbind(N) | {QKV}\n"
        f"decoder.layers.{{N}}.qkv.weight  model.layers.{{N}}.{{q|k|v}}.weight  {QKV}\n",
        "f",
    )
    assert described(short) == described(long)


def test_two_brackets_give_four_rules_their_unbinds_in_order() -> None:
    rules = parse_rules("a.[N].experts.[E].fc2  m.{N}.experts.{E}.down  crop_rows(4)\n", "f")
    assert [(r.source, r.kind) for r in rules.rules] == [
        ("a.experts.fc2", "unbind | unbind | crop_rows"),
        ("a.experts.{E}.fc2", "unbind | crop_rows"),
        ("a.{N}.experts.fc2", "unbind | crop_rows"),
        ("a.{N}.experts.{E}.fc2", "crop_rows"),
    ]
    assert [r.unbound for r in rules.rules] == [("N", "E"), ("N",), ("E",), ()]


def test_a_bracketed_drop_stays_a_drop_and_a_condition_stays() -> None:
    rules = parse_rules("a.[N].bias  -  drop\nb.[N].w  m.{N}.w  if tie\n", "f")
    assert [(r.source, r.kind, r.condition) for r in rules.rules] == [
        ("a.bias", "drop", None),
        ("a.{N}.bias", "drop", None),
        ("b.w", "unbind", "tie"),
        ("b.{N}.w", "rename", "tie"),
    ]


def test_an_include_with_prefixes_and_arguments_is_its_rules_written_out() -> None:
    part = "# a gated MLP\nlinear_fc1.weight  {gate|up}_proj.weight  gate_up(F)\nlinear_fc2.weight  down_proj.weight\nskip x.*\n"
    short = parse_rules(
        "define gate_up(F) = split_rows(groups=1, sizes=(F, F))\n"
        "include mlp.rules  decoder.layers.[N].mlp  model.layers.{N}.mlp  F=intermediate_size\n"
        "include mlp.rules  decoder.layers.[N].mlp.experts.[E]  model.layers.{N}.mlp.experts.{E}  F=2*moe_size\n",
        "family.rules",
        files({"mlp.rules": part}),
    )
    layers = "decoder.layers.{N}.mlp"
    long = parse_rules(
        f"decoder.layers.mlp.linear_fc1.weight  model.layers.{{N}}.mlp.{{gate|up}}_proj.weight  unbind(N) | {GATE_UP}\n"
        f"{layers}.linear_fc1.weight  model.layers.{{N}}.mlp.{{gate|up}}_proj.weight  {GATE_UP}\n"
        "decoder.layers.mlp.linear_fc2.weight  model.layers.{N}.mlp.down_proj.weight  unbind(N)\n"
        f"{layers}.linear_fc2.weight  model.layers.{{N}}.mlp.down_proj.weight\n",
        "long.rules",
    )
    got = described(short)
    assert got[:4] == described(long)[:4]
    experts = [r for r in short.rules if "experts" in r.source and not r.skip]
    assert [r.source for r in experts][:2] == [
        "decoder.layers.mlp.experts.linear_fc1.weight",
        "decoder.layers.mlp.experts.{E}.linear_fc1.weight",
    ]
    assert experts[0].kind == "unbind | unbind | split_rows"
    assert ast.unparse(experts[0].steps[-1].args["sizes"]) == "(2 * moe_size, 2 * moe_size)"
    assert short.reads_config
    # An included part's rule is named where it is written.
    assert {r.where.rpartition(":")[0] for r in short.rules} == {"mlp.rules"}


def test_skip_patterns_are_prefixed_and_bracketed() -> None:
    rules = parse_rules("include p.rules a.[N] m.{N}\n", "f", files({"p.rules": "skip x.* y.**\nw  w\n"}))
    assert [r.source for r in rules.rules if r.skip] == ["a.x.*", "a.{N}.x.*", "a.y.**", "a.{N}.y.**"]


def test_a_define_is_its_chain_and_is_checked_where_it_is_written() -> None:
    short = parse_rules(f"define qkv = {QKV}\na.w  b.{{N}}.{{q|k|v}}  unbind(N) | qkv\n", "f")
    long = parse_rules(f"a.w  b.{{N}}.{{q|k|v}}  unbind(N) | {QKV}\n", "f")
    assert described(short) == described(long)
    with pytest.raises(InputError, match=r"^f:1: .*split_rows must be the last"):
        parse_rules("define bad = split_rows(groups=1, sizes=(2, 2)) | unbind(N)\na b\n", "f")
    with pytest.raises(InputError, match=r"^f:2: gate_up needs F \(defined at f:1\)"):
        parse_rules("define gate_up(F) = split_rows(groups=1, sizes=(F, F))\na  b.{x|y}  gate_up\n", "f")
    with pytest.raises(InputError, match=r"^f:2: gate_up takes F"):
        parse_rules("define gate_up(F) = split_rows(groups=1, sizes=(F, F))\na  b.{x|y}  gate_up(1, 2)\n", "f")
    with pytest.raises(InputError, match=r"^f:1: define 'unbind': unbind is a built-in transform"):
        parse_rules("define unbind = crop_rows(2)\na b\n", "f")
    with pytest.raises(InputError, match=r"^f:2: define 'x' differs from the one at f:1"):
        parse_rules("define x = crop_rows(2)\ndefine x = crop_rows(3)\na b\n", "f")
    # The same definition again (a part included twice) is no error.
    parse_rules("define x = crop_rows(2)\ndefine x = crop_rows(2)\na b x\n", "f")


@pytest.mark.parametrize(
    ("text", "parts", "message"),
    [
        ("include p.rules\n", {"p.rules": "include p.rules\n"}, r"includes itself \(f -> p.rules -> p.rules\)"),
        ("include p.rules\n", {"p.rules": "model_type llama\na b\n"}, r"^p.rules:1: model_type belongs to the family"),
        ("include p.rules a\n", {"p.rules": "a b\n"}, r"^f:1: an include line reads"),
        ("include q.rules\n", {}, r"^f:1: include 'q.rules': no such file"),
        ("a.x[N].w  b\n", {}, r"^f:1: .*'\[NAME\]' stands alone as a dotted part"),
        ("a.[N].[N].w  b\n", {}, r"^f:1: .*each \[NAME\] appears once"),
        ("include p.rules a b F=\n", {"p.rules": "a b\n"}, r"^f:1: an include line reads"),
        ("include p.rules a.[N] m.{N}\n", {"p.rules": "w  {x|y}  split_rows(groups=1)\n"}, r"^p.rules:1: split_rows needs sizes"),
    ],
)
def test_bad_composition_names_its_line(text: str, parts: dict[str, str], message: str) -> None:
    with pytest.raises(InputError, match=message) as caught:
        parse_rules(text, "f", files(parts))
    assert caught.value.exit_code == 2


def test_rules_given_as_text_cannot_include() -> None:
    with pytest.raises(InputError, match="cannot include files"):
        expand("include p.rules\n", "f")


# ---------------------------------------------------------------- every built-in family


FAMILIES = [(trainer.name, origin) for trainer in TRAINERS.values() for origin, _ in trainer.rule_texts()]


def _example(source: str) -> str:
    """A name the source pattern matches: each capture a number, ``**`` two parts, ``*`` one."""
    return re.sub(r"\{[^{}]*\}", "7", source.replace("**", "a.b").replace("*", "x"))


def _family(trainer: str, origin: str) -> RuleSet:
    return next(s for s in TRAINERS[trainer].rule_sets() if s.origin == origin)


@pytest.mark.parametrize(("trainer", "origin"), FAMILIES)
def test_every_built_in_family_parses_and_each_rule_is_reachable(trainer: str, origin: str) -> None:
    """Every rule of a family decides the names it is written for: no earlier rule shadows it, except a
    conditional one (a tied head) before its general case, or the family's own rule overriding a part's."""
    family = _family(trainer, origin)
    assert family.model_types and family.reads_config
    for rule in family.rules:
        name = _example(rule.source)
        first: Rule = next(r for r in family.rules if r.pattern.fullmatch(name))
        overrides = first.where.startswith(f"{origin}:") and not rule.where.startswith(f"{origin}:")
        assert first is rule or first.condition is not None or overrides, (rule.where, rule.source, first.where)


def test_the_megatron_families_repeat_no_rule() -> None:
    """The family files state only what is particular to them: each line of a family file, other than
    its comments and includes, appears in no other family file."""
    folder = TRAINERS["megatron"].rule_file("megatron-llama.rules", "")[0]
    assert folder == "megatron:megatron-llama.rules"
    lines: dict[str, list[str]] = {}
    for origin, _ in TRAINERS["megatron"].rule_texts():
        text = TRAINERS["megatron"].rule_file(origin.partition(":")[2], "")[1]
        for line in text.splitlines():
            words = line.split("#", 1)[0].split()
            if words and words[0] not in ("include", "model_type"):
                lines.setdefault(" ".join(words), []).append(origin)
    assert {line: where for line, where in lines.items() if len(where) > 1} == {}


# ---------------------------------------------------------------- a user's file built from the parts


def test_a_users_rule_file_includes_built_in_parts_and_its_own(tmp_path: Path) -> None:
    """``--adapter FILE`` composes: a part beside the file, and a trainer's built-in parts by name."""
    case = "llama-tp2"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "mlp.rules").write_text(
        "include megatron:parts/gated-mlp.rules decoder.layers.[N].mlp model.layers.{N}.mlp F=intermediate_size\n"
    )
    family = tmp_path / "my-llama.rules"
    family.write_text(
        "model_type llama\n"
        "include megatron:parts/common.rules\n"
        "include megatron:parts/norms.rules  decoder.layers.[N]  model.layers.{N}\n"
        "include megatron:parts/gqa.rules    decoder.layers.[N]  model.layers.{N}\n"
        "include mine/mlp.rules\n"
    )
    out = tmp_path / "hf"
    mpicons.consolidate(checkpoint(case), out, adapter=str(family), hf_assets=hf_assets(case), comm=SingleProcess(), sync=False)
    expected = load_tensors(expected_dir(case) / "model.safetensors")
    assert (out / "model.safetensors").read_bytes() == reference_bytes(expected)


def test_a_users_include_that_is_missing_names_the_line(tmp_path: Path) -> None:
    family = tmp_path / "mine.rules"
    family.write_text("model_type llama\ninclude nowhere.rules\n")
    with pytest.raises(InputError, match=r"mine.rules:2: include 'nowhere.rules': no such file") as caught:
        mpicons.inspect(checkpoint("llama-tp2"), adapter=str(family), hf_assets=hf_assets("llama-tp2"), comm=SingleProcess())
    assert caught.value.exit_code == 2


def test_the_model_families_page_lists_the_built_in_families_and_its_command_prints_them() -> None:
    page = (Path(__file__).parent.parent / "docs" / "model-families.md").read_text()
    listed = {
        cells[1].strip("` "): sorted(t.strip("` ") for t in cells[2].split(","))
        for row in page.split("## 1.")[0].splitlines()
        if row.startswith("| `") and len(cells := row.split("|")) > 3
    }
    shipped = {name: sorted(t for s in TRAINERS[name].rule_sets() for t in s.model_types) for name in listed}
    assert listed == shipped and set(listed) == {name for name, trainer in TRAINERS.items() if trainer.has_rules()}
    command = page.split("```bash\n", 1)[1].split("\n```", 1)[0]
    proc = run_python("-c", command.split('"')[1], timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        name, *types = line.split()
        printed[name] = sorted([*printed.get(name, []), *types])
    assert printed == shipped
