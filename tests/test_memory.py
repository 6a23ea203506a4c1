"""Memory per rank is bounded by --buffer-size, not by tensor size (a 2.5 GiB tensor, 32 MiB buffer)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

GIB = 1 << 30


def write_sparse_shard(path: Path, tensors: dict[str, tuple[str, list[int], list[int], int]]) -> int:
    """A DCP shard whose data is a hole (zeros) except where markers are written; returns data start."""
    info = {name: {"saved_offsets": offsets} for name, (_, offsets, _, _) in tensors.items()}
    header: dict[str, object] = {"__metadata__": {"format": "pt", "DCP_SHARDING_INFO": json.dumps(info)}}
    position = 0
    for name, (dtype, _, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + nbytes]}
        position += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        handle.truncate(8 + len(text) + position)
    return 8 + len(text)


def test_peak_rss_is_bounded_by_the_buffer_on_a_multi_gib_tensor(tmp_path):
    rows, cols = 40_960, 32_768  # bf16: 2.5 GiB, cut into two column halves
    half = rows * (cols // 2) * 2
    shards = tmp_path / "in"
    shards.mkdir()
    starts = []
    for rank in range(2):
        starts.append(
            write_sparse_shard(
                shards / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors",
                {"w": ("BF16", [0, rank * cols // 2], [rows, cols // 2], half)},
            )
        )
    # Markers: the last element of each piece's last row lands at known output positions.
    markers = {0: b"\x11\x22", 1: b"\x33\x44"}
    for rank, start in enumerate(starts):
        with open(shards / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors", "r+b") as handle:
            handle.seek(start + half - 2)
            handle.write(markers[rank])
    out = tmp_path / "out"
    script = Path(__file__).parent / "scripts" / "peak_rss.py"
    proc = subprocess.run(
        [sys.executable, str(script), "consolidate", str(shards), str(out), "--buffer-size", "32M",
         "--stats-json", str(tmp_path / "s.json"), "-q"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert proc.returncode == 0, proc.stderr
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["total_bytes"] == 2 * half
    peak = float(proc.stdout.split("PEAK_RSS_MB")[1].split()[0])
    assert peak < 32 + 100, proc.stdout  # buffer + 100 MB, for a 2.5 GiB tensor
    output = out / "model-00001-of-00001.safetensors"
    with open(output, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        data_start = 8 + length
        row = cols * 2
        handle.seek(data_start + (rows - 1) * row + (cols // 2 - 1) * 2)
        assert handle.read(2) == markers[0]
        handle.seek(data_start + rows * row - 2)
        assert handle.read(2) == markers[1]
    assert os.path.getsize(output) == data_start + 2 * half
