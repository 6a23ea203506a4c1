"""A checkpoint missing its last training rank's files is refused, never consolidated short.

DCP's Hugging Face layout records no full shapes: without the last rank's shard files the tensors
just look smaller (no hole, no overlap). Each case copies a real torch-written checkpoint without its
last rank's files and shows every door closed: ``{rank}`` directories beyond the job's ranks, the
model's config (``--hf-assets`` or a ``config.json`` beside the input), ``--expect-ranks``; and
``inspect`` / ``verify`` say what they cannot know instead of a bare OK. The command line runs under
``mpiexec`` at 1-3 ranks in subprocesses with timeouts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import DISTCP_FIXTURES, FIXTURES, cli, slow_beyond

import mpicons
from mpicons.adaptation.model_shapes import config_shapes
from mpicons.comm import SingleProcess
from mpicons.core.errors import InputError

EDGE = FIXTURES / "edge-3ranks"  # Llama names and shapes, 3 training ranks, tensors cut along dims 0, 1 and 2
ASSETS = EDGE / "hf-assets"  # its config.json, written by transformers' save_pretrained
FSDP = FIXTURES / "fsdp2-3ranks"  # 3 training ranks, every parameter cut along dim 0
TIMEOUT = 120


def without_last_rank(source: Path, target: Path, last: str = "shard-00003-") -> Path:
    """A copy of the shard directory ``source`` with the last training rank's files left out."""
    target.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if not path.name.startswith(last):
            shutil.copy(path, target / path.name)
    return target


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one error line of a run refused as bad input (exit 2), with no traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mpicons: error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.fixture
def short_edge(tmp_path: Path) -> Path:
    return without_last_rank(EDGE / "sharded", tmp_path / "ckpt" / "sharded")


def test_the_short_checkpoint_is_accepted_as_it_is(short_edge: Path, tmp_path: Path) -> None:
    """What the doors close: without any of them the checkpoint consolidates, 20 tensors short."""
    result = mpicons.consolidate(short_edge, tmp_path / "out", comm=SingleProcess(), sync=False)
    shapes = {t.name: t.shape for t in result.layout.tensors}
    assert shapes["model.embed_tokens.weight"] == (670, 64) and shapes["lm_head.weight"] == (1003, 44)


# ---------------------------------------------------------------- the model's config


@pytest.mark.parametrize("ranks", slow_beyond([2, 1, 3], 1))
def test_hf_assets_refuse_tensors_shorter_than_the_model(short_edge: Path, tmp_path: Path, ranks: int) -> None:
    pytest.importorskip("transformers", reason="the shapes of the model transformers builds are what this names")
    out = tmp_path / "out"
    line = error_line(cli(ranks, "consolidate", short_edge, out, "--hf-assets", ASSETS, timeout=TIMEOUT)[0])
    assert "tensor 'lm_head.weight': shape [1003, 44] in the shards, [1003, 64] in the model" in line
    assert "LlamaForCausalLM, transformers" in line  # the meta-device model transformers builds from config.json
    assert "missing training rank" in line and "19 more tensors" in line
    assert not out.exists()


@pytest.fixture
def without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shapes from the config fields alone, as where transformers is not installed (and fast)."""
    import mpicons.job.model_check as model_check

    monkeypatch.setattr(model_check, "_transformers_shapes", lambda config: None)


def test_a_known_architecture_asks_no_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its config fields decide when every tensor agrees with them: no child process, no torch to import."""
    import mpicons.job.model_check as model_check

    def refuse(config: object) -> None:
        raise AssertionError("transformers asked")

    monkeypatch.setattr(model_check, "_transformers_shapes", refuse)
    result = mpicons.consolidate(EDGE / "sharded", tmp_path / "out", hf_assets=ASSETS, comm=SingleProcess(), sync=False)
    assert len(result.layout.tensors) == 27


def test_an_architecture_the_fields_do_not_know_is_built_by_transformers(short_edge: Path, tmp_path: Path) -> None:
    """Granite has Llama's names and shapes, and no fields mpicons knows: transformers' model decides."""
    pytest.importorskip("transformers")
    granite = json.loads((ASSETS / "config.json").read_text())
    granite.update(model_type="granite", architectures=["GraniteForCausalLM"])
    (tmp_path / "granite").mkdir()
    (tmp_path / "granite" / "config.json").write_text(json.dumps(granite))
    with pytest.raises(InputError, match=r"'lm_head.weight': shape \[1003, 44\].*GraniteForCausalLM, transformers"):
        mpicons.consolidate(short_edge, tmp_path / "out", hf_assets=tmp_path / "granite", comm=SingleProcess())


