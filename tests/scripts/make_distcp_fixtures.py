"""Write the small `.distcp` fixtures of tests/fixtures/distcp/ with torch (run once; the tests do not need torch).

    python tests/scripts/make_distcp_fixtures.py OUT_DIR      # needs torch (CPU build is enough)

Two training ranks (gloo) save one state dict with ``torch.distributed.checkpoint.save`` twice: with
the default ``torch_save`` serialization and with ``safetensors``. It holds every dtype DCP writes
(as DTensor pieces cut on dim 0 or dim 1, and as plain tensors, which DCP saves once), a scalar, an
empty tensor, a tensor with fewer rows than ranks (an empty piece), and non-tensor entries. The
full tensors go to ``expected/full.safetensors``; ``expected/origin.json`` says how it was made.
A third checkpoint holds one transposed (non-row-major) tensor, which mpicons refuses.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

RANKS = 2


def full_tensors() -> dict[str, tuple[torch.Tensor, int | None]]:
    """name → (full tensor, the dimension it is cut on, or None for a plain tensor)."""
    g = torch.Generator().manual_seed(7)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    def ints(low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=g)

    return {
        "model.embed.weight": (rand(9, 6).to(torch.bfloat16), 0),
        "model.proj.weight": (rand(5, 7).to(torch.float16), 1),
        "model.norm.weight": (rand(6), None),
        "model.f64": (rand(3, 4).double(), 0),
        "model.f8_e4m3": (rand(4, 6).to(torch.float8_e4m3fn), 0),
        "model.f8_e5m2": (rand(4, 6).to(torch.float8_e5m2), 1),
        "model.i64": (ints(-(2**40), 2**40, 7, 3), 0),
        "model.i32": (ints(-(2**30), 2**30, 5).int(), 0),
        "model.i16": (ints(-30000, 30000, 2, 5).short(), 1),
        "model.i8": (ints(-128, 128, 6).to(torch.int8), 0),
        "model.u8": (ints(0, 256, 3, 3).to(torch.uint8), 0),
        "model.bool": (ints(0, 2, 5, 2).bool(), 0),
        "model.u16": (ints(0, 65536, 4).to(torch.uint16), None),
        "model.u32": (ints(0, 2**32, 4).to(torch.uint32), None),
        "model.u64": (ints(0, 2**62, 3).to(torch.uint64), None),
        "model.c64": (torch.complex(rand(3), rand(3)), None),
        "model.scalar": (torch.tensor(2.5), None),
        "model.empty": (torch.zeros(0, 4), None),
        "model.one_row": (rand(1, 8).to(torch.bfloat16), 0),
    }


def state_dict(rank: int, mesh) -> dict[str, object]:
    state: dict[str, object] = {}
    for name, (full, dim) in full_tensors().items():
        if dim is None:
            state[name] = full.clone()
        else:
            pieces = list(torch.chunk(full, RANKS, dim=dim))
            pieces += [full.narrow(dim, 0, 0)] * (RANKS - len(pieces))
            state[name] = DTensor.from_local(
                pieces[rank].contiguous(), mesh, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride()
            )
    state["train.step"] = 1234  # non-tensor entries, as optimizer and data-loader state carry them
    state["train.note"] = "not a tensor"
    return state


def worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    mesh = init_device_mesh("cpu", (RANKS,))
    for folder, serialization in (
        ("dtypes-2ranks", SerializationFormat.TORCH_SAVE),
        ("dtypes-2ranks-safetensors", SerializationFormat.SAFETENSORS),
    ):
        writer = FileSystemWriter(os.path.join(out, folder, "dcp"), serialization_format=serialization)
        dcp.save(state_dict(rank, mesh), storage_writer=writer)
    if rank == 0:
        transposed = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
        dcp.save({"weight": transposed}, storage_writer=FileSystemWriter(os.path.join(out, "transposed", "dcp")), no_dist=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1]
    port = 29500 + os.getpid() % 1000
    mp.spawn(worker, args=(out, port), nprocs=RANKS)
    tensors = {name: full.contiguous() for name, (full, _) in full_tensors().items()}
    for folder, serialization in (("dtypes-2ranks", "torch_save"), ("dtypes-2ranks-safetensors", "safetensors")):
        expected = os.path.join(out, folder, "expected")
        os.makedirs(expected, exist_ok=True)
        save_file(tensors, os.path.join(expected, "full.safetensors"))
        origin = {
            "torch": torch.__version__,
            "training_ranks": RANKS,
            "serialization": serialization,
            "cut": {name: dim for name, (_, dim) in full_tensors().items()},
            "non_tensor": ["train.note", "train.step"],
            "writer": "FileSystemWriter defaults (one file per rank, one thread)",
        }
        with open(os.path.join(expected, "origin.json"), "w") as handle:
            json.dump(origin, handle, indent=1)


if __name__ == "__main__":
    main()
