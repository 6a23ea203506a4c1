"""The Megatron-Core rule files (``mpicons/trainers/megatron/rules/``) on Megatron-shaped checkpoints.

Each case starts from a tiny model transformers builds and saves (its names and shapes are the
library's own; its values are replaced by random ones, norms included, so a mix-up shows). The
test lays those tensors out as Megatron-Core saves them, from the facts of
``tests/fixtures/megatron/FACTS.md`` alone: stacked on a layer (and expert) axis or one key per
layer / per expert, fused QKV by query group, fc1 as [gate; up] (or its ``_w``/``_v`` halves), the
vocabulary padded with random rows, cut as tensor parallelism cuts them. Consolidated with the
family's rule file, the output must be safetensors' serialization of the Hugging Face tensors.

The fixtures written by Megatron-LM itself are checked by name and shape: their ``.metadata`` read
with torch's own DCP reader (skipped without torch), mapped by the rules, against ``expected/``.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from helpers import cli
from test_adapter_rules import OUT_FILE, Box, serialized, write_checkpoint

import mpicons
from mpicons.adaptation.apply import plan_conversion
from mpicons.adaptation.rules import RuleSet, parse_rules
from mpicons.comm import SingleProcess

RULES = Path(__file__).parent.parent / "mpicons" / "trainers" / "megatron" / "rules"
FIXTURES = Path(__file__).parent / "fixtures" / "megatron"
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
#: Megatron's padding multiple here (make_vocab_size_divisible_by x TP): vocab 100 becomes 128.
VOCAB, PADDED = 100, 128


def rule_file(model_type: str) -> Path:
    return RULES / f"megatron-{model_type}.rules"


def rule_set_of(model_type: str) -> RuleSet:
    """The family's rule file parsed, its includes read beside it (as ``--adapter FILE`` reads them)."""

    def include(name: str, including: str) -> tuple[str, str]:
        path = Path(including).parent / name
        return str(path), path.read_text()

    return parse_rules(rule_file(model_type).read_text(), str(rule_file(model_type)), include)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_rule_file_parses_for_its_model_type(model_type: str) -> None:
    rule_set = rule_set_of(model_type)
    assert rule_set.model_types == (model_type,)
    assert rule_set.reads_config


# ---------------------------------------------------------------- Megatron-shaped checkpoints


@dataclass(frozen=True)
class Case:
    """One family in one on-disk layout.

    ``layers``: ``stacked`` ([L, ...] keys), ``per_layer`` (``decoder.layers.N.`` keys, experts stacked
    [E, ...]) or ``singleton`` (per layer, experts one key each, fc1 as ``_w``/``_v``). ``norm``: where the
    MoE layers' post-attention norm is (``local``: fc1's layer_norm_weight; ``te``: pre_mlp_layernorm).
    """

    model_type: str
    layers: str = "stacked"
    norm: str = "local"
    tied: bool = False
    bias: bool = False
    dense_layer: bool = False  # qwen3_moe: layer 1 is dense (mlp_only_layers)
    expert_bias: bool = False  # an aux-loss-free router's expert_bias, which Hugging Face has no place for
    tied_head_saved: bool = False  # tied, yet output_layer saved (Megatron-LM 0.16 saves none): dropped


CASES = {
    "llama": Case("llama"),
    "llama, biases, one key per layer": Case("llama", "per_layer", bias=True),
    "llama, singleton fc1 halves": Case("llama", "singleton"),
    "qwen3, tied": Case("qwen3", tied=True),
    "qwen3, one key per layer": Case("qwen3", "per_layer"),
    "qwen3_moe, local spec": Case("qwen3_moe"),
    "qwen3_moe, TE spec, expert_bias": Case("qwen3_moe", norm="te", expert_bias=True),
    "qwen3_moe, per layer, a dense layer": Case("qwen3_moe", "per_layer", dense_layer=True),
    "qwen3_moe, singleton experts": Case("qwen3_moe", "singleton", norm="te", dense_layer=True),
    "mixtral": Case("mixtral", norm="te"),
    "mixtral, singleton experts, tied": Case("mixtral", "singleton", tied=True, tied_head_saved=True),
}


