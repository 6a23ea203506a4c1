"""``--hf-assets DIR``: the model's Hugging Face files, read once and published beside the weights.

A user keeps ``config.json``, the tokenizer files and ``generation_config.json`` in one directory
(torchtitan's ``hf_assets_path``; often a Hugging Face cache snapshot, whose entries are links into
``blobs/``). :func:`read_assets` reads what the job needs from it (the config, the index's
``weight_map``) and decides what to copy; :func:`stage_assets` copies that into the run's staging
directory, so the assets are published in the same transaction as the weights: never a model
directory with weights and no config, or the reverse.

Only a model's own files directly in DIR are copied (:data:`MODEL_FILE_PATTERNS`: config, generation
config, tokenizer and its parts, chat template, processor configs, remote code, model card, licence;
a link is followed only to a regular file). A trainer's files that often sit beside them in a
checkpoint folder (``latest``, ``zero_to_fp32.py``, ``trainer_state.json``, rng and optimizer
states) are left out and reported, and so are the weights and indexes (mpicons writes its own),
hidden entries and subdirectories. Copies are made in blocks in the kernel, never a whole file in memory. DIR may be an
``s3://`` prefix: its objects are sorted the same way and read whole (:attr:`HFAssets.contents`).
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.errors import InputError, WriteError
from ..core.mapping import parse_mapping
from ..core.names import CHECKPOINT_FILE, INDEX_NAME, SHARD_FILE
from ..core.options import DTYPE_TARGETS
from ..core.safetensors_codec import DTYPE_BY_NAME
from .journal import describe_names
from .regular_files import NotRegular, fsync_directory, kind_of, open_regular, read_bounded
from .s3 import is_s3
from .sources import MAX_TRANSFER

CONFIG_NAME = "config.json"
#: Weights and their indexes, in any format a model directory may hold: never copied (mpicons writes the weights).
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    "*.index.json",
    ".metadata",
    "*.distcp",
)
#: A model's own files, the only ones copied (fnmatch patterns on the name): what ``from_pretrained``
#: and a tokenizer or processor read, the remote code a ``trust_remote_code`` model imports, and what a
#: model repository publishes with them (card, licence, notices).
MODEL_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "feature_extractor_config.json",
    "configuration_*.py",
    "modeling_*.py",
    "tokenization_*.py",
    "processing_*.py",
    "image_processing_*.py",
    "README.md",
    "LICENSE",
    "LICENSE.*",
    "LICENCE",
    "NOTICE",
    "NOTICE.*",
    "USE_POLICY.md",
)
#: Largest ``config.json`` or index read (both are parsed whole; real ones are kilobytes to a few megabytes).
READ_LIMIT = 100 << 20
#: The config keys that give the weights' dtype: transformers ≥ 4.56 reads ``dtype`` (and prefers it when
#: both are there) and writes only it; older versions read only ``torch_dtype``.
DTYPE_KEYS = ("dtype", "torch_dtype")
_COPY_BLOCK = 8 << 20
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class HFAssets:
    """What an assets directory holds, as read once on the rank that owns the output directory."""

    #: The directory given (``--hf-assets``).
    directory: str
    #: ``config.json`` parsed (a JSON object); None when the directory has none.
    config: dict[str, Any] | None
    #: ``model.safetensors.index.json``'s ``weight_map`` (tensor name → file name); None when absent.
    weight_map: dict[str, str] | None
    #: The names copied into the output, sorted.
    files: tuple[str, ...]
    #: What was left out and why (subdirectories, weights, hidden entries), one line each, for the report.
    notes: tuple[str, ...] = ()
    #: ``config.json``'s bytes as parsed: what is published (when no dtype is set), so the config in the
    #: output is the one this run's rules read, even if the file changes meanwhile.
    config_bytes: bytes | None = field(default=None, repr=False)
    #: Every file's bytes, read at once when the assets are in object storage (``s3://``): they travel
    #: with the job's agreed settings, so whichever rank publishes has them. None: read from the directory.
    contents: dict[str, bytes] | None = field(default=None, repr=False)
    #: What to call the config in messages when it is no file of ``directory`` (one derived from a run's args).
    config_origin: str | None = None
    #: Folders the job makes and publishes beside the files (``--no-merge``'s ``lora_adapter/``): name →
    #: its files' bytes (empty until the job has them; the name alone is known from the plan).
    folders: dict[str, dict[str, bytes]] = field(default_factory=dict, repr=False)

    @property
    def published_names(self) -> tuple[str, ...]:
        """Every entry the assets add to the output: the files copied, then the folders made."""
        return (*self.files, *self.folders)

    @property
    def config_path(self) -> str:
        """The config as messages name it: its file, or where it was derived from."""
        return self.config_origin or os.path.join(self.directory, "config.json")


def read_assets(directory: str | os.PathLike[str], endpoint: str | None = None) -> HFAssets:
    """Read DIR's config and index and decide which files to copy; :class:`InputError` when DIR is unusable.
    An ``s3://`` prefix (``endpoint``: the S3 API's) is read whole: its files are small."""
    path = os.fspath(directory)
    if is_s3(path):
        return _read_object_assets(path, endpoint)
    _check_directory(path)
    kept: list[str] = []
    subdirectories: list[str] = []
    weights: list[str] = []
    hidden: list[str] = []
    others: list[str] = []
    has_index = False
    for name in sorted(_list(path)):
        full = os.path.join(path, name)
        if _is_weight(name):
            if name != INDEX_NAME:
                weights.append(name)  # never opened, whatever it is
            elif not stat.S_ISREG(mode := _target_mode(full)):
                raise _not_regular(full, mode)
            else:
                has_index = True
            continue
        if name.startswith("."):
            hidden.append(name)
            continue
        mode = _target_mode(full)
        if stat.S_ISDIR(mode):
            subdirectories.append(name)
        elif not is_model_file(name):
            others.append(name)  # never opened, whatever it is
        elif not stat.S_ISREG(mode):
            raise _not_regular(full, mode)
        else:
            kept.append(name)
    sorted_out = _SortedEntries(kept, subdirectories, weights, hidden, has_index, others)
    return _assets(path, sorted_out, lambda name: _read_file(os.path.join(path, name)))


