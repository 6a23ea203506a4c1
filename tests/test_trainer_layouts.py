"""DeepSpeed ZeRO and verl checkpoints as pieces: every tensor assembled from the byte ranges the
layouts name equals the expected weights exactly, every element covered exactly once.

The fixtures were written by DeepSpeed 0.19.8 and verl 0.9.1 (tests/fixtures/*/README.md); their
``expected-fp32`` weights were gathered from the live training engines. The cases they do not cover
(3-4 ranks with padding, tied embeddings, frozen parameters, buffers, several groups) are written by
tests/trainer_saves.py from tensors made here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import load_tensors
from trainer_saves import write_verl, write_zero

from mpicons.core.errors import InputError
from mpicons.core.flat_pieces import TrainerLayout, as_pieces
from mpicons.core.safetensors_codec import DTYPE_BY_NAME, DTYPES
from mpicons.formats.byte_sources import PosixSource
from mpicons.trainers.accelerate import fsdp as accelerate
from mpicons.trainers.deepspeed import files as zero_files
from mpicons.trainers.deepspeed.layout import zero_layout
from mpicons.trainers.deepspeed.records import read_model_states, read_optim_states
from mpicons.trainers.verl import files as verl_files
from mpicons.trainers.verl.layout import verl_layout
from mpicons.trainers.verl.records import read_rank

FIXTURES = Path(__file__).parent / "fixtures"
ZERO = ["llama-zero2", "llama-zero3"]
_NUMPY = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


def zero_directory(case: str) -> Path:
    return FIXTURES / "deepspeed" / case / "checkpoint" / "global_step2"


def read_zero(directory: Path) -> TrainerLayout:
    """What the job will do for a ZeRO checkpoint, in one process: detect, read every file, lay out."""
    found = zero_files.detect(os.listdir(directory), str(directory))
    assert found is not None
    models, partitions = [], []
    for rank, name in found.model_states.items():
        with PosixSource(str(directory / name)) as source:
            models.append(read_model_states(source, name, rank))
    for rank, name in found.optim_states.items():
        with PosixSource(str(directory / name)) as source:
            partitions.append(read_optim_states(source, name, rank))
    return zero_layout(found, models, partitions, str(directory))


def read_verl(directory: Path) -> TrainerLayout:
    found = verl_files.detect(os.listdir(directory), str(directory))
    assert found is not None
    if found.config:
        verl_files.check_config(found, (directory / found.config).read_text(), str(directory))
    ranks = []
    for rank, name in found.models.items():
        with PosixSource(str(directory / name)) as source:
            ranks.append(read_rank(source, name, rank))
    return verl_layout(found, ranks, str(directory))


def assemble(layout: TrainerLayout, directory: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of ``layout`` read from the byte ranges its pieces name (numpy), each element exactly once."""
    out = {}
    for param in layout.params:
        itemsize = DTYPE_BY_NAME[param.dtype].bits // 8
        values = np.zeros(param.numel * itemsize, dtype=np.uint8)
        covered = np.zeros(param.numel, dtype=np.int64)
        for piece in (p for p in layout.pieces if p.tensor == param.name):
            data = np.fromfile(directory / piece.file, dtype=np.uint8, count=piece.count * itemsize, offset=piece.begin)
            values[piece.start * itemsize : (piece.start + piece.count) * itemsize] = data
            covered[piece.start : piece.start + piece.count] += 1
        assert (covered == 1).all(), f"{param.name}: elements covered {sorted(set(covered.tolist()))} times"
        out[param.name] = (param.dtype, list(param.shape), values.tobytes())
    return out


