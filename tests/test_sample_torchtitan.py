"""The torchtitan-native sample: torchtitan's names and layouts (checked against the checkpoints real
torchtitan code wrote, tests/fixtures/torchtitan), cut off head boundaries, with its HF assets beside it.

The reference conversion :func:`torchtitan_to_hf` is first checked against torchtitan's own ``to_hf``
output of the fixtures; consolidations of the sample are then compared with safetensors' serializer
of the sample's full tensors (plain) and of their reference conversion (``--adapter torchtitan``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import Tensors, assert_consolidated, cli, load_tensors, mpirun, sample_expected
from mpi4py import MPI
from safetensors.numpy import load_file

import mpicons
from mpicons.comm import SingleProcess
from mpicons.core.safetensors_codec import DTYPE_BY_NAME
from mpicons.formats.distcp_metadata import read_metadata
from mpicons.frontends.sample import hf_config, torchtitan_to_hf
from mpicons.sample import SampleConfig, check_sample, full_tensor, tensor_specs, write_sample

TITAN = Path(__file__).parent / "fixtures" / "torchtitan"
CASES = {"llama3-fsdp2": 0, "qwen3moe-fsdp2": 4}  # fixture → the sample's experts for the same family


def small(experts: int = 0, optimizer: bool = True, **fields: object) -> SampleConfig:
    """10 query heads of 16 rows, 2 key/value heads; FSDP2 over 3 ranks inside TP over 2 (q pieces of 27 rows)."""
    base: dict[str, object] = {
        "layers": 2, "hidden": 160, "intermediate": 96, "vocab": 77, "head_dim": 16, "experts": experts,
        "dp": 3, "tp": 2, "files": 1, "dtype": "BF16", "kind": "torchtitan", "optimizer": optimizer,
    }  # fmt: skip
    return SampleConfig(**{**base, **fields})  # type: ignore[arg-type]


def generic(names: object) -> set[str]:
    return {re.sub(r"layers\.\d+\.", "layers.N.", n) for n in names}  # type: ignore[attr-defined]


def hf_expected(config: SampleConfig) -> Tensors:
    """The sample's full tensors through the reference conversion, as raw bytes."""
    full = {name: full_tensor(config, name, dtype, shape) for name, dtype, shape, _, _ in tensor_specs(config)}
    names = {np.dtype(DTYPE_BY_NAME[d].numpy): d for d in ("BF16", "F32")}
    return {
        hf_name: (names[value.dtype], list(value.shape), np.ascontiguousarray(value).tobytes())
        for hf_name, value in torchtitan_to_hf(full, hf_config(config)).items()
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_reference_conversion_is_torchtitans_to_hf(case: str, tmp_path: Path) -> None:
    """``torchtitan_to_hf`` of the unsharded torchtitan state dict (the model-only save, consolidated
    plainly: torchtitan's names and layouts) equals torchtitan's own ``to_hf``."""
    config = json.loads((TITAN / case / "hf-assets" / "config.json").read_text())
    mpicons.consolidate(TITAN / case / "native-model-only", tmp_path / "titan", comm=SingleProcess(), sync=False)
    titan = load_file(tmp_path / "titan" / "model.safetensors")
    reference = load_file(TITAN / case / "ref" / "full_hf.safetensors")
    converted = torchtitan_to_hf(titan, config)
    assert sorted(converted) == sorted(reference)
    for name, value in reference.items():
        assert converted[name].dtype == value.dtype and converted[name].shape == value.shape, name
        assert np.ascontiguousarray(converted[name]).tobytes() == value.tobytes(), name


def test_the_reference_conversion_refuses_an_unknown_key() -> None:
    config = hf_config(small())
    with pytest.raises(ValueError, match="layers.0.attention.wqkv.weight"):
        torchtitan_to_hf({"layers.0.attention.wqkv.weight": np.zeros((4, 4))}, config)
    with pytest.raises(ValueError, match="unknown key 'layers.x.norm.weight'"):
        torchtitan_to_hf({"layers.x.norm.weight": np.zeros(4)}, config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_sample_has_torchtitans_names_and_shapes(case: str, tmp_path: Path) -> None:
    """Model keys and the ``exp_avg`` optimizer keys (the fused ``wqkv``) are the fixture's, layer for
    layer; every shape follows from the config as in the fixture."""
    fixture = read_metadata(str(TITAN / case / "native" / ".metadata"))
    config = small(experts=CASES[case])
    write_sample(tmp_path / "native", config)
    sample = read_metadata(str(tmp_path / "native" / ".metadata"))
    wanted = {n for n in generic(fixture.names) if not n.endswith((".exp_avg_sq", ".step"))}
    assert generic(sample.names) == wanted
    shapes = {name: shape for name, _, shape, _, _ in tensor_specs(config)}
    hd, kv = config.head_dim, config.n_kv_heads * config.head_dim
    assert shapes["layers.1.attention.qkv_linear.wq.weight"] == (config.n_heads * hd, config.hidden)
    assert shapes["layers.1.attention.qkv_linear.wk.weight"] == (kv, config.hidden)
    fused = "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"
    assert shapes[fused] == ((config.n_heads + 2 * config.n_kv_heads) * hd, config.hidden)
    if config.experts:
        e, f = config.experts, config.intermediate
        assert shapes["layers.0.moe.routed_experts.inner_experts.w1_EFD"] == (e, f, config.hidden)
        assert shapes["layers.0.moe.routed_experts.inner_experts.w2_EDF"] == (e, config.hidden, f)
        assert shapes["layers.0.moe.expert_bias_E"] == (e,)
        assert not any(n.startswith("optimizer.") and "expert_bias" in n for n in shapes)
    dtypes = {name: dtype for name, dtype, _, _, _ in tensor_specs(config)}
    assert {dtypes[n] for n in dtypes if n.endswith(("norm.weight", "expert_bias_E"))} == {"F32"}


def test_row_pieces_end_inside_heads_and_rotary_pairs(tmp_path: Path) -> None:
    """FSDP2 over 3 ranks inside TP over 2: the q and k pieces start off head boundaries, some at an odd row."""
    config = small()
    write_sample(tmp_path / "native", config)
    table = read_metadata(str(tmp_path / "native" / ".metadata"))
    starts: dict[str, set[int]] = {}
    for i, t in enumerate(table.tensor):
        name = table.names[t]
        if name.endswith(("wq.weight", "wk.weight")) and not name.startswith("optimizer."):
            starts.setdefault(name.rsplit(".", 2)[-2], set()).add(int(table.offset[i, 0]))
    for which, rows in starts.items():
        assert any(r % config.head_dim for r in rows), (which, rows)
    assert any(r % 2 for rows in starts.values() for r in rows), starts
    assert table.files and len(table.files) == config.world


def test_hf_assets_are_written_beside_the_checkpoint(tmp_path: Path) -> None:
    config = small(experts=4)
    write_sample(tmp_path / "native", config, assets_dir=tmp_path / "hf-assets")
    assert sorted(p.name for p in (tmp_path / "hf-assets").iterdir()) == ["config.json", "tokenizer_config.json"]
    assert not any(p.name.endswith(".json") for p in (tmp_path / "native").iterdir())
    written = json.loads((tmp_path / "hf-assets" / "config.json").read_text())
    assert written["model_type"] == "qwen3_moe" and written["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (written["num_attention_heads"], written["num_key_value_heads"], written["head_dim"]) == (10, 2, 16)
    assert (written["hidden_size"], written["num_hidden_layers"], written["vocab_size"]) == (160, 2, 77)
    assert written["num_experts"] == 4 and written["moe_intermediate_size"] == 96
    assert written["tie_word_embeddings"] is False and written["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="beside the checkpoint"):
        write_sample(tmp_path / "again", config, assets_dir=tmp_path / "again" / "assets")
    with pytest.raises(ValueError, match="torchtitan kind"):
        write_sample(tmp_path / "llama", SampleConfig(), assets_dir=tmp_path / "llama-assets")


@pytest.mark.parametrize("experts", [0, 4], ids=["llama3", "qwen3_moe"])
def test_a_plain_consolidation_is_the_samples_tensors(experts: int, tmp_path: Path) -> None:
    config = small(experts=experts)
    write_sample(tmp_path / "native", config)
    result = mpicons.consolidate(tmp_path / "native", tmp_path / "out", comm=SingleProcess(), sync=False)
    expected = sample_expected(config)
    assert result.skipped == ["train_state.step"]
    assert_consolidated(tmp_path / "out", expected, dict.fromkeys(expected, "model.safetensors"))
    assert check_sample(tmp_path / "out", config, MPI.COMM_SELF) == len(expected)


@pytest.mark.parametrize("experts", [0, 4], ids=["llama3", "qwen3_moe"])
def test_the_adapter_writes_the_reference_conversion(experts: int, tmp_path: Path) -> None:
    """``--adapter torchtitan`` on the sample at 3 ranks with 4 KiB blocks: torchtitan's ``to_hf`` of the
    sample's tensors (checked above against torchtitan's own) in safetensors' serializer's bytes."""
    config = small(experts=experts)
    write_sample(tmp_path / "native", config, assets_dir=tmp_path / "hf-assets")
    out = tmp_path / "out"
    proc, _ = cli(
        3, "consolidate", tmp_path / "native", out, "--adapter", "torchtitan", "--hf-assets", tmp_path / "hf-assets",
        "--buffer-size", "4K", "--no-sync", timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    expected = hf_expected(config)
    assert_consolidated(out, expected, dict.fromkeys(expected, "model.safetensors"))
    assert json.loads((out / "config.json").read_text()) == hf_config(config)
    assert "optimizer" in proc.stdout + proc.stderr


WRITE_WITH_RANKS = """
import sys
from mpi4py import MPI
from mpicons.sample import SampleConfig, write_sample
config = SampleConfig(**{**eval(sys.argv[2])})
write_sample(sys.argv[1], config, MPI.COMM_WORLD, assets_dir=sys.argv[1] + "-assets")
"""


def test_the_sample_written_by_two_ranks_consolidates_the_same(tmp_path: Path) -> None:
    """Training ranks dealt to 2 writing ranks (the metadata and assets written once, last)."""
    config = small(experts=4)
    fields = {k: getattr(config, k) for k in config.__dataclass_fields__}
    proc, _ = mpirun(2, ["-c", WRITE_WITH_RANKS, str(tmp_path / "native"), repr(fields)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "native-assets" / "config.json").is_file()
    assert len(list((tmp_path / "native").glob("__*_0.distcp"))) == config.world
    mpicons.consolidate(tmp_path / "native", tmp_path / "out", comm=SingleProcess(), sync=False)
    assert load_tensors(tmp_path / "out" / "model.safetensors") == sample_expected(config)
