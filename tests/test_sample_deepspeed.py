"""The DeepSpeed ZeRO-3 sample: mpicons consolidates it to the fp32 weights it was made from; torch
reads its archives (``weights_only=True``) and the partition rule of tests/fixtures/deepspeed/FACTS.md
§7, written here with torch operations, gives those weights back; DeepSpeed's own ``zero_to_fp32.py``
(where DeepSpeed is installed) converts it to the same bytes; its plain twin holds the same tensors.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from helpers import cli, load_tensors, reference_bytes, subprocess_env
from safetensors import safe_open

import mpicons
from mpicons.comm import SingleProcess
from mpicons.sample import ZeroSampleConfig, write_zero_plain, write_zero_sample, zero_expected_hf
from mpicons.trainers.deepspeed.sample import zero_param_specs

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
#: Padding on the last rank (odd sizes over 3 ranks), tied embeddings, one rank, no Adam moments.
CONFIGS = {
    "world3-padded": ZeroSampleConfig(),
    "world2-tied": ZeroSampleConfig(layers=1, hidden=48, ffn=40, heads=4, kv_heads=1, head_dim=12, vocab=130, world=2,
                                    tied=True, seed=5),
    "world1": ZeroSampleConfig(layers=1, hidden=32, ffn=64, heads=2, kv_heads=2, vocab=77, world=1, seed=2),
    "world4-no-moments": ZeroSampleConfig(layers=1, world=4, moments=False, step=7, seed=9),
}  # fmt: skip


def _expected(config: ZeroSampleConfig, bf16: bool = False) -> dict[str, tuple[str, list[int], bytes]]:
    tensors = {}
    for name, value in zero_expected_hf(config):
        data = value.astype(ml_dtypes.bfloat16) if bf16 else value  # numpy rounds to nearest even
        tensors[name] = ("BF16" if bf16 else "F32", list(value.shape), data.tobytes())
    return tensors


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_mpicons_consolidates_the_sample_to_its_weights(case: str, tmp_path: Path) -> None:
    config = CONFIGS[case]
    step_dir = Path(write_zero_sample(tmp_path / "run", config, assets_dir=tmp_path / "hf"))
    assert step_dir == tmp_path / "run" / f"global_step{config.step}"
    assert (tmp_path / "run" / "latest").read_text() == step_dir.name
    result = mpicons.consolidate(tmp_path / "run", tmp_path / "out", comm=SingleProcess(), sync=False)
    expected = _expected(config)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == reference_bytes(expected)
    assert ("lm_head.weight" in expected) != config.tied
    notes = "\n".join(result.input_notes)
    if config.moments:  # per rank: Adam's step and two moments
        assert f"(Adam moments, step counters): {3 * config.world} tensors" in notes, notes
    else:
        assert "Adam moments" not in notes, notes


def test_dtype_bf16_and_hf_assets(tmp_path: Path) -> None:
    config = CONFIGS["world2-tied"]
    write_zero_sample(tmp_path / "run", config, assets_dir=tmp_path / "hf")
    mpicons.consolidate(tmp_path / "run", tmp_path / "out", dtype="bf16", hf_assets=str(tmp_path / "hf"), sync=False)
    assert load_tensors(tmp_path / "out" / "model.safetensors") == _expected(config, bf16=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True


def test_existing_files_are_never_replaced(tmp_path: Path) -> None:
    write_zero_sample(tmp_path / "run", CONFIGS["world1"])
    with pytest.raises(FileExistsError):
        write_zero_sample(tmp_path / "run", CONFIGS["world1"])


class _LossScaler:
    """Stands in for DeepSpeed's class when torch unpickles with ``weights_only=True``."""


class _ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


