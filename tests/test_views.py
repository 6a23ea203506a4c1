"""Pieces torch saved as views: every layout ``torch.distributed.checkpoint.save`` writes is read.

torch keeps a tensor's strides when it saves a view (a transpose, a slice, a permutation; a tensor
with no elements keeps whatever strides it had), so a ``.distcp`` item holds the view's storage and
its strides. mpicons reads each in its saved order, at block cost, and must write exactly what
``safetensors.torch.save_file`` writes for contiguous copies of the same tensors. The checkpoints are
written by torch itself, in a subprocess (no torch import in the test process).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli, subprocess_env

import mpicons
from mpicons.comm import SingleProcess

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch to write the checkpoint")

#: Writes a DCP checkpoint of views (sys.argv[1]) and the safetensors file of their contiguous copies (sys.argv[2]).
WRITE = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
torch.manual_seed(0)
base = torch.randn(40, 64)
views = {
    "transposed": torch.randn(48, 33).t(),  # (33, 48), strides (1, 33)
    "sliced": base[:, 8:40],  # (40, 32), strides (64, 1)
    "empty": torch.zeros(0, 4).t(),  # (4, 0), strides (1, 4)
    "permuted": torch.randn(3, 5, 7, dtype=torch.bfloat16).permute(2, 0, 1),  # (7, 3, 5), strides (1, 35, 7)
    "plain": torch.arange(24, dtype=torch.int32).reshape(4, 6),
    "column": torch.randn(16, 9, dtype=torch.float16)[:, 3],  # (16,), stride (9,)
}
assert not views["transposed"].is_contiguous() and not views["permuted"].is_contiguous()
dcp.save(views, checkpoint_id=sys.argv[1], no_dist=True)
save_file({k: v.contiguous() for k, v in views.items()}, sys.argv[2], metadata={"format": "pt"})
"""


@pytest.fixture(scope="module")
def views(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("views")
    proc = subprocess.run(
        [sys.executable, "-c", WRITE, str(work / "dcp"), str(work / "expected.safetensors")],
        capture_output=True,
        text=True,
        timeout=180,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr
    return work / "dcp", work / "expected.safetensors"


def test_every_view_torch_saves_is_read_in_its_order(views: tuple[Path, Path], tmp_path: Path) -> None:
    checkpoint, expected = views
    mpicons.consolidate(checkpoint, tmp_path / "out", comm=SingleProcess(), sync=False)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == expected.read_bytes()


def test_views_are_read_alike_at_any_rank_count_and_tiny_blocks(views: tuple[Path, Path], tmp_path: Path) -> None:
    """Three ranks and a 4 KiB buffer: each view is cut over ranks and blocks, rows of a transposed piece
    in one block and the rest in others."""
    checkpoint, expected = views
    proc, _ = cli(3, "consolidate", checkpoint, tmp_path / "out", "--buffer-size", "4K", "--no-sync", "-q", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == expected.read_bytes()
    proc, _ = cli(2, "verify", tmp_path / "out", "--against", checkpoint, "--buffer-size", "4K", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_views_convert_like_any_tensor(views: tuple[Path, Path], tmp_path: Path) -> None:
    """--dtype on views: the converted bytes of the contiguous copies (the plain path's conversion)."""
    checkpoint, expected = views
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes(expected.read_bytes())
    mpicons.consolidate(plain, tmp_path / "from-plain", comm=SingleProcess(), sync=False, dtype="fp16")
    mpicons.consolidate(checkpoint, tmp_path / "from-views", comm=SingleProcess(), sync=False, dtype="fp16")
    converted = (tmp_path / "from-views" / "model.safetensors").read_bytes()
    assert converted == (tmp_path / "from-plain" / "model.safetensors").read_bytes()


def test_views_move_between_ranks_alike(views: tuple[Path, Path], tmp_path: Path) -> None:
    """Node-local shards (``{rank}``: rank 1 sees no data file) and --gather-to: transposed pieces read by
    one rank are placed by another, through the same scratch."""
    checkpoint, expected = views
    for rank in (0, 1):
        (tmp_path / f"local{rank}").mkdir()
    for entry in checkpoint.iterdir():
        shutil.copy(entry, tmp_path / "local0" / entry.name)
    proc, _ = cli(2, "consolidate", tmp_path / "local{rank}", tmp_path / "out", "--buffer-size", "4K", "--no-sync", "-q")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == expected.read_bytes()
    proc, _ = cli(
        3, "consolidate", checkpoint, tmp_path / "gathered", "--gather-to", "2", "--buffer-size", "4K", "--no-sync", "-q"
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "gathered" / "model.safetensors").read_bytes() == expected.read_bytes()


WIDE = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
view = torch.randn(2000, 3).t()  # (3, 2000): rows of 8000 bytes, saved transposed
dcp.save({"wide": view}, checkpoint_id=sys.argv[1], no_dist=True)
save_file({"wide": view.contiguous()}, sys.argv[2], metadata={"format": "pt"})
"""


def test_a_transposed_row_larger_than_a_block_is_refused_before_writing(tmp_path: Path) -> None:
    """Rows of transposed pieces are never cut across blocks: one larger than a block is exit 2 at plan
    time on every rank, naming the tensor and the buffer size to give; a larger buffer reads it."""
    checkpoint, expected = tmp_path / "dcp", tmp_path / "expected.safetensors"
    proc = subprocess.run(
        [sys.executable, "-c", WIDE, str(checkpoint), str(expected)], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    proc, _ = cli(2, "consolidate", checkpoint, tmp_path / "out", "--buffer-size", "4K", "--no-sync", "-q")
    assert proc.returncode == 2 and "'wide'" in proc.stderr and "--buffer-size" in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()
    proc, _ = cli(2, "consolidate", checkpoint, tmp_path / "out", "--buffer-size", "64K", "--no-sync", "-q")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == expected.read_bytes()
