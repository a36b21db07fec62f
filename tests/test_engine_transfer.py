"""Host-to-device uploads: every array arrives with its values, dtype and shape; the runner's
staging reuses its buffers."""

import numpy as np
import pytest
import torch

from batchllm.ops.transfer import PinnedStaging, upload_arrays


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


def test_staging_reuses_its_buffers():
    """Every upload of a step lands in the staging's persistent buffers, which grow to the largest
    step and are then reused without another allocation; the arrays arrive intact."""
    staging = PinnedStaging(torch.device("cpu"), num_bytes=256)
    rng = np.random.default_rng(0)
    allocations = []
    for step in range(6):
        staging.begin_step()
        arrays = {"ids": rng.integers(-9, 1 << 40, size=7, dtype=np.int64),
                  "table": rng.integers(0, 99, size=(3, 50), dtype=np.int32),
                  "mask": rng.random((2, 5)) < 0.5, "settings": rng.random(4)}
        uploaded = staging.upload(arrays)
        more = staging.upload({"rows": np.arange(3, dtype=np.int64)})
        for name, array in arrays.items():
            assert uploaded[name].dtype == torch.from_numpy(array).dtype, name
            assert np.array_equal(uploaded[name].numpy(), array), name
        assert more["rows"].tolist() == [0, 1, 2]
        allocations.append(staging.num_host_allocations)
    assert allocations[0] > 2 and allocations[1:] == [allocations[1]] * 5  # each buffer grew at its first step only


@pytest.mark.gpu
def test_staging_on_cuda_reuses_pinned_memory():
    """On a GPU the staged host buffers are pinned (a copy from them does not block) and reused by
    every later step of the same size; the device receives every array."""
    staging = PinnedStaging(torch.device("cuda"), num_bytes=1 << 12)
    results = []
    for step in range(4):
        staging.begin_step()
        arrays = {"ids": np.arange(100 * step, 100 * step + 37, dtype=np.int64), "mask": np.arange(5) % 2 == 0}
        results.append((arrays, staging.upload(arrays)))
    torch.cuda.synchronize()
    assert staging.pinned
    assert staging.num_host_allocations == 2
    for arrays, uploaded in results[-1:]:  # (earlier steps' device views are reused by later steps)
        for name, array in arrays.items():
            assert np.array_equal(uploaded[name].cpu().numpy(), array)


@pytest.mark.gpu
def test_sampled_ids_come_back_through_a_ring_of_pinned_buffers():
    """Each step's sampled ids are copied into the next of three persistent pinned buffers; a step
    read after its buffer was reused raises instead of returning a later step's ids."""
    from batchllm.engine.sampler import SamplerOutput
    from batchllm.engine.step_result import SampledHostCopies, StepResult

    copies = SampledHostCopies()
    results = []
    for step in range(4):
        sampled = SamplerOutput(torch.tensor([step, 10 + step], device="cuda"),
                                torch.tensor([-0.5, -1.5], device="cuda"))
        results.append(StepResult((1, 2), sampled, copies.copy(sampled)))
    assert results[3].host_output().token_ids.tolist() == [3, 13]
    assert results[1].host_output().token_ids.tolist() == [1, 11]
    assert results[2].host_output().logprobs.tolist() == [-0.5, -1.5]
    assert results[2].host_output().token_ids.is_pinned()
    with pytest.raises(RuntimeError, match="reused"):
        results[0].host_output()  # its buffer holds step 3's ids now
