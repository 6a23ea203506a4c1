"""``--adapter torchtitan`` end to end, on checkpoints torchtitan itself wrote (tests/fixtures/torchtitan).

The expected tensors are torchtitan's own ``to_hf`` of the unsharded model (``ref/full_hf.safetensors``),
the expected files are what safetensors' serializer writes for them, laid out as the assets' index
says; transformers must load the result with no missing or unexpected keys and reproduce the
reference logits. What each reference is: the fixtures' README.md, FACTS.md and ``ref/NOTES.txt``.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import json
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from helpers import assert_manifest, cli, load_tensors, reference_bytes, run_python, subprocess_env

import mpicons
from mpicons.comm import SingleProcess

TITAN = Path(__file__).parent / "fixtures" / "torchtitan"
CASES = ("llama3-fsdp2", "qwen3moe-fsdp2")
SOURCES = ("native", "native-model-only")
INDEX = "model.safetensors.index.json"
ASSET_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
#: torchtitan's non-model state groups in an interval save (FACTS.md §1): never in the output.
NON_MODEL = ("optimizer", "lr_scheduler", "dataloader", "train_state")
#: What an fp32 Hugging Face forward must reproduce (NOTES.txt: qwen3moe's stock logits ran its experts in bf16).
LOGITS = {"llama3-fsdp2": ("logits.pt", 1e-4), "qwen3moe-fsdp2": ("logits_fp32experts.pt", 1e-4)}
#: model entries torchtitan's to_hf drops on purpose (FACTS.md §6), per layer: to be reported by name.
DROPPED = {"llama3-fsdp2": (), "qwen3moe-fsdp2": ("layers.{N}.moe.expert_bias_E",)}
#: an optimizer tensor's name in the native .metadata, and a model-looking name of the same length
#: that no adapter rule knows (pickled as SHORT_BINUNICODE, so a byte replacement keeps the pickle valid).
RENAMED = ("optimizer.state.norm.weight.step", "layers.0.attention.sink_b.weight")
TIMEOUT = 120


def assets(case: str) -> Path:
    return TITAN / case / "hf-assets"


def adapter_args(case: str, hf_assets: Path | None = None) -> list[str]:
    return ["--adapter", "torchtitan", "--hf-assets", str(hf_assets or assets(case))]


def run_cli(ranks: int, *args: object) -> subprocess.CompletedProcess:
    """``mpicons ARGS`` at ``ranks`` ranks; one rank runs without a launcher."""
    if ranks == 1:
        return run_python("-m", "mpicons", *args, timeout=TIMEOUT)
    return cli(ranks, *args, timeout=TIMEOUT)[0]


def reference(case: str) -> dict[str, np.ndarray]:
    """torchtitan's to_hf of the unsharded model, read by safetensors itself."""
    return safetensors.numpy.load_file(TITAN / case / "ref" / "full_hf.safetensors")


def asset_weight_map(case: str) -> dict[str, str]:
    return json.loads((assets(case) / INDEX).read_text())["weight_map"]


def tree(directory: Path) -> dict[str, bytes]:
    """Every entry of ``directory`` with its bytes (a subdirectory or a hidden leftover fails the comparison)."""
    return {p.name: p.read_bytes() if p.is_file() else b"<not a regular file>" for p in sorted(directory.iterdir())}


def by_file(weight_map: dict[str, str]) -> dict[str, list[str]]:
    files: dict[str, list[str]] = {}
    for name, file_name in weight_map.items():
        files.setdefault(file_name, []).append(name)
    return files


