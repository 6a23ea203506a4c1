"""The Megatron rules read backwards (mpicons.adaptation.inverse): the saved tensors a Hugging Face model
becomes, checked against the fixtures' saved tensors built with numpy from FACTS.md (tests/megatron_cases.py)
and against the Megatron sample's own layout, and by the forward plan giving the Hugging Face names back."""

from __future__ import annotations

import json

import numpy as np
import pytest
from megatron_cases import CASES, _arrays, hf_assets, saved_tensors, shape_of

from mpicons.adaptation.apply import plan_conversion
from mpicons.adaptation.inverse import SavedForm, SavedTensor, invert
from mpicons.core.errors import InputError
from mpicons.trainers import TRAINERS
from mpicons.trainers.megatron.sample import MegatronSampleConfig, megatron_expected_hf, megatron_hf_config, megatron_values


def materialize(saved: SavedTensor, hf: dict[str, np.ndarray]) -> np.ndarray:
    """The saved tensor filled from the Hugging Face arrays, as a writer of it would (zero elsewhere)."""
    dtype = hf[saved.fills[0].source].dtype
    rest = hf[saved.fills[0].source].shape[1:]
    out = np.zeros(saved.shape, dtype=dtype)
    rows = out.reshape(-1, *rest)
    for fill in saved.fills:
        rows[fill.row : fill.row + fill.rows] = hf[fill.source][fill.source_row : fill.source_row + fill.rows]
    return out


def inverted_case(case: str):
    facts = shape_of(case)
    config = json.loads((hf_assets(case) / "config.json").read_text())
    hf = _arrays(case)
    rules = TRAINERS["megatron"].choose_rules(config)
    # DeepSeek-V3's layers differ (dense, then MoE): one key per layer, norms as separate modules (FACTS.md §15).
    fused = ("linear_qkv.layer_norm_weight", "linear_fc1.layer_norm_weight", "up_proj.layer_norm_weight")
    form = SavedForm(frozenset({"N"}), fused) if facts["arch"] == "deepseek_v3" else SavedForm()
    padded = facts["padded_vocab"]
    result = invert({n: a.shape for n, a in hf.items()}, rules, config, lambda rows: padded, form)
    return result, hf, rules, config


@pytest.mark.parametrize("case", CASES)
def test_every_fixture_model_inverts_to_what_megatron_saved(case):
    """Every saved tensor of the Megatron-LM checkpoint, exactly, from the expected Hugging Face tensors."""
    result, hf, _, _ = inverted_case(case)
    expected = saved_tensors(case)
    got = {t.name: materialize(t, hf) for t in result.saved}
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert got[name].shape == array.shape, name
        assert got[name].tobytes() == np.ascontiguousarray(array).tobytes(), name


@pytest.mark.parametrize("case", CASES)
def test_the_forward_plan_of_the_inverse_gives_the_model_back(case):
    result, hf, rules, config = inverted_case(case)
    names = [t.name for t in result.saved]
    shapes = [t.shape for t in result.saved]
    conversion = plan_conversion(names, shapes, [False] * len(names), rules, config)
    back = {o.name: o.storage for o in conversion.outputs}
    dropped = set(result.dropped)
    assert back == {n: a.shape for n, a in hf.items() if n not in dropped}


@pytest.mark.parametrize(("tp", "tied"), [(1, False), (2, False), (2, True), (4, False)])
def test_the_megatron_sample_inverts_to_its_own_layout(tp, tied):
    """The sample writer lays a llama out by hand (its own numpy); the rules read backwards agree, the
    vocabulary padding rows aside (the sample fills them; a conversion leaves them zero)."""
    c = MegatronSampleConfig(tp=tp, tied=tied, layers=2, query_groups=4)
    hf = dict(megatron_expected_hf(c))
    if tied:  # saved by transformers anyway: the rules drop it (Megatron keeps the embedding only)
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    rules = TRAINERS["megatron"].choose_rules(megatron_hf_config(c))
    result = invert({n: a.shape for n, a in hf.items()}, rules, megatron_hf_config(c), lambda rows: c.padded_vocab)
    got = {t.name: materialize(t, hf) for t in result.saved}
    seen = set()
    for key, layer, value in megatron_values(c):
        seen.add(key)
        mine = got[key] if layer is None else got[key][layer]
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert mine.shape == value.shape and not mine[c.vocab :].any()
            mine, value = mine[: c.vocab], value[: c.vocab]
        assert mine.tobytes() == value.tobytes(), (key, layer)
    assert seen == set(got)
    assert result.dropped == (("lm_head.weight",) if tied else ())


def test_a_missing_layer_tensor_is_named():
    c = MegatronSampleConfig(tp=1, pp=1, layers=3)
    shapes = {n: a.shape for n, a in megatron_expected_hf(c)}
    del shapes["model.layers.1.self_attn.k_proj.weight"]
    rules = TRAINERS["megatron"].choose_rules(megatron_hf_config(c))
    with pytest.raises(InputError, match=r"linear_qkv.weight.*N=1 \(part 2 of 3\).*is it complete"):
        invert(shapes, rules, megatron_hf_config(c))


def test_a_tensor_no_rule_gives_is_named():
    c = MegatronSampleConfig(tp=1, pp=1, layers=1)
    shapes = {n: a.shape for n, a in megatron_expected_hf(c)} | {"model.vision_tower.weight": (4, 4)}
    rules = TRAINERS["megatron"].choose_rules(megatron_hf_config(c))
    with pytest.raises(InputError, match="no rule gives 'model.vision_tower.weight'"):
        invert(shapes, rules, megatron_hf_config(c))


def test_a_shape_the_config_does_not_imply_is_named():
    c = MegatronSampleConfig(tp=1, pp=1, layers=1)
    shapes = {n: a.shape for n, a in megatron_expected_hf(c)}
    shapes["model.layers.0.mlp.up_proj.weight"] = (c.ffn + 1, c.hidden)
    rules = TRAINERS["megatron"].choose_rules(megatron_hf_config(c))
    with pytest.raises(InputError, match=r"up_proj.weight' has shape \[353, 128\]"):
        invert(shapes, rules, megatron_hf_config(c))