@dataclass
class _SortedEntries:
    """An assets location's entries by what is done with them."""

    kept: list[str] = field(default_factory=list)  # copied
    subdirectories: list[str] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)  # never read
    hidden: list[str] = field(default_factory=list)
    has_index: bool = False  # model.safetensors.index.json: read for its weight_map
    others: list[str] = field(default_factory=list)  # not a model's files: a trainer's, the user's own


def is_model_file(name: str) -> bool:
    """Whether ``name`` is one of a model's own files (:data:`MODEL_FILE_PATTERNS`), copied with the weights."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in MODEL_FILE_PATTERNS)


def _assets(
    path: str, entries: _SortedEntries, read: Callable[[str], bytes], contents: dict[str, bytes] | None = None
) -> HFAssets:
    """The assets at ``path`` from its sorted entries, the config and index read through ``read``."""
    kept = entries.kept
    config_bytes = read(CONFIG_NAME) if CONFIG_NAME in kept else None
    config = None if config_bytes is None else _parse_config(os.path.join(path, CONFIG_NAME), config_bytes)
    index_path = os.path.join(path, INDEX_NAME)
    weight_map = _parse_index(index_path, read(INDEX_NAME)) if entries.has_index else None
    _refuse_reserved(path, kept, weight_map)
    notes = [
        f"left out subdirectory '{name}/' of {path} (only files directly in it are copied)" for name in entries.subdirectories
    ]
    if entries.weights:
        notes.append(f"left out {describe_names(entries.weights)} of {path}: weights, which mpicons writes itself")
    if entries.has_index:
        notes.append(f"{index_path}: its weight_map decides the output files; mpicons writes its own index")
    if entries.hidden:
        notes.append(f"left out hidden {describe_names(entries.hidden)} of {path}")
    if entries.others:
        notes.append(
            f"left out {describe_names(entries.others, show=8)} of {path}: not a model's files (config, tokenizer, "
            "chat template, processor, remote code, card, licence are copied; the list is in docs/assets.md)"
        )
    return HFAssets(path, config, weight_map, tuple(kept), tuple(notes), config_bytes, contents)


def _read_object_assets(url: str, endpoint: str | None) -> HFAssets:
    """The assets under an ``s3://`` prefix: the objects directly under it sorted as a directory's
    entries are (a sub-prefix is a subdirectory), the kept ones read whole, each at most :data:`READ_LIMIT`."""
    from .s3_sources import S3Place

    place = S3Place.at(url, endpoint)
    names = place.entries()
    if not names:
        raise InputError(
            f"{url}: no objects there (--hf-assets names the prefix holding the model's config.json and tokenizer files)"
        )
    entries = _SortedEntries()
    for name in names:
        if _is_weight(name) and place.is_file(name):
            entries.has_index |= name == INDEX_NAME
            if name != INDEX_NAME:
                entries.weights.append(name)
        elif name.startswith("."):
            entries.hidden.append(name)
        elif not place.is_file(name):
            entries.subdirectories.append(name)
        elif is_model_file(name):
            entries.kept.append(name)
        else:
            entries.others.append(name)

    def read(name: str) -> bytes:
        return place.read_small(name, "a file mpicons reads from --hf-assets", limit=READ_LIMIT)

    contents = {name: read(name) for name in entries.kept}
    return _assets(url, entries, lambda name: contents[name] if name in contents else read(name), contents)


def read_config(path: str) -> dict[str, Any]:
    """A model's ``config.json`` at ``path`` (a regular file, or a link to one), parsed: bounded, a JSON object."""
    return _parse_config(path, _read_file(path))