def assert_layout(out: Path, case: str, converted: bool = False) -> dict[str, str]:
    """The weight files the assets' index names, that index, and the assets beside them, nothing else.
    With a dtype conversion the copied config may say the new dtype: only its dtype fields may differ."""
    weight_map = asset_weight_map(case)
    assert sorted(p.name for p in out.iterdir()) == sorted({"SHA256SUMS", *weight_map.values(), INDEX, *ASSET_FILES})
    assert_manifest(out)
    assert json.loads((out / INDEX).read_text())["weight_map"] == weight_map
    for name in ASSET_FILES:
        if converted and name == "config.json":
            got, want = (json.loads((d / name).read_text()) for d in (out, assets(case)))
            assert {k: v for k, v in got.items() if "dtype" not in k} == {k: v for k, v in want.items() if "dtype" not in k}
            continue
        assert (out / name).read_bytes() == (assets(case) / name).read_bytes(), f"{name} differs from the assets'"
    return weight_map


def assert_hf_checkpoint(out: Path, case: str, scratch: Path) -> None:
    """Every tensor equals to_hf's; every file is what safetensors' serializer writes for its tensors."""
    expected = reference(case)
    weight_map = assert_layout(out, case)
    assert set(weight_map) == set(expected)
    index = json.loads((out / INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in expected.values())
    for file_name, names in by_file(weight_map).items():
        got = safetensors.numpy.load_file(out / file_name)
        assert sorted(got) == sorted(names), file_name
        for name in names:
            want = expected[name]
            assert (got[name].dtype, got[name].shape) == (want.dtype, want.shape), f"{file_name}: {name}"
            assert got[name].tobytes() == want.tobytes(), f"{file_name}: {name} differs from to_hf's"
        serialized = scratch / file_name
        safetensors.numpy.save_file({n: expected[n] for n in names}, serialized, metadata={"format": "pt"})
        assert (out / file_name).read_bytes() == serialized.read_bytes(), f"{file_name}: not the serializer's bytes"


@dataclass
class Run:
    out: Path
    text: str  # what the command printed (empty for an API run)
    report: object  # the --stats-json report, or the API's result


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Run]:
    """The one-rank consolidation of each (case, source), made on first use: ``native`` through the
    command line (its printed report is checked), ``native-model-only`` through the API."""
    made: dict[tuple[str, str], Run] = {}

    def get(case: str, source: str) -> Run:
        if (case, source) not in made:
            work = tmp_path_factory.mktemp(f"{case}-{source}")
            out = work / "hf"
            if source == "native":
                stats = work / "stats.json"
                proc = run_cli(1, "consolidate", TITAN / case / source, out, *adapter_args(case), "--stats-json", stats)
                assert proc.returncode == 0, proc.stdout + proc.stderr
                made[case, source] = Run(out, proc.stdout + proc.stderr, json.loads(stats.read_text()))
            else:
                result = mpicons.consolidate(
                    TITAN / case / source, out, adapter="torchtitan", hf_assets=assets(case), comm=SingleProcess()
                )
                made[case, source] = Run(out, "", result)
        return made[case, source]

    return get


# ---------------------------------------------------------------- one rank: exactly torchtitan's to_hf


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("case", CASES)
def test_one_rank_writes_to_hf(one_rank: Callable[[str, str], Run], case: str, source: str, tmp_path: Path) -> None:
    assert_hf_checkpoint(one_rank(case, source).out, case, tmp_path)


def saved_groups(case: str) -> dict[str, tuple[int, int]]:
    """Top-level group → (tensors, non-tensor entries) of ``native``, as the fixture's NOTES.txt counted them."""
    notes = (TITAN / case / "ref" / "NOTES.txt").read_text()
    found = re.search(r"native top-level groups \(tensors, non-tensor entries\): (\{.*\})", notes)
    assert found, "NOTES.txt: no count of the native groups"
    return {group: (tensors, others) for group, (tensors, others) in ast.literal_eval(found.group(1)).items()}


