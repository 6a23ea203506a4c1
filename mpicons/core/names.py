"""The file names a checkpoint is made of, in one place: the plan names its output files with these
rules and the output directory recognises them with the same ones (pure: functions of their arguments).

DCP's shard names (``shard-RRRRR-model-IIIII-of-NNNNN.safetensors``) and the missing-shard hint
built on them are in :mod:`mpicons.core.table`, beside the header reading that parses them.
"""

from __future__ import annotations

import re

#: Hugging Face's index of a sharded checkpoint, published last: the commit point of a run.
INDEX_NAME = "model.safetensors.index.json"
#: What Hugging Face names a checkpoint of one file (and writes no index for).
SINGLE_FILE_NAME = "model.safetensors"
#: File names a Hugging Face safetensors checkpoint is made of (beside the files its index names).
CHECKPOINT_FILE = re.compile(r"^(model-\d{5,}-of-\d{5,}\.safetensors|model\.safetensors|model\.safetensors\.index\.json)$")
#: Files of a sharded checkpoint (DCP's safetensors layout, DCP's default format): never an output directory's.
SHARD_FILE = re.compile(r"^(shard-\d+-model-\d+-of-\d+\.safetensors|\.metadata|.+\.distcp)$")


def output_name(index: int, count: int) -> str:
    """Output file ``index`` (from 1) of ``count``, as Hugging Face's ``save_pretrained`` names it."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plain_file_name(name: object) -> bool:
    """A file name that stays inside its directory: not empty, not ``.``/``..``, no separators or NUL."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


__all__ = ["INDEX_NAME", "SINGLE_FILE_NAME", "CHECKPOINT_FILE", "SHARD_FILE", "output_name", "plain_file_name"]