def assemble_boxes(layout: TrainerLayout, directory: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """The same through the scan's columns: each box (offset, shape) from its byte range, each cell once."""
    names = sorted(p.name for p in layout.params)
    files = sorted({p.file for p in layout.pieces})
    pieces = as_pieces(layout, names, files, holder=0)
    out = {}
    for t, name in enumerate(names):
        param = next(p for p in layout.params if p.name == name)
        dtype = _NUMPY[param.dtype]
        full = np.zeros(param.shape, dtype=dtype)
        covered = np.zeros(param.shape, dtype=np.int64)
        mine = np.flatnonzero(pieces.tensor == t)
        assert {DTYPES[d].name for d in pieces.dtype[mine].tolist()} <= {param.dtype}, name
        for i in mine:
            ndim = int(pieces.ndim[i])
            shape, offset = pieces.shape[i, :ndim], pieces.offset[i, :ndim]
            data = np.fromfile(
                directory / files[pieces.file[i]], dtype=dtype, count=math.prod(shape), offset=int(pieces.begin[i])
            )
            region = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            full[region] = data.reshape(shape)
            covered[region] += 1
        assert (covered == 1).all(), name
        out[name] = (param.dtype, list(param.shape), full.tobytes())
    return out


# ---------------------------------------------------------------- the library-written fixtures


@pytest.mark.parametrize("case", ZERO)
def test_zero_masters_are_the_expected_weights(case: str) -> None:
    layout = read_zero(zero_directory(case))
    expected = load_tensors(FIXTURES / "deepspeed" / case / "expected-fp32" / "model.safetensors")
    assert assemble(layout, zero_directory(case)) == expected
    assert assemble_boxes(layout, zero_directory(case)) == expected
    meta = json.loads((FIXTURES / "deepspeed" / case / "meta.json").read_text())
    assert [(p.name, list(p.shape)) for p in layout.params] == list(meta["params"].items())  # the model's order


@pytest.mark.parametrize("case", ZERO)
def test_zero_optimizer_state_and_16_bit_copies_are_skipped_and_counted(case: str) -> None:
    layout = read_zero(zero_directory(case))
    assert layout.skipped[0].startswith("optimizer state (Adam moments, step counters): 6 tensors, 2.01 MB in 2 files")
    if case == "llama-zero2":
        assert layout.skipped[1].startswith("16-bit module weights in mp_rank_00_model_states.pt: 30 tensors")
    assert len(layout.skipped) == (2 if case == "llama-zero2" else 1) and not layout.tied
    assert {p.file for p in layout.pieces} == {f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)}


def test_verl_shards_are_the_expected_weights() -> None:
    directory = FIXTURES / "verl" / "llama-fsdp2" / "checkpoint" / "global_step_1" / "actor"
    layout = read_verl(directory)
    expected = load_tensors(FIXTURES / "verl" / "llama-fsdp2" / "expected-fp32" / "model.safetensors")
    assert assemble(layout, directory) == expected
    assert assemble_boxes(layout, directory) == expected
    assert len(layout.pieces) == 2 * len(expected) and not layout.tied


def _copy_without(source: Path, tmp_path: Path, *left_out: str) -> Path:
    target = tmp_path / source.name
    shutil.copytree(source, target, ignore=lambda _, names: [n for n in names if n in left_out])
    return target