@pytest.mark.parametrize("case", CASES)
def test_non_model_state_and_dropped_entries_are_reported(one_rank: Callable[[str, str], Run], case: str) -> None:
    """The optimizer, lr_scheduler, dataloader and train_state of an interval save are left out, and
    the printed report says so: the optimizer's tensors counted and named by group, the non-tensor
    entries counted, every entry to_hf drops (qwen3's expert_bias_E) named, in the JSON report too."""
    run = one_rank(case, "native")
    written = {name for p in run.out.glob("*.safetensors") for name in safetensors.numpy.load_file(p)}
    assert not [name for name in written if name.split(".")[0] in NON_MODEL]
    groups = saved_groups(case)
    assert sorted(groups) == sorted({"model", *NON_MODEL})
    lines = run.text.splitlines()
    skipped_tensors = sum(groups[g][0] for g in NON_MODEL)
    assert any(str(skipped_tensors) in line and "optimizer" in line for line in lines), run.text
    assert any(str(sum(groups[g][1] for g in NON_MODEL)) in line for line in lines), run.text
    layers = json.loads((assets(case) / "config.json").read_text())["num_hidden_layers"]
    said = json.dumps(run.report)
    for pattern in DROPPED[case]:
        for layer in range(layers):
            name = pattern.format(N=layer)
            assert name in run.text and name in said, f"{name} is not named in the report:\n{run.text}"


