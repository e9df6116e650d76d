"""Weights packed for Ray's object store (numpy views; bf16 as its bit pattern) arrive exactly;
a model of another shape is refused. No Ray needed: the packing is plain data."""

import pickle

import pytest
import torch

from oppo.weights.sync import is_packed, pack, unpack_into


def _model(seed: int, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    m.register_buffer("steps", torch.tensor([seed], dtype=torch.long))
    return m.to(dtype)


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_pack_unpack_round_trip(src_dtype, dst_dtype):
    src, dst = _model(0, src_dtype), _model(1, dst_dtype)
    packed = pickle.loads(pickle.dumps(pack(src)))  # as it crosses a process boundary
    assert is_packed(packed) and not is_packed(src.state_dict())
    unpack_into(dst, packed)
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert b.dtype == (dst_dtype if a.is_floating_point() else a.dtype), k  # the target keeps its dtype
        assert torch.equal(b, a.to(b.dtype)), k  # bit-exact (a cast where the dtypes differ)


def test_unpack_refuses_another_model():
    with pytest.raises(KeyError, match=r"unexpected \['1\."):
        unpack_into(torch.nn.Sequential(torch.nn.Linear(4, 8)), pack(_model(0)))


def test_trainable_only_sends_what_trains():
    src, dst = _model(0), _model(1)
    src[0].requires_grad_(False)  # a frozen part (a LoRA base) is not sent
    packed = pack(src, trainable_only=True)
    assert set(packed) == {"1.weight", "1.bias", "2.weight", "2.bias"}
    with pytest.raises(KeyError):
        unpack_into(dst, packed)  # a full load needs every weight
    unpack_into(dst, packed, partial=True)
    assert torch.equal(dst[2].weight, src[2].weight) and not torch.equal(dst[0].weight, src[0].weight)

