"""``--adapter megatron`` end to end, on checkpoints Megatron-LM itself wrote (tests/fixtures/megatron).

For every fixture, from the run's directory and from the iteration's, with the model's assets and with
a config derived from the run's args: every tensor equals ``expected/`` (the Hugging Face model the
Megatron model was built from), every file is what safetensors' serializer writes for them, and
transformers loads the result with no missing or unexpected keys and the expected model's logits.
The adapter is chosen by the input (a Megatron checkpoint) and its rules by the config's model_type.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_manifest, cli, load_tensors, reference_bytes, run_python, transformers_reports
from megatron_cases import CASES, ITERATION, NUMPY_DTYPES, checkpoint, expected_dir, hf_assets, iteration_dir, verify_record

import mpicons
from mpicons.comm import SingleProcess

GIVEN = ("run", "iteration")
CONFIGS = ("assets", "derived")
TIMEOUT = 180
SCRIPTS = Path(__file__).parent / "scripts"
#: Fields a derived config leaves to transformers' defaults, which the models' own configs spell out.
LEFT_TO_DEFAULTS = {"bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "initializer_range"}


def source(case: str, given: str) -> Path:
    return checkpoint(case) if given == "run" else iteration_dir(case)


def options(case: str, config: str) -> list[str]:
    return ["--hf-assets", str(hf_assets(case))] if config == "assets" else []


def run_cli(ranks: int, *args: object) -> subprocess.CompletedProcess:
    """``mpicons ARGS`` at ``ranks`` ranks; one rank runs without a launcher."""
    if ranks == 1:
        return run_python("-m", "mpicons", *args, timeout=TIMEOUT)
    return cli(ranks, *args, timeout=TIMEOUT)[0]


def tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() if p.is_file() else b"<not a regular file>" for p in sorted(directory.iterdir())}


@dataclass
class Run:
    out: Path
    result: mpicons.ConsolidateResult


@pytest.fixture(scope="module")
def serial(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str, str], Run]:
    """The one-process consolidation of each (case, given, config), made on first use through the API."""
    made: dict[tuple[str, str, str], Run] = {}

    def get(case: str, given: str, config: str) -> Run:
        if (case, given, config) not in made:
            out = tmp_path_factory.mktemp(f"{case}-{given}-{config}") / "hf"
            assets = hf_assets(case) if config == "assets" else None
            result = mpicons.consolidate(source(case, given), out, hf_assets=assets, comm=SingleProcess(), sync=False)
            made[case, given, config] = Run(out, result)
        return made[case, given, config]

    return get


def assert_expected_model(out: Path, case: str, config: str) -> None:
    """``expected/``'s tensors in the serializer's bytes, and the model's files beside them."""
    expected = load_tensors(expected_dir(case) / "model.safetensors")
    assert load_tensors(out / "model.safetensors") == expected
    assert (out / "model.safetensors").read_bytes() == reference_bytes(expected)
    assert_manifest(out)
    own = hf_assets(case)
    if config == "assets":
        assert sorted(p.name for p in out.iterdir()) == [
            "SHA256SUMS",
            "config.json",
            "generation_config.json",
            "model.safetensors",
        ]
        for name in ("config.json", "generation_config.json"):
            assert (out / name).read_bytes() == (own / name).read_bytes()
        return
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "config.json", "model.safetensors"]
    derived, want = (json.loads((d / "config.json").read_text()) for d in (out, own))
    shared = set(derived) & set(want)
    assert {k: derived[k] for k in shared} == {k: want[k] for k in shared}
    assert set(want) - set(derived) <= LEFT_TO_DEFAULTS | {"attention_dropout", "hidden_act", "use_cache", "layer_types",
        "max_window_layers", "sliding_window", "use_sliding_window", "pretraining_tp", "output_router_logits",
        "router_aux_loss_coef", "mlp_only_layers", "decoder_sparse_step", "mlp_bias", "attention_bias"}  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("given", GIVEN)
