"""The built-in sample checkpoints (the documented import path ``mpicons.sample``).

They live in :mod:`mpicons.frontends.sample`; this module names its public functions where users
import them from.
"""

from __future__ import annotations

from .frontends.sample import SampleConfig, check_sample, expected_mapping, full_tensor, tensor_specs, write_sample

__all__ = ["SampleConfig", "check_sample", "expected_mapping", "full_tensor", "tensor_specs", "write_sample"]