def asset_names(assets: HFAssets) -> list[str]:
    """The names the assets take in the output directory (for the replaced-entries check before staging)."""
    return list(assets.files)


def config_with_dtype(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """``config`` saying the weights are ``dtype`` (a safetensors name: ``BF16``, ``F16``, ``F32``).

    Every dtype key already there is set (a stale ``torch_dtype`` beside ``dtype`` would mislead older
    transformers); with neither, both are written, so every transformers version reads the same dtype.
    """
    torch_name = DTYPE_BY_NAME[dtype].torch
    keys = [key for key in DTYPE_KEYS if key in config] or list(DTYPE_KEYS)
    return {**config, **dict.fromkeys(keys, torch_name)}


def with_folder(assets: HFAssets | None, name: str, files: dict[str, bytes]) -> HFAssets:
    """``assets`` (or none) publishing the folder ``name`` holding ``files`` too."""
    if assets is None:
        assets = HFAssets("", None, None, ())
    return replace(assets, folders={**assets.folders, name: files})


def with_config(assets: HFAssets, config: dict[str, Any]) -> HFAssets:
    """``assets`` publishing ``config`` as their ``config.json`` (one the job changed: FP8 dequantized)."""
    return replace(assets, config=config, config_bytes=render_config(config))


def render_config(config: dict[str, Any]) -> bytes:
    """``config`` as transformers' ``save_pretrained`` writes it (indent 2, keys sorted, a final newline)."""
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def stage_assets(assets: HFAssets, staging: str, dtype: str | None, durable: bool) -> list[str]:
    """Copy ``assets.files`` into ``staging`` (created exclusively, never through an existing entry).

    ``dtype``: what the weights were converted to (``--dtype``), recorded in ``config.json``, which
    is then re-serialized; None copies it byte for byte. Returns the names staged. On any failure
    the files this call created are removed again.
    """
    if dtype is not None and dtype not in DTYPE_TARGETS.values():
        raise ValueError(f"stage_assets: dtype {dtype!r} is not one of {', '.join(DTYPE_TARGETS.values())}")
    staged: list[str] = []
    try:
        for name in assets.files:
            target = os.path.join(staging, name)
            if name == CONFIG_NAME and dtype is not None and assets.config is not None:
                _stage_file(target, durable, data=render_config(config_with_dtype(assets.config, dtype)))
            elif name == CONFIG_NAME and assets.config_bytes is not None:
                _stage_file(target, durable, data=assets.config_bytes)
            elif assets.contents is not None:
                _stage_file(target, durable, data=assets.contents[name])
            else:
                _stage_file(target, durable, source=os.path.join(assets.directory, name))
            staged.append(name)
        for name, files in assets.folders.items():
            _stage_folder(os.path.join(staging, name), files, durable)
            staged.append(name)
    except BaseException:
        for name in staged:
            try:
                if name in assets.folders:
                    shutil.rmtree(os.path.join(staging, name))
                else:
                    os.unlink(os.path.join(staging, name))
            except OSError:
                pass
        raise
    return staged


def _stage_folder(path: str, files: dict[str, bytes], durable: bool) -> None:
    """A folder created exclusively and its files (a failure leaves it for the caller to remove)."""
    try:
        os.mkdir(path, 0o755)
    except OSError as exc:
        raise WriteError(f"{path}: cannot create it ({exc.strerror})") from None
    for name, data in sorted(files.items()):
        _stage_file(os.path.join(path, name), durable, data=data)
    if durable:
        fsync_directory(path)


def _check_directory(path: str) -> None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise InputError(
            f"{path}: no such directory (--hf-assets names the directory holding the model's config.json and tokenizer files)"
        ) from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the --hf-assets directory ({exc.strerror})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise InputError(
            f"{path}: is {kind_of(info.st_mode)}, not a directory (--hf-assets names the directory holding config.json)"
        )


def _list(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError as exc:
        raise InputError(f"{path}: cannot list the --hf-assets directory ({exc.strerror})") from None


def _is_weight(name: str) -> bool:
    lowered = name.lower()
    return any(fnmatch.fnmatchcase(lowered, pattern) for pattern in WEIGHT_PATTERNS)


def _target_mode(path: str) -> int:
    """The mode of what ``path`` leads to (a link followed); a dangling link is refused."""
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise InputError(
                f"{path}: a symbolic link to {os.readlink(path)!r}, which does not exist: "
                "fix or remove it (in a Hugging Face cache, download the snapshot again)"
            ) from None
        raise InputError(f"{path}: removed while the --hf-assets directory was read; run again") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc.strerror})") from None


