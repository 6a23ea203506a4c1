"""The built-in sample checkpoints (the documented import path ``mpicons.sample``).

They live in :mod:`mpicons.frontends.sample`, :mod:`mpicons.trainers.megatron.sample` and
:mod:`mpicons.trainers.deepspeed.sample`; this
module names their public functions where users import them from.
"""

from __future__ import annotations

from .frontends.sample import check_sample, write_sample
from .trainers.deepspeed.sample import ZeroSampleConfig, write_zero_plain, write_zero_sample, zero_expected_hf
from .trainers.megatron.sample import (
    MegatronSampleConfig,
    megatron_expected_hf,
    megatron_hf_config,
    megatron_values,
    write_megatron_sample,
)
from .trainers.sample_model import SampleConfig, expected_mapping, full_tensor, tensor_specs

__all__ = [
    "MegatronSampleConfig",
    "SampleConfig",
    "ZeroSampleConfig",
    "check_sample",
    "expected_mapping",
    "full_tensor",
    "megatron_expected_hf",
    "megatron_hf_config",
    "megatron_values",
    "tensor_specs",
    "write_megatron_sample",
    "write_sample",
    "write_zero_plain",
    "write_zero_sample",
    "zero_expected_hf",
]
