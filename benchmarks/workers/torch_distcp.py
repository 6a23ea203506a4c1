#!/usr/bin/env python3
"""torch's way from a ``.distcp`` checkpoint to a Hugging Face file, timed (its import excluded).

``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (one process, the whole model in
memory) into a ``.pt`` file, ``torch.load`` of it, and ``safetensors.torch.save_file`` of its
tensors with ``{"format": "pt"}``: what people run today, in one process.

    python benchmarks/workers/torch_distcp.py DCP_DIR WORK_DIR RESULT

RESULT gets ``import_s``, ``call_s`` (all three steps), ``sync_s`` (fsync of the output, which
mpicons does and torch does not), ``peak_rss_mb`` and ``error``.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

from durability import fsync_paths


def main() -> None:
    dcp_dir, work, result = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    began = time.perf_counter()
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import_s = time.perf_counter() - began
    work.mkdir(parents=True, exist_ok=True)
    output = work / "model.safetensors"
    error = ""
    began = time.perf_counter()
    try:
        dcp_to_torch_save(dcp_dir, str(work / "full.pt"))
        state = torch.load(work / "full.pt", weights_only=True)
        save_file({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, str(output), metadata={"format": "pt"})
        del state
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        error = f"{type(exc).__name__}: {exc}"
    call_s = time.perf_counter() - began
    sync_s = fsync_paths([output]) if output.exists() else 0.0
    (work / "full.pt").unlink(missing_ok=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result.write_text(json.dumps({"import_s": import_s, "call_s": call_s, "sync_s": sync_s, "peak_rss_mb": rss, "error": error}))


if __name__ == "__main__":
    main()
