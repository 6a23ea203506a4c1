"""The documentation's examples run as written, and its links lead somewhere.

The Python examples run each in a fresh process, in an empty directory. The Python API example
(docs/python-api.md) makes its own sample checkpoint. The torch.distributed example
(docs/torch-dropin.md) is a snippet for a training job that already has shards: it runs under
torchrun with the built-in sample at the ``ckpt/sharded`` it names, the only thing provided beside
it. README.md is the front page: short, with the reference material in docs/, every page linked.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
from helpers import MPIEXEC, ROOT, subprocess_env

from mpicons.comm import SingleProcess
from mpicons.sample import write_sample

BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SHELL = re.compile(r"^```(?:bash|sh)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
TORCHRUN = Path(sys.executable).parent / "torchrun"
README = ROOT / "README.md"
PYTHON_API = ROOT / "docs" / "python-api.md"
TORCH_DROPIN = ROOT / "docs" / "torch-dropin.md"
#: The pages whose ```python blocks this file runs: README.md's own (none now) and the two examples' pages.
EXAMPLE_PAGES = (README, PYTHON_API, TORCH_DROPIN)
#: Every page whose relative links must resolve.
PAGES = (README, *sorted((ROOT / "docs").rglob("*.md")))
README_MAX_LINES = 450


def _python_blocks(page: Path | None = None) -> list[str]:
    """The ```python blocks of one page, or of every page in EXAMPLE_PAGES."""
    pages = EXAMPLE_PAGES if page is None else (page,)
    return [block for each in pages for block in BLOCK.findall(each.read_text())]


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


def test_the_docs_have_the_examples_this_file_runs() -> None:
    blocks = _python_blocks()
    assert len([b for b in blocks if not _uses_torch(b)]) == 1 and len(blocks) == 2
    assert any("mpicons.verify(" in b and "mpicons.inspect(" in b for b in blocks)
    # Each on its own page. README.md holds none: one added there counts among the blocks above, so it
    # would have to be one of the two examples the tests below run.
    (api,) = _python_blocks(PYTHON_API)
    assert not _uses_torch(api) and "mpicons.verify(" in api and "mpicons.inspect(" in api
    (dropin,) = _python_blocks(TORCH_DROPIN)
    assert _uses_torch(dropin)
    assert _python_blocks(README) == []


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
    text = README.read_text()
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
    [("docs/object-storage.md", "s3server.py serve"), ("docs/benchmarks.md", "# quick check")],
)
def test_try_outs_leave_no_stray_files_in_the_checkout(document: str, marker: str) -> None:
    """The S3 try-out wrote s3-url.txt, the benchmarks' quick check result.json, into the repository root."""
    (block,) = [b for b in SHELL.findall((ROOT / document).read_text()) if marker in b]
    written = _written_paths(block)
    assert written, block
    assert [path for path in written if not _ignored(path)] == []


def test_the_readme_is_a_front_page() -> None:
    """README.md says what mpicons is and how to start; the reference material is in docs/."""
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail to docs/"


FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
#: A code span: a run of backticks, up to the next run of as many (never across a blank line).
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(?:(?!\n[ \t]*\n)[\s\S])*?(?<!`)\1(?!`)")
#: An inline link or image: ``[text](target)``, ``[text](<target>)``, ``[text](target "title")``.
LINK = re.compile(r"\[(?:[^\]\\]|\\.)*\]\(\s*(?:<([^>]*)>|([^)\s]*))(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")


def _prose(text: str, spans: bool = False) -> str:
    """The page without its fenced code blocks, which hold no links or headings, and without its
    code spans (which hold no links, but are part of a heading's text) unless ``spans``."""
    kept, fence = [], None
    for line in text.splitlines():
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = None
        else:
            kept.append(line)
            continue
        kept.append("")
    return "\n".join(kept) if spans else CODE_SPAN.sub(" ", "\n".join(kept))


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation other than hyphens and underscores
    removed, each space a hyphen (``DCP's default format (`.metadata` + `.distcp`)`` →
    ``dcps-default-format-metadata--distcp``)."""
    text = re.sub(r"!?\[((?:[^\]\\]|\\.)*)\]\([^)]*\)", r"\1", heading)  # a link's or image's text
    text = re.sub(r"<[^>]*>", "", text).lower()  # inline HTML
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page; a repeated one gets -1, -2, ... as GitHub numbers them."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(page.read_text(), spans=True).splitlines():
        match = HEADING.match(line)
        if match:
            anchor = _anchor(match.group(2).strip())
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def _relative_links(page: Path) -> list[str]:
    """The page's links that point into the repository (no scheme such as https: or mailto:)."""
    targets = [angled or bare for angled, bare in LINK.findall(_prose(page.read_text()))]
    return [target for target in targets if not re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target)]


def _link_problem(page: Path, target: str) -> str | None:
    path, _, anchor = target.partition("#")
    destination = (page.parent / unquote(path)).resolve() if path else page.resolve()
    if not destination.is_relative_to(ROOT.resolve()):
        return f"{target}: outside the repository"
    if not destination.exists():
        return f"{target}: no such file"
    if anchor and destination.suffix == ".md" and unquote(anchor) not in _anchors(destination):
        return f"{target}: no heading with that anchor in {destination.relative_to(ROOT.resolve())}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    """A link into the repository names a file that exists, and an #anchor into a Markdown file names
    one of its headings (docs/ pages reach the repository's files through ../)."""
    problems = [problem for target in _relative_links(page) if (problem := _link_problem(page, target))]
    assert problems == []


def test_the_link_check_reads_links_and_anchors_as_github_does(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# DCP's default format (`.metadata` + `.distcp`)\n\n## Quick start (Python 3.10+, no MPI)\n\n"
        "## Notes\n\n## Notes\n\n```bash\n# not a heading [nor](a-link.md)\n```\n\n"
        "See [that](other.md#x), ![img](<pic one.png>), `[code](not-a-link.md)` and [web](https://example.org).\n"
    )
    assert _anchors(page) == {"dcps-default-format-metadata--distcp", "quick-start-python-310-no-mpi", "notes", "notes-1"}
    assert _relative_links(page) == ["other.md#x", "pic one.png"]


def test_the_readme_links_every_docs_page() -> None:
    """The README's "where to read more" list reaches every page under docs/."""
    linked = {(README.parent / unquote(target.partition("#")[0])).resolve() for target in _relative_links(README)}
    assert [str(page.relative_to(ROOT)) for page in PAGES[1:] if page.resolve() not in linked] == []
