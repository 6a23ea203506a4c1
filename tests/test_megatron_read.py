"""Reading Megatron-Core ``torch_dist`` checkpoints as they are (tests/fixtures/megatron, written by
Megatron-LM's own ``save_checkpoint``), without depending on the built-in Megatron rules.

What each saved tensor must hold is restated from FACTS.md with numpy (``megatron_cases``); a rule file
that keeps every saved name lets the consolidated tensors be compared with it. Also: the inputs a user
may give (a run's directory, an iteration's, NeMo 2's layout), the allow-lists of ``.metadata`` and
``common.pt`` and what they still refuse, and the config derived from the run's args or checked
against them.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
from helpers import load_tensors, reference_bytes, run_python
from megatron_cases import (
    CASES,
    ITERATION,
    as_tensors,
    checkpoint,
    copy_run,
    hf_assets,
    identity_rules,
    iteration_dir,
    saved_tensors,
    shape_of,
    verify_record,
)

import mpicons
from mpicons.comm import SingleProcess
from mpicons.core.errors import InputError
from mpicons.formats.distcp_metadata import read_metadata
from mpicons.io.places import LocalPlace
from mpicons.trainers import recognise
from mpicons.trainers.megatron.config import FAMILIES, check_config, derive_config
from mpicons.trainers.megatron.files import METADATA_ALLOW, read_common

SCRIPTS = Path(__file__).parent / "scripts"


def rules_for(case: str, directory: Path) -> Path:
    path = directory / f"{case}-identity.rules"
    path.write_text(identity_rules(sorted(saved_tensors(case))))
    return path


def consolidate(source: Path, out: Path, **options: object) -> mpicons.ConsolidateResult:
    return mpicons.consolidate(source, out, comm=SingleProcess(), sync=False, **options)


def assert_saved(out: Path, case: str) -> None:
    """The output holds every saved tensor as FACTS.md says Megatron saved it, in the serializer's bytes."""
    want = as_tensors(saved_tensors(case))
    assert load_tensors(out / "model.safetensors") == want
    assert (out / "model.safetensors").read_bytes() == reference_bytes(want)


# ---------------------------------------------------------------- .metadata and its allow-list


@pytest.mark.parametrize("case", CASES)
def test_megatron_metadata_is_refused_without_its_allow_list(case: str) -> None:
    with pytest.raises(InputError, match=r"torch\.distributed\.checkpoint\.planner\.SavePlan.*refused without running") as caught:
        read_metadata(str(iteration_dir(case) / ".metadata"))
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("case", CASES)
def test_megatron_metadata_reads_with_its_allow_list(case: str) -> None:
    """The tensors and non-tensor items are those torch's own reader found (the fixture's record)."""
    table = read_metadata(str(iteration_dir(case) / ".metadata"), METADATA_ALLOW)
    record = verify_record(case)
    assert table.names == sorted(record["dcp_tensor_keys"])
    assert table.skipped == sorted(record["dcp_nontensor_keys"])
    shapes = {name: list(array.shape) for name, array in saved_tensors(case).items()}
    assert {n: [int(x) for x in table.size[t][: table.ndim[t]]] for t, n in enumerate(table.names)} == shapes


def _text(value: str) -> bytes:
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


