"""LoRA merged as peft's ``merge_and_unload`` merges it, against peft's own merged models
(tests/fixtures/lora: peft 0.21.2 adapters on bf16 and fp32 bases, rslora, DoRA, ``modules_to_save``, a
tied Qwen3, ``all-linear``, a DCP-sharded base, and a verl 0.9.1 FSDP2 LoRA actor)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import cli, load_tensors, reference_logits_reports

import mpicons
from mpicons.comm import SingleProcess
from mpicons.core.errors import InputError

CASES = Path(__file__).parent / "fixtures" / "lora"
PEFT_CASES = ["llama-bf16", "llama-fp32", "llama-rslora", "llama-lmhead-saved", "qwen3-tied", "llama-all-linear", "llama-dora"]
VERL = CASES / "verl-llama-lora-fsdp2"


def _tensors(directory: Path) -> dict:
    found: dict = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_tensors(path))
    return found


@pytest.mark.parametrize("case", PEFT_CASES)
def test_a_peft_adapter_merges_bit_for_bit_as_peft_merges_it(case: str, tmp_path: Path) -> None:
    """Every tensor (merged, replaced, untouched) equals peft's merged model, byte for byte; the base's own
    config is published with it."""
    base, out = CASES / case / "base", tmp_path / "out"
    result = mpicons.consolidate(base, out, lora=str(CASES / case / "adapter"), comm=SingleProcess())
    assert _tensors(out) == _tensors(CASES / case / "expected")
    assert json.loads((out / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    assert any("merged LoRA" in note for note in result.input_notes), result.input_notes


def test_a_bf16_base_merged_and_kept_in_fp32_is_peft_s_fp32_merge(tmp_path: Path) -> None:
    case = CASES / "llama-bf16"
    mpicons.consolidate(case / "base", tmp_path / "out", lora=str(case / "adapter"), dtype="fp32", comm=SingleProcess())
    assert _tensors(tmp_path / "out") == _tensors(case / "expected-fp32")


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_a_dcp_sharded_base_merges_at_any_rank_count(ranks: int, tmp_path: Path) -> None:
    case = CASES / "llama-dcp-2ranks"
    out = tmp_path / "out"
    proc, _ = cli(ranks, "consolidate", case / "base" / "sharded", out, "--lora", case / "adapter", "--hf-assets", case / "base")
    assert proc.returncode == 0, proc.stderr
    assert _tensors(out) == _tensors(case / "expected")


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_a_verl_lora_actor_comes_out_merged(ranks: int, tmp_path: Path) -> None:
    """verl keeps peft's wrapped names and LoRA's A sharded along r: the actor comes out as peft's merge of
    it (fp32, as trained), with the alpha verl recorded."""
    out = tmp_path / "out"
    proc, _ = cli(ranks, "consolidate", VERL / "checkpoint", out)
    assert proc.returncode == 0, proc.stderr
    assert _tensors(out) == _tensors(VERL / "expected-fp32")
    assert "merged LoRA into 14 weights" in " ".join(proc.stdout.split()), proc.stdout


def test_a_verl_lora_actor_in_bf16_is_rounded_once(tmp_path: Path) -> None:
    mpicons.consolidate(VERL / "checkpoint", tmp_path / "out", dtype="bf16", comm=SingleProcess())
    assert _tensors(tmp_path / "out") == _tensors(VERL / "expected")


def test_a_verl_lora_actor_without_its_alpha_asks_for_the_adapter_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(VERL / "checkpoint", run)
    actor = run / "global_step_2" / "actor"
    meta = json.loads((actor / "lora_train_meta.json").read_text())
    (actor / "lora_train_meta.json").unlink()
    with pytest.raises(InputError, match="lora_alpha is unknown: give the training's adapter config with --lora DIR") as caught:
        mpicons.consolidate(run, tmp_path / "out", comm=SingleProcess())
    assert caught.value.exit_code == 2 and not (tmp_path / "out").exists()
    given = tmp_path / "adapter"
    given.mkdir()
    (given / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": meta["r"], "lora_alpha": meta["lora_alpha"]})
    )
    mpicons.consolidate(run, tmp_path / "out", lora=str(given), comm=SingleProcess())
    assert _tensors(tmp_path / "out") == _tensors(VERL / "expected-fp32")


def test_an_adapter_of_another_model_is_refused_naming_the_module(tmp_path: Path) -> None:
    """An adapter whose A does not fit its module's weight (another model's): the module named, exit 2."""
    from safetensors.numpy import load_file, save_file

    adapter = tmp_path / "adapter"
    shutil.copytree(CASES / "llama-bf16" / "adapter", adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"
    tensors[name] = tensors[name][:, :32].copy()
    save_file(tensors, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    proc, _ = cli(2, "consolidate", CASES / "llama-bf16" / "base", tmp_path / "out", "--lora", adapter)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    said = " ".join(proc.stderr.split())
    assert "model.layers.1.mlp.up_proj: lora_B [128, 8] @ lora_A [8, 32]" in said and "is it this base's adapter?" in said
    assert not (tmp_path / "out").exists()


def test_a_folder_that_is_no_adapter_is_named(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"adapter_config.json: no such file: --lora names a peft adapter folder"):
        mpicons.consolidate(CASES / "llama-bf16" / "base", tmp_path / "out", lora=str(tmp_path), comm=SingleProcess())


def test_inspect_shows_the_merge(tmp_path: Path) -> None:
    report = mpicons.inspect(CASES / "llama-bf16" / "base", lora=str(CASES / "llama-bf16" / "adapter"), comm=SingleProcess())
    assert not report.problems and any("merged LoRA" in note for note in report.notes), report.notes


@pytest.mark.slow
def test_transformers_loads_the_merged_models_with_the_reference_logits(tmp_path: Path) -> None:
    """Loaded by transformers in float32, every merged output gives the fixture's reference logits (those
    of peft's merged model) exactly."""
    pairs = []
    for case in PEFT_CASES + ["llama-dcp-2ranks"]:
        out, base = tmp_path / case, CASES / case / "base"
        source, assets = (base / "sharded", str(base)) if case == "llama-dcp-2ranks" else (base, None)
        mpicons.consolidate(source, out, lora=str(CASES / case / "adapter"), hf_assets=assets, comm=SingleProcess())
        pairs.append((out, CASES / case / "ref_logits.pt"))
    out = tmp_path / "verl"
    mpicons.consolidate(VERL / "checkpoint", out, comm=SingleProcess())
    pairs.append((out, VERL / "ref_logits.pt"))
    for report in reference_logits_reports(pairs):
        assert report["equal"], report


