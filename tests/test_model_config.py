"""A config.json that does not match the weights is refused before anything is published: the layers,
the output layer of untied embeddings, every tensor a known family's model has, and each tensor's shape.

The pure checks run on names; the job's on real checkpoints (DeepSpeed ZeRO-3 and Megatron-LM fixtures)
with a config changed in one field: exit 2 naming the config file, the key and both values, nothing
written; ``inspect`` and ``verify --against`` report the same. A config that agrees goes through.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, load_tensors
from megatron_cases import expected_dir
from test_adapter_rules import write_checkpoint

import mpicons
from mpicons.adaptation.model_shapes import config_shapes, disagreements
from mpicons.comm import SingleProcess
from mpicons.core.errors import InputError

FIXTURES = Path(__file__).parent / "fixtures"
ZERO3 = FIXTURES / "deepspeed" / "llama-zero3"
TIMEOUT = 120


def llama(layers: int = 2, **extra: object) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 12,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        **extra,
    }


def names_of(config: dict) -> list[str]:
    shapes = config_shapes(config)
    assert shapes is not None
    return list(shapes)


def test_the_weights_of_the_configs_model_agree() -> None:
    config = llama()
    assert disagreements(config, names_of(config)) == []
    tied = llama(tie_word_embeddings=True)
    assert disagreements(tied, [n for n in names_of(tied) if n != "lm_head.weight"]) == []


def test_layers_past_the_config_or_missing_from_the_weights_are_named() -> None:
    (found,) = disagreements(llama(2), names_of(llama(3)))
    assert (found.key, found.said, found.tensor) == ("num_hidden_layers", 2, "model.layers.2.input_layernorm.weight")
    assert "hold layers up to 2 (3 layers)" in found.found
    (found,) = disagreements(llama(3), names_of(llama(2)))
    assert (found.key, found.said) == ("num_hidden_layers", 3) and "hold no layer 2 (2 layers: layers 0 to 1)" in found.found
    # Tensors left out on purpose (--include/--exclude): missing layers are not the config's fault; extra ones are.
    assert disagreements(llama(3), names_of(llama(2)), whole=False) == []
    assert [d.key for d in disagreements(llama(2), names_of(llama(3)), whole=False)] == ["num_hidden_layers"]


def test_untied_embeddings_need_an_output_layer() -> None:
    names = [n for n in names_of(llama()) if n != "lm_head.weight"]
    (found,) = disagreements(llama(), names)
    assert (found.key, found.said) == ("tie_word_embeddings", False) and "no lm_head.weight" in found.found
    # A family mpicons does not know says nothing unless its config does.
    assert disagreements({"model_type": "other", "num_hidden_layers": 2}, names) == []
    assert [d.key for d in disagreements({"model_type": "other", "tie_word_embeddings": False}, names)] == ["tie_word_embeddings"]


def test_a_known_familys_tensors_must_all_be_there() -> None:
    qwen3 = llama(model_type="qwen3", head_dim=4)
    (found,) = disagreements(qwen3, names_of(llama()))
    assert (found.key, found.said) == ("model_type", "qwen3")
    assert "have no model.layers.0.self_attn.q_norm.weight and 3 more tensors its model has" in found.found


def test_deepseeks_multi_token_prediction_layers_come_after_the_config_s() -> None:
    config = json.loads((expected_dir("deepseekv3-ep2") / "config.json").read_text())
    names = list(load_tensors(expected_dir("deepseekv3-ep2") / "model.safetensors"))
    assert disagreements(config, names) == []
    mtp = [n.replace("model.layers.2.", "model.layers.3.") for n in names if n.startswith("model.layers.2.")]
    assert [d.key for d in disagreements(config, names + mtp)] == ["num_hidden_layers"]
    assert disagreements({**config, "num_nextn_predict_layers": 1}, names + mtp) == []


# ---------------------------------------------------------------- the job, on real checkpoints


def changed_assets(tmp_path: Path, **fields: object) -> Path:
    """ZeRO-3's Hugging Face files with ``fields`` changed in config.json."""
    assets = tmp_path / "assets"
    shutil.copytree(ZERO3 / "hf", assets)
    config = json.loads((assets / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**config, **fields}))
    return assets


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"num_hidden_layers": 4}, "num_hidden_layers is 4, but the weights hold no layer 3 (3 layers: layers 0 to 2)"),
        ({"num_hidden_layers": 2}, "num_hidden_layers is 2, but the weights hold layers up to 2 (3 layers)"),
        (
            {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
            "model_type is 'qwen3', but the weights have no model.layers.0.self_attn.q_norm.weight",
        ),
    ],
)
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_config_that_does_not_match_the_weights_is_refused(tmp_path: Path, fields: dict, said: str, ranks: int) -> None:
    assets = changed_assets(tmp_path, **fields)
    out = tmp_path / "hf"
    proc = cli(ranks, "consolidate", ZERO3 / "checkpoint", out, "--hf-assets", assets, timeout=TIMEOUT)[0]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{assets / 'config.json'}: {said}" in " ".join(proc.stderr.split()), proc.stderr
    assert "missing training rank" not in proc.stderr and not out.exists()