@pytest.mark.parametrize(
    "case, left_out",
    [
        ("llama-zero2", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("llama-zero3", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        ("llama-zero3", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ],
)
def test_a_missing_rank_file_is_named(tmp_path: Path, case: str, left_out: str) -> None:
    directory = _copy_without(zero_directory(case), tmp_path, left_out)
    with pytest.raises(InputError, match=f"{left_out}: missing .*records 2 data-parallel ranks") as error:
        read_zero(directory)
    assert error.value.exit_code == 2


def _saved_as(source: Path, target: Path) -> None:
    """``source``'s archive as torch.save would have written it to ``target`` (its folder named for it)."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            new.writestr(target.stem + "/" + info.filename.split("/", 1)[1], old.read(info))


def test_a_rank_file_beyond_the_recorded_world_is_refused(tmp_path: Path) -> None:
    directory = _copy_without(zero_directory("llama-zero2"), tmp_path)
    rank_1, rank_2 = (directory / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (1, 2))
    shutil.copy(rank_1, rank_2)  # a copy: its archive still says it is rank 1's
    with pytest.raises(InputError, match="rank_2_mp_rank_00_optim_states.pt: this archive was saved as bf16_zero_pp_rank_1_"):
        read_zero(directory)
    _saved_as(rank_1, rank_2)
    with pytest.raises(InputError, match="rank_2_mp_rank_00_optim_states.pt: rank 2's optimizer states, but .* records 2"):
        read_zero(directory)


def test_a_verl_rank_file_missing_or_a_world_size_disagreeing_is_named(tmp_path: Path) -> None:
    actor = FIXTURES / "verl" / "llama-fsdp2" / "checkpoint" / "global_step_1" / "actor"
    with pytest.raises(InputError, match=r"model_world_size_2_rank_1.pt: missing \(rank 1 of 2\)"):
        read_verl(_copy_without(actor, tmp_path / "a", "model_world_size_2_rank_1.pt"))
    other = _copy_without(actor, tmp_path / "b")
    (other / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 4}')
    with pytest.raises(InputError, match="fsdp_config.json: records world size 4, the model files say 2"):
        read_verl(other)


def test_records_that_do_not_add_up_are_named() -> None:
    """What the files say, changed one fact at a time: each is bad input naming the file."""
    directory = zero_directory("llama-zero2")
    found = zero_files.detect(os.listdir(directory), str(directory))
    assert found is not None
    with PosixSource(str(directory / found.model_states[0])) as source:
        model = read_model_states(source, found.model_states[0])
    partitions = []
    for rank, name in sorted(found.optim_states.items()):
        with PosixSource(str(directory / name)) as source:
            partitions.append(read_optim_states(source, name, rank))
    first, second = partitions
    short = dataclasses.replace(second, groups=[dataclasses.replace(second.groups[0], shape=(100,))])
    cases = [
        ([model], [first, short], "parameter group 0: its fp32 partition holds 100 elements, DeepSpeed gives rank 1"),
        ([model], [first, dataclasses.replace(second, partition_count=3)], "stage 2 over 3 ranks"),
        ([model], [first, dataclasses.replace(second, stage=3)], "ZeRO stage 3 over 2 ranks"),
        ([dataclasses.replace(model, world_size=3)], partitions, "rank_2_mp_rank_00_optim_states.pt: missing"),
        ([dataclasses.replace(model, model_parallel=2)], partitions, "2-way tensor parallelism"),
        ([dataclasses.replace(model, shared={"lm_head.bias": "nowhere"})], partitions, "'lm_head.bias' names 'nowhere'"),
        ([model, dataclasses.replace(model, rank=1, file="other.pt", param_shapes=[])], partitions, "other.pt: records other"),
    ]
    for models, parts, phrase in cases:
        with pytest.raises(InputError, match=phrase.replace("(", r"\(")):
            zero_layout(found, models, parts, str(directory))


# ---------------------------------------------------------------- cases written here


def _params(vocab: int, hidden: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A small model's weights, with sizes that are multiples of no world size."""
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.layers.0.self_attn.q_proj.weight": (hidden, hidden),
        "model.layers.0.input_layernorm.weight": (hidden,),
        "model.layers.0.mlp.down_proj.weight": (hidden, 3 * hidden - 1),
        "model.layers.0.mlp.expert_bias": (2, 3, 5),
        "model.norm.weight": (hidden,),
        "model.scale": (),
    }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _bytes(tensors: dict[str, np.ndarray]) -> dict[str, tuple[str, list[int], bytes]]:
    names = {np.float32: "F32", np.float16: "F16", np.int64: "I64"}
    return {n: (names[v.dtype.type], list(v.shape), v.tobytes()) for n, v in tensors.items()}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero_with_padding_tied_frozen_buffers_and_groups(tmp_path: Path, stage: int, world: int) -> None:
    rng = np.random.default_rng(world * 10 + stage)
    params = _params(101, 7, rng)
    frozen = {"model.layers.0.mlp.gate_proj.weight": rng.standard_normal((5, 7)).astype(np.float16)}
    buffers = {"model.layers.0.position_ids": np.arange(11, dtype=np.int64)}
    names = list(params)
    directory = tmp_path / "global_step7"
    write_zero(
        directory,
        params,
        world,
        stage,
        tied={"lm_head.weight": "model.embed_tokens.weight"},
        frozen=frozen,
        buffers=buffers,
        groups=[names[:3], names[3:]] if stage == 2 else None,
        sub_groups=1 if stage == 2 else 3,
    )
    assert zero_files.latest_tag((tmp_path / "latest").read_text(), str(tmp_path / "latest")) == "global_step7"
    layout = read_zero(directory)
    expected = _bytes({**buffers, **frozen, **params})
    assert assemble(layout, directory) == expected
    assert assemble_boxes(layout, directory) == expected
    assert [p.name for p in layout.params] == list(expected)  # buffers, frozen, trainable: as DeepSpeed's converter
    assert layout.tied == {"lm_head.weight": "model.embed_tokens.weight"}


@pytest.mark.parametrize("world", [1, 3, 4])
def test_verl_uneven_shards_padded_storages_and_tied_embeddings(tmp_path: Path, world: int) -> None:
    rng = np.random.default_rng(world)
    params = {
        "model.embed_tokens.weight": rng.standard_normal((10, 6)).astype(np.float32),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((2, 6)).astype(np.float32),  # empty shards
        "model.layers.0.mlp.experts": rng.standard_normal((5, 2, 3)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(6).astype(np.float32),
    }
    write_verl(tmp_path / "actor", params, world, tied={"lm_head.weight": "model.embed_tokens.weight"})
    layout = read_verl(tmp_path / "actor")
    assert assemble(layout, tmp_path / "actor") == _bytes(params)
    assert assemble_boxes(layout, tmp_path / "actor") == _bytes(params)
    assert layout.tied == {"lm_head.weight": "model.embed_tokens.weight"}


# ---------------------------------------------------------------- recognising the directories


def test_zero_directories_are_recognised_from_their_names() -> None:
    for case, stage3 in (("llama-zero2", False), ("llama-zero3", True)):
        directory = zero_directory(case)
        found = zero_files.detect(os.listdir(directory), str(directory))
        assert found is not None and found.stage3 == stage3 and sorted(found.optim_states) == [0, 1]
        run = directory.parent
        assert zero_files.detect(os.listdir(run), str(run)) is None
        assert zero_files.latest_tag((run / zero_files.LATEST).read_text(), str(run)) == "global_step2"
    assert zero_files.detect(["model.safetensors", "config.json"], "d") is None
    refused = {
        "with tensor \\(model\\) parallelism": ["mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"],
        "pipeline-parallel": ["layer_01-model_00-model_states.pt"],
        "without optimizer states": ["mp_rank_00_model_states.pt"],
        "optimizer states without model states": ["zero_pp_rank_0_mp_rank_00_optim_states.pt"],
        "both with and without": [
            "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ],
    }
    for phrase, names in refused.items():
        with pytest.raises(InputError, match=phrase):
            zero_files.detect(names, "d")
    for tag in ("", "..", "a/b", "x" * 300):
        with pytest.raises(InputError, match="does not name a checkpoint directory"):
            zero_files.latest_tag(tag, "d/latest")


def test_verl_and_accelerate_directories_are_recognised_from_their_names() -> None:
    run = FIXTURES / "verl" / "llama-fsdp2" / "checkpoint"
    step = verl_files.step_directory((run / verl_files.LATEST).read_text(), str(run))
    actor = run / step / verl_files.ACTOR
    found = verl_files.detect(os.listdir(actor), str(actor))
    assert step == "global_step_1" and found is not None and found.world_size == 2 and found.assets == "huggingface"
    assert verl_files.detect(os.listdir(run), str(run)) is None
    with pytest.raises(InputError, match="world sizes 2 and 4"):
        verl_files.detect(["model_world_size_2_rank_0.pt", "model_world_size_4_rank_0.pt"], "d")
    with pytest.raises(InputError, match="does not hold a step number"):
        verl_files.step_directory("latest\n", "d")
    names = ["model.embed_tokens.weight", "model.lm_head.weight"]
    assert accelerate.prefix_to_strip("ckpt/checkpoint-500/pytorch_model_fsdp_0", names) == "model."
    assert accelerate.prefix_to_strip("ckpt/checkpoint-500/pytorch_model_fsdp_0/", ["embed.weight"]) is None
    assert accelerate.prefix_to_strip("ckpt/sharded", names) is None
    assert accelerate.model_directory(["optimizer_0", "pytorch_model_fsdp_0", "scheduler.bin"], "c") == "pytorch_model_fsdp_0"
    with pytest.raises(InputError, match="of 2 models"):
        accelerate.model_directory(["pytorch_model_fsdp_0", "pytorch_model_fsdp_1"], "c")