def _not_regular(path: str, mode: int) -> InputError:
    return InputError(
        f"{path}: is {kind_of(mode)}, not a regular file; mpicons copies only regular files from --hf-assets: "
        "remove it or replace it with a copy of the file"
    )


def _open_source(path: str) -> int:
    """A read descriptor on the regular file at ``path`` (a link to one is followed), never blocking."""
    try:
        return open_regular(path, follow_links=True)
    except NotRegular as exc:
        raise _not_regular(path, exc.mode) from None
    except FileNotFoundError:
        raise InputError(f"{path}: removed from --hf-assets since the run began: put it back and run again") from None
    except OSError as exc:
        raise WriteError(f"{path}: cannot open it ({exc.strerror})") from None


def _read_file(path: str) -> bytes:
    """All of the small file at ``path`` (at most :data:`READ_LIMIT` bytes)."""
    fd = _open_source(path)
    try:
        size = os.fstat(fd).st_size
        if size > READ_LIMIT:
            raise InputError(f"{path}: {size} bytes, more than the {READ_LIMIT >> 20} MB mpicons reads from --hf-assets")
        data = read_bounded(fd, READ_LIMIT)
    except OSError as exc:
        raise WriteError(f"{path}: cannot read it ({exc.strerror})") from None
    finally:
        os.close(fd)
    if data is None:
        raise InputError(f"{path}: more than the {READ_LIMIT >> 20} MB mpicons reads from --hf-assets")
    return data


def _load_json(path: str, data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc}): {what}") from None


def _parse_config(path: str, data: bytes) -> dict[str, Any]:
    config = _load_json(path, data, "give the model's Hugging Face config.json")
    if not isinstance(config, dict):
        raise InputError(
            f"{path}: holds a JSON {type(config).__name__}, not an object: give the model's Hugging Face config.json"
        )
    return config


def _parse_index(path: str, data: bytes) -> dict[str, str]:
    index = _load_json(path, data, "give Hugging Face's index of the model, or remove it (default sharding is used then)")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise InputError(f'{path}: has no "weight_map" object (tensor name → file name): fix it or remove it')
    for name, file_name in weight_map.items():
        if not isinstance(file_name, str):
            raise InputError(f"{path}: weight_map maps tensor {name!r} to {file_name!r}, not a file name: fix it or remove it")
    return dict(parse_mapping(index, path))