def test_a_config_beside_the_input_is_checked_too(short_edge: Path, tmp_path: Path, without_transformers: None) -> None:
    """``ckpt/sharded`` with ``ckpt/config.json`` (or the config in ``ckpt/sharded`` itself) counts as given."""
    for place in (short_edge.parent, short_edge):
        shutil.copy(ASSETS / "config.json", place / "config.json")
        with pytest.raises(InputError, match=f"'lm_head.weight': shape .*{place / 'config.json'}, its llama fields"):
            mpicons.consolidate(short_edge, tmp_path / "out", comm=SingleProcess())
        (place / "config.json").unlink()
    (short_edge.parent / "config.json").write_text("{not json")  # not asked for: passed over with a warning
    mpicons.consolidate(short_edge, tmp_path / "out", comm=SingleProcess(), sync=False)


def test_without_transformers_the_config_fields_give_the_shapes(
    short_edge: Path, tmp_path: Path, without_transformers: None
) -> None:
    with pytest.raises(InputError, match=r"'lm_head.weight': shape \[1003, 44\].*config.json, its llama fields"):
        mpicons.consolidate(short_edge, tmp_path / "out", hf_assets=ASSETS, comm=SingleProcess())


def test_only_names_the_model_has_are_checked(tmp_path: Path, without_transformers: None) -> None:
    """The whole checkpoint (with tensors no Llama has: buffers, fp8, a 3-D expert tensor) passes, also
    selected, renamed and converted; a config that does not fit is named as the likely cause."""
    comm = SingleProcess()
    result = mpicons.consolidate(EDGE / "sharded", tmp_path / "all", hf_assets=ASSETS, comm=comm, sync=False)
    assert len(result.layout.tensors) == 27 and "config.json" in result.assets
    mpicons.consolidate(
        EDGE / "sharded", tmp_path / "some", hf_assets=ASSETS, dtype="bf16", include=("model.*",), comm=comm, sync=False
    )
    # Renamed away from the model's names: nothing left to compare, nothing refused.
    mpicons.consolidate(EDGE / "sharded", tmp_path / "renamed", hf_assets=ASSETS, strip_prefix="model.", comm=comm, sync=False)
    other = json.loads((ASSETS / "config.json").read_text()) | {"vocab_size": 1000}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(other))
    with pytest.raises(InputError, match=r"\[1003, 64\] in the shards, \[1000, 64\].*is this config the checkpoint's model"):
        mpicons.consolidate(EDGE / "sharded", tmp_path / "other-out", hf_assets=tmp_path / "other", comm=comm)


FAMILIES = {
    "llama": {"attention_bias": True, "mlp_bias": True},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 24, "attention_bias": True},
    "qwen3_moe": {"num_experts": 3, "moe_intermediate_size": 12, "decoder_sparse_step": 2, "mlp_only_layers": [2]},
}


def test_the_config_fields_agree_with_the_models_transformers_builds() -> None:
    """Each architecture known without transformers: the same names and shapes as transformers' own model
    (its per-expert names, which transformers 5 fuses, against the hub's index naming them)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    base = dict(vocab_size=101, hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4)
    for family, extra in FAMILIES.items():
        settings = {**base, "num_key_value_heads": 2, **extra}
        config = transformers.AutoConfig.for_model(family, **settings)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        built = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        ours = config_shapes({"model_type": family, **config.to_dict()})
        assert ours is not None, family
        assert {n: s for n, s in ours.items() if n in built} == {n: s for n, s in built.items() if n in ours}, family
        fused = {n for n in ours if ".experts." in n}
        assert set(ours) - fused == set(built) - {n for n in built if ".experts." in n}, family
    assets = Path(__file__).parent / "fixtures" / "torchtitan" / "qwen3moe-fsdp2" / "hf-assets"
    index = json.loads((assets / "model.safetensors.index.json").read_text())
    config = json.loads((assets / "config.json").read_text())
    assert set(config_shapes(config) or {}) == set(index["weight_map"])


# ---------------------------------------------------------------- --expect-ranks


@pytest.mark.parametrize("ranks", slow_beyond([3, 1, 2], 1))
def test_expect_ranks_names_the_missing_rank(tmp_path: Path, ranks: int) -> None:
    short = without_last_rank(FSDP / "sharded", tmp_path / "sharded")
    line = error_line(cli(ranks, "consolidate", short, tmp_path / "out", "--expect-ranks", 3, timeout=TIMEOUT)[0])
    assert "--expect-ranks 3" in line and "no files of training rank 3 (shard-00003-*)" in line
    assert not (tmp_path / "out").exists()


def test_expect_ranks_takes_exactly_the_ranks_that_saved_it(tmp_path: Path) -> None:
    comm = SingleProcess()
    mpicons.consolidate(FSDP / "sharded", tmp_path / "out", expect_ranks=3, comm=comm, sync=False)
    with pytest.raises(InputError, match=r"files of training rank 3 \(shard-00003-\*\), beyond them"):
        mpicons.consolidate(FSDP / "sharded", tmp_path / "two", expect_ranks=2, comm=comm)
    distcp = DISTCP_FIXTURES / "fsdp-3ranks" / "dcp"
    mpicons.consolidate(distcp, tmp_path / "distcp", expect_ranks=3, comm=comm, sync=False)
    with pytest.raises(InputError, match=r"training ranks 0\.\.3 .*no files of training rank 3 \(__3_\*\.distcp\)"):
        mpicons.consolidate(distcp, tmp_path / "distcp4", expect_ranks=4, comm=comm)
    with pytest.raises(InputError, match="the files carry no training rank"):
        mpicons.consolidate(tmp_path / "out", tmp_path / "plain", expect_ranks=1, comm=comm)
    with pytest.raises(InputError, match="--expect-ranks must be a positive number"):
        mpicons.consolidate(FSDP / "sharded", tmp_path / "zero", expect_ranks=0, comm=comm)


# ---------------------------------------------------------------- {rank} directories


def rank_directories(source: Path, root: Path, ranks: int) -> Path:
    """``root/ckpt-R`` for each training rank R < ``ranks``, holding that rank's shard files."""
    for rank in range(ranks):
        (root / f"ckpt-{rank}").mkdir(parents=True)
        for path in source.glob(f"shard-{rank + 1:05d}-*"):
            shutil.copy(path, root / f"ckpt-{rank}" / path.name)
    return root / "ckpt-{rank}"