def hf_model(case: Case, directory: Path) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """A tiny model of the family, saved by transformers: its config and its tensors with random values.
    head_dim 16 with hidden 32 and 4 heads: q's rows (64) differ from hidden_size."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=case.tied, intermediate_size=40,
    )  # fmt: skip
    if case.model_type == "llama":
        config = transformers.LlamaConfig(**common, attention_bias=case.bias, mlp_bias=case.bias)
    elif case.model_type == "qwen3":
        config = transformers.Qwen3Config(**common)
    elif case.model_type == "qwen3_moe":
        dense = [1] if case.dense_layer else []
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=dense
        )
    else:
        config = transformers.MixtralConfig(**{**common, "intermediate_size": 24}, num_local_experts=4, num_experts_per_tok=2)
    model = getattr(transformers, FAMILIES[case.model_type])(config)
    model.save_pretrained(directory)
    saved = safetensors.numpy.load_file(directory / "model.safetensors")
    rng = np.random.default_rng(list(CASES.values()).index(case))
    tensors = {name: rng.standard_normal(a.shape).astype(np.float32) for name, a in sorted(saved.items())}
    (directory / "model.safetensors").unlink()  # the assets: config.json and generation_config.json
    return json.loads((directory / "config.json").read_text()), tensors


def grid(shape: tuple[int, ...], cuts: dict[int, list[int]]) -> list[Box]:
    """The boxes of ``shape`` cut at ``cuts[dim]`` along each dim."""
    spans = [list(zip([0, *cuts.get(d, [])], [*cuts.get(d, []), size])) for d, size in enumerate(shape)]
    return [(tuple(a for a, _ in box), tuple(b - a for a, b in box)) for box in itertools.product(*spans)]


def tensor_parallel_cuts(kind: str, shape: tuple[int, ...], lead: int) -> dict[int, list[int]]:
    """Where Megatron's pieces end: one layer (and expert) each along the ``lead`` stacked dims; two
    tensor-parallel ranks on dim 0 (column parallel: QKV, router, embedding), on the last dim (row
    parallel: proj, fc2), or fc1's four chunks (each rank's gate rows, then its up rows)."""
    cuts = {d: list(range(1, shape[d])) for d in range(lead)}
    rows = shape[lead] if len(shape) > lead else 0
    if kind == "column":
        cuts[lead] = [rows // 2]
    elif kind == "fc1":
        cuts[lead] = [rows // 4, rows // 2, 3 * rows // 4]
    elif kind == "row":
        cuts[len(shape) - 1] = [shape[-1] // 2]
    return cuts


def fused_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, groups: int) -> np.ndarray:
    """FACTS.md section 5: per query group, its q heads' rows, then its k head, then its v head."""
    qs, ks, vs = np.split(q, groups), np.split(k, groups), np.split(v, groups)
    return np.concatenate([np.concatenate([qs[g], ks[g], vs[g]]) for g in range(groups)])


class Megatron:
    """A Megatron-Core state dict under construction: per-layer entries gathered, then stacked or not."""

    def __init__(self, case: Case, layers: int) -> None:
        self.case, self.layers = case, layers
        self.per_layer: dict[str, list[tuple[np.ndarray, str, int]]] = {}
        self.tensors: dict[str, tuple[str, np.ndarray, list[Box]]] = {}

    def add(self, name: str, full: np.ndarray, cuts: dict[int, list[int]]) -> None:
        self.tensors[name] = ("F32", full, grid(full.shape, cuts))

    def whole(self, name: str, full: np.ndarray, kind: str = "") -> None:
        self.add(name, full, tensor_parallel_cuts(kind, full.shape, 0))

    def layer(self, suffix: str, i: int, full: np.ndarray, kind: str = "", experts: int = 0) -> None:
        """``full`` for layer ``i`` (stacked on an expert axis when ``experts``)."""
        if self.case.layers == "stacked":
            self.per_layer.setdefault(suffix, []).append((full, kind, experts))
        else:
            lead = 1 if experts else 0
            self.add(f"decoder.layers.{i}.{suffix}", full, tensor_parallel_cuts(kind, full.shape, lead))

    def done(self) -> dict[str, tuple[str, np.ndarray, list[Box]]]:
        for suffix, entries in self.per_layer.items():
            assert len(entries) == self.layers, suffix
            full = np.stack([e[0] for e in entries])
            lead = 2 if entries[0][2] else 1
            self.add(f"decoder.layers.{suffix}", full, tensor_parallel_cuts(entries[0][1], full.shape, lead))
        return self.tensors


Layer = dict[str, np.ndarray]  # one Hugging Face layer's tensors, by the name after ``model.layers.N.``


