"""Memory per rank is bounded by --buffer-size, not by tensor size (a 2.5 GiB tensor, 32 MiB buffer)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import run_python

GIB = 1 << 30


def write_sparse_shard(path: Path, tensors: dict[str, tuple[str, list[int], list[int], int]], dcp: bool = True) -> int:
    """A DCP shard (or, without ``dcp``, a plain safetensors file) whose data is a hole (zeros) except where
    markers are written; returns data start."""
    info = {name: {"saved_offsets": offsets} for name, (_, offsets, _, _) in tensors.items()}
    header: dict[str, object] = {"__metadata__": {"format": "pt", **({"DCP_SHARDING_INFO": json.dumps(info)} if dcp else {})}}
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


#: The adapters the bound is checked with: none, a rotary row order (640 heads of 64 rows, 4 MiB
#: each), and a Megatron-style chain (5 stacked layers, each a fused tensor of two 4096-row parts).
ADAPTERS = {
    "plain": None,
    "rotary-adapter": "w  w  rope_to_half(640, 64)\n",
    "chained-adapter": "w  w.{N}.{a|b}  unbind(N) | split_rows(groups=1, sizes=(4096, 4096))\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_peak_rss_is_bounded_by_the_buffer_on_a_multi_gib_tensor(tmp_path, adapter):
    """With an adapter's transforms the bound is the same."""
    rows, cols = 40_960, 32_768  # bf16: 2.5 GiB, cut into two column halves
    half = rows * (cols // 2) * 2
    layers = 5 if adapter == "chained-adapter" else 0  # saved as [5, 8192, cols]: the same bytes
    shards = tmp_path / "in"
    shards.mkdir()
    starts = []
    for rank in range(2):
        offsets, shape = [0, rank * cols // 2], [rows, cols // 2]
        if layers:
            offsets, shape = [0, *offsets], [layers, rows // layers, cols // 2]
        starts.append(
            write_sparse_shard(
                shards / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors", {"w": ("BF16", offsets, shape, half)}
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
    extra: list[object] = []
    if ADAPTERS[adapter]:  # the last row of the tensor stays the last row: the markers keep their places
        rules = tmp_path / "adapter.rules"
        rules.write_text(ADAPTERS[adapter])
        extra = ["--adapter", rules]
    proc = run_python(
        script, "consolidate", shards, out, "--buffer-size", "32M", "--stats-json", tmp_path / "s.json", "-q", *extra,
        timeout=300,
    )  # fmt: skip
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


# ---------------------------------------------------------------- planning memory per rank

#: The stated bound on planning memory per rank (docs/design.md, "Memory"): bytes per piece of the
#: rank's share, per tensor of the checkpoint, per byte of the largest header (its parsed JSON), and fixed.
PER_PIECE, PER_TENSOR, PER_HEADER_BYTE, FIXED = 260, 2048, 25, 1 << 20


@pytest.mark.slow
@pytest.mark.mpi
def test_planning_memory_is_the_ranks_share_of_the_pieces(mpi_tmp_path):
    """Scan + plan of 128,000 pieces: the peak of Python/numpy allocations on each rank stays within the
    stated bound for 1/size of the pieces, so it fails if any rank held (or copied) the whole table."""
    import tracemalloc

    from helpers import reference_bytes
    from mpi4py import MPI

    from mpicons.comm import as_communicator
    from mpicons.core.planner import build_layout
    from mpicons.job.scan import scan
    from mpicons.job.shares import distribute

    comm = as_communicator(MPI.COMM_WORLD)
    training_ranks, tensors = 256, 500
    if comm.rank == 0:
        mpi_tmp_path.mkdir(exist_ok=True)
        for r in range(training_ranks):
            pieces = {f"layers.{t // 8}.experts.{t % 8}.w": ("BF16", [1, 4], bytes(8)) for t in range(tensors)}
            info = {name: {"saved_offsets": [r, 0]} for name in pieces}
            metadata = {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)}
            (mpi_tmp_path / f"shard-{r + 1:05d}-model-00001-of-00001.safetensors").write_bytes(reference_bytes(pieces, metadata))
    comm.bcast(None, root=0)  # wait for the files
    header = max(p.stat().st_size for p in mpi_tmp_path.iterdir())
    tracemalloc.start()
    try:
        scanned = scan(str(mpi_tmp_path), comm)
        layout = build_layout(scanned.files, scanned.names, scanned.facts, comm.size)
        part = distribute(comm, scanned, layout)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    share = training_ranks * tensors / comm.size
    bound = PER_PIECE * share + PER_TENSOR * tensors + PER_HEADER_BYTE * header + FIXED
    results = comm.allgather((peak, len(part.pieces)))
    assert sum(n for _, n in results) == training_ranks * tensors  # every piece is in exactly one part here
    assert all(p <= bound for p, _ in results), f"peaks {[p for p, _ in results]} over the bound {bound:.0f} at {comm.size} ranks"


def _sparse_file(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A plain safetensors file of zeros (a hole): what is measured is the memory, not the disk."""
    size = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
    entries = {name: (dtype, [0, 0], shape, size[dtype] * shape[0] * shape[1]) for name, (dtype, shape) in tensors.items()}
    write_sparse_shard(path, entries, dcp=False)


@pytest.mark.slow
@pytest.mark.parametrize("job", ["lora", "dequantize", "quantize"])
def test_peak_rss_is_bounded_by_the_buffer_when_values_change(tmp_path, job):
    """A 1 GiB weight merged with a rank-16 LoRA, dequantized from block FP8, quantized to it: the buffer
    plus 100 MB, as a plain consolidation (the value ops work in chunks of rows)."""
    from safetensors.numpy import save_file

    rows, cols, name = 16_384, 32_768, "model.layers.0.mlp.up_proj.weight"
    base, extra = tmp_path / "base", []
    base.mkdir()
    if job == "dequantize":
        _sparse_file(base / "model.safetensors", {name: ("F8_E4M3", [rows * 2, cols]), name + "_scale_inv": ("F32", [256, 256])})
        extra = ["--dtype", "bf16"]
    else:
        _sparse_file(base / "model.safetensors", {name: ("BF16", [rows, cols])})
        extra = ["--dtype", "fp8"]
    if job == "lora":
        adapter = tmp_path / "adapter"
        adapter.mkdir()
        rng = np.random.default_rng(0)
        module = f"base_model.model.{name.removesuffix('.weight')}"
        save_file(
            {
                f"{module}.lora_A.weight": rng.random((16, cols), np.float32),
                f"{module}.lora_B.weight": rng.random((rows, 16), np.float32),
            },
            adapter / "adapter_model.safetensors",
        )
        (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32}))
        extra = ["--lora", adapter]
    out = tmp_path / "out"
    script = Path(__file__).parent / "scripts" / "peak_rss.py"
    proc = run_python(script, "consolidate", base, out, "--buffer-size", "32M", "-q", *extra, timeout=600)
    shutil.rmtree(out, ignore_errors=True)  # 0.5-2 GiB written: the disk is not what is measured
    assert proc.returncode == 0, proc.stderr
    peak = float(proc.stdout.split("PEAK_RSS_MB")[1].split()[0])
    assert peak < 32 + 100, proc.stdout
