"""Host-to-device uploads: every array arrives with its values, dtype and shape."""

import numpy as np
import pytest
import torch

from batchllm.ops.transfer import upload_arrays


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "ids": rng.integers(-5, 1 << 40, size=7, dtype=np.int64),  # 56 bytes: the next start is padded
        "table": rng.integers(0, 1 << 30, size=(3, 5), dtype=np.int32),
        "empty": np.zeros((0, 4), dtype=np.int32),
        "odd": rng.integers(0, 9, size=3, dtype=np.int32)[::-1],  # not contiguous
        "last": np.arange(5, dtype=np.int64),
    }


def _check(device: torch.device) -> dict:
    arrays = _arrays()
    uploaded = upload_arrays(arrays, device)
    assert list(uploaded) == list(arrays)
    for name, array in arrays.items():
        tensor = uploaded[name]
        assert tensor.device.type == device.type, name
        assert tuple(tensor.shape) == array.shape, name
        assert str(tensor.dtype) == f"torch.{array.dtype}", name
        assert np.array_equal(tensor.cpu().numpy(), array), name
    return uploaded


def test_upload_on_cpu():
    _check(torch.device("cpu"))


@pytest.mark.gpu
def test_upload_packs_one_buffer_on_cuda():
    uploaded = _check(torch.device("cuda"))
    storages = {tensor.untyped_storage().data_ptr() for tensor in uploaded.values()}
    assert len(storages) == 1  # views of one buffer: one copy