def megatron_checkpoint(
    case: Case, config: dict[str, object], hf: dict[str, np.ndarray], rng: np.random.Generator
) -> dict[str, tuple[str, np.ndarray, list[Box]]]:
    """``hf`` laid out as Megatron-Core saves it (FACTS.md sections 4-8, 11), for ``case``'s layout."""
    layers = int(str(config["num_hidden_layers"]))
    m = Megatron(case, layers)
    embedding = hf["model.embed_tokens.weight"]
    padding = rng.standard_normal((PADDED - VOCAB, embedding.shape[1])).astype(np.float32)
    m.whole("embedding.word_embeddings.weight", np.concatenate([embedding, padding]), "column")
    if not case.tied or case.tied_head_saved:
        # Megatron keeps a tied head a copy of the embeddings, padded rows too (they are all-reduced together).
        head, head_padding = (embedding, padding) if case.tied else (hf["lm_head.weight"], padding[::-1])
        m.whole("output_layer.weight", np.concatenate([head, head_padding]), "column")
    m.whole("decoder.final_layernorm.weight", hf["model.norm.weight"])
    m.whole("optimizer.state.exp_avg.decoder.final_layernorm.weight", hf["model.norm.weight"])
    for i in range(layers):
        prefix = f"model.layers.{i}."
        layer = {name[len(prefix) :]: a for name, a in hf.items() if name.startswith(prefix)}
        attention(m, case, i, layer, int(str(config["num_key_value_heads"])))
        norm = layer["post_attention_layernorm.weight"]
        if "mlp.gate_proj.weight" in layer:  # a dense layer
            m.layer("mlp.linear_fc1.layer_norm_weight", i, norm)
            dense_mlp(m, case, i, layer)
            continue
        m.layer("pre_mlp_layernorm.weight" if case.norm == "te" else "mlp.linear_fc1.layer_norm_weight", i, norm)
        router = layer["block_sparse_moe.gate.weight" if case.model_type == "mixtral" else "mlp.gate.weight"]
        m.layer("mlp.router.weight", i, router, "column")
        if case.expert_bias:
            m.layer("mlp.router.expert_bias", i, rng.standard_normal(router.shape[0]).astype(np.float32))
        experts(m, case, i, layer, router.shape[0])
    return m.done()


def attention(m: Megatron, case: Case, i: int, layer: Layer, groups: int) -> None:
    m.layer("self_attention.linear_qkv.layer_norm_weight", i, layer["input_layernorm.weight"])
    for kind in ("weight", "bias") if case.bias else ("weight",):
        q, k, v = (layer[f"self_attn.{x}_proj.{kind}"] for x in "qkv")
        m.layer(f"self_attention.linear_qkv.{kind}", i, fused_qkv(q, k, v, groups), "column")
        m.layer(f"self_attention.linear_proj.{kind}", i, layer[f"self_attn.o_proj.{kind}"], "row" if kind == "weight" else "")
    if case.model_type.startswith("qwen3"):
        m.layer("self_attention.q_layernorm.weight", i, layer["self_attn.q_norm.weight"])
        m.layer("self_attention.k_layernorm.weight", i, layer["self_attn.k_norm.weight"])


def dense_mlp(m: Megatron, case: Case, i: int, layer: Layer) -> None:
    for kind in ("weight", "bias") if case.bias else ("weight",):
        gate, up = layer[f"mlp.gate_proj.{kind}"], layer[f"mlp.up_proj.{kind}"]
        if case.layers == "singleton" and kind == "weight":
            m.layer("mlp.linear_fc1.weight_w", i, gate, "column")
            m.layer("mlp.linear_fc1.weight_v", i, up, "column")
        else:
            m.layer(f"mlp.linear_fc1.{kind}", i, np.concatenate([gate, up]), "fc1")
        m.layer(f"mlp.linear_fc2.{kind}", i, layer[f"mlp.down_proj.{kind}"], "row" if kind == "weight" else "")


def experts(m: Megatron, case: Case, i: int, layer: Layer, count: int) -> None:
    """Qwen3-MoE's gate/up/down_proj or Mixtral's w1/w3/w2, per expert: stacked [E, ...] or one key each."""
    prefix, (gate, up, down) = "mlp.experts", ("gate_proj", "up_proj", "down_proj")
    if case.model_type == "mixtral":
        prefix, (gate, up, down) = "block_sparse_moe.experts", ("w1", "w3", "w2")
    fc1 = [np.concatenate([layer[f"{prefix}.{e}.{gate}.weight"], layer[f"{prefix}.{e}.{up}.weight"]]) for e in range(count)]
    fc2 = [layer[f"{prefix}.{e}.{down}.weight"] for e in range(count)]
    if case.layers != "singleton":
        m.layer("mlp.experts.experts.linear_fc1.weight", i, np.stack(fc1), "fc1", experts=count)
        m.layer("mlp.experts.experts.linear_fc2.weight", i, np.stack(fc2), "row", experts=count)
        return
    for e in range(count):
        if e % 2:  # singleton_local_shards' _w / _v halves
            m.layer(f"mlp.experts.experts.{e}.linear_fc1.weight_w", i, layer[f"{prefix}.{e}.{gate}.weight"], "column")
            m.layer(f"mlp.experts.experts.{e}.linear_fc1.weight_v", i, layer[f"{prefix}.{e}.{up}.weight"], "column")
        else:  # or fc1 whole
            m.layer(f"mlp.experts.experts.{e}.linear_fc1.weight", i, fc1[e], "fc1")
        m.layer(f"mlp.experts.experts.{e}.linear_fc2.weight", i, fc2[e], "row")


