"""Reading a checkpoint from ``s3://bucket/prefix`` (no MPI here): ranged GETs through one client.

Every rank makes one :class:`~mpicons.io.s3.S3Client` for the input and shares it between the
header reads and the engine's reads (boto3's clients are thread-safe, so the writer's I/O threads
use it too). The header readers ask for a few large ranges; the engine's reads are its coalesced
runs, each one ranged GET straight into its buffer (resumed where it stopped if the body is cut off);
a rank's GETs are made one after another, the ranks' in parallel.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from ..core.errors import InputError
from ..formats.byte_sources import ByteSource
from ..formats.shard_headers import input_files
from .places import SMALL_FILE
from .s3 import S3Client, S3Location
from .sources import SourceFiles


class S3Object:
    """One object as a :class:`~mpicons.formats.byte_sources.ByteSource`: ``read_at`` is a ranged GET."""

    def __init__(self, client: S3Client, key_name: str, size: int) -> None:
        self.client, self.key_name, self.size = client, key_name, size
        self.name = client.location.url(key_name)

    def read_at(self, offset: int, length: int) -> bytes:
        length = min(length, self.size - offset)  # a range past the end is an error to S3, a short read here
        return self.client.read(self.key_name, offset, length) if length > 0 else b""

    def close(self) -> None:
        """Nothing to release: the client is the store's."""


class S3SourceFiles(SourceFiles):
    """The engine's source files in a bucket: reads are ranged GETs into the engine's buffers."""

    local = False  # no descriptors: outputs copy through their bounce buffers

    def __init__(self, client: S3Client, names: Sequence[str]) -> None:
        super().__init__(client.location.url(), names)
        self.client = client

    def path(self, file: int) -> str:
        return self.client.location.url(self.names[file])

    def fd(self, file: int) -> int:
        """No descriptor to open ahead (a GET needs none): -1."""
        return -1

    def read_into(self, file: int, offset: int, target: memoryview) -> None:
        """Fill ``target`` with the bytes at ``offset`` of object ``file`` (a short object is a WriteError)."""
        if len(target):
            self.client.read_into(self.names[file], offset, target)

    def close(self) -> None:
        """Nothing to close: the client's connections are reused by the next reads."""


class S3Inputs:
    """The input files under ``s3://bucket/prefix``: listed by one rank, read by every rank through its one client."""

    shared = True

    def __init__(self, url: str, endpoint: str | None = None) -> None:
        self.client = S3Client(S3Location.parse(url), endpoint)
        self.location = self.client.location.url()

    def path(self, name: str) -> str:
        return self.client.location.url(name)

    def check_access(self) -> None:
        self.client.check_access(write=False)

    def list(self) -> tuple[list[str], list[int]]:
        return input_files(self.client.list())

    def open(self, name: str, size: int | None = None) -> ByteSource:
        if size is None:
            raise ValueError(f"{self.path(name)}: an object is opened with its listed size")
        return S3Object(self.client, name, size)

    def sources(self, names: Sequence[str]) -> SourceFiles:
        return S3SourceFiles(self.client, names)

    def nested(self) -> builtins.list[str]:
        below = [key.split("/") for key in self.client.list_below()]
        return sorted({sub for sub, name in below if input_files([(name, 0)])[0]})

    def list_suffixed(self, suffixes: tuple[str, ...]) -> tuple[builtins.list[str], builtins.list[int]]:
        kept = [(name, size) for name, size in self.client.list() if name.endswith(suffixes) and not name.startswith(".")]
        return [name for name, _ in kept], [size for _, size in kept]


class S3Place:
    """An ``s3://`` prefix as a :class:`~mpicons.io.places.Place`: a folder is a sub-prefix holding
    objects. One client (rooted at the bucket) serves the prefix and every folder looked at from it;
    each folder is listed once, with one request per thousand entries."""

    def __init__(self, client: S3Client, folder: str) -> None:
        self.client, self.folder = client, folder
        self.path = client.location.url(folder)
        self.name = folder.rsplit("/", 1)[-1]
        self._listing: tuple[dict[str, int], set[str]] | None = None

    @classmethod
    def at(cls, url: str, endpoint: str | None = None) -> S3Place:
        """The prefix ``url``, its bucket's access checked first (bad input when it cannot be read)."""
        location = S3Location.parse(url)
        client = S3Client(location, endpoint)
        client.check_access(write=False)
        return cls(client.moved(S3Location(location.bucket, "")), location.prefix)

    def _listed(self) -> tuple[dict[str, int], set[str]]:
        if self._listing is None:
            files, folders = self.client.list_folder(self.folder)
            self._listing = dict(files), set(folders)
        return self._listing

    def _key(self, name: str) -> str:
        return f"{self.folder}/{name}" if self.folder else name

    def entries(self) -> builtins.list[str]:
        files, folders = self._listed()
        return sorted({*files, *folders})

    def is_file(self, name: str) -> bool:
        return name in self._listed()[0]

    def is_dir(self, name: str) -> bool:
        return name in self._listed()[1]

    def child(self, name: str) -> S3Place:
        return S3Place(self.client, self._key(name))

    def parent(self) -> S3Place:
        return S3Place(self.client, self.folder.rpartition("/")[0])

    def join(self, name: str) -> str:
        return self.client.location.url(self._key(name))

    def _size(self, name: str, what: str) -> int:
        size = self._listed()[0].get(name)
        if size is None:
            raise InputError(f"{self.join(name)}: no such object, not {what}")
        return size

    def read_small(self, name: str, what: str, limit: int = SMALL_FILE) -> bytes:
        size = self._size(name, what)
        if size > limit:
            raise InputError(f"{self.join(name)}: larger than {limit >> 20} MiB, not {what}")
        return self.client.read(self._key(name), 0, size) if size else b""

    def open(self, name: str) -> ByteSource:
        return S3Object(self.client, self._key(name), self._size(name, "a file"))


__all__ = ["S3Object", "S3Place", "S3SourceFiles", "S3Inputs"]
