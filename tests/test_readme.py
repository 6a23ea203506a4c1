"""The README's Python examples run as written: each block in a fresh process, in an empty directory.

The Python API example makes its own sample checkpoint. The torch.distributed example is a snippet
for a training job that already has shards: it runs under torchrun with the built-in sample at the
``ckpt/sharded`` it names, the only thing provided beside it.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MPIEXEC, ROOT, subprocess_env

from mpicons.comm import SingleProcess
from mpicons.sample import write_sample

BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SHELL = re.compile(r"^```(?:bash|sh)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _python_blocks() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def _uses_torch(block: str) -> bool:
    return re.search(r"^import torch|^from torch", block, re.MULTILINE) is not None


def _run(command: list[str], cwd: Path, timeout: float = 240) -> None:
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=subprocess_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _script(tmp_path: Path, block: str) -> Path:
    script = tmp_path / "example.py"
    script.write_text(block)
    work = tmp_path / "work"
    work.mkdir()
    return script


def test_the_readme_has_the_examples_this_file_runs() -> None:
    blocks = _python_blocks()
    assert len([b for b in blocks if not _uses_torch(b)]) == 1 and len(blocks) == 2
    assert any("mpicons.verify(" in b and "mpicons.inspect(" in b for b in blocks)


@pytest.mark.slow
def test_the_python_api_example_runs_as_written_in_one_process(tmp_path: Path) -> None:
    (block,) = [b for b in _python_blocks() if not _uses_torch(b)]
    script = _script(tmp_path, block)
    _run([sys.executable, str(script)], cwd=tmp_path / "work")
    for name in ("hf", "hf-bf16", "hf-0", "hf-alone-0"):
        assert (tmp_path / "work" / "ckpt" / name / "model.safetensors.index.json").is_file(), name


@pytest.mark.slow
def test_the_python_api_example_runs_as_written_at_2_ranks(tmp_path: Path) -> None:
    (block,) = [b for b in _python_blocks() if not _uses_torch(b)]
    script = _script(tmp_path, block)
    _run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(script)], cwd=tmp_path / "work")
    for name in ("hf", "hf-bf16", "hf-0", "hf-1", "hf-alone-0", "hf-alone-1"):
        assert (tmp_path / "work" / "ckpt" / name / "model.safetensors.index.json").is_file(), name


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or not TORCHRUN.exists(), reason="needs torch")
def test_the_torch_distributed_example_runs_under_torchrun(tmp_path: Path) -> None:
    (block,) = [b for b in _python_blocks() if _uses_torch(b)]
    script = _script(tmp_path, block)
    write_sample(tmp_path / "work" / "ckpt" / "sharded", comm=SingleProcess())
    _run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script)], cwd=tmp_path / "work")
    assert (tmp_path / "work" / "ckpt" / "hf" / "model.safetensors.index.json").is_file()


def test_the_readme_says_how_to_reach_mpicons_before_calling_it_by_name() -> None:
    """After the quick start, mpicons and mpiexec are in .venv/bin, not on PATH: the first command that calls
    them by name comes after the README says to activate the environment (or to use .venv/bin/)."""
    text = (ROOT / "README.md").read_text()
    bare = re.compile(r"^(mpiexec|mpicons|srun [^\n]*\bmpicons)\b", re.MULTILINE)
    first = min(block.start() for block in SHELL.finditer(text) if bare.search(block.group(1)))
    assert "source .venv/bin/activate" in text[:first]


def _written_paths(block: str) -> list[str]:
    """What a shell block writes, by path: redirections, report files, the demo's directory, outputs."""
    paths = re.findall(r"(?<![0-9&>])>>?\s*([^\s&;]+)", block)
    paths += re.findall(r"--(?:stats-)?json\s+(\S+)", block)
    paths += re.findall(r"mpicons demo\s+([^\s-]\S*)", block)
    paths += re.findall(r"mpicons consolidate\s+\S+\s+(\S+)", block)
    return [path.strip("'\"") for path in paths]


def _ignored(path: str) -> bool:
    """Outside the checkout (a variable such as a temporary directory, an absolute path, a bucket) or
    in a directory the checkout's .gitignore names."""
    if path.startswith(("$", "/", "s3://", "~")):
        return True
    ignored = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines() if line.strip().endswith("/")]
    return any((path.rstrip("/") + "/").startswith(directory) for directory in ignored)


@pytest.mark.parametrize(
    "document, marker",
    [("README.md", "s3server.py serve"), ("docs/benchmarks.md", "# quick check")],
)
def test_try_outs_leave_no_stray_files_in_the_checkout(document: str, marker: str) -> None:
    """The S3 try-out wrote s3-url.txt, the benchmarks' quick check result.json, into the repository root."""
    (block,) = [b for b in SHELL.findall((ROOT / document).read_text()) if marker in b]
    written = _written_paths(block)
    assert written, block
    assert [path for path in written if not _ignored(path)] == []