def build(case: Case, work: Path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """The case's checkpoint and assets directory, and the Hugging Face tensors the output must hold."""
    assets = work / "assets"
    config, hf = hf_model(case, assets)
    tensors = megatron_checkpoint(case, config, hf, np.random.default_rng(7))
    return write_checkpoint(work / "ckpt", tensors), assets, hf


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_layouts_become_the_hugging_face_model(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    checkpoint, assets, hf = build(case, tmp_path)
    out = tmp_path / "out"
    result = mpicons.consolidate(
        checkpoint, out, adapter=str(rule_file(case.model_type)), hf_assets=assets, buffer_size=4096, comm=SingleProcess()
    )
    assert (out / OUT_FILE).read_bytes() == serialized(hf)
    assert any("optimizer.**" in line for line in result.adapted), result.adapted
    assert any("dropped output_layer.weight" in line for line in result.adapted) == case.tied_head_saved
    # A routing bias that is not zero is lost by the Hugging Face model: a warning naming it.
    assert any("expert_bias" in line for line in result.warnings) == case.expert_bias, result.warnings
    # A tied output layer saved beside the embeddings repeats them: compared, and equal, so no warning.
    assert not any("output_layer" in line for line in result.warnings), result.warnings


@pytest.mark.parametrize(("name", "ranks"), [("qwen3_moe, TE spec, expert_bias", 3), ("llama, biases, one key per layer", 2)])
def test_megatron_layouts_at_several_ranks(name: str, ranks: int, tmp_path: Path) -> None:
    case = CASES[name]
    checkpoint, assets, hf = build(case, tmp_path)
    out = tmp_path / "out"
    adapter = rule_file(case.model_type)
    proc, _ = cli(
        ranks,
        "consolidate",
        checkpoint,
        out,
        "--adapter",
        adapter,
        "--hf-assets",
        assets,
        "--buffer-size",
        "4096",
        "-q",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / OUT_FILE).read_bytes() == serialized(hf)


# ---------------------------------------------------------------- the fixtures Megatron-LM wrote

FIXTURE_FAMILIES = {"llama-tp2": "llama", "qwen3-pp2": "qwen3", "qwen3moe-ep2": "qwen3_moe"}


@pytest.mark.parametrize("fixture", list(FIXTURE_FAMILIES))
def test_the_fixtures_names_and_shapes_map_to_expected(fixture: str) -> None:
    """Each tensor of the ``.metadata`` torch reads, through the rules, is a tensor of ``expected/``
    with its shape; nothing is left over; the non-tensor entries are bytes items the rules never see."""
    pytest.importorskip("torch")
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    folder = FIXTURES / fixture
    metadata = FileSystemReader(str(folder / "checkpoint" / "iter_0000010")).read_metadata()
    saved = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    non_tensors = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    assert non_tensors and all("_extra_state" in k for k in non_tensors)
    config = json.loads((folder / "hf" / "config.json").read_text())
    model_type = FIXTURE_FAMILIES[fixture]
    rule_set = rule_set_of(model_type)
    conversion = plan_conversion(list(saved), list(saved.values()), [False] * len(saved), rule_set, config)
    with safetensors.safe_open(folder / "expected" / "model.safetensors", "numpy") as handle:
        expected = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
    assert {o.name: o.storage for o in conversion.outputs} == expected
    assert conversion.dropped == ()


def test_the_documented_megatron_rules_are_the_shipped_ones() -> None:
    """docs/adapter-rules.md's Megatron example: every rule line it shows is a line of a shipped file."""
    docs = (Path(__file__).parent.parent / "docs" / "adapter-rules.md").read_text()
    section = docs.split("## The second worked example: Megatron-Core", 1)[1].split("\n## ", 1)[0]
    shown = [line for block in section.split("```text\n")[1:] for line in block.split("```", 1)[0].splitlines() if line]
    shipped = {" ".join(line.split()) for path in RULES.rglob("*.rules") for line in path.read_text().splitlines()}
    assert len(shown) > 15
    assert [line for line in shown if " ".join(line.split()) not in shipped] == []
