"""Test-suite options: slow tests run only when asked (``--run-slow``, or ``MPICONS_SLOW=1`` as CI sets);
torch.distributed tests only under torchrun with ``--only-torch``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")
    parser.addoption(
        "--only-torch", action="store_true", default=False, help="run only the torch.distributed tests (under torchrun)"
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Without ``--only-torch`` the torch.distributed tests are not even imported (torch is heavy)."""
    if collection_path.name == "test_torch.py" and not config.getoption("--only-torch"):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    only_torch = config.getoption("--only-torch")
    not_torch = pytest.mark.skip(reason="--only-torch: torch.distributed tests only")
    for item in items:
        if only_torch and "torch_dist" not in item.keywords:
            item.add_marker(not_torch)
    if config.getoption("--run-slow") or os.environ.get("MPICONS_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