@pytest.mark.parametrize("case", CASES)
def test_one_process_writes_the_expected_model(
    serial: Callable[[str, str, str], Run], case: str, given: str, config: str
) -> None:
    run = serial(case, given, config)
    assert_expected_model(run.out, case, config)
    notes = run.result.input_notes
    assert any("iteration 10" in note for note in notes), notes
    assert any("adapter megatron: chosen because the input is a Megatron-Core torch_dist checkpoint" in n for n in notes)
    said = "agrees with the run's args" if config == "assets" else "config.json derived from the run's args"
    assert any(said in note for note in notes), notes
    assert run.result.skipped == sorted(verify_record(case)["dcp_nontensor_keys"])


# ---------------------------------------------------------------- transformers loads it


@pytest.fixture(scope="module")
def loaded(serial: Callable[[str, str, str], Run]) -> dict[tuple[str, str, str], dict]:
    """What transformers makes of every output, beside the expected model: one subprocess for all
    (importing torch and transformers is most of the time, and would weigh on every later test here)."""
    keys = [(case, given, config) for case in CASES for given in GIVEN for config in CONFIGS]
    groups = [(expected_dir(case), [serial(case, given, config).out for given in GIVEN for config in CONFIGS]) for case in CASES]
    lines = transformers_reports(groups, timeout=TIMEOUT)
    return dict(zip(keys, lines))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("given", GIVEN)
@pytest.mark.parametrize("case", CASES)
def test_transformers_loads_it_with_the_expected_logits(loaded: dict, case: str, given: str, config: str) -> None:
    """``from_pretrained`` in fp32: no missing, unexpected or mismatched keys, the expected model's class,
    config and logits (bit for bit: the same weights); a derived config differs only in what it leaves
    to transformers' defaults."""
    report = loaded[case, given, config]
    assert (report["missing_keys"], report["unexpected_keys"], report["mismatched_keys"]) == ([], [], [])
    assert report["equal"], f"logits differ by {report['max_diff']}"
    assert report["cls"] == json.loads((hf_assets(case) / "config.json").read_text())["architectures"][0]
    allowed = set() if config == "assets" else LEFT_TO_DEFAULTS | {"_name_or_path"}
    assert set(report["config_differs"]) <= allowed | {"_name_or_path"}, report["config_differs"]


# ---------------------------------------------------------------- 1-4 ranks: the one-process output

#: (case, ranks, given, config): each case, each input and config and each rank count once by default.
SPREAD = [
    ("llama-tp2", 1, "iteration", "derived"),
    ("llama-tp2", 2, "run", "assets"),
    ("qwen3-pp2", 3, "iteration", "derived"),
    ("qwen3moe-ep2", 4, "run", "derived"),
    ("qwen3moe-ep2", 2, "iteration", "assets"),
    ("qwen2-tp2", 3, "run", "derived"),
    ("qwen2-tp2", 2, "iteration", "assets"),
    ("deepseekv3-ep2", 1, "run", "assets"),
    ("deepseekv3-ep2", 2, "iteration", "derived"),
    ("deepseekv3-ep2", 3, "run", "derived"),
]
EVERY = [(c, k, g, a) for c in CASES for k in (1, 2, 3, 4) for g in GIVEN for a in CONFIGS if (c, k, g, a) not in SPREAD]


def _ranks_write_it(serial: Callable[[str, str, str], Run], case: str, ranks: int, given: str, config: str, tmp: Path) -> None:
    out = tmp / "hf"
    proc = run_cli(ranks, "consolidate", source(case, given), out, *options(case, config), "--no-sync")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert tree(out) == tree(serial(case, given, config).out)
    assert "adapter megatron: chosen because" in proc.stdout and "iteration 10" in proc.stdout, proc.stdout
    assert "skipped" in proc.stdout and "_extra_state/shard_" in proc.stdout