@pytest.mark.parametrize("ranks", slow_beyond([2, 1], 1))
def test_rank_directories_beyond_the_job_are_refused(tmp_path: Path, ranks: int) -> None:
    """Three node-local rank directories read by fewer MPI ranks: the rest named, and the -n to use."""
    pattern = rank_directories(EDGE / "sharded", tmp_path, 3)
    for command in (["consolidate", pattern, tmp_path / "out"], ["inspect", pattern]):
        line = error_line(cli(ranks, *command, timeout=TIMEOUT)[0])
        assert f"{tmp_path / f'ckpt-{ranks}'}: the input" in line and "run with -n 3" in line
    assert not (tmp_path / "out").exists()


def test_every_rank_directory_read_is_fine(tmp_path: Path) -> None:
    pattern = rank_directories(EDGE / "sharded", tmp_path, 3)
    (tmp_path / "ckpt-x").mkdir()  # not a rank's name
    proc, _ = cli(3, "consolidate", pattern, tmp_path / "out", "-q", "--expect-ranks", 3, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- inspect and verify


def test_inspect_and_verify_say_what_they_cannot_know(short_edge: Path, tmp_path: Path, without_transformers: None) -> None:
    comm = SingleProcess()
    report = mpicons.inspect(short_edge, comm=comm)
    assert report.ok and report.caveat == "global shapes are not recorded in this format; 2 training ranks seen (1-2)"
    assert "status   OK; global shapes are not recorded in this format; 2 training ranks seen (1-2)" in report.table()
    assert any("--expect-ranks N" in note for note in report.notes)
    checked = mpicons.inspect(short_edge, comm=comm, expect_ranks=3, hf_assets=ASSETS)
    kinds = [p.kind for p in checked.problems]
    assert kinds.count("ranks") == 1 and kinds.count("model shape") == 20
    good = mpicons.inspect(EDGE / "sharded", comm=comm, hf_assets=ASSETS)
    assert good.ok and good.caveat is not None and good.caveat.startswith("shapes of 21 of 27 tensors checked against")
    out = tmp_path / "out"
    mpicons.consolidate(short_edge, out, comm=comm, sync=False)
    check = mpicons.verify(out, against=short_edge, comm=comm)
    assert check.ok and "global shapes are not recorded in this format; 2 training ranks seen" in check.summary()
    check = mpicons.verify(out, against=short_edge, comm=comm, expect_ranks=3, hf_assets=ASSETS)
    assert not check.ok and {p.kind for p in check.problems} == {"ranks", "model shape"}
    with pytest.raises(InputError, match="--hf-assets, --expect-ranks: .* only with --against"):
        mpicons.verify(out, comm=comm, expect_ranks=3, hf_assets=ASSETS)  # an OK would claim checks never made
    assert mpicons.inspect(DISTCP_FIXTURES / "fsdp-3ranks" / "dcp", comm=comm).caveat is None  # .metadata records the shapes


def test_the_command_line_exit_codes(short_edge: Path, tmp_path: Path) -> None:
    proc, _ = cli(2, "inspect", short_edge, "--expect-ranks", 3, timeout=TIMEOUT)
    assert proc.returncode == 2 and "no files of training rank 3" in proc.stdout, proc.stdout + proc.stderr
    proc, _ = cli(2, "inspect", short_edge, timeout=TIMEOUT)
    assert proc.returncode == 0 and "global shapes are not recorded in this format; 2 training ranks seen" in proc.stdout