def test_verify_compares_with_the_base_merged_the_same_way(tmp_path: Path) -> None:
    """``verify --against BASE --lora DIR`` passes on the merged output; without ``--lora`` every merged
    weight is named as differing from the shards."""
    case, out = CASES / "llama-dora", tmp_path / "out"
    mpicons.consolidate(case / "base", out, lora=str(case / "adapter"), comm=SingleProcess())
    merged = mpicons.verify(out, against=case / "base", lora=str(case / "adapter"), comm=SingleProcess())
    assert merged.ok and merged.compared_tensors == 21, merged.problems
    plain = mpicons.verify(out, against=case / "base", comm=SingleProcess())
    assert sorted(p.tensor for p in plain.problems) == sorted(
        name for name in _tensors(case / "base") if name.endswith("_proj.weight")
    )


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_no_merge_keeps_the_base_and_a_peft_adapter_beside_it(ranks: int, tmp_path: Path) -> None:
    """``--no-merge``: the base as it was before training (the fixture's bf16 base, byte for byte) and
    ``lora_adapter/``, a peft folder whose merge gives peft's merged model."""
    out = tmp_path / "out"
    proc, _ = cli(ranks, "consolidate", VERL / "checkpoint", out, "--no-merge", "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert _tensors(out) == _tensors(VERL / "base")
    settings = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    assert (settings["peft_type"], settings["r"], settings["lora_alpha"], len(settings["target_modules"])) == ("LORA", 8, 16, 7)
    adapter = load_tensors(out / "lora_adapter" / "adapter_model.safetensors")
    assert len(adapter) == 28 and {dtype for dtype, _, _ in adapter.values()} == {"F32"}  # as trained
    merged = tmp_path / "merged"
    mpicons.consolidate(out, merged, lora=str(out / "lora_adapter"), dtype="fp32", comm=SingleProcess())
    assert _tensors(merged) == _tensors(VERL / "expected-fp32")  # the frozen base was bf16's, upcast
    mpicons.consolidate(VERL / "checkpoint", tmp_path / "fp32", no_merge=True, comm=SingleProcess())
    mpicons.consolidate(tmp_path / "fp32", tmp_path / "again", lora=str(tmp_path / "fp32" / "lora_adapter"), comm=SingleProcess())
    assert _tensors(tmp_path / "again") == _tensors(VERL / "expected-fp32")


def test_no_merge_needs_lora_weights_in_the_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--no-merge keeps the LoRA weights a checkpoint holds apart") as caught:
        mpicons.consolidate(CASES / "llama-bf16" / "base", tmp_path / "out", no_merge=True, comm=SingleProcess())
    assert caught.value.exit_code == 2 and not (tmp_path / "out").exists()


def test_no_merge_never_replaces_an_adapter_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "lora_adapter").mkdir(parents=True)
    with pytest.raises(InputError, match="is a directory; mpicons never replaces a directory"):
        mpicons.consolidate(VERL / "checkpoint", out, no_merge=True, force=True, comm=SingleProcess())
    assert sorted(p.name for p in out.iterdir()) == ["lora_adapter"] and not list((out / "lora_adapter").iterdir())


def test_a_failed_publish_leaves_no_adapter_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder is published in the weights' transaction: a failure at its commit point takes it back out."""
    from mpicons.io import journal

    def fail(label: str) -> None:
        if label.startswith("commit"):
            raise OSError(5, "injected")

    monkeypatch.setattr(journal, "step_hook", fail)
    out = tmp_path / "out"
    with pytest.raises(Exception, match="injected"):
        mpicons.consolidate(VERL / "checkpoint", out, no_merge=True, comm=SingleProcess())
    assert not (out / "lora_adapter").exists() and not list(out.glob("*.safetensors"))