def test_inspect_and_verify_report_the_same_disagreement(tmp_path: Path) -> None:
    assets = changed_assets(tmp_path, num_hidden_layers=2)
    report = mpicons.inspect(ZERO3 / "checkpoint", hf_assets=assets, comm=SingleProcess())
    assert not report.ok
    assert [p.kind for p in report.problems if p.kind == "model config"] == ["model config"], report.problems
    good = tmp_path / "good"
    mpicons.consolidate(ZERO3 / "checkpoint", good, hf_assets=ZERO3 / "hf", comm=SingleProcess(), sync=False)
    result = mpicons.verify(good, against=ZERO3 / "checkpoint", hf_assets=assets, comm=SingleProcess())
    assert not result.ok and any(p.kind == "model config" for p in result.problems), result.problems


def test_the_checkpoints_own_config_goes_through_and_left_out_tensors_are_not_blamed_on_it(tmp_path: Path) -> None:
    mpicons.consolidate(ZERO3 / "checkpoint", tmp_path / "all", hf_assets=ZERO3 / "hf", comm=SingleProcess(), sync=False)
    mpicons.consolidate(
        ZERO3 / "checkpoint",
        tmp_path / "some",
        hf_assets=ZERO3 / "hf",
        exclude=("model.layers.2.*",),
        comm=SingleProcess(),
        sync=False,
    )
    with pytest.raises(InputError, match="num_hidden_layers is 2"):
        mpicons.consolidate(
            ZERO3 / "checkpoint",
            tmp_path / "fewer",
            hf_assets=changed_assets(tmp_path, num_hidden_layers=2),
            exclude=("lm_head.*",),
            comm=SingleProcess(),
        )


# ---------------------------------------------------------------- never into a training run's folder

RUNS = {
    "deepspeed": FIXTURES / "deepspeed" / "llama-zero3" / "checkpoint",
    "verl": FIXTURES / "verl" / "llama-fsdp2" / "checkpoint",
    "megatron": FIXTURES / "megatron" / "qwen2-tp2" / "checkpoint",
}


def run_copy(trainer: str, tmp_path: Path) -> Path:
    """A writable copy of a trainer's run folder (a refusal that failed must not write into the fixtures)."""
    copy = tmp_path / f"{trainer}-run"
    shutil.copytree(RUNS[trainer], copy)
    return copy


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


@pytest.mark.parametrize("trainer", list(RUNS))
@pytest.mark.parametrize("where", ["run", "inside", "step"])
def test_a_model_is_never_published_into_a_training_run(trainer: str, where: str, tmp_path: Path) -> None:
    """The arguments swapped (a model directory, then a run folder), or an output inside a run: exit 2, nothing written."""
    run = run_copy(trainer, tmp_path)
    before = listing(run)
    step = next(p for p in sorted(run.iterdir()) if p.is_dir())
    output = {"run": run, "inside": run / "hf", "step": step}[where]
    model = tmp_path / "model"
    mpicons.consolidate(expected_dir("llama-tp2"), model, comm=SingleProcess(), sync=False)
    proc = cli(1, "consolidate", model, output, timeout=TIMEOUT)[0]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    words = " ".join(proc.stderr.split())
    assert "mpicons never writes into a training run's folder" in words and "swapped" in words, proc.stderr
    assert listing(run) == before


