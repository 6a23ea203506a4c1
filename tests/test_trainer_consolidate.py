"""DeepSpeed ZeRO and verl checkpoints consolidated end to end (``mpicons consolidate CKPT OUT``).

The checkpoints are the real libraries' (tests/fixtures/deepspeed, tests/fixtures/verl; the same as
../shared/fixtures when present); every output must be the bytes safetensors' own serializer writes
for the weights gathered from the live training engine (``expected-fp32/``), at one rank in this
process and at 2 and 3 ranks under mpiexec. Then the failures: a hostile pickle, a class nobody
allowed, a missing rank file: each exit 2 on every rank, naming the file.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import cli, load_tensors, reference_bytes, transformers_reports
from trainer_saves import write_verl, write_zero

import mpicons

FIXTURES = Path(__file__).parent / "fixtures"
#: case → (its folder, the checkpoint's run directory, the step directory in it)
CASES = {
    "zero2": (FIXTURES / "deepspeed/llama-zero2", "checkpoint", "checkpoint/global_step2"),
    "zero3": (FIXTURES / "deepspeed/llama-zero3", "checkpoint", "checkpoint/global_step2"),
    "verl": (FIXTURES / "verl/llama-fsdp2", "checkpoint", "checkpoint/global_step_1/actor"),
}
TIMEOUT = 120


def _expected(case: str, dtype: str | None = None) -> dict[str, tuple[str, list[int], bytes]]:
    """The weights the training engine held (fp32), or their rounding to bf16 by numpy (round to nearest even)."""
    tensors = load_tensors(CASES[case][0] / "expected-fp32" / "model.safetensors")
    if dtype is None:
        return tensors
    rounded = {}
    for name, (_, shape, data) in tensors.items():
        value = np.frombuffer(data, dtype=np.float32).astype(ml_dtypes.bfloat16)
        rounded[name] = ("BF16", shape, value.tobytes())
    return rounded


def _assert_written(out: Path, expected: dict[str, tuple[str, list[int], bytes]]) -> None:
    data = (out / "model.safetensors").read_bytes()
    assert load_tensors(out / "model.safetensors") == expected
    assert data == reference_bytes(expected), "bytes differ from safetensors' serializer"


@pytest.mark.parametrize("given", ["run", "step"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_process_writes_the_engines_weights(case: str, given: str, tmp_path: Path) -> None:
    folder, run, step = CASES[case]
    source = folder / (run if given == "run" else step)
    result = mpicons.consolidate(source, tmp_path / "out")
    _assert_written(tmp_path / "out", _expected(case))
    notes = "\n".join(result.input_notes)
    if given == "run":
        assert ("global_step2 (named by" in notes) if case != "verl" else ("step 1 (named by" in notes), notes
    if case == "verl":  # its huggingface/ folder is the assets
        assert (tmp_path / "out" / "tokenizer.json").exists() and "huggingface" in notes, notes
    else:
        assert "optimizer state" in notes and "not read" in notes, notes
        assert not (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("case", ["zero2", "zero3"])
def test_dtype_bf16_rounds_the_masters(case: str, tmp_path: Path) -> None:
    folder, run, _ = CASES[case]
    mpicons.consolidate(folder / run, tmp_path / "out", dtype="bf16", hf_assets=str(folder / "hf"))
    _assert_written(tmp_path / "out", _expected(case, "bf16"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    own = folder / "expected-bf16" / "model.safetensors"  # the module's own 16-bit weights: the masters rounded
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == own.read_bytes()


@pytest.mark.parametrize("ranks, case", [(2, "zero2"), (3, "zero3"), (3, "verl"), (2, "verl")])
def test_ranks_write_the_engines_weights(ranks: int, case: str, tmp_path: Path) -> None:
    folder, run, _ = CASES[case]
    proc, _ = cli(ranks, "consolidate", folder / run, tmp_path / "out", "--no-sync", timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_written(tmp_path / "out", _expected(case))


def _tied_params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "model.embed_tokens.weight": rng.standard_normal((11, 6)).astype(np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((7, 6)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(6).astype(np.float32),
    }


@pytest.mark.parametrize("kind", ["zero2", "zero3", "verl"])
def test_tied_embeddings_are_written_once(kind: str, tmp_path: Path) -> None:
    """What the official converter crashes on: lm_head.weight saved as the embeddings is written once, under their name."""
    params = _tied_params(np.random.default_rng(3))
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    source = tmp_path / "run" / ("actor" if kind == "verl" else "global_step3")  # the output beside the run, not in it
    if kind == "verl":
        write_verl(source, params, 3, tied=tied)
    else:
        write_zero(source, params, 3, int(kind[-1]), tied=tied)
    proc, _ = cli(2, "consolidate", source, tmp_path / "out", "--no-sync", timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = {n: ("F32", list(v.shape), v.tobytes()) for n, v in params.items()}
    _assert_written(tmp_path / "out", expected)
    assert "'lm_head.weight' is tied to 'model.embed_tokens.weight'" in " ".join(proc.stdout.split()), proc.stdout


def _copy(case: str, tmp_path: Path) -> Path:
    folder, _, step = CASES[case]
    target = tmp_path / "ckpt"
    shutil.copytree(folder / step, target)
    return target


def _replace_pickle(path: Path, pickled: bytes) -> None:
    """``path`` rewritten with its ``data.pkl`` replaced (every other record as it was)."""
    with zipfile.ZipFile(path) as old:
        members = [(info, old.read(info)) for info in old.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as new:
        for info, data in members:
            new.writestr(info.filename, pickled if info.filename.endswith("/data.pkl") else data)


@pytest.mark.parametrize(
    "case, file, pickled, phrase",
    [
        (
            "zero3",
            "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
            b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueq\x00\x85R.",
            "os.system",
        ),
        ("verl", "model_world_size_2_rank_1.pt", b"\x80\x02ctorch.distributed.tensor\nReplicate\n)\x81.", "Replicate"),
    ],
    ids=["a payload", "a class nobody allowed"],
)
def test_a_pickle_naming_anything_else_is_refused_on_every_rank(
    case: str, file: str, pickled: bytes, phrase: str, tmp_path: Path
) -> None:
    source = _copy(case, tmp_path)
    _replace_pickle(source / file, pickled)
    proc, _ = cli(2, "consolidate", source, tmp_path / "out", timeout=TIMEOUT)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, said
    assert file in said and phrase in said and "refused without running anything" in said, said
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "case, removed",
    [
        ("zero2", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("zero3", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
        ("verl", "model_world_size_2_rank_1.pt"),
    ],
)
def test_a_missing_rank_file_is_named(case: str, removed: str, tmp_path: Path) -> None:
    source = _copy(case, tmp_path)
    (source / removed).unlink()
    proc, _ = cli(2, "consolidate", source, tmp_path / "out", timeout=TIMEOUT)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and f"{removed}: missing" in said, said


def test_inspect_lists_the_pieces_and_what_is_skipped(tmp_path: Path) -> None:
    folder, run, _ = CASES["zero3"]
    proc, _ = cli(2, "inspect", folder / run, timeout=TIMEOUT)
    said = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "model.embed_tokens.weight" in said and "optimizer state" in said, said


@pytest.mark.parametrize("case", ["zero2", "verl"])
def test_verify_against_the_checkpoint(case: str, tmp_path: Path) -> None:
    folder, run, _ = CASES[case]
    mpicons.consolidate(folder / run, tmp_path / "out")
    proc, _ = cli(2, "verify", tmp_path / "out", "--against", folder / run, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bad = tmp_path / "out" / "model.safetensors"
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0x40
    bad.write_bytes(bytes(data))
    proc, _ = cli(1, "verify", tmp_path / "out", "--against", folder / run, timeout=TIMEOUT)
    assert proc.returncode != 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_transformers_loads_every_output_with_the_engines_logits(tmp_path: Path) -> None:
    groups = []
    for case, (folder, run, _) in CASES.items():
        out, expected = tmp_path / case, tmp_path / f"{case}-expected"
        assets = folder / "hf" if case != "verl" else None
        mpicons.consolidate(folder / run, out, hf_assets=None if assets is None else str(assets))
        expected.mkdir()
        shutil.copy(out / "config.json", expected / "config.json")
        shutil.copy(folder / "expected-fp32" / "model.safetensors", expected / "model.safetensors")
        groups.append((expected, [out]))
    for report in transformers_reports(groups):
        assert (report["missing_keys"], report["unexpected_keys"], report["mismatched_keys"]) == ([], [], [])
        assert report["equal"], report


@pytest.mark.parametrize("given", ["checkpoint-2", "checkpoint-2/pytorch_model_fsdp_0"])
def test_accelerate_fsdp_consolidates_with_its_prefix_removed(given: str, tmp_path: Path) -> None:
    folder = FIXTURES / "accelerate"
    result = mpicons.consolidate(folder / given, tmp_path / "out")
    _assert_written(tmp_path / "out", load_tensors(folder / "expected.safetensors"))
    assert any("'model.' prefix removed" in note for note in result.input_notes), result.input_notes


def test_archives_in_per_rank_directories_are_refused_with_what_to_do(tmp_path: Path) -> None:
    """Per-rank directories are for shards; a ZeRO checkpoint copied into them is named, and the way out said."""
    step = CASES["zero3"][0] / CASES["zero3"][2]
    for rank in range(2):
        shutil.copytree(step, tmp_path / f"ckpt-{rank}")
    proc, _ = cli(2, "consolidate", tmp_path / "ckpt-{rank}", tmp_path / "out", timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{tmp_path / 'ckpt-0'} holds a DeepSpeed ZeRO checkpoint" in proc.stderr and "gather them into one" in proc.stderr
    assert not (tmp_path / "out").exists()
