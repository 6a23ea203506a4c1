"""What a consolidation says about names: a trainer's own names consolidated without ``--adapter`` (the
report names the adapter that maps them), ``--adapter`` on names that are Hugging Face's already ("drop
--adapter"), and dropped entries that hold what the model loses (a routing bias that is not zero, a
tied ``lm_head`` that differs from the embeddings), which are warnings naming them.

The expected counts come from the sample's own generator (``full_tensor``) or from the values
torchtitan saved (tests/fixtures/torchtitan), read by safetensors; never from mpicons' reading.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from helpers import FIXTURES, cli, load_tensors, reference_bytes, run_python

import mpicons
from mpicons.adaptation.hints import recognising_adapters
from mpicons.adaptation.rule_text import joined
from mpicons.adaptation.rules import may_read
from mpicons.comm import SingleProcess
from mpicons.sample import SampleConfig, full_tensor, tensor_specs, write_sample
from mpicons.trainers import TRAINERS, known_rule_sets, rule_sets_reading

TITAN = Path(__file__).parent / "fixtures" / "torchtitan"
TIMEOUT = 120
NOTE = "the tensor names are torchtitan's own, which transformers will not load as they are; --adapter torchtitan --hf-assets DIR"


def _run(ranks: int, *args: object):  # noqa: ANN202 - a CompletedProcess
    """``mpicons ARGS`` at ``ranks`` ranks (one rank without a launcher)."""
    if ranks == 1:
        return run_python("-m", "mpicons", *args, timeout=TIMEOUT)
    return cli(ranks, *args, timeout=TIMEOUT)[0]


def _flat(text: str) -> str:
    """A report's text with its line breaks (the report wraps at 80 columns in a pipe) made spaces."""
    return " ".join(text.split())


# ---------------------------------------------------------------- a trainer's names, no adapter


