"""``SHA256SUMS``: the format (``sha256sum -c`` accepts it, hostile names are refused), hashing, and
``verify OUT`` checking it: every listed file hashed, a changed, missing, unlisted or linked file
reported with its name; ``inspect`` saying a manifest is there.

Checkpoints are built here with the safetensors library, and their manifests written with hashlib
digests, so the check is held to account apart from the consolidation that writes them; one test
takes a real ``consolidate`` output. The MPI test runs at two ranks or more on a shared directory:
rank 0 builds and damages it, every rank verifies, and the reports are compared across ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import FIXTURES, run_python
from mpi4py import MPI
from safetensors.numpy import save_file

import mpicons
from mpicons.comm import SingleProcess
from mpicons.core.errors import WriteError
from mpicons.core.reports import KINDS
from mpicons.core.safetensors_codec import read_header
from mpicons.frontends import manifest_check
from mpicons.frontends.verification import VerifyReport, verify
from mpicons.io.manifest import MANIFEST_NAME, format_manifest, hash_file, parse_manifest

FILE1 = "model-00001-of-00002.safetensors"
FILE2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
ADAPTER = "lora_adapter/adapter_model.safetensors"
SHA256SUM = shutil.which("sha256sum")
DIGEST = "ab" * 32


# ---------------------------------------------------------------- a checkpoint with a manifest


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _listed_files(out: Path) -> list[str]:
    """Every regular file below ``out`` but the manifest, as the manifest names them."""
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def _write_manifest(out: Path) -> None:
    (out / MANIFEST_NAME).write_bytes(format_manifest({name: _sha256(out / name) for name in _listed_files(out)}))


def _checkpoint(out: Path) -> Path:
    """A two-file Hugging Face checkpoint written by safetensors, its index and config, a LoRA adapter
    folder, and a SHA256SUMS over all of them."""
    out.mkdir(parents=True)
    embed = np.arange(96, dtype=np.float32).reshape(12, 8)
    save_file({"model.embed_tokens.weight": embed}, out / FILE1, metadata={"format": "pt"})
    second = {"lm_head.weight": np.ones((12, 8), dtype=np.float32), "model.norm.weight": np.full(8, 0.5, np.float32)}
    save_file(second, out / FILE2, metadata={"format": "pt"})
    weight_map = {"model.embed_tokens.weight": FILE1, "lm_head.weight": FILE2, "model.norm.weight": FILE2}
    index = {"metadata": {"total_size": 4 * (96 + 96 + 8)}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps({"note": "written by tests/test_manifest.py"}))
    (out / "lora_adapter").mkdir()
    save_file({"lora_A.weight": np.zeros((2, 8), np.float32)}, out / ADAPTER, metadata={"format": "pt"})
    (out / "lora_adapter" / "adapter_config.json").write_text("{}")
    _write_manifest(out)
    return out


def _flip_data_byte(path: Path) -> None:
    """Change one byte of the last tensor's data: the header, and so verify's structure checks, stay intact."""
    header = read_header(path)
    position = header.data_start + header.tensors[-1].end - 1
    with open(path, "r+b") as handle:
        handle.seek(position)
        byte = handle.read(1)
        handle.seek(position)
        handle.write(bytes([byte[0] ^ 0x01]))


def _verify(out: Path, **kwargs: object) -> VerifyReport:
    report = verify(out, comm=SingleProcess(), **kwargs)
    assert all(p.kind in KINDS for p in report.problems), [p.kind for p in report.problems]
    return report


def _problems(report: VerifyReport) -> list[tuple[str, str]]:
    """(kind, path relative to the checked directory) of every problem."""
    return [(p.kind, os.path.relpath(p.path or "", report.output_dir)) for p in report.problems]


# ---------------------------------------------------------------- the format


def test_format_and_parse_round_trip() -> None:
    digests = {"b.json": "0" * 64, "a/c.safetensors": "f" * 64, "model with space.bin": DIGEST}
    raw = format_manifest(digests)
    assert raw.decode().splitlines() == [f"{'f' * 64}  a/c.safetensors", f"{'0' * 64}  b.json", f"{DIGEST}  model with space.bin"]
    assert parse_manifest(raw) == digests
    # sha256sum's binary-mode marker and upper-case digests are read too (digests kept lower-case).
    assert parse_manifest(f"{DIGEST.upper()} *x.bin\n\n".encode()) == {"x.bin": DIGEST}


@pytest.mark.parametrize(
    "raw, why",
    [
        (f"{DIGEST}  ../x\n", "leaves the directory"),
        (f"{DIGEST}  a/../../x\n", "leaves the directory"),
        (f"{DIGEST}  /etc/passwd\n", "not a plain relative path"),
        (f"{DIGEST}  a//b\n", "empty part"),
        (f"{DIGEST}  ./a\n", "leaves the directory"),
        (f"{DIGEST}  a\\b\n", "not a plain relative path"),
        (f"{DIGEST}  x\n{DIGEST}  x\n", "a second time"),
        (f"{DIGEST[:-1]}  x\n", "is not '<64 hex digits>  <file name>'"),
        (f"{'g' * 64}  x\n", "is not '<64 hex digits>  <file name>'"),
        (f"{DIGEST} x\n", "is not '<64 hex digits>  <file name>'"),
        ("\n", "lists no files"),
    ],
)
def test_hostile_or_broken_manifests_are_refused(raw: str, why: str) -> None:
    problem = parse_manifest(raw.encode())
    assert isinstance(problem, str) and why in problem, problem


def test_a_manifest_that_is_not_utf8_is_refused() -> None:
    assert parse_manifest(DIGEST.encode() + b"  \xff.bin\n") == "it is not UTF-8 text"


@pytest.mark.skipif(SHA256SUM is None, reason="needs coreutils' sha256sum")
def test_sha256sum_checks_a_manifest_written_by_format_manifest(tmp_path: Path) -> None:
    out = _checkpoint(tmp_path / "out")
    proc = subprocess.run([SHA256SUM, "-c", MANIFEST_NAME], cwd=out, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(proc.stdout.splitlines()) == sorted(f"{name}: OK" for name in _listed_files(out))
    _flip_data_byte(out / FILE2)
    proc = subprocess.run([SHA256SUM, "-c", "--quiet", MANIFEST_NAME], cwd=out, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout.splitlines() == [f"{FILE2}: FAILED"], proc.stdout


def test_hash_file_is_hashlib_over_the_file_and_never_follows_a_link(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(0).bytes(10_000))
    assert hash_file(str(path)) == _sha256(path)
    assert hash_file(str(path), memoryview(bytearray(999))) == _sha256(path)  # many reads through a small buffer
    (tmp_path / "empty").write_bytes(b"")
    assert hash_file(str(tmp_path / "empty")) == hashlib.sha256(b"").hexdigest()
    (tmp_path / "link").symlink_to(path)
    with pytest.raises(WriteError, match="is a symbolic link, not a regular file; not hashed"):
        hash_file(str(tmp_path / "link"))
    assert hash_file(str(tmp_path / "link"), follow_links=True) == _sha256(path)


# ---------------------------------------------------------------- verify


def test_a_checkpoint_with_its_manifest_verifies(tmp_path: Path) -> None:
    out = _checkpoint(tmp_path / "out")
    report = _verify(out)
    assert report.ok, report.lines()
    assert report.manifest == str(out / MANIFEST_NAME)
    assert report.manifest_files == report.checksummed == 6
    assert "SHA256SUMS: 6 files match" in report.summary()
    assert {"manifest": report.manifest, "manifest_files": 6, "checksummed": 6}.items() <= report.to_dict().items()


def test_a_flipped_byte_is_a_checksum_problem_naming_the_file(tmp_path: Path) -> None:
    out = _checkpoint(tmp_path / "out")
    _flip_data_byte(out / FILE2)
    report = _verify(out)
    assert _problems(report) == [("checksum", FILE2)], report.lines()  # the structure is intact: only the manifest sees it
    assert f"{out / FILE2}: SHA-256 " in report.lines()[0] and "differs from the" in report.lines()[0]
    assert report.checksummed == 5 and "SHA256SUMS: 5 of 6 files match" in report.summary()
    assert report.to_dict()["problems"][0]["kind"] == "checksum"
    proc = run_python("-m", "mpicons", "verify", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{out / FILE2}: SHA-256 " in proc.stdout and "mpicons: error" not in proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("mpicons verify: 1 problem:")


def test_a_flipped_byte_in_a_sub_folder_is_found_with_or_without_against(tmp_path: Path) -> None:
    out = _checkpoint(tmp_path / "out")
    _flip_data_byte(out / ADAPTER)
    assert _problems(_verify(out)) == [("checksum", ADAPTER)]


@pytest.mark.parametrize(
    "name, what",
    [("config.json", "listed in SHA256SUMS but missing"), (FILE1, "listed in the index for 1 tensor but missing")],
)
def test_a_listed_file_that_is_gone_is_reported_missing_once(name: str, what: str, tmp_path: Path) -> None:
    """A weights file is missing from the index and from the manifest: one problem, the index's."""
    out = _checkpoint(tmp_path / "out")
    (out / name).unlink()
    report = _verify(out)
    missing = [p for p in report.problems if p.kind == "missing file"]
    assert [(p.path, p.what) for p in missing] == [(str(out / name), what)], report.lines()
    assert not report.ok and report.checksummed == 5


