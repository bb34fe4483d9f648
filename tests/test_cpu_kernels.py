"""Our C kernels (evo.workloads.generation_core.cpu_kernels) against float64 on freshly drawn inputs."""
from __future__ import annotations

import pytest
import torch

from evo.workloads.generation_core import cpu_kernels


def _reference(q, k, v, lengths):
    """Grouped-query softmax attention in float64, row r over its keys [0, lengths[r])."""
    n, H, d = q.shape
    G = H // k.shape[1]
    out = torch.empty(n, H, d, dtype=torch.float64)
    for r in range(n):
        keys = k[r, :, :lengths[r]].double().repeat_interleave(G, 0)  # [H, S, d]
        values = v[r, :, :lengths[r]].double().repeat_interleave(G, 0)
        scores = (keys @ q[r].double()[:, :, None])[..., 0] * d**-0.5  # [H, S]
        out[r] = (scores.softmax(-1)[:, None] @ values)[:, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["BHLD", "BLHD"])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 16), (8, 1, 8)])
def test_decode_attention_matches_float64_over_each_rows_own_keys(dtype, layout, heads, kv_heads, d):
    gen = torch.Generator().manual_seed(heads * 100 + d)
    n, L = 5, 40
    shape = (n, kv_heads, L, d) if layout == "BHLD" else (n, L, kv_heads, d)
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    if layout == "BLHD":
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # strided [n, KVH, L, d] views, as the pool hands them
    lengths = torch.tensor([1, 7, 8, 33, 17])  # one key, tails of S % 8, whole vectors
    S = int(lengths.max())
    k, v = k[:, :, :S], v[:, :, :S]
    k[0, :, 1:] = v[0, :, 1:] = float("nan")  # past a row's length nothing is read: poison would show
    q = torch.randn(n, heads, d, generator=gen) * 3  # scores spread wide enough for the softmax to matter
    out = cpu_kernels.decode_attention(q, k, v, lengths, d**-0.5)
    assert out.dtype == torch.float32 and out.shape == (n, heads, d)
    assert torch.allclose(out.double(), _reference(q, k, v, lengths), atol=2e-6, rtol=1e-5)


def test_decode_attention_refuses_what_it_cannot_read():
    with pytest.raises(cpu_kernels.KernelUnavailable, match="multiple of 8"):
        cpu_kernels.check_attention_supported(12, torch.float32, "cpu")
    with pytest.raises(cpu_kernels.KernelUnavailable, match="float32 or bfloat16"):
        cpu_kernels.check_attention_supported(64, torch.float16, "cpu")
    k = torch.zeros(1, 1, 4, 8).transpose(-1, -2)  # the head's values not contiguous
    with pytest.raises(ValueError, match="contiguous heads"):
        cpu_kernels.decode_attention(torch.zeros(1, 1, 4), k, k, torch.tensor([2]), 1.0)
    k = torch.zeros(2, 1, 4, 8)
    for lengths in ([1, 5], [0, 2]):  # a row's keys past the cache's, or none: refused, not read out of bounds
        with pytest.raises(ValueError, match="each in \\[1, S\\]"):
            cpu_kernels.decode_attention(torch.zeros(2, 1, 8), k, k, torch.tensor(lengths), 1.0)


@pytest.mark.parametrize("with_residual,in_place", [(True, True), (True, False), (False, False)])
def test_add_rms_norm_matches_float64(with_residual, in_place):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 72, generator=gen) * 4
    residual = torch.randn(6, 72, generator=gen) if with_residual else None
    weight, eps = torch.rand(72, generator=gen) + 0.5, 1e-5
    x0 = x.clone()
    normed, new_x = cpu_kernels.add_rms_norm(x, residual, weight, eps, in_place)
    s = x0.double() + (residual.double() if with_residual else 0)
    want = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    assert torch.allclose(new_x.double(), s, atol=1e-6) and torch.allclose(normed.double(), want, atol=1e-5, rtol=1e-5)
    assert (new_x.data_ptr() == x.data_ptr()) == (in_place or not with_residual)  # written in place only if asked
    assert torch.equal(x, new_x if in_place else x0)
