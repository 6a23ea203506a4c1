"""The built-in sample checkpoints (the documented import path ``mpicons.sample``).

They live in :mod:`mpicons.frontends.sample` and :mod:`mpicons.frontends.sample_megatron`; this
module names their public functions where users import them from.
"""

from __future__ import annotations

from .frontends.sample import SampleConfig, check_sample, expected_mapping, full_tensor, tensor_specs, write_sample
from .frontends.sample_megatron import (
    MegatronSampleConfig,
    megatron_expected_hf,
    megatron_hf_config,
    megatron_values,
    write_megatron_sample,
)

__all__ = [
    "MegatronSampleConfig",
    "SampleConfig",
    "check_sample",
    "expected_mapping",
    "full_tensor",
    "megatron_expected_hf",
    "megatron_hf_config",
    "megatron_values",
    "tensor_specs",
    "write_megatron_sample",
    "write_sample",
]
