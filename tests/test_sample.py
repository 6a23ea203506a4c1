"""The sample's values do not depend on how many elements are drawn at a time: a large tensor is
drawn in chunks (bounded memory), and its bytes must be those of one draw."""

from __future__ import annotations

import numpy as np
import pytest

from mpicons.sample import SampleConfig, full_tensor
from mpicons.trainers import sample_model


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64", "BOOL", "F8_E4M3", "I32"])
def test_chunked_draws_give_the_bytes_of_one_draw(monkeypatch, dtype) -> None:
    config = SampleConfig()
    shape = (37, 11)
    one = np.ascontiguousarray(full_tensor(config, "model.layers.0.mlp.up_proj.weight", dtype, shape)).tobytes()
    monkeypatch.setattr(sample_model, "_DRAW", 5)  # 82 chunks, the last one short
    chunked = np.ascontiguousarray(full_tensor(config, "model.layers.0.mlp.up_proj.weight", dtype, shape)).tobytes()
    assert chunked == one


@pytest.mark.parametrize("serialization", ["safetensors", "torch_save"])
def test_the_distcp_sample_is_written_one_tensor_at_a_time(tmp_path, serialization) -> None:
    """Memory for writing the ``.distcp`` form is a few times the largest tensor (its float32 draws),
    not the files' size: 117 tensors of 55 MB in all, at most 1.1 MB each."""
    import math
    import tracemalloc

    from mpicons.core.safetensors_codec import DTYPE_BY_NAME
    from mpicons.sample import tensor_specs, write_sample

    config = SampleConfig.sized(int(60e6), layers=12)
    sizes = [math.prod(shape) * DTYPE_BY_NAME[dtype].bits // 8 for _, dtype, shape, _, _ in tensor_specs(config)]
    tracemalloc.start()
    try:
        write_sample(tmp_path / "ckpt", config, distcp=serialization)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(sizes) > 40 * max(sizes)
    assert peak < 10 * max(sizes) + (4 << 20), (peak, max(sizes), sum(sizes))