@pytest.mark.parametrize(("case", "ranks", "given", "config"), SPREAD)
def test_ranks_write_the_one_process_output(serial, case: str, ranks: int, given: str, config: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _ranks_write_it(serial, case, ranks, given, config, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "ranks", "given", "config"), EVERY)
def test_every_rank_count_writes_the_one_process_output(
    serial, case: str, ranks: int, given: str, config: str, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    _ranks_write_it(serial, case, ranks, given, config, tmp_path)


# ---------------------------------------------------------------- layouts no fixture holds (written by torch's DCP)


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch writes these checkpoints")


@needs_torch
@pytest.mark.parametrize(
    ("kind", "case"),
    [
        ("optimizer", CASES[0]),
        ("nemo", CASES[2]),
        ("distributed-optimizer", "qwen2-tp2"),
        ("distributed-optimizer", "deepseekv3-ep2"),
    ],
)
def test_optimizer_state_and_nemo2_give_the_expected_model(kind: str, case: str, tmp_path: Path) -> None:
    made = tmp_path / "ckpt"
    proc = run_python(SCRIPTS / "megatron_variants.py", iteration_dir(case), made, kind, timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(2, "consolidate", made, tmp_path / "hf", "--hf-assets", hf_assets(case), "--no-sync")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_expected_model(tmp_path / "hf", case, "assets")
    assert "optimizer.**" in proc.stdout and "skipped" in proc.stdout, proc.stdout


@needs_torch
@pytest.mark.parametrize(("kind", "case"), [("fp32-main", "qwen2-tp2"), ("fully-reshardable", "deepseekv3-ep2")])
def test_the_fp32_main_parameters_are_taken_instead_when_asked(kind: str, case: str, tmp_path: Path) -> None:
    """A run whose optimizer keeps fp32 main weights per parameter: those, mapped like the model's, in fp32."""
    made = tmp_path / "ckpt"
    proc = run_python(SCRIPTS / "megatron_variants.py", iteration_dir(case), made, kind, timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(2, "consolidate", made, tmp_path / "hf", "--main-params", "--no-sync")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the optimizer's fp32 main parameters" in proc.stdout, proc.stdout
    got = load_tensors(tmp_path / "hf" / "model.safetensors")
    want = {}
    for name, (dtype, shape, data) in load_tensors(expected_dir(case) / "model.safetensors").items():
        main = np.frombuffer(data, dtype=NUMPY_DTYPES[dtype]).astype(np.float32)
        if name.endswith("e_score_correction_bias"):  # a buffer: the model's own, fp32 already
            want[name] = (dtype, shape, data)
            continue
        want[name] = ("F32", shape, (main + main * np.float32(2.0**-12)).tobytes())  # as the variant made them
    assert got == want
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == reference_bytes(want)


# ---------------------------------------------------------------- inspect and verify through the adapter


@pytest.mark.parametrize("case", CASES)
def test_inspect_shows_the_mapping_and_the_iteration(case: str, tmp_path: Path) -> None:
    report = mpicons.inspect(checkpoint(case), comm=SingleProcess())
    assert report.ok, report.problems
    assert report.adapter is not None and report.adapter.startswith("megatron:")
    rows = {row.source: row for row in report.mapping_rows}
    written = {name for row in rows.values() if row.fate == "written" for name in row.targets}
    assert written == set(load_tensors(expected_dir(case) / "model.safetensors")) == {t.name for t in report.tensors}
    source, target = MAPPED[case.split("-")[0]]
    row = rows[source]
    assert target in row.targets and ":" in row.rule
    assert any("iteration 10" in note for note in report.notes)
    assert report.skipped == sorted(verify_record(case)["dcp_nontensor_keys"])
    assert "note: adapter megatron: chosen" in report.table(limit=0) and not list(tmp_path.iterdir())


#: A saved tensor of each family and one Hugging Face tensor its rule makes (a split for the GQA families).
QKV = ("decoder.layers.self_attention.linear_qkv.weight", "model.layers.0.self_attn.k_proj.weight")
MAPPED = {
    **dict.fromkeys(("llama", "qwen3", "qwen3moe", "qwen2"), QKV),
    "deepseekv3": ("decoder.layers.0.self_attention.linear_kv_up_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"),
}


def _flip_a_byte(out: Path, name: str) -> None:
    with open(out / "model.safetensors", "r+b") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        at = 8 + length + header[name]["data_offsets"][0] + 2
        handle.seek(at)
        value = handle.read(1)
        handle.seek(at)
        handle.write(bytes([value[0] ^ 0xFF]))


@pytest.mark.parametrize("case", CASES)
def test_verify_compares_through_the_adapter(serial: Callable[[str, str, str], Run], case: str, tmp_path: Path) -> None:
    out = serial(case, "run", "derived").out
    proc = run_cli(2, "verify", out, "--against", checkpoint(case))
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    name = MAPPED[case.split("-")[0]][1].replace("layers.0", "layers.1")
    _flip_a_byte(broken, name)
    proc = run_cli(1, "verify", broken, "--against", iteration_dir(case))
    assert proc.returncode == 1 and name in proc.stdout, proc.stdout + proc.stderr


def test_the_adapter_named_gives_the_same_output(serial: Callable[[str, str, str], Run], tmp_path: Path) -> None:
    """``--adapter megatron`` said outright is what the input chooses; ``{ITERATION}`` read through the run."""
    case = CASES[0]
    mpicons.consolidate(checkpoint(case), tmp_path / "hf", adapter="megatron", comm=SingleProcess(), sync=False)
    assert tree(tmp_path / "hf") == tree(serial(case, "run", "derived").out)
    assert ITERATION in str(iteration_dir(case))


def test_adapter_none_keeps_megatron_s_own_tensors(tmp_path: Path) -> None:
    """``--adapter none``: Megatron's names and layouts as saved (the padded vocabulary too), no adapter chosen."""
    case = CASES[0]
    result = mpicons.consolidate(checkpoint(case), tmp_path / "raw", adapter="none", comm=SingleProcess(), sync=False)
    assert result.adapted == [] and not any("chosen because" in note for note in result.input_notes), result.input_notes
    raw = load_tensors(tmp_path / "raw" / "model.safetensors")
    embedding = load_tensors(expected_dir(case) / "model.safetensors")["model.embed_tokens.weight"]
    dtype, shape, data = raw["embedding.word_embeddings.weight"]
    assert dtype == embedding[0] and shape[1:] == embedding[1][1:] and shape[0] > embedding[1][0], (shape, embedding[1])
    assert data[: len(embedding[2])] == embedding[2]  # the vocabulary's rows, then the padding
    assert any(name.startswith("decoder.layers.") for name in raw) and not any(name.startswith("model.") for name in raw)


@needs_torch
def test_main_params_are_refused_where_the_checkpoint_names_no_parameter(tmp_path: Path) -> None:
    """The distributed optimizer's default form keeps flat buckets: --main-params says so (exit 2) and
    what to do; so does an input that is no Megatron run, and --main-params with --include."""
    made = tmp_path / "ckpt"
    proc = run_python(SCRIPTS / "megatron_variants.py", iteration_dir("qwen2-tp2"), made, "distributed-optimizer", timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(1, "consolidate", made, tmp_path / "hf", "--main-params")
    assert proc.returncode == 2 and "flat per-bucket buffers (dp_reshardable)" in proc.stderr, proc.stderr
    assert "leave out --main-params" in proc.stderr and not (tmp_path / "hf").exists()
    plain = Path(__file__).parent / "fixtures" / "distcp" / "fsdp-3ranks" / "dcp"
    proc = run_cli(1, "inspect", plain, "--main-params")
    assert proc.returncode == 2 and "only a Megatron run" in proc.stderr, proc.stderr
    proc = run_cli(1, "consolidate", made, tmp_path / "hf", "--main-params", "--include", "decoder.*")
    assert proc.returncode == 2 and "leave out --include" in proc.stderr, proc.stderr