@pytest.mark.parametrize("trainer", ["verl", "megatron", "deepspeed"])
def test_the_run_as_its_own_output_is_refused(trainer: str, tmp_path: Path) -> None:
    run = run_copy(trainer, tmp_path)
    before = listing(run)
    proc = cli(2, "consolidate", run, run, timeout=TIMEOUT)[0]
    assert proc.returncode == 2 and "output directory is the input directory" in proc.stderr, proc.stderr
    assert listing(run) == before


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("mixtral", {"num_local_experts": 3}),
        (
            "deepseek_v3",
            {
                "n_routed_experts": 4,
                "q_lora_rank": 16,
                "kv_lora_rank": 8,
                "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 4,
                "v_head_dim": 6,
                "first_k_dense_replace": 1,
                "moe_intermediate_size": 12,
                "n_shared_experts": 2,
                "n_group": 1,
                "topk_group": 1,
            },
        ),
    ],
)
def test_the_config_fields_give_what_transformers_saves(family: str, extra: dict, tmp_path: Path) -> None:
    """Mixtral and DeepSeek-V3 as transformers' ``save_pretrained`` writes them: every name and shape."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    settings = dict(vocab_size=101, hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4)
    config = transformers.AutoConfig.for_model(family, num_key_value_heads=2, **settings, **extra)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    saved = {name: tuple(shape) for name, (_, shape, _) in load_tensors(tmp_path / "model" / "model.safetensors").items()}
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config_shapes(written) == saved
    assert disagreements(written, list(saved)) == []


# ---------------------------------------------------------------- an HF Trainer checkpoint-N/ folder

TRAINER_FILES = ("zero_to_fp32.py", "zero_to_torch.py", "trainer_state.json", "training_args.bin", "rng_state_0.pth")


def hf_trainer_folder(tmp_path: Path) -> Path:
    """What Hugging Face's Trainer with DeepSpeed saves: checkpoint-2/ holding global_step2/, latest, the
    model's config and the trainer's own files."""
    folder = tmp_path / "run" / "checkpoint-2"
    shutil.copytree(ZERO3 / "checkpoint", folder)
    for asset in (ZERO3 / "hf").iterdir():
        shutil.copy(asset, folder / asset.name)
    for name in TRAINER_FILES:
        (folder / name).write_text("a trainer's own file\n")
    return folder


@pytest.mark.parametrize("given", ["checkpoint-2", "global_step2"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_an_hf_trainer_checkpoint_folder_consolidates_by_itself(given: str, ranks: int, tmp_path: Path) -> None:
    folder = hf_trainer_folder(tmp_path)
    source = folder if given == "checkpoint-2" else folder / "global_step2"
    out = tmp_path / "hf"
    proc = cli(ranks, "consolidate", source, out, "--no-sync", timeout=TIMEOUT)[0]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "config.json", "generation_config.json", "model.safetensors"]
    assert (out / "config.json").read_bytes() == (ZERO3 / "hf" / "config.json").read_bytes()
    assert load_tensors(out / "model.safetensors") == load_tensors(ZERO3 / "expected-fp32" / "model.safetensors")
    said = " ".join(proc.stdout.split())
    assert f"the model's Hugging Face files (config, tokenizer) from {folder}" in said, proc.stdout
    assert "zero_to_fp32.py" in said and "not a model's files" in said
    # The output is the model, not a checkpoint: it can be given again as an input.
    again = tmp_path / "again"
    proc = cli(1, "consolidate", out, again, "--no-sync", timeout=TIMEOUT)[0]
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_output_without_a_config_says_how_to_make_it_loadable(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = mpicons.consolidate(ZERO3 / "checkpoint", out, comm=SingleProcess(), sync=False)
    assert any("transformers cannot load" in note and "--hf-assets DIR" in note for note in result.input_notes)
    with_assets = mpicons.consolidate(ZERO3 / "checkpoint", tmp_path / "b", hf_assets=ZERO3 / "hf", comm=SingleProcess())
    assert not any("transformers cannot load" in note for note in with_assets.input_notes)


# ---------------------------------------------------------------- not a model


def test_optimizer_state_alone_is_not_passed_off_as_a_model(tmp_path: Path) -> None:
    """accelerate's optimizer_0/ (DCP of the optimizer's state alone): exit 2 saying what it is; asked for
    on purpose (--include), written."""
    rng = np.random.default_rng(5)
    state = {
        f"optimizer.state.model.layers.{i}.weight.{moment}": (
            "F32",
            rng.standard_normal((4, 3)).astype(np.float32),
            [((0, 0), (4, 3))],
        )
        for i in range(2)
        for moment in ("exp_avg", "exp_avg_sq")
    }
    folder = write_checkpoint(tmp_path / "optimizer_0", state)
    proc = cli(2, "consolidate", folder, tmp_path / "out", timeout=TIMEOUT)[0]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "holds optimizer state only (4 tensors named optimizer.*), no model weights" in " ".join(proc.stderr.split())
    assert not (tmp_path / "out").exists()
    asked = mpicons.consolidate(folder, tmp_path / "asked", include=("optimizer.*",), comm=SingleProcess(), sync=False)
    assert sorted(t.name for t in asked.layout.tensors) == sorted(state)


# ---------------------------------------------------------------- rank files that cannot be impersonated

IMPERSONATIONS = [
    ("zero2", "mp_rank_00_model_states.pt", "mp_rank_000_model_states.pt"),
    ("zero3", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_0_mp_rank_0_optim_states.pt"),
    ("zero3", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_\u0660_mp_rank_00_optim_states.pt"),
    ("zero3", "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_01_mp_rank_00_model_states.pt"),
    ("verl", "model_world_size_2_rank_0.pt", "model_world_size_2_rank_00.pt"),
]
STEPS = {
    "zero2": FIXTURES / "deepspeed" / "llama-zero2" / "checkpoint" / "global_step2",
    "zero3": FIXTURES / "deepspeed" / "llama-zero3" / "checkpoint" / "global_step2",
    "verl": FIXTURES / "verl" / "llama-fsdp2" / "checkpoint" / "global_step_1" / "actor",
}


@pytest.mark.parametrize(("case", "real", "other"), IMPERSONATIONS)
@pytest.mark.parametrize("how", ["beside", "instead"])
def test_a_rank_file_under_another_spelling_is_refused(case: str, real: str, other: str, how: str, tmp_path: Path) -> None:
    """Another spelling of a rank (padding, digits of another script) beside the real file, or in its place:
    exit 2 naming the file and the one it claims to be; nothing written."""
    step = tmp_path / "step"
    shutil.copytree(STEPS[case], step)
    shutil.copy(step / real, step / other)
    if how == "instead":
        (step / real).unlink()
    proc = cli(1, "consolidate", step, tmp_path / "out", timeout=TIMEOUT)[0]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    words = " ".join(proc.stderr.split())
    assert f"{step / other}: not a name the trainer writes; it claims what {real} holds" in words, proc.stderr
    assert ("beside" in words) == (how == "beside") and not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["zero2", "zero3", "verl"])
def test_two_rank_files_swapped_are_refused(case: str, tmp_path: Path) -> None:
    """Each archive names the file it was saved as (its folder inside the zip): swapped files are exit 2."""
    step = tmp_path / "step"
    shutil.copytree(STEPS[case], step)
    first, second = (
        ("model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt")
        if case == "verl"
        else ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    )
    (step / first).rename(step / "swap")
    (step / second).rename(step / first)
    (step / "swap").rename(step / second)
    proc = cli(2, "consolidate", step, tmp_path / "out", timeout=TIMEOUT)[0]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    words = " ".join(proc.stderr.split())
    assert "this archive was saved as" in words and "files renamed or swapped?" in words, proc.stderr
    assert not (tmp_path / "out").exists()


def test_inside_its_own_input_when_asked_as_torchs_consolidators_do(tmp_path: Path) -> None:
    """torch's consolidators write into INPUT/consolidated (the drop-in's contract): asked for, allowed even
    where the input is a trainer's (accelerate's) folder; not asked for, refused."""
    source = tmp_path / "pytorch_model_fsdp_0"
    shutil.copytree(FIXTURES / "accelerate" / "checkpoint-2" / "pytorch_model_fsdp_0", source)
    with pytest.raises(InputError, match="mpicons never writes into a training run's folder"):
        mpicons.consolidate(source, source / "consolidated", comm=SingleProcess())
    mpicons.consolidate(source, source / "consolidated", inside_input=True, comm=SingleProcess(), sync=False)
    assert load_tensors(source / "consolidated" / "model.safetensors") == load_tensors(
        FIXTURES / "accelerate" / "expected.safetensors"
    )
