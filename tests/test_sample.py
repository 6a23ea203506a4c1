"""The sample's values do not depend on how many elements are drawn at a time: a large tensor is
drawn in chunks (bounded memory), and its bytes must be those of one draw."""

from __future__ import annotations

import numpy as np
import pytest

from mpicons.frontends import sample_model
from mpicons.sample import SampleConfig, full_tensor


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64", "BOOL", "F8_E4M3", "I32"])
def test_chunked_draws_give_the_bytes_of_one_draw(monkeypatch, dtype) -> None:
    config = SampleConfig()
    shape = (37, 11)
    one = np.ascontiguousarray(full_tensor(config, "model.layers.0.mlp.up_proj.weight", dtype, shape)).tobytes()
    monkeypatch.setattr(sample_model, "_DRAW", 5)  # 82 chunks, the last one short
    chunked = np.ascontiguousarray(full_tensor(config, "model.layers.0.mlp.up_proj.weight", dtype, shape)).tobytes()
    assert chunked == one