PLANNER = "torch.distributed.checkpoint.planner"
#: Pickles that must not get past the allow-list (given the marker file a command would create), with
#: what the refusal says.
HOSTILE = {
    "os.system": (lambda marker: _global("posix", "system") + _text(f"touch {marker}") + b"\x85R", "posix.system"),
    "an allowed record called": (
        lambda marker: _global(PLANNER, "SavePlan") + _text(f"touch {marker}") + b"\x85R",
        "not a readable pickle",
    ),
    "state on an allowed class": (
        lambda marker: _global(PLANNER, "WriteItem") + b"}" + _text("kind") + _text("x") + b"sb",
        "not a readable pickle",
    ),
    "state on an enum member": (
        lambda marker: _global(PLANNER, "WriteItemType") + b"K\x02\x85R}" + _text("value") + b"K\x01sb",
        "sets state",
    ),
    "an enum of a list": (lambda marker: _global(PLANNER, "WriteItemType") + b"]\x85R", "WriteItemType of"),
    "common.pt's class in .metadata": (lambda marker: _global("argparse", "Namespace") + b")\x81", "argparse.Namespace"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_allow_list_lets_nothing_else_run(case: str, tmp_path: Path) -> None:
    """With Megatron's allow-list: an unknown class is refused by name, an allowed one cannot be called,
    changed or given state; nothing the pickle names runs; a good checkpoint reads as before."""
    marker = tmp_path / "ran"
    body, phrase = HOSTILE[case]
    path = tmp_path / ".metadata"
    path.write_bytes(b"\x80\x02" + body(marker) + b".")
    with pytest.raises(InputError, match=phrase) as caught:
        read_metadata(str(path), METADATA_ALLOW)
    assert caught.value.exit_code == 2 and not marker.exists()
    table = read_metadata(str(iteration_dir(CASES[0]) / ".metadata"), METADATA_ALLOW)
    assert table.names == sorted(verify_record(CASES[0])["dcp_tensor_keys"])


def test_an_unknown_class_in_megatron_metadata_is_exit_2_naming_it(tmp_path: Path) -> None:
    """A save plan class of a name no allow-list holds (same length, so the pickle stays valid): refused by name."""
    run = copy_run(CASES[0], tmp_path / "run")
    metadata = run / ITERATION / ".metadata"
    data = metadata.read_bytes()
    assert data.count(b"\x8c\x08SavePlan") == 1
    metadata.write_bytes(data.replace(b"\x8c\x08SavePlan", b"\x8c\x08SaveBomb"))
    rules = rules_for(CASES[0], tmp_path)
    proc = run_python("-m", "mpicons", "consolidate", run, tmp_path / "out", "--adapter", rules, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "torch.distributed.checkpoint.planner.SaveBomb" in proc.stderr and "Megatron-Core" in proc.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.safetensors"))


# ---------------------------------------------------------------- what is read: every saved tensor


@pytest.mark.parametrize("case", CASES)
def test_every_saved_tensor_is_read_as_megatron_saved_it(case: str, tmp_path: Path) -> None:
    """Through a rule file that keeps the saved names: the stacked, fused, padded tensors of FACTS.md;
    the ``_extra_state`` byte items skipped and reported; the run's iteration said."""
    out = tmp_path / "out"
    result = consolidate(checkpoint(case), out, adapter=str(rules_for(case, tmp_path)))
    assert_saved(out, case)
    assert result.skipped == sorted(verify_record(case)["dcp_nontensor_keys"])
    assert all("_extra_state/shard_" in name for name in result.skipped)
    assert any("iteration 10" in note and ITERATION in note for note in result.input_notes), result.input_notes


@pytest.mark.parametrize("given", ["run", "iteration", "release"])
def test_the_inputs_a_megatron_user_gives(given: str, tmp_path: Path) -> None:
    case = CASES[1]
    run = copy_run(case, tmp_path / "run")
    if given == "release":
        (run / ITERATION).rename(run / "release")
        (run / "latest_checkpointed_iteration.txt").write_text("release")
    source = run / ITERATION if given == "iteration" else run
    result = consolidate(source, tmp_path / "out", adapter=str(rules_for(case, tmp_path)))
    assert_saved(tmp_path / "out", case)
    said = {"run": "iteration 10 (named by", "iteration": "iteration 10:", "release": "the release checkpoint"}[given]
    assert any(said in note for note in result.input_notes), result.input_notes


def _tracker(run: Path, text: str) -> None:
    (run / "latest_checkpointed_iteration.txt").write_text(text)


BROKEN_RUNS = {
    "tracker holds garbage": (lambda run: _tracker(run, "ten"), "neither an iteration number nor 'release'"),
    "tracker names a missing iteration": (lambda run: _tracker(run, "20"), "iteration 20, but"),
    "no tracker": (lambda run: (run / "latest_checkpointed_iteration.txt").unlink(), "no latest_checkpointed_iteration.txt"),
    "legacy torch format": (
        lambda run: (shutil.rmtree(run / ITERATION), (run / ITERATION / "mp_rank_00").mkdir(parents=True)),
        "legacy 'torch' format",
    ),
    "another backend": (
        lambda run: (run / ITERATION / "metadata.json").write_text('{"sharded_backend": "zarr"}'),
        "'zarr' backend",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_RUNS))
def test_a_broken_run_directory_is_bad_input_naming_it(case: str, tmp_path: Path) -> None:
    run = copy_run(CASES[0], tmp_path / "run")
    damage, phrase = BROKEN_RUNS[case]
    damage(run)
    with pytest.raises(InputError, match=phrase) as caught:
        consolidate(run, tmp_path / "out")
    assert caught.value.exit_code == 2 and not (tmp_path / "out").exists()


def test_a_plain_dcp_checkpoint_is_no_trainers(tmp_path: Path) -> None:
    plain = Path(__file__).parent / "fixtures" / "distcp"
    assert all(recognise(LocalPlace(str(path / "dcp"))) is None for path in plain.iterdir() if (path / "dcp").is_dir())


# ---------------------------------------------------------------- layouts no fixture holds, written by torch's DCP

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch writes these checkpoints")


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Megatron-LM run with optimizer state (llama) and a NeMo 2 step directory (qwen3_moe)."""
    made = {}
    for kind, case in (("optimizer", CASES[0]), ("nemo", CASES[2])):
        out = tmp_path_factory.mktemp(kind) / "ckpt"
        proc = run_python(SCRIPTS / "megatron_variants.py", iteration_dir(case), out, kind, timeout=300)
        assert proc.returncode == 0, proc.stderr
        made[kind] = out
    return made


@needs_torch
def test_optimizer_state_is_skipped_and_counted(variants: dict[str, Path], tmp_path: Path) -> None:
    case = CASES[0]
    result = consolidate(variants["optimizer"], tmp_path / "out", adapter=str(rules_for(case, tmp_path)))
    assert_saved(tmp_path / "out", case)
    count = 2 * len(saved_tensors(case))  # exp_avg and exp_avg_sq of every tensor
    assert any(f"skipped {count} " in line and "optimizer.**" in line for line in result.adapted), result.adapted
    assert any("iteration 20" in note for note in result.input_notes)


@needs_torch
@pytest.mark.parametrize("given", ["step", "weights"])
def test_nemo2_names_lose_their_module_prefix(variants: dict[str, Path], given: str, tmp_path: Path) -> None:
    case = CASES[2]
    source = variants["nemo"] if given == "step" else variants["nemo"] / "weights"
    result = consolidate(source, tmp_path / "out", adapter=str(rules_for(case, tmp_path)), hf_assets=hf_assets(case))
    assert_saved(tmp_path / "out", case)
    assert any("NeMo 2" in note and "'module.'" in note for note in result.input_notes), result.input_notes
    assert any("optimizer.**" in line for line in result.adapted)


@needs_torch
def test_nemo2_without_assets_asks_for_them(variants: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(InputError, match="context/.*--hf-assets"):
        consolidate(variants["nemo"], tmp_path / "out")


# ---------------------------------------------------------------- common.pt


@pytest.mark.parametrize("case", CASES)
def test_common_pt_gives_the_args_and_the_iteration(case: str) -> None:
    run = read_common(LocalPlace(str(iteration_dir(case))))
    facts = shape_of(case)
    assert run.iteration == 10
    assert run.args is not None
    fields = {"hidden_size": "hidden", "num_layers": "layers", "num_attention_heads": "heads"}
    if "kv_lora" in facts:  # multi-latent attention: its ranks and widths (FACTS.md §15), no query groups
        fields.update(q_lora_rank="q_lora", kv_lora_rank="kv_lora", qk_head_dim="qk_nope", qk_pos_emb_head_dim="qk_rope",
                      v_head_dim="v_head")  # fmt: skip
    else:
        fields.update(num_query_groups="kv", kv_channels="head_dim")
    assert {k: run.args[k] for k in fields} == {k: facts[v] for k, v in fields.items()}
    assert run.args["padded_vocab_size"] == facts["padded_vocab"]


def _hostile_common(directory: Path, marker: Path) -> None:
    body = _global("posix", "system") + _text(f"touch {marker}") + b"\x85R"
    with zipfile.ZipFile(directory / "common.pt", "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("common/data.pkl", b"\x80\x02" + body + b".")
        archive.writestr("common/version", "3\n")


def test_a_hostile_common_pt_runs_nothing(tmp_path: Path) -> None:
    """Without assets it is bad input naming the class; with them, a note that the config went unchecked."""
    case = CASES[0]
    run = copy_run(case, tmp_path / "run")
    marker = tmp_path / "ran"
    _hostile_common(run / ITERATION, marker)
    with pytest.raises(InputError, match=r"posix\.system.*refused without running anything"):
        consolidate(run, tmp_path / "out", adapter=str(rules_for(case, tmp_path)))
    result = consolidate(run, tmp_path / "out", adapter=str(rules_for(case, tmp_path)), hf_assets=hf_assets(case))
    assert_saved(tmp_path / "out", case)
    assert any("posix.system" in note and "not checked" in note for note in result.input_notes), result.input_notes
    assert not marker.exists()


# ---------------------------------------------------------------- the config: derived, or checked


def _args(case: str) -> dict[str, object]:
    run = read_common(LocalPlace(str(iteration_dir(case))))
    assert run.args is not None
    return dict(run.args)


@pytest.mark.parametrize("case", CASES)
def test_the_derived_config_says_what_the_models_own_says(case: str) -> None:
    derived = derive_config(_args(case), "common.pt", None)
    own = json.loads((hf_assets(case) / "config.json").read_text())
    shared = sorted(set(derived) & set(own))
    assert {k: derived[k] for k in shared} == {k: own[k] for k in shared}
    assert {"architectures", "model_type", "hidden_size", "num_hidden_layers", "num_key_value_heads",
            "rms_norm_eps", "rope_parameters", "vocab_size", "tie_word_embeddings", "dtype"} <= set(shared)  # fmt: skip
    assert ("head_dim" in derived) == ("head_dim" in own)  # Qwen2's config has none
    assert derived["torch_dtype"] == "bfloat16"
    check_config(_args(case), "common.pt", own, "config.json")  # and the model's own config agrees with the args


#: One changed field of a fixture's config, and the field the refusal must name.
DISAGREEING = {
    "llama-tp2": [
        ("hidden_size", 128), ("num_key_value_heads", 4), ("head_dim", 32), ("rms_norm_eps", 1e-5),
        ("rope_parameters", {"rope_theta": 5e5, "rope_type": "default"}), ("tie_word_embeddings", True),
        ("vocab_size", 999), ("intermediate_size", 128), ("num_hidden_layers", 2),
    ],
    "qwen3moe-ep2": [
        ("norm_topk_prob", False), ("num_experts_per_tok", 1), ("moe_intermediate_size", 64), ("num_local_experts", 8),
        ("mlp_only_layers", [1]),
    ],
}  # fmt: skip


@pytest.mark.parametrize(("case", "key", "value"), [(c, k, v) for c, fields in DISAGREEING.items() for k, v in fields])
def test_a_config_that_disagrees_with_the_run_is_refused_naming_the_field(case: str, key: str, value: object) -> None:
    config = copy.deepcopy(json.loads((hf_assets(case) / "config.json").read_text()))
    config[key] = value
    named = "rope_theta" if key == "rope_parameters" else key
    with pytest.raises(InputError, match=rf"config\.json: {named}\b.*talks nonsense") as caught:
        check_config(_args(case), "common.pt", config, "config.json")
    assert caught.value.exit_code == 2


def test_a_config_of_another_family_is_refused(tmp_path: Path) -> None:
    config = json.loads((hf_assets("qwen3-pp2") / "config.json").read_text())
    with pytest.raises(InputError, match="model_type 'llama' has no qk-norm"):
        check_config(_args("qwen3-pp2"), "common.pt", {**config, "model_type": "llama"}, "config.json")
    with pytest.raises(InputError, match="vocab_size is 2000, more rows than the checkpoint's embedding holds"):
        check_config({**_args("qwen3-pp2"), "vocab_size": None}, "common.pt", {**config, "vocab_size": 2000}, "config.json")


def test_the_cli_refuses_assets_that_disagree(tmp_path: Path) -> None:
    case = CASES[0]
    assets = tmp_path / "hf"
    shutil.copytree(hf_assets(case), assets)
    config = json.loads((assets / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    proc = run_python("-m", "mpicons", "consolidate", checkpoint(case), tmp_path / "out", "--hf-assets", assets, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "num_key_value_heads is 4" in proc.stderr and "says 2" in proc.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


ARGS_CANNOT_TELL = {
    "no vocabulary size": ({"vocab_size": None}, None, "args.vocab_size is not set.*--hf-assets"),
    "another norm": ({"normalization": "LayerNorm"}, None, "args.normalization = 'LayerNorm'"),
    "no SwiGLU": ({"swiglu": False}, None, "args.swiglu = false"),
    "rotary scaling": ({"use_rope_scaling": True}, None, "args.use_rope_scaling = true"),
    "a model type of experts": ({}, "qwen3_moe", "'qwen3_moe' is a mixture of experts, but .* no experts"),
    "an unknown model type": ({}, "gpt2", "--model-type 'gpt2'"),
}


@pytest.mark.parametrize("case", list(ARGS_CANNOT_TELL))
def test_what_the_args_cannot_tell_is_refused(case: str) -> None:
    changes, model_type, phrase = ARGS_CANNOT_TELL[case]
    with pytest.raises(InputError, match=phrase) as caught:
        derive_config({**_args("llama-tp2"), **changes}, "common.pt", model_type)
    assert caught.value.exit_code == 2


def test_model_type_decides_between_families_the_args_allow() -> None:
    """Dense without qk-norm is llama unless --model-type says otherwise; it must agree with the args."""
    assert derive_config(_args("llama-tp2"), "common.pt", None)["architectures"] == ["LlamaForCausalLM"]
    assert derive_config(_args("llama-tp2"), "common.pt", "llama")["model_type"] == "llama"
    moe = derive_config({**_args("qwen3moe-ep2"), "qk_layernorm": False}, "common.pt", None)
    assert (moe["model_type"], moe["intermediate_size"], moe["num_local_experts"]) == ("mixtral", 32, 4)
    with pytest.raises(InputError, match="has qk-norm"):
        derive_config(_args("llama-tp2"), "common.pt", "qwen3")


def test_model_type_must_agree_with_the_assets(tmp_path: Path) -> None:
    case = CASES[0]
    with pytest.raises(InputError, match="--model-type 'qwen3': config.json from --hf-assets says 'llama'"):
        consolidate(
            checkpoint(case),
            tmp_path / "out",
            adapter=str(rules_for(case, tmp_path)),
            hf_assets=hf_assets(case),
            model_type="qwen3",
        )
    with pytest.raises(InputError, match="--model-type is for"):
        consolidate(Path(__file__).parent / "fixtures" / "distcp" / "transposed" / "dcp", tmp_path / "out", model_type="llama")


# ---------------------------------------------------------------- the config of qwen2 and deepseek_v3

#: The fixtures of the families told apart by biases (qwen2) and by multi-latent attention (deepseek_v3).
NEW_FAMILIES = {"qwen2-tp2": "Qwen2ForCausalLM", "deepseekv3-ep2": "DeepseekV3ForCausalLM"}
#: Keys of a model's own config.json a derived one may leave to transformers (tests/test_megatron.py's list).
LEFT_OUT = {"bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "initializer_range",
            "attention_dropout", "hidden_act", "use_cache", "layer_types", "max_window_layers", "sliding_window",
            "use_sliding_window", "pretraining_tp", "output_router_logits", "router_aux_loss_coef", "mlp_only_layers",
            "decoder_sparse_step", "mlp_bias", "attention_bias"}  # fmt: skip


def _own_config(case: str) -> dict[str, object]:
    return json.loads((hf_assets(case) / "config.json").read_text())


@pytest.mark.parametrize("case", list(NEW_FAMILIES))
def test_the_new_families_derive_the_models_own_config(case: str) -> None:
    """Every key both have agrees, the derived one leaves out only what transformers defaults, and the
    model's own config passes the check."""
    derived, own = derive_config(_args(case), "common.pt", None), _own_config(case)
    shared = set(derived) & set(own)
    assert {k: derived[k] for k in shared} == {k: own[k] for k in shared}
    assert set(own) - set(derived) <= LEFT_OUT
    assert derived["architectures"] == [NEW_FAMILIES[case]] and derived["dtype"] == own["dtype"]
    check_config(_args(case), "common.pt", own, "config.json")


#: One changed field of a new family's config, and the field the refusal must name.
NEW_DISAGREEING = {
    "qwen2-tp2": [
        ("num_key_value_heads", 4), ("head_dim", 32), ("intermediate_size", 128), ("tie_word_embeddings", False),
        ("rms_norm_eps", 1e-5), ("num_hidden_layers", 2),
    ],
    "deepseekv3-ep2": [
        ("q_lora_rank", 64), ("q_lora_rank", None), ("kv_lora_rank", 16), ("qk_nope_head_dim", 16),
        ("qk_rope_head_dim", 8), ("head_dim", 8), ("v_head_dim", 32), ("num_key_value_heads", 1),
        ("n_routed_experts", 16), ("num_experts_per_tok", 4), ("moe_intermediate_size", 64), ("n_shared_experts", 2),
        ("first_k_dense_replace", 0), ("routed_scaling_factor", 1.0), ("n_group", 1), ("topk_group", 2),
        ("norm_topk_prob", False), ("rope_interleave", False), ("num_nextn_predict_layers", 1),
        ("intermediate_size", 64),
    ],
}  # fmt: skip


@pytest.mark.parametrize(("case", "key", "value"), [(c, k, v) for c, fields in NEW_DISAGREEING.items() for k, v in fields])
def test_a_new_familys_config_that_disagrees_is_refused_naming_the_field(case: str, key: str, value: object) -> None:
    config = {**_own_config(case), key: value}
    with pytest.raises(InputError, match=rf"config\.json: {key} is .*talks nonsense") as caught:
        check_config(_args(case), "common.pt", config, "config.json")
    assert caught.value.exit_code == 2


#: A DeepSeek-V3 config.json that leaves a key out gets transformers' default (DeepSeek-V3's own size),
#: or, for the head widths, what transformers computes from the config's other keys.
LEFT_OUT_OF_DEEPSEEK = {"n_group": "n_group is 8", "first_k_dense_replace": "first_k_dense_replace is 3",
                        "q_lora_rank": "q_lora_rank is 1536", "n_routed_experts": "n_routed_experts is 256",
                        "head_dim": None, "qk_head_dim": None, "num_key_value_heads": None}  # fmt: skip


@pytest.mark.parametrize("key", list(LEFT_OUT_OF_DEEPSEEK))
def test_a_key_left_out_of_a_deepseek_config_means_transformers_default(key: str) -> None:
    config = {k: v for k, v in _own_config("deepseekv3-ep2").items() if k != key}
    phrase = LEFT_OUT_OF_DEEPSEEK[key]
    if phrase is None:
        check_config(_args("deepseekv3-ep2"), "common.pt", config, "config.json")
        return
    with pytest.raises(InputError, match=rf"config\.json: {phrase}, but the checkpoint's run says"):
        check_config(_args("deepseekv3-ep2"), "common.pt", config, "config.json")


CONFIGS_ASKING_FOR_MORE = {
    "yarn": ("deepseekv3-ep2", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 40.0}},
             "rope_parameters.rope_type is 'yarn'"),
    "legacy rope scaling": ("qwen2-tp2", {"rope_scaling": {"type": "linear", "factor": 2.0}},
                            "rope_parameters.rope_type is 'linear'"),
    "partial rotary embeddings": ("qwen2-tp2", {"partial_rotary_factor": 0.5}, "partial_rotary_factor is 0.5"),
    "sliding-window layers": ("qwen2-tp2", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
                              "layer_types is"),
    "a model type of another attention": ("deepseekv3-ep2", {"model_type": "qwen3_moe"},
                                          "model_type 'qwen3_moe' has no multi-latent attention"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS_ASKING_FOR_MORE))
def test_a_config_asking_for_what_the_run_has_not_is_refused(name: str) -> None:
    case, changes, phrase = CONFIGS_ASKING_FOR_MORE[name]
    with pytest.raises(InputError, match=phrase) as caught:
        check_config(_args(case), "common.pt", {**_own_config(case), **changes}, "config.json")
    assert caught.value.exit_code == 2


#: Args of the DeepSeek-V3 run that its Hugging Face config cannot express: refused naming the args field.
DEEPSEEK_CANNOT_SAY = {
    "softmax routing": ({"moe_router_score_function": "softmax"}, r"args\.moe_router_score_function = 'softmax'"),
    "no expert bias": ({"moe_router_enable_expert_bias": False}, r"args\.moe_router_enable_expert_bias = false"),
    "groups scored by 3": ({"moe_router_topk": 3}, r"args\.moe_router_group_topk = 1 \(with moe_router_topk 3\)"),
    "groups scored by 1": ({"moe_router_topk": 4, "moe_router_group_topk": 4, "moe_router_num_groups": 8},
                           r"args\.moe_router_group_topk = 4 .*top moe_router_topk // moe_router_group_topk = 1"),
    "yarn": ({"rope_type": "yarn"}, r"args\.rope_type = 'yarn'.*yarn's scaling is not derived"),
    "MLA's default rope": ({"rope_type": None}, r"args\.rope_type = None \(MLA's default, 'yarn'\)"),
    "yarn's softmax scale": ({"rotary_scaling_factor": 40.0, "mscale_all_dim": 1.0}, r"args\.mscale_all_dim = 1\.0"),
    "experts first": ({"moe_layer_freq": [1, 0, 1]}, r"args\.moe_layer_freq = \[1, 0, 1\]"),
    "no shared expert": ({"moe_shared_expert_intermediate_size": None}, r"args\.moe_shared_expert_intermediate_size = None"),
    "a shared expert of 1.5 experts": ({"moe_shared_expert_intermediate_size": 48},
                                       r"args\.moe_shared_expert_intermediate_size = 48"),
    "a gated shared expert": ({"moe_shared_expert_gate": True}, r"args\.moe_shared_expert_gate = true"),
    "no latent norms": ({"qk_layernorm": False}, r"args\.qk_layernorm = false"),
    "multi-token prediction": ({"mtp_num_layers": 1}, r"args\.mtp_num_layers = 1"),
    "an MLP bias": ({"add_bias_linear": True}, r"args\.add_bias_linear = true"),
    "no experts": ({"num_experts": None}, r"'deepseek_v3' is a mixture of experts, but .* no experts"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DEEPSEEK_CANNOT_SAY))
def test_what_deepseek_v3s_config_cannot_say_is_refused(case: str) -> None:
    changes, phrase = DEEPSEEK_CANNOT_SAY[case]
    args = {**_args("deepseekv3-ep2"), **changes}
    with pytest.raises(InputError, match=phrase) as caught:
        derive_config(args, "common.pt", None)
    assert caught.value.exit_code == 2
    with pytest.raises(InputError, match=phrase):  # a config given for such a run is no better
        check_config(args, "common.pt", _own_config("deepseekv3-ep2"), "config.json")


def test_deepseek_v3_routing_and_queries_the_config_can_say() -> None:
    """No group-limited routing is one group; every group chosen scores them however; top-1 routing
    keeps its sigmoid score (Megatron renormalises only for k > 1); no q compression is q_lora_rank null."""
    args = _args("deepseekv3-ep2")
    ungrouped = derive_config({**args, "moe_router_group_topk": None}, "common.pt", None)
    assert (ungrouped["n_group"], ungrouped["topk_group"]) == (1, 1)
    every = derive_config({**args, "moe_router_group_topk": 2}, "common.pt", None)
    assert (every["n_group"], every["topk_group"]) == (2, 2)
    top1 = derive_config({**args, "moe_router_topk": 1, "moe_router_group_topk": None}, "common.pt", None)
    assert top1["norm_topk_prob"] is False and top1["num_experts_per_tok"] == 1
    lite = derive_config({**args, "q_lora_rank": None}, "common.pt", None)
    assert lite["q_lora_rank"] is None
    own = _own_config("deepseekv3-ep2")
    check_config({**args, "q_lora_rank": None}, "common.pt", {**own, "q_lora_rank": None}, "config.json")
    unscaled = derive_config({**args, "moe_router_topk_scaling_factor": None}, "common.pt", None)
    assert unscaled["routed_scaling_factor"] == 1.0


#: How the biases and --model-type choose between qwen2 and llama (and MLA between deepseek_v3 and the rest).
BIASES_AND_FAMILIES = {
    "q/k/v biases only": ("qwen2-tp2", {}, None, "qwen2"),
    "no biases": ("qwen2-tp2", {"add_qkv_bias": False}, None, "llama"),
    "biases everywhere": ("qwen2-tp2", {"add_bias_linear": True}, None, "llama"),
    "llama's args as qwen2": ("llama-tp2", {}, "qwen2", r"model_type 'qwen2' has biases on q, k and v and nowhere else"),
    "qwen2's args as llama": ("qwen2-tp2", {}, "llama", r"args\.add_qkv_bias = true \(with add_bias_linear false\)"),
    "q/k/v biases with qk-norm": ("qwen3-pp2", {"add_qkv_bias": True}, None, r"args\.add_qkv_bias = true"),
    "MLA as qwen2": ("qwen2-tp2", {"multi_latent_attention": True}, "qwen2",
                     r"model_type 'qwen2' has no multi-latent attention, but .*args\.multi_latent_attention is True"),
    "MLA as qwen3_moe": ("deepseekv3-ep2", {}, "qwen3_moe", r"'qwen3_moe' has no multi-latent attention"),
    "deepseek_v3 without MLA": ("qwen3moe-ep2", {}, "deepseek_v3", r"'deepseek_v3' has multi-latent attention"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BIASES_AND_FAMILIES))
def test_biases_and_attention_choose_the_family(name: str) -> None:
    case, changes, model_type, said = BIASES_AND_FAMILIES[name]
    args = {**_args(case), **changes}
    if said in FAMILIES:
        config = derive_config(args, "common.pt", model_type)
        assert (config["model_type"], config["architectures"]) == (said, [FAMILIES[said].architecture])
        if said == "llama":  # Megatron's --add-bias-linear biases q/k/v, o_proj and the MLP alike
            assert config["attention_bias"] == config["mlp_bias"] == changes.get("add_bias_linear", False)
        return
    with pytest.raises(InputError, match=said) as caught:
        derive_config(args, "common.pt", model_type)
    assert caught.value.exit_code == 2


def test_a_qwen2_head_width_other_than_hidden_over_heads_is_said() -> None:
    """Qwen2Config has no head_dim, but transformers' Qwen2 reads one when given: written only then."""
    config = derive_config({**_args("qwen2-tp2"), "kv_channels": 32}, "common.pt", None)
    assert config["head_dim"] == 32 and "attention_bias" not in config
    with pytest.raises(InputError, match=r"config\.json: head_dim is 16, but the checkpoint's run says 32"):
        check_config({**_args("qwen2-tp2"), "kv_channels": 32}, "common.pt", _own_config("qwen2-tp2"), "config.json")


@pytest.mark.parametrize(
    ("changes", "phrase"),
    [({"window_size": [128, 0]}, r"args\.window_size = "), ({"qk_l2_norm": True}, r"args\.qk_l2_norm = true"),
     ({"softmax_type": "off-by-one"}, r"args\.softmax_type = 'off-by-one'"),
     ({"rotary_seq_len_interpolation_factor": 4}, r"args\.rotary_seq_len_interpolation_factor = 4")],
)  # fmt: skip
def test_attention_no_family_has_is_refused(changes: dict[str, object], phrase: str) -> None:
    for case in NEW_FAMILIES:
        with pytest.raises(InputError, match=phrase):
            derive_config({**_args(case), **changes}, "common.pt", None)