def test_files_present_but_not_listed_are_reported(tmp_path: Path) -> None:
    """Every regular file of the directory and its sub-folders; not the hidden entries at its top."""
    out = _checkpoint(tmp_path / "out")
    (out / "README.md").write_text("a model card added later\n")
    (out / "lora_adapter" / "extra.bin").write_bytes(b"x")
    (out / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (out / ".cache").mkdir()
    (out / ".cache" / "x").write_bytes(b"y")
    os.mkfifo(out / "a-fifo")  # not a regular file: neither opened nor counted
    report = _verify(out)
    assert _problems(report) == [("unlisted", "README.md"), ("unlisted", "lora_adapter/extra.bin")], report.lines()
    assert "not listed in SHA256SUMS" in report.problems[0].what
    assert report.checksummed == report.manifest_files == 6 and not report.ok


def test_a_folder_the_manifest_lists_nothing_of_is_not_the_checkpoint(tmp_path: Path) -> None:
    """torchtitan's layout: the shards stay in ``STEP/sharded`` beside the model consolidated into ``STEP``."""
    out = _checkpoint(tmp_path / "out")
    (out / "sharded").mkdir()
    (out / "sharded" / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"not listed, not ours")
    report = _verify(out)
    assert _problems(report) == [] and report.ok, report.lines()


def test_a_file_name_that_is_not_utf8_is_reported_printably(tmp_path: Path) -> None:
    out = _checkpoint(tmp_path / "out")
    (out / os.fsdecode(b"bad-\xff.bin")).write_bytes(b"x")
    report = _verify(out)
    assert _problems(report) == [("unlisted", "bad-\\udcff.bin")], report.lines()
    proc = run_python("-m", "mpicons", "verify", out)
    assert proc.returncode == 1 and "bad-\\udcff.bin: not listed" in proc.stdout, proc.stdout + proc.stderr


def test_a_link_in_place_of_a_listed_file_is_not_followed(tmp_path: Path) -> None:
    """An identical copy outside: read through the link, it would match."""
    out = _checkpoint(tmp_path / "out")
    copy = tmp_path / "elsewhere.json"
    shutil.copy(out / "config.json", copy)
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(copy)
    report = _verify(out)
    assert _problems(report) == [("refused", "config.json")], report.lines()
    assert f"is a symbolic link to {copy}" in report.problems[0].what
    assert report.refused == [str(out / "config.json")] and report.checksummed == 5
    followed = _verify(out, follow_links=True)  # asked for, a link to a regular file is read like the rest
    assert followed.ok and followed.checksummed == 6, followed.lines()


def test_a_linked_sub_folder_is_never_entered(tmp_path: Path) -> None:
    out = _checkpoint(tmp_path / "out")
    shutil.move(out / "lora_adapter", tmp_path / "adapter-copy")
    (out / "lora_adapter").symlink_to(tmp_path / "adapter-copy")
    for follow_links in (False, True):
        report = _verify(out, follow_links=follow_links)
        assert _problems(report) == [("refused", "lora_adapter/adapter_config.json"), ("refused", ADAPTER)], report.lines()
        assert "inside lora_adapter, a symbolic link to" in report.problems[0].what
        assert report.checksummed == 4


def test_a_fifo_in_place_of_a_listed_file_is_not_opened(tmp_path: Path) -> None:
    out = _checkpoint(tmp_path / "out")
    (out / "config.json").unlink()
    os.mkfifo(out / "config.json")  # opening it for reading would wait for a writer
    proc = run_python("-m", "mpicons", "verify", out, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # as for any entry verify will not read
    assert f"{out / 'config.json'}: is a FIFO (named pipe), not a regular file" in proc.stdout


def test_a_file_swapped_for_a_link_after_the_look_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 looked at a regular file; by the time a rank opens it, it is a link: the open refuses it."""
    out = _checkpoint(tmp_path / "out")
    looked = manifest_check._look

    def look_then_swap(directory: str, follow_links: bool) -> object:
        found = looked(directory, follow_links)
        shutil.copy(out / "config.json", tmp_path / "copy.json")
        (out / "config.json").unlink()
        (out / "config.json").symlink_to(tmp_path / "copy.json")
        return found

    monkeypatch.setattr(manifest_check, "_look", look_then_swap)
    report = _verify(out)
    assert _problems(report) == [("unreadable", "config.json")], report.lines()
    assert "is now a symbolic link, not a regular file (it changed while verify looked at it)" in report.problems[0].what
    assert report.checksummed == 5


@pytest.mark.parametrize(
    "plant, kind, what",
    [
        (lambda m: m.write_text("not a manifest\n"), "manifest", "is not a manifest in sha256sum's format (line 1"),
        (lambda m: (m.unlink(), m.symlink_to("/etc/passwd")), "refused", "is a symbolic link to /etc/passwd"),
        (lambda m: (m.unlink(), os.mkfifo(m)), "refused", "is a FIFO (named pipe)"),
    ],
)
def test_a_manifest_that_cannot_be_used_is_a_problem(plant, kind: str, what: str, tmp_path: Path) -> None:
    out = _checkpoint(tmp_path / "out")
    plant(out / MANIFEST_NAME)
    report = _verify(out)
    assert _problems(report) == [(kind, MANIFEST_NAME)] and what in report.problems[0].what, report.lines()
    assert report.manifest == str(out / MANIFEST_NAME) and report.manifest_files == report.checksummed == 0
    assert "SHA256SUMS not usable (see above)" in report.summary()


def test_a_manifest_over_the_size_limit_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _checkpoint(tmp_path / "out")
    monkeypatch.setattr(manifest_check, "MANIFEST_LIMIT", 100)
    report = _verify(out)
    assert _problems(report) == [("manifest", MANIFEST_NAME)], report.lines()
    assert "is larger than the 100-byte limit" in report.problems[0].what


def test_without_a_manifest_the_summary_says_contents_were_not_checked(tmp_path: Path) -> None:
    out = _checkpoint(tmp_path / "out")
    (out / MANIFEST_NAME).unlink()
    _flip_data_byte(out / FILE2)
    report = _verify(out)
    assert report.ok and report.manifest is None
    assert "no SHA256SUMS: file contents not checked without --against" in report.summary()


# ---------------------------------------------------------------- inspect, and a real consolidation


def test_inspect_says_a_manifest_is_there(tmp_path: Path) -> None:
    out = _checkpoint(tmp_path / "out")
    report = mpicons.inspect(out, comm=SingleProcess())
    assert report.manifest == "SHA256SUMS lists 6 files (not hashed here; mpicons verify checks them)"
    assert f"  manifest {report.manifest}" in report.table().splitlines()
    assert report.to_dict()["manifest"] == report.manifest
    (out / MANIFEST_NAME).unlink()
    report = mpicons.inspect(out, comm=SingleProcess())
    assert report.manifest is None and "  manifest" not in report.table()


def test_a_consolidated_output_carries_a_manifest_verify_and_sha256sum_check(tmp_path: Path) -> None:
    out = tmp_path / "out"
    mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", out, comm=SingleProcess())
    report = _verify(out)
    assert report.ok and report.checksummed == report.manifest_files == len(_listed_files(out)) == 3, report.lines()
    if SHA256SUM is not None:
        assert subprocess.run([SHA256SUM, "-c", "--quiet", MANIFEST_NAME], cwd=out, timeout=60).returncode == 0
    _flip_data_byte(out / FILE1)
    assert _problems(_verify(out)) == [("checksum", FILE1)]


# ---------------------------------------------------------------- over the ranks


@pytest.mark.mpi(min_size=2)
def test_ranks_hash_the_files_and_agree_on_the_report(mpi_tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each listed file is hashed by one rank, more than one rank hashes, and every rank has the same report."""
    from mpicons.job import checksums

    comm = MPI.COMM_WORLD
    out = mpi_tmp_path / "out"
    hashed: list[str] = []

    def counted(path: str, buffer: memoryview | None = None, follow_links: bool = False) -> str:
        hashed.append(os.path.relpath(path, out))
        return hash_file(path, buffer, follow_links)

    monkeypatch.setattr(checksums, "hash_file", counted)
    error = None
    if comm.rank == 0:
        try:
            _checkpoint(out)
            _flip_data_byte(out / FILE1)
            (out / "lora_adapter" / "extra.bin").write_bytes(b"x")
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            error = repr(exc)
    error = comm.bcast(error, root=0)
    assert error is None, error
    report = verify(out, comm=comm)
    reports = comm.allgather((report.to_dict(), _problems(report)))
    assert all(r == reports[0] for r in reports)
    assert report.ranks == comm.size
    assert _problems(report) == [("unlisted", "lora_adapter/extra.bin"), ("checksum", FILE1)], report.lines()
    assert report.checksummed == 5 and report.manifest_files == 6
    by_rank = comm.allgather(hashed)
    assert sorted(name for names in by_rank for name in names) == sorted(parse_manifest((out / MANIFEST_NAME).read_bytes()))
    assert sum(1 for names in by_rank if names) >= 2, by_rank