def _refuse_reserved(path: str, kept: list[str], weight_map: dict[str, str] | None) -> None:
    """Refuse a file to copy whose name the weights take (by mpicons' naming rules or the index)."""
    weight_files = set() if weight_map is None else set(weight_map.values())
    for name in kept:
        if CHECKPOINT_FILE.match(name) or SHARD_FILE.match(name):
            raise InputError(
                f"{os.path.join(path, name)}: the name of a checkpoint file, which mpicons writes itself: rename or remove it"
            )
        if name in weight_files:
            raise InputError(
                f"{os.path.join(path, name)}: {INDEX_NAME} names this file for weights, so it cannot also be "
                "copied: fix the index's weight_map or remove the file"
            )


def _stage_file(path: str, durable: bool, data: bytes | None = None, source: str | None = None) -> None:
    """Create ``path`` exclusively holding ``data`` or a copy of ``source`` (flushed if ``durable``).

    The source is opened first (a missing one leaves nothing behind); a failure removes ``path`` again.
    """
    src = None if source is None else _open_source(source)
    try:
        try:
            fd = os.open(path, _CREATE_FLAGS, 0o644)
        except FileExistsError:
            raise InputError(
                f"{path}: already staged (another output of this run is named {os.path.basename(path)!r}); "
                "nothing was overwritten"
            ) from None
        except OSError as exc:
            raise WriteError(f"{path}: cannot create it ({exc.strerror})") from None
        try:
            try:
                if src is not None and source is not None:
                    _copy(src, fd, source, path)
                else:
                    _write_all(fd, data or b"", path)
                if durable:
                    os.fsync(fd)
            except OSError as exc:
                raise WriteError(f"{path}: cannot flush it to storage ({exc.strerror})") from None
            finally:
                os.close(fd)
        except BaseException:
            try:
                os.unlink(path)  # this call's own, just created
            except OSError:
                pass
            raise
    finally:
        if src is not None:
            os.close(src)


def _write_all(fd: int, data: bytes, path: str) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view[:MAX_TRANSFER]) :]
    except OSError as exc:
        raise WriteError(f"{path}: cannot write it ({exc.strerror})") from None


def _copy(src: int, dst: int, source: str, target: str) -> None:
    """Copy all of ``src`` into ``dst`` in blocks: in the kernel when it can, else through one buffer."""
    offset = 0
    try:
        while True:
            got = os.copy_file_range(src, dst, _COPY_BLOCK, offset, offset)
            if got == 0:
                return
            offset += got
    except AttributeError:
        pass  # no copy_file_range on this platform
    except OSError as exc:
        if exc.errno not in _NO_COPY_RANGE:
            raise WriteError(f"{target}: copy from {source} failed ({exc.strerror})") from None
    try:
        while True:
            block = os.pread(src, _COPY_BLOCK, offset)
            if not block:
                return
            view = memoryview(block)
            while view:
                view = view[os.pwrite(dst, view, offset + len(block) - len(view)) :]
            offset += len(block)
    except OSError as exc:
        raise WriteError(f"{target}: copy from {source} failed ({exc.strerror})") from None


def asset_bytes(assets: HFAssets, dtype: str | None) -> dict[str, bytes]:
    """Each asset's bytes as :func:`stage_assets` would stage them (``dtype`` recorded in ``config.json``),
    for outputs that are objects rather than files; read with the same bounded, regular-file-only reads."""
    if assets.folders:
        raise InputError(f"{describe_names(list(assets.folders))}: a folder, which an object-store output does not take yet")
    payloads: dict[str, bytes] = {}
    for name in assets.files:
        if name == CONFIG_NAME and dtype is not None and assets.config is not None:
            payloads[name] = render_config(config_with_dtype(assets.config, dtype))
        elif name == CONFIG_NAME and assets.config_bytes is not None:
            payloads[name] = assets.config_bytes
        elif assets.contents is not None:
            payloads[name] = assets.contents[name]
        else:
            payloads[name] = _read_file(os.path.join(assets.directory, name))
    return payloads