# ---------------------------------------------------------------- any number of ranks: the same bytes


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", CASES)
def test_ranks_write_the_one_rank_output(one_rank: Callable[[str, str], Run], case: str, ranks: int, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    proc = run_cli(ranks, "consolidate", TITAN / case / "native", out, *adapter_args(case))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert tree(out) == tree(one_rank(case, "native").out)


# ---------------------------------------------------------------- transformers loads it


LOAD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM

for out, tokens, logits in zip(*[iter(sys.argv[1:])] * 3):
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    with torch.no_grad():
        got = model(torch.load(tokens, weights_only=True).reshape(1, -1)).logits[0]
    want = torch.load(logits, weights_only=True)
    report = {key: sorted(map(str, info[key])) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    report.update(dtype=str(next(model.parameters()).dtype), shape=list(got.shape), want=list(want.shape))
    report["max_diff"] = (got - want).abs().max().item() if got.shape == want.shape else None
    print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def loaded(one_rank: Callable[[str, str], Run]) -> dict[str, dict]:
    """What transformers makes of each case's output: one subprocess for all cases, since importing
    torch and transformers is most of the time (and would weigh on every later test in this process)."""
    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (tests/run.sh installs it with torch)")
    args = []
    for case in CASES:
        ref = TITAN / case / "ref"
        args += [str(one_rank(case, "native").out), str(ref / "tokens.pt"), str(ref / LOGITS[case][0])]
    proc = subprocess.run(
        [sys.executable, "-c", LOAD, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=subprocess_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
    )
    assert proc.returncode == 0, proc.stderr
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == len(CASES), proc.stdout + proc.stderr
    return dict(zip(CASES, reports))


@pytest.mark.parametrize("case", CASES)
def test_transformers_loads_it_with_the_reference_logits(loaded: dict[str, dict], case: str) -> None:
    """``from_pretrained`` in fp32: no missing, unexpected or mismatched keys, and the reference logits."""
    report = loaded[case]
    logits, atol = LOGITS[case]
    assert (report["missing_keys"], report["unexpected_keys"], report["mismatched_keys"]) == ([], [], [])
    assert report["dtype"] == "torch.float32"
    assert report["shape"] == report["want"]
    assert report["max_diff"] <= atol, f"logits differ from {logits} by {report['max_diff']}"


# ---------------------------------------------------------------- bad input: exit 2 before any work


def _no_weights(out: Path) -> bool:
    return not out.exists() or not list(out.glob("*.safetensors"))


def renamed_native(case: str, directory: Path) -> Path:
    """A copy of ``native`` whose optimizer step tensor of ``norm.weight`` is renamed to a model-looking
    key no rule knows (only the .metadata pickle names it: the .distcp items are found by offset)."""
    copy = directory / "native"
    shutil.copytree(TITAN / case / "native", copy)
    old, new = (s.encode() for s in RENAMED)
    metadata = (copy / ".metadata").read_bytes()
    pickled = (bytes([0x8C, len(old)]) + old, bytes([0x8C, len(new)]) + new)
    assert metadata.count(pickled[0]) == 2  # the state_dict_metadata key and its MetadataIndex
    (copy / ".metadata").write_bytes(metadata.replace(*pickled))
    return copy


@pytest.mark.parametrize("case", CASES)
def test_an_unknown_model_key_is_refused_until_excluded(one_rank: Callable[[str, str], Run], case: str, tmp_path: Path) -> None:
    native = renamed_native(case, tmp_path)
    out = tmp_path / "hf"
    proc = run_cli(1, "consolidate", native, out, *adapter_args(case))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert RENAMED[1] in proc.stderr
    assert _no_weights(out)
    proc = run_cli(1, "consolidate", native, out, *adapter_args(case), "--exclude", RENAMED[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert tree(out) == tree(one_rank(case, "native").out)


def test_the_adapter_needs_hf_assets(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    proc = run_cli(1, "consolidate", TITAN / CASES[0] / "native-model-only", out, "--adapter", "torchtitan")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "hf-assets" in proc.stderr
    assert _no_weights(out)


def test_a_model_type_without_rules_is_named(tmp_path: Path) -> None:
    hf_assets = tmp_path / "assets"
    shutil.copytree(assets(CASES[0]), hf_assets)
    config = json.loads((hf_assets / "config.json").read_text())
    config["model_type"] = "gpt2"
    (hf_assets / "config.json").write_text(json.dumps(config))
    out = tmp_path / "hf"
    proc = run_cli(1, "consolidate", TITAN / CASES[0] / "native-model-only", out, *adapter_args(CASES[0], hf_assets))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpt2" in proc.stderr
    assert _no_weights(out)


# ---------------------------------------------------------------- a user's rule file


#: torchtitan's llama3 → Hugging Face, written from FACTS.md §3-4 as a user would: no model_type line,
#: no tied-embedding rule, the head size computed from hidden_size instead of read from head_dim.
Q_ROWS = "rope_to_half(num_attention_heads, hidden_size // num_attention_heads)"
K_ROWS = "rope_to_half(num_key_value_heads, hidden_size // num_attention_heads)"
USER_RULES = f"""\
# my llama3 rules
skip optimizer.** lr_scheduler.** dataloader.** train_state.**
tok_embeddings.weight  model.embed_tokens.weight
norm.weight  model.norm.weight
lm_head.weight  lm_head.weight
layers.{{N}}.attention.qkv_linear.wq.weight  model.layers.{{N}}.self_attn.q_proj.weight  {Q_ROWS}
layers.{{N}}.attention.qkv_linear.wk.weight  model.layers.{{N}}.self_attn.k_proj.weight  {K_ROWS}
layers.{{N}}.attention.qkv_linear.wv.weight  model.layers.{{N}}.self_attn.v_proj.weight
layers.{{N}}.attention.wo.weight  model.layers.{{N}}.self_attn.o_proj.weight
layers.{{N}}.attention_norm.weight  model.layers.{{N}}.input_layernorm.weight
layers.{{N}}.ffn_norm.weight  model.layers.{{N}}.post_attention_layernorm.weight
layers.{{N}}.feed_forward.w1.weight  model.layers.{{N}}.mlp.gate_proj.weight
layers.{{N}}.feed_forward.w3.weight  model.layers.{{N}}.mlp.up_proj.weight
layers.{{N}}.feed_forward.w2.weight  model.layers.{{N}}.mlp.down_proj.weight
"""


def test_a_user_rule_file_gives_the_built_in_output(one_rank: Callable[[str, str], Run], tmp_path: Path) -> None:
    case = CASES[0]
    rules = tmp_path / "llama3.rules"
    rules.write_text(USER_RULES)
    out = tmp_path / "hf"
    mpicons.consolidate(TITAN / case / "native", out, adapter=str(rules), hf_assets=assets(case), comm=SingleProcess())
    assert_hf_checkpoint(out, case, tmp_path)
    assert tree(out) == tree(one_rank(case, "native").out)


def test_a_rule_file_lacking_a_rule_names_the_key(tmp_path: Path) -> None:
    case = CASES[0]
    rules = tmp_path / "llama3.rules"
    rules.write_text("".join(line for line in USER_RULES.splitlines(keepends=True) if not line.startswith("norm.")))
    out = tmp_path / "hf"
    proc = run_cli(1, "consolidate", TITAN / case / "native", out, "--adapter", rules, "--hf-assets", assets(case))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"(?<![\w.])norm\.weight", proc.stderr), proc.stderr
    assert _no_weights(out)


def test_a_bad_rule_is_named_by_its_line(tmp_path: Path) -> None:
    """A target capture the source does not have: refused before anything is read, naming FILE:LINE."""
    case = CASES[0]
    lines = USER_RULES.splitlines(keepends=True)
    bad = next(i for i, line in enumerate(lines) if line.startswith("layers.{N}.feed_forward.w2"))
    lines[bad] = lines[bad].replace("layers.{N}.", "layers.*.", 1)
    rules = tmp_path / "llama3.rules"
    rules.write_text("".join(lines))
    out = tmp_path / "hf"
    proc = run_cli(1, "consolidate", TITAN / case / "native", out, "--adapter", rules, "--hf-assets", assets(case))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{rules}:{bad + 1}" in proc.stderr, proc.stderr
    assert _no_weights(out)


# ---------------------------------------------------------------- per-tensor dtype rules


@pytest.mark.parametrize("case", CASES)
def test_bf16_keeps_the_norms_in_f32(case: str, tmp_path: Path) -> None:
    """``--dtype bf16 --keep-dtype '*norm*'``: the norms stay F32, everything else is to_hf's tensor
    rounded to nearest even (ml_dtypes' conversion), in the files the assets' index names."""
    out = tmp_path / "hf"
    args = ("consolidate", TITAN / case / "native-model-only", out, *adapter_args(case), "--dtype", "bf16")
    proc = run_cli(1, *args, "--keep-dtype", "*norm*")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = {}
    for name, array in reference(case).items():
        kept = fnmatch.fnmatchcase(name, "*norm*")
        converted = array if kept else array.astype(ml_dtypes.bfloat16)
        expected[name] = ("F32" if kept else "BF16", list(array.shape), converted.tobytes())
    assert {dtype for dtype, _, _ in expected.values()} == {"F32", "BF16"}
    weight_map = assert_layout(out, case, converted=True)
    assert json.loads((out / INDEX).read_text())["metadata"]["total_size"] == sum(len(d) for _, _, d in expected.values())
    for file_name, names in by_file(weight_map).items():
        got = load_tensors(out / file_name)
        assert sorted(got) == sorted(names), file_name
        for name in names:
            assert got[name] == expected[name], f"{file_name}: {name}"
        assert (out / file_name).read_bytes() == reference_bytes({n: expected[n] for n in names}), file_name


# ---------------------------------------------------------------- inspect and verify through the adapter


@pytest.mark.parametrize("case", CASES)
def test_inspect_shows_the_mapping_without_writing(case: str, tmp_path: Path) -> None:
    """Every saved tensor has one row: its Hugging Face names (those of to_hf), transform, rule line, fate."""
    report = mpicons.inspect(TITAN / case / "native", adapter="torchtitan", hf_assets=assets(case), comm=SingleProcess())
    assert report.ok, report.problems
    rows = {row.source: row for row in report.mapping_rows}
    written = {name for row in rows.values() if row.fate == "written" for name in row.targets}
    assert written == set(reference(case)) == {t.name for t in report.tensors}
    assert {row.source for row in rows.values() if row.fate == "skipped"} == {
        name for name in rows if name.startswith("optimizer.")
    }
    dropped = sorted(name for name, row in rows.items() if row.fate == "dropped")
    assert dropped == sorted(p.replace("{N}", str(n)) for p in DROPPED[case] for n in range(len(dropped)))
    q = next(row for name, row in rows.items() if name.endswith("layers.0.attention.qkv_linear.wq.weight"))
    assert q.transform == ("rope_to_half" if case.startswith("llama") else "rename") and ":" in q.rule
    if case.startswith("qwen3moe"):
        experts = next(row for name, row in rows.items() if name.endswith("layers.0.moe.routed_experts.inner_experts.w1_EFD"))
        assert experts.transform == "unbind" and len(experts.targets) == 4
    table = report.table(limit=0)
    assert "adapter torchtitan:" in table and "model.layers.0.self_attn.q_proj.weight" in table
    assert report.to_dict()["adapter_mapping"] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("case", CASES)
def test_verify_compares_through_the_adapter(one_rank: Callable[[str, str], Run], case: str, tmp_path: Path) -> None:
    """verify --against NATIVE --adapter: every output tensor matches; a changed q row is found, named."""
    out = one_rank(case, "native").out
    proc = run_cli(2, "verify", out, "--against", TITAN / case / "native", *adapter_args(case))
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    # Without the adapter: one line saying to give it, not a missing and an extra tensor per name.
    proc = run_cli(2, "verify", out, "--against", TITAN / case / "native")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problem, summary = proc.stdout.splitlines()
    assert problem.startswith(f"{out}: ") and problem.endswith(
        "the shards hold torchtitan's names and the output Hugging Face's. If it was written with --adapter torchtitan, "
        "verify with --adapter torchtitan --hf-assets DIR, as it was written"
    ), problem
    assert summary.startswith("mpicons verify: 1 problem:"), summary
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    weights = json.loads((broken / INDEX).read_text())["weight_map"]
    name = "model.layers.0.self_attn.q_proj.weight"
    with open(broken / weights[name], "r+b") as handle:  # flip one byte of that tensor's data
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        begin = 8 + length + header[name]["data_offsets"][0] + 4
        handle.seek(begin)
        value = handle.read(1)
        handle.seek(begin)
        handle.write(bytes([value[0] ^ 0xFF]))
    proc = run_cli(1, "verify", broken, "--against", TITAN / case / "native", *adapter_args(case))
    assert proc.returncode == 1 and name in proc.stdout, proc.stdout + proc.stderr


def test_assets_without_an_adapter_are_published_with_the_weights(tmp_path: Path) -> None:
    """A plain consolidation that also gets its assets; an asset name already in the output needs --force."""
    shards = Path(__file__).parent / "fixtures" / "dcp" / "fsdp2-3ranks" / "sharded"
    hf_assets = tmp_path / "assets"
    hf_assets.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(assets(CASES[0]) / name, hf_assets / name)
    out = tmp_path / "out"
    mpicons.consolidate(shards, out, hf_assets=hf_assets, comm=SingleProcess(), sync=False)
    for name in ("config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (hf_assets / name).read_bytes()
    plain = tmp_path / "plain"
    mpicons.consolidate(shards, plain, comm=SingleProcess(), sync=False)
    asset_names = ("config.json", "tokenizer.json")
    assert {p.name: p.read_bytes() for p in plain.iterdir() if p.name != "SHA256SUMS"} == {
        p.name: p.read_bytes() for p in out.iterdir() if p.name not in ("SHA256SUMS", *asset_names)
    }
    # Both manifests: the same lines but for the assets' (sha256sum's two spaces before each name).
    weights_lines = [line for line in (out / "SHA256SUMS").read_text().splitlines() if line.split("  ", 1)[1] not in asset_names]
    assert (plain / "SHA256SUMS").read_text().splitlines() == weights_lines
    assert_manifest(out)
    again = tmp_path / "again"
    again.mkdir()
    (again / "config.json").write_text("{}")
    with pytest.raises(mpicons.InputError, match="config.json"):
        mpicons.consolidate(shards, again, hf_assets=hf_assets, comm=SingleProcess(), sync=False)
    assert (again / "config.json").read_text() == "{}"
    mpicons.consolidate(shards, again, hf_assets=hf_assets, comm=SingleProcess(), sync=False, force=True)
    assert (again / "config.json").read_bytes() == (hf_assets / "config.json").read_bytes()