def _torch_load(path: Path) -> Any:
    torch = pytest.importorskip("torch")
    stand_ins = [
        (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
        (_ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    ]
    with torch.serialization.safe_globals(stand_ins):
        return torch.load(path, weights_only=True)


def _facts_section_7(step_dir: Path, world: int) -> tuple[dict[str, Any], list[Any]]:
    """The fp32 weights by FACTS.md §7: parameter k is at offset Σ_{j<k} ceil(n_j / world) of every rank's
    flat vector; the rank-ordered pieces concatenated and cut to n_k. Also the ranks' flat vectors."""
    import torch

    model = _torch_load(step_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert model["dp_world_size"] == world and all(t.numel() == 0 for t in model["module"].values())
    flats = []
    for rank in range(world):
        state = _torch_load(step_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert int(state["zero_stage"]) == 3 and state["partition_count"] == world
        assert isinstance(state["loss_scaler"], _LossScaler)
        flats.append(torch.cat(state["fp32_flat_groups"]).detach())
    weights, at = {}, 0
    for group in model["param_shapes"]:
        for name, shape in group.items():
            part = -(-shape.numel() // world)
            whole = torch.cat([flat[at : at + part] for flat in flats])
            weights[name] = whole[: shape.numel()].reshape(shape)
            at += part
    assert all(flat.numel() == at for flat in flats)
    return weights, flats


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_torch_reads_the_archives_with_weights_only(case: str, tmp_path: Path) -> None:
    """The archives are torch.save files: torch loads them (refusing anything but torch's classes and the two
    DeepSpeed names stood in for), and the partition rule gives the sample's weights back."""
    pytest.importorskip("torch", reason="torch's own loader is what reads them here")
    config = CONFIGS[case]
    step_dir = Path(write_zero_sample(tmp_path / "run", config))
    weights, flats = _facts_section_7(step_dir, config.world)
    expected = dict(zero_expected_hf(config))
    assert list(weights) == list(expected)
    for name, value in expected.items():
        assert weights[name].dtype.is_floating_point and weights[name].numpy().tobytes() == value.tobytes(), name
    padding = sum(-(-v.size // config.world) * config.world - v.size for v in expected.values())
    if padding:  # the last rank's padding is garbage, NaN among it, as DeepSpeed saves uninitialised memory
        assert bool(flats[-1].isnan().any())
    model = _torch_load(step_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert model["shared_params"] == ({"lm_head.weight": "model.embed_tokens.weight"} if config.tied else {})


def test_the_stand_ins_read_the_real_fixture_alike() -> None:
    """What the test above relies on holds for DeepSpeed's own files: the same load and rule give its weights."""
    pytest.importorskip("torch")
    weights, _ = _facts_section_7(FIXTURES / "llama-zero3" / "checkpoint" / "global_step2", 2)
    expected = load_tensors(FIXTURES / "llama-zero3" / "expected-fp32" / "model.safetensors")
    assert sorted(weights) == sorted(expected)
    assert all(weights[name].numpy().tobytes() == data for name, (_, _, data) in expected.items())


def test_the_plain_twin_holds_the_same_tensors(tmp_path: Path) -> None:
    config = CONFIGS["world3-padded"]
    files = write_zero_plain(tmp_path / "plain", config)
    assert files == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2, 3)]
    mpicons.consolidate(tmp_path / "plain", tmp_path / "out", comm=SingleProcess(), sync=False)
    assert load_tensors(tmp_path / "out" / "model-00001-of-00001.safetensors") == _expected(config)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_deepspeeds_converter_reads_the_sample(tmp_path: Path) -> None:
    """DeepSpeed's zero_to_fp32.py (the copy save_checkpoint puts beside a checkpoint) writes the sample's weights."""
    import deepspeed.utils

    config = CONFIGS["world3-padded"]
    write_zero_sample(tmp_path / "run", config)
    script = tmp_path / "zero_to_fp32.py"  # run from outside the package (its folder shadows torch)
    shutil.copy(Path(deepspeed.utils.__file__).parent / "zero_to_fp32.py", script)
    command = [sys.executable, script, tmp_path / "run", tmp_path / "out", "--safe_serialization"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert load_tensors(tmp_path / "out" / "model.safetensors") == _expected(config)


@pytest.mark.slow
def test_an_archive_past_4_gib_is_read_through_its_zip64_records(tmp_path: Path) -> None:
    """One rank's flat partition of 4.4 GB: the member's sizes, the offsets of the members after it
    and the central directory's place need ZIP64 records; the weights come out exact."""
    config = ZeroSampleConfig.sized(int(4.4e9), world=1, moments=False, layers=2)
    step_dir = Path(write_zero_sample(tmp_path / "run", config))
    [optim] = step_dir.glob("*_optim_states.pt")
    with zipfile.ZipFile(optim) as archive:
        members = archive.infolist()
    assert max(m.file_size for m in members) > zipfile.ZIP64_LIMIT and max(m.header_offset for m in members) > zipfile.ZIP64_LIMIT
    proc, _ = cli(2, "consolidate", tmp_path / "run", tmp_path / "out", "--no-sync", "-q", timeout=600)
    assert proc.returncode == 0, proc.stderr
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as written:
        assert sorted(written.keys()) == sorted(name for name, _ in zero_param_specs(config))
        for name, value in zero_expected_hf(config):
            assert written.get_tensor(name).tobytes() == value.tobytes(), name


def test_sizes_and_bad_configs() -> None:
    from mpicons.trainers.deepspeed.sample import weight_bytes, zero_param_specs

    for target in (200_000_000, 2_000_000_000):
        config = ZeroSampleConfig.sized(target)
        assert target <= weight_bytes(config) < 1.3 * target
        assert (config.world, config.heads, config.kv_heads * 4, config.ffn % 64) == (4, config.hidden // 64, config.heads, 0)
    names = [name for name, _ in zero_param_specs(ZeroSampleConfig(layers=1))]
    assert names[:3] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                         "model.layers.0.self_attn.k_proj.weight"]  # fmt: skip
    assert names[-4:] == ["model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                          "model.norm.weight", "lm_head.weight"]  # fmt: skip
    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        ZeroSampleConfig(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="world = 0 must be positive"):
        ZeroSampleConfig(world=0)
    assert np.dtype("float32").itemsize * sum(v.size for _, v in zero_expected_hf(CONFIGS["world1"])) == weight_bytes(
        CONFIGS["world1"]
    )