def test_the_built_in_rules_recognise_a_trainer_s_own_names() -> None:
    titan = ["tok_embeddings.weight", "layers.0.attention.wo.weight", "norm.weight", "optimizer.state.norm.weight.exp_avg"]
    assert recognising_adapters(titan, known_rule_sets()) == ["torchtitan"]
    assert recognising_adapters(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"], known_rule_sets()) == []
    assert recognising_adapters(["optimizer.state.norm.weight.exp_avg"], known_rule_sets()) == []  # nothing a rule renames
    assert recognising_adapters([*titan, "my_own.weight"], known_rule_sets()) == []  # one name no rule reads
    assert recognising_adapters([], known_rule_sets()) == []


def _example(source: str) -> str:
    """A name a source pattern matches: each capture a number, ``**`` two parts, ``*`` one."""
    return re.sub(r"\{[^{}]*\}", "7", source.replace("**", "a.b").replace("*", "x"))


def test_only_the_rule_files_that_may_read_the_first_name_are_asked() -> None:
    titan = ["tok_embeddings.weight", "layers.0.attention.wo.weight", "norm.weight", "optimizer.state.norm.weight.exp_avg"]
    hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for names in (titan, hf, ["optimizer.state.norm.weight.exp_avg"], [*titan, "my_own.weight"], [], ["my_own.weight", *titan]):
        assert recognising_adapters(names, rule_sets_reading(names)) == recognising_adapters(names, known_rule_sets())
    assert len(rule_sets_reading(["my_own.weight"])) < len(known_rule_sets())
    # Never a file left out that reads the name: every rule's source, made a name, keeps its file.
    for trainer in TRAINERS.values():
        for (origin, lines), rules in zip(trainer.rule_texts(), trainer.rule_sets(), strict=True):
            text = joined(lines)
            for rule in rules.rules:
                name = _example(rule.source)
                assert rule.pattern.fullmatch(name), (origin, rule.source, name)
                assert may_read(text, name), (origin, rule.source)
                assert any(found is rules for _, found in rule_sets_reading([name]))


def test_trainer_names_without_an_adapter_are_consolidated_with_a_note(tmp_path: Path) -> None:
    source = TITAN / "llama3-fsdp2" / "native-model-only"
    result = mpicons.consolidate(source, tmp_path / "plain", comm=SingleProcess())
    assert len(result.advice) == 1 and result.advice[0].startswith(NOTE), result.advice
    assert "tok_embeddings.weight" in load_tensors(tmp_path / "plain" / "model.safetensors")  # written as they are
    adapted = mpicons.consolidate(
        source, tmp_path / "hf", adapter="torchtitan", hf_assets=TITAN / "llama3-fsdp2" / "hf-assets", comm=SingleProcess()
    )
    assert adapted.advice == []
    hf_names = mpicons.consolidate(FIXTURES / "fsdp2-3ranks" / "sharded", tmp_path / "other", comm=SingleProcess())
    assert hf_names.advice == []
    assert [note for note in mpicons.inspect(source, comm=SingleProcess()).notes if note.startswith(NOTE)]


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_note_is_in_the_printed_and_the_json_report(ranks: int, tmp_path: Path) -> None:
    proc = _run(ranks, "consolidate", TITAN / "qwen3moe-fsdp2" / "native", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert f"mpicons: note: {NOTE}" in _flat(proc.stdout), proc.stdout
    proc = _run(ranks, "consolidate", TITAN / "qwen3moe-fsdp2" / "native", tmp_path / "again", "--stats-json", "-")
    assert proc.returncode == 0, proc.stderr
    [advice] = json.loads(proc.stdout)["advice"]
    assert advice.startswith(NOTE)


def test_an_adapter_on_hugging_face_names_says_to_drop_it(tmp_path: Path) -> None:
    """torchtitan's own Hugging Face export, consolidated with --adapter torchtitan: one line saying to drop
    --adapter, not a list of --exclude suggestions; at 2 ranks the same, once."""
    plain = tmp_path / "hf-names"
    plain.mkdir()
    shutil.copy(TITAN / "llama3-fsdp2" / "ref" / "full_hf.safetensors", plain / "model.safetensors")
    assets = TITAN / "llama3-fsdp2" / "hf-assets"
    with pytest.raises(mpicons.InputError) as caught:
        mpicons.consolidate(plain, tmp_path / "out", adapter="torchtitan", hf_assets=assets, comm=SingleProcess())
    message = str(caught.value)
    assert "the checkpoint is in Hugging Face's names already. Drop --adapter" in message, message
    assert "--exclude" not in message
    proc = _run(2, "consolidate", plain, tmp_path / "out", "--adapter", "torchtitan", "--hf-assets", assets)
    assert proc.returncode == 2
    [line] = proc.stderr.splitlines()
    assert "Drop --adapter" in line and "--exclude" not in line
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- dropped entries that hold information


def _torchtitan_sample(tmp_path: Path, tied: bool) -> tuple[SampleConfig, Path, Path]:
    """A qwen3_moe sample in torchtitan's names (random routing biases, an lm_head unlike the embeddings)
    and its Hugging Face assets, with ``tie_word_embeddings`` as asked."""
    config = SampleConfig.torchtitan(1 << 19, experts=4, layers=2, vocab=320, head_dim=32)
    native, assets = tmp_path / "native", tmp_path / "assets"
    write_sample(native, config, assets_dir=assets)
    hf_config = json.loads((assets / "config.json").read_text())
    hf_config["tie_word_embeddings"] = tied
    (assets / "config.json").write_text(json.dumps(hf_config))
    return config, native, assets


def _full(config: SampleConfig, name: str) -> np.ndarray:
    [(dtype, shape)] = [(d, s) for n, d, s, _, _ in tensor_specs(config) if n == name]
    return full_tensor(config, name, dtype, shape)


def _node_local(native: Path, ranks: int) -> str:
    """The checkpoint as node-local disks hold it: ``in-{rank}`` with .metadata and some of the data files each."""
    data = sorted(p for p in native.iterdir() if p.suffix == ".distcp")
    for rank in range(ranks):
        local = native.parent / f"in-{rank}"
        local.mkdir()
        shutil.copy(native / ".metadata", local / ".metadata")
        for path in data[rank::ranks]:
            shutil.copy(path, local / path.name)
    return str(native.parent / "in-{rank}")


@pytest.mark.parametrize("ranks, local", [(1, False), (2, True), (3, False)])
def test_dropped_entries_that_hold_information_are_warnings(ranks: int, local: bool, tmp_path: Path) -> None:
    config, native, assets = _torchtitan_sample(tmp_path, tied=True)
    source = _node_local(native, ranks) if local else native
    stats = tmp_path / "stats.json"
    proc = _run(ranks, "consolidate", source, tmp_path / "out", "--adapter", "torchtitan", "--hf-assets", assets,
                "--stats-json", stats, "--buffer-size", "64K")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(stats.read_text())
    head, embeddings = _full(config, "lm_head.weight"), _full(config, "tok_embeddings.weight")
    differ = int(np.count_nonzero(head.view(np.uint16) != embeddings.view(np.uint16)))
    expected = [
        (rf"dropped layers\.{n}\.moe\.expert_bias_E \(rule torchtitan:[^)]+\) is not zero in "
         rf"{np.count_nonzero(_full(config, f'layers.{n}.moe.expert_bias_E'))} of 4 elements: the Hugging Face model "
         "has no place for it")
        for n in range(config.layers)
    ] + [
        rf"dropped lm_head\.weight \(rule torchtitan:[^)]+\) differs from tok_embeddings\.weight in {differ} of "
        rf"{head.size} elements: lm_head\.weight is left out because config\.json's tie_word_embeddings is true, so "
        r"the Hugging Face model uses tok_embeddings\.weight's values in its place; if the two were not tied in "
        r"training, set tie_word_embeddings to false in the --hf-assets config\.json"
    ]  # fmt: skip
    assert differ > 0 and len(report["warnings"]) == len(expected), report["warnings"]
    for pattern, line in zip(expected, sorted(report["warnings"])):
        assert re.match(pattern, line), (pattern, line)
    assert not [line for line in report["adapter"] if line.startswith("dropped ")]  # no "on purpose" line for them
    printed = _flat(proc.stdout)
    assert printed.count("mpicons: warning: dropped ") == 3 and "on purpose" not in printed, proc.stdout
    assert "lm_head.weight" not in load_tensors(tmp_path / "out" / "model.safetensors")


def test_entries_that_hold_nothing_are_dropped_quietly(tmp_path: Path) -> None:
    """Routing biases of zero (the qwen3 MoE fixture) and a tied head equal to the embeddings (the llama3
    fixture with lm_head set to tok_embeddings) are entries dropped on purpose, and no warning."""
    result = mpicons.consolidate(
        TITAN / "qwen3moe-fsdp2" / "native", tmp_path / "moe", adapter="torchtitan",
        hf_assets=TITAN / "qwen3moe-fsdp2" / "hf-assets", comm=SingleProcess(),
    )  # fmt: skip
    assert result.warnings == []
    dropped = [line for line in result.adapted if line.startswith("dropped ")]
    assert [line.split(":")[0] for line in dropped] == [f"dropped layers.{n}.moe.expert_bias_E" for n in range(2)], dropped
    saved = mpicons.consolidate(TITAN / "llama3-fsdp2" / "native-model-only", tmp_path / "titan", comm=SingleProcess())
    assert saved.files == ["model.safetensors"]
    tensors = load_tensors(tmp_path / "titan" / "model.safetensors")
    assets = tmp_path / "assets"
    shutil.copytree(TITAN / "llama3-fsdp2" / "hf-assets", assets)
    hf_config = json.loads((assets / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**hf_config, "tie_word_embeddings": True}))
    (assets / "model.safetensors.index.json").unlink()  # its weight_map was made for an untied head
    head, embeddings = (np.frombuffer(tensors[n][2], np.float32) for n in ("lm_head.weight", "tok_embeddings.weight"))
    for name, value, warned in (("tied", tensors["tok_embeddings.weight"], False), ("trained", tensors["lm_head.weight"], True)):
        checkpoint = tmp_path / name
        checkpoint.mkdir()
        (checkpoint / "model.safetensors").write_bytes(reference_bytes({**tensors, "lm_head.weight": value}))
        proc = _run(2, "consolidate", checkpoint, tmp_path / f"{name}-hf", "--adapter", "torchtitan", "--hf-assets", assets,
                    "--stats-json", "-")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        if warned:
            differ = int(np.count_nonzero(head != embeddings))
            [line] = report["warnings"]
            assert "dropped lm_head.weight (rule torchtitan:" in line and f"in {differ} of {head.size} elements" in line
        else:
            assert report["warnings"] == []
            assert [line for line in report["adapter"] if line.startswith("dropped lm_head.weight (Hugging Face lm_head.weight)")]
        written = safetensors.numpy.load_file(tmp_path / f"{name}-hf" / "model.safetensors")
        assert "lm_head.weight" not in written and "model.embed_tokens.weight" in written


def test_a_tied_head_whose_embeddings_are_left_out_is_looked_at_alone(tmp_path: Path) -> None:
    """With the tensor it repeats excluded, a dropped head has nothing to be compared with: values that are
    not zero are a warning of their own."""
    config, native, assets = _torchtitan_sample(tmp_path, tied=True)
    result = mpicons.consolidate(
        native, tmp_path / "out", adapter="torchtitan", hf_assets=assets, exclude=["tok_embeddings.weight"],
        comm=SingleProcess(), buffer_size=1 << 16,
    )  # fmt: skip
    head = _full(config, "lm_head.weight")
    [line] = [line for line in result.warnings if line.startswith("dropped lm_head.weight")]
    assert re.fullmatch(
        rf"dropped lm_head\.weight \(rule [^)]+\) is not zero in {np.count_nonzero(head)} of {head.size} elements: "
        r"lm_head\.weight is left out because config\.json's tie_word_embeddings is true, so the Hugging Face model "
        r"does not get these values",
        line,
    ), line
