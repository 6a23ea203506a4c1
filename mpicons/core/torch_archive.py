"""A whole ``torch.save`` archive read as plain values, without torch (no MPI here): what a trainer
keeps beside its shards (Megatron's ``common.pt``: the run's arguments, the iteration).

The archive's ``data.pkl`` is read by the restricted unpickler of DCP's items
(:class:`~mpicons.core.distcp_items.TensorUnpickler`) plus the classes the caller allows (an
``argparse.Namespace`` as a record, enums as their values); every other name is refused before
anything of the pickle runs. A tensor in it stays a reference to its storage, whose bytes are never
read: a caller wants the small values beside them.
"""

from __future__ import annotations

import zipfile

from .byte_sources import ByteSource, opened
from .distcp_items import SourceWindow, TensorUnpickler
from .errors import InputError
from .unpickling import NOTHING, AllowList, unpickle

#: The largest ``data.pkl`` read (arguments and optimizer hyper-parameters are kilobytes to megabytes).
MAX_PICKLE = 256 << 20


def read_archive(source: ByteSource | str, allow: AllowList = NOTHING, what: str = "a torch.save archive") -> object:
    """The value pickled in the ``torch.save`` archive ``source`` (a path or an open source), built only
    from plain values, torch dtypes, tensor references and the classes ``allow`` names."""
    with opened(source) as readable:
        path = readable.name
        try:
            archive = zipfile.ZipFile(SourceWindow(readable, 0, readable.size))
            members = [
                info for info in archive.infolist() if info.filename.endswith("/data.pkl") and info.filename.count("/") == 1
            ]
            if len(members) != 1:
                raise InputError(f"{path}: not a torch.save archive ({what}: no single <name>/data.pkl in it)")
            if members[0].file_size > MAX_PICKLE:
                raise InputError(f"{path}: its data.pkl is {members[0].file_size} bytes, more than mpicons reads of {what}")
            data = archive.read(members[0])
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as exc:
            raise InputError(f"{path}: not a readable torch.save archive ({what}: {exc})") from None
    return unpickle(data, TensorUnpickler, path, what, allow, format_name="a torch.save archive of plain values")


__all__ = ["MAX_PICKLE", "read_archive"]
