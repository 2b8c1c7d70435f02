"""api/parking.py: weights a run never reads, off the device for the run and put back after.
That a parked weight cannot be read by mistake, that it comes back byte for byte and as the
same views of one storage, and that an exception inside the block still restores it."""

from __future__ import annotations

import pytest
import torch

from orchestrate.api.parking import parked


def packed_params() -> tuple[torch.Tensor, list[torch.nn.Parameter]]:
    """Three parameters that are views of one storage, as a packed q,k,v is."""
    whole = torch.randn(12, 4)
    params = [torch.nn.Parameter(whole[i * 4 : (i + 1) * 4], requires_grad=False) for i in range(3)]
    return whole, params


def test_a_parked_parameter_is_empty_and_a_read_of_it_fails():
    _, params = packed_params()
    x = torch.randn(2, 4)
    with parked(params) as record:
        assert record.bytes == 12 * 4 * 4  # the storage once, not once per view
        assert record.freed is None  # measured on CUDA only
        assert all(p.numel() == 0 for p in params)
        with pytest.raises(RuntimeError):
            x @ params[1].t()


def test_parked_parameters_come_back_with_their_bytes_as_views_of_one_storage():
    whole, params = packed_params()
    expected = whole.clone()
    with parked(params):
        pass
    storage = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == storage for p in params)
    assert [p.storage_offset() for p in params] == [0, 16, 32]
    assert torch.equal(torch.cat(list(params)), expected)
    assert params[0].untyped_storage().nbytes() == 12 * 4 * 4  # one storage, not three


def test_an_exception_inside_the_block_still_puts_the_weights_back():
    whole, params = packed_params()
    expected = whole.clone()
    with pytest.raises(ValueError, match="served badly"), parked(params):
        raise ValueError("served badly")
    assert torch.equal(torch.cat(list(params)), expected)


def test_a_parameter_given_twice_or_parked_already_is_parked_once():
    _, params = packed_params()
    with parked([*params, params[0]]) as outer:
        with parked(params) as inner:
            assert inner.bytes == 0
        assert all(p.numel() == 0 for p in params)  # the inner block restored nothing
    assert outer.bytes == 12 * 4 * 4 and all(p.numel() == 16 for p in params)


@pytest.mark.gpu
def test_parking_frees_the_device_bytes_it_moves_and_restores_them_on_gpu():
    whole = torch.randn(1024, 1024, device="cuda")  # 4 MiB
    params = [torch.nn.Parameter(whole[:512], False), torch.nn.Parameter(whole[512:], False)]
    expected = whole.cpu()
    del whole
    with parked(params) as record:
        assert record.bytes == 4 * 2**20
        assert record.freed == 4 * 2**20  # the allocator's drop, measured
    assert params[0].is_cuda and torch.equal(torch.cat(list(params)).cpu(), expected)
    assert params[1].untyped_storage().data_ptr() == params[0].untyped_storage().data_ptr()
