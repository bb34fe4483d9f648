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


def _step_reference(shape, layers, final_norm, head, freq, k, v, x, pos, interleaved, linear_input=None):
    """One decode step in float64 over the same weights (as stored, widened), caches k, v [rows, KVH, L, d] (the
    rows' earlier keys, read as stored), each product's input through `linear_input` (e.g. rounded as the step rounds
    it); returns the logits and each layer's new keys and values."""
    H, KVH, d = shape.heads, shape.kv_heads, shape.head_dim
    half = d // 2
    li = linear_input or (lambda t: t)

    def norm(t, w):
        return t * (t.pow(2).mean(-1, keepdim=True) + shape.rms_eps).rsqrt() * w.double()

    def rotate(t, p):  # [heads, d] at position p
        angle = p * freq
        c, s = angle.cos(), angle.sin()
        a, b = (t[:, 0::2], t[:, 1::2]) if interleaved else (t[:, :half], t[:, half:])
        out = torch.empty_like(t)
        ra, rb = a * c - b * s, b * c + a * s
        if interleaved:
            out[:, 0::2], out[:, 1::2] = ra, rb
        else:
            out[:, :half], out[:, half:] = ra, rb
        return out

    logits, new = [], []
    for r in range(len(x)):
        h, p, made = x[r].double(), int(pos[r]), []
        for i, w in enumerate(layers):
            a = li(norm(h, w["input_norm"]))
            q = rotate((w["q"].double() @ a).view(H, d), p)
            kr = rotate((w["k"].double() @ a).view(KVH, d), p)
            vr = (w["v"].double() @ a).view(KVH, d)
            keys = torch.cat([k[i][r, :, :p].double(), kr[:, None]], 1).repeat_interleave(H // KVH, 0)
            values = torch.cat([v[i][r, :, :p].double(), vr[:, None]], 1).repeat_interleave(H // KVH, 0)
            att = (((keys @ q[:, :, None])[..., 0] * d**-0.5).softmax(-1)[:, None] @ values)[:, 0]
            h = h + w["o"].double() @ li(att.reshape(-1))
            m = li(norm(h, w["post_norm"]))
            g, u = w["gate"].double() @ m, w["up"].double() @ m
            h = h + w["down"].double() @ li(g * torch.sigmoid(g) * u)
            made.append((kr, vr))
        logits.append(head.double() @ li(norm(h, final_norm)))
        new.append(made)
    return torch.stack(logits), new


@pytest.mark.parametrize("weights,cache,layout,interleaved", [
    (torch.float32, torch.float32, "BHLD", True), (torch.bfloat16, torch.bfloat16, "BLHD", False),
    (torch.bfloat16, torch.float32, "BHLD", False), (torch.float32, torch.bfloat16, "BLHD", True)])
def test_the_llama_decode_step_matches_float64_and_writes_each_rows_keys(weights, cache, layout, interleaved):
    """Rows 1, 2, 3, 5 (every blocking of the C step's linear: 4 + 1 rows at float32, 2 + 2 + 1 at bfloat16); outputs
    not a multiple of 8 (V = 100: the one-output tail); grouped heads (6 over 2); rows at their own positions."""
    shape = cpu_kernels.StepShape(layers=2, hidden=48, heads=6, kv_heads=2, head_dim=16, intermediate=80, vocab=100,
                                  rms_eps=1e-5)
    gen = torch.Generator().manual_seed(5)
    D, I, H, KVH, d = shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim

    def w(out, into):
        return (torch.randn(out, into, generator=gen) / into**0.5).to(weights)

    layers = [{"input_norm": 1 + 0.1 * torch.randn(D, generator=gen), "post_norm": 1 + 0.1 * torch.randn(D, generator=gen),
               "q": w(H * d, D), "k": w(KVH * d, D), "v": w(KVH * d, D), "o": w(D, H * d), "gate": w(I, D),
               "up": w(I, D), "down": w(D, I)} for _ in range(shape.layers)]
    final_norm, head = 1 + 0.1 * torch.randn(D, generator=gen), w(shape.vocab, D)
    freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    rows, L = 5, 24
    pool_shape = (rows, KVH, L, d) if layout == "BHLD" else (rows, L, KVH, d)
    k = [torch.randn(pool_shape, generator=gen).to(cache) for _ in range(shape.layers)]
    v = [torch.randn(pool_shape, generator=gen).to(cache) for _ in range(shape.layers)]
    read = (lambda t: t) if layout == "BHLD" else (lambda t: t.transpose(1, 2))  # [rows, KVH, L, d] views
    step = cpu_kernels.LlamaDecodeStep(shape, layers, final_norm, head, freq, k, v, interleaved, layout == "BHLD")
    for n in (1, 2, 3, 5):
        pos = torch.tensor([0, 7, 23, 16, 3][:n])
        x = torch.randn(n, D, generator=gen)
        for t in k + v:
            for r in range(n):
                read(t)[r, :, pos[r] + 1:] = float("nan")  # keys after a row's own are never read: poison would show
        before_k, before_v = [read(t).clone() for t in k], [read(t).clone() for t in v]
        want, new = _step_reference(shape, layers, final_norm, head, freq, before_k, before_v, x, pos, interleaved)
        got = step(x, pos)
        tolerance = 1e-4 if weights == torch.float32 and cache == torch.float32 else 2e-2  # activations' rounding
        assert got.shape == (n, shape.vocab) and torch.isfinite(got).all()
        assert (got.double() - want).abs().max() <= tolerance * want.abs().max(), n
        for i in range(shape.layers):
            for r in range(n):
                kr, vr = new[r][i]
                assert torch.allclose(read(k[i])[r, :, pos[r]].double(), kr, rtol=1e-2, atol=1e-2)
                assert torch.allclose(read(v[i])[r, :, pos[r]].double(), vr, rtol=1e-2, atol=1e-2)
                assert torch.equal(read(k[i])[r, :, :pos[r]], before_k[i][r, :, :pos[r]])  # left as they were


def test_the_llama_decode_step_over_int8_groups_matches_float64_over_their_values():
    """int8 weights in groups of 32 (q8_rows) against float64 over the weights they stand for: rows 1 to 5 (every
    blocking: 1 x 4 outputs, 2 x 4, 3 and 4 x 2, 4 + 1), V = 100 (the one-output tail), inputs 80 and 88 (a last group
    of 16 and of 24), grouped heads (4 over 2)."""
    from evo.workloads.llama.int8 import dequantised_groups, quantise_groups

    shape = cpu_kernels.StepShape(layers=2, hidden=80, heads=4, kv_heads=2, head_dim=16, intermediate=88, vocab=100,
                                  rms_eps=1e-5)
    gen = torch.Generator().manual_seed(6)
    D, I, H, KVH, d = shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim

    def w(out, into):  # (what the step reads, the float32 values they stand for)
        q, scale = quantise_groups(torch.randn(out, into, generator=gen) / into**0.5)
        return cpu_kernels.q8_rows(q, scale), dequantised_groups(q, scale)

    stored, values = [], []
    for _ in range(shape.layers):
        norms = {"input_norm": 1 + 0.1 * torch.randn(D, generator=gen), "post_norm": 1 + 0.1 * torch.randn(D, generator=gen)}
        pairs = {name: w(*size) for name, size in (("q", (H * d, D)), ("k", (KVH * d, D)), ("v", (KVH * d, D)),
                                                   ("o", (D, H * d)), ("gate", (I, D)), ("up", (I, D)), ("down", (D, I)))}
        stored.append({**norms, **{name: pair[0] for name, pair in pairs.items()}})
        values.append({**norms, **{name: pair[1] for name, pair in pairs.items()}})
    final_norm, (head, head_values) = 1 + 0.1 * torch.randn(D, generator=gen), w(shape.vocab, D)
    freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    k = [torch.randn(5, KVH, 16, d, generator=gen) for _ in range(shape.layers)]
    v = [torch.randn(5, KVH, 16, d, generator=gen) for _ in range(shape.layers)]
    step = cpu_kernels.LlamaDecodeStep(shape, stored, final_norm, head, freq, k, v, False, True)
    for n in (1, 2, 3, 4, 5):
        pos = torch.tensor([0, 7, 15, 11, 3][:n])
        x = torch.randn(n, D, generator=gen)
        before_k, before_v = [t.clone() for t in k], [t.clone() for t in v]
        want, _ = _step_reference(shape, values, final_norm, head_values, freq, before_k, before_v, x, pos, False)
        got = step(x, pos)
        assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max(), n
    with pytest.raises(ValueError, match="int8 as q8_rows"):  # int8 rows without their scales
        cpu_kernels.LlamaDecodeStep(shape, [{**layer, "q": layer["q"][:, :D]} for layer in stored], final_norm, head,
                                    freq, k, v, False, True)


@pytest.mark.skipif(not cpu_kernels.amx_bf16_available(), reason="this CPU has no AMX-BF16 tiles")
def test_the_llama_decode_step_on_amx_tiles_matches_float64_over_bfloat16_rows():
    """bfloat16 weights as AMX tiles against float64 over the same weights with each product's input rounded to
    bfloat16 as the step rounds it: rows 1, 3, 16 and 17 (a second 16-row pass), outputs in groups of 4, 3, 2 and 1
    tiles (vocab 112, hidden 48, heads 96, kv 32, intermediate 80), inputs padded to 32 (48 and 80)."""
    shape = cpu_kernels.StepShape(layers=2, hidden=48, heads=6, kv_heads=2, head_dim=16, intermediate=80, vocab=112,
                                  rms_eps=1e-5)
    gen = torch.Generator().manual_seed(7)
    D, I, H, KVH, d = shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim

    def w(out, into):
        return (torch.randn(out, into, generator=gen) / into**0.5).to(torch.bfloat16)

    layers = [{"input_norm": 1 + 0.1 * torch.randn(D, generator=gen),
               "post_norm": 1 + 0.1 * torch.randn(D, generator=gen),
               "q": w(H * d, D), "k": w(KVH * d, D), "v": w(KVH * d, D), "o": w(D, H * d), "gate": w(I, D),
               "up": w(I, D), "down": w(D, I)} for _ in range(shape.layers)]
    final_norm, head = 1 + 0.1 * torch.randn(D, generator=gen), w(shape.vocab, D)
    tiled = [{name: cpu_kernels.amx_tiles(t) if t.dtype == torch.bfloat16 else t for name, t in layer.items()}
             for layer in layers]
    freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    k = [torch.randn(17, KVH, 24, d, generator=gen) for _ in range(shape.layers)]
    v = [torch.randn(17, KVH, 24, d, generator=gen) for _ in range(shape.layers)]
    step = cpu_kernels.LlamaDecodeStep(shape, tiled, final_norm, cpu_kernels.amx_tiles(head), freq, k, v, False, True,
                                       tiles=True)
    rounded = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    for n in (1, 3, 16, 17):
        pos = torch.randint(0, 24, (n,), generator=gen)
        x = torch.randn(n, D, generator=gen)
        before_k, before_v = [t.clone() for t in k], [t.clone() for t in v]
        want, _ = _step_reference(shape, layers, final_norm, head, freq, before_k, before_v, x, pos, False, rounded)
        got = step(x, pos)
        assert (got.double() - want).abs().max() <= 1e-3 * want.abs().max(), n
    with pytest.raises(ValueError, match="tiles as amx_tiles"):  # untiled rows
        cpu_kernels.LlamaDecodeStep(shape, layers, final_norm, head, freq, k, v, False, True, tiles=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernels.amx_tiles(w(40, 32))


def test_the_llama_decode_step_refuses_what_it_cannot_run():
    odd = cpu_kernels.StepShape(layers=1, hidden=40, heads=4, kv_heads=2, head_dim=10, intermediate=64, vocab=8,
                                rms_eps=1e-5)
    with pytest.raises(cpu_kernels.KernelUnavailable, match="multiples of 8.*head_dim"):
        cpu_kernels.check_step_supported(odd, torch.float32, torch.float32, "cpu")
    narrow = cpu_kernels.StepShape(layers=1, hidden=40, heads=5, kv_heads=5, head_dim=8, intermediate=64, vocab=8,
                                   rms_eps=1e-5)
    cpu_kernels.check_step_supported(narrow, torch.float32, torch.float32, "cpu")  # float32 reads 8 at a time
    with pytest.raises(cpu_kernels.KernelUnavailable, match="16 at a time.*hidden"):
        cpu_kernels.check_step_supported(narrow, torch.bfloat16, torch.float32, "cpu")
    with pytest.raises(cpu_kernels.KernelUnavailable, match="not torch.float16"):
        cpu_kernels.check_step_supported(narrow, torch.float16, torch.float32, "cpu")
    with pytest.raises(cpu_kernels.KernelUnavailable, match="AMX tiles take bfloat16 weights.*vocab"):
        cpu_kernels.check_step_supported(narrow, torch.bfloat16, torch.float32, "cpu", tiles=True)


def _delta_rule(state, q, k, v, decay, beta, lengths):
    """The KDA recurrence in float64, sequence b over its first lengths[b] tokens: o [B, T, H, V] (zero past a
    length), the final states."""
    S, o = state.double().clone(), torch.zeros(*v.shape, dtype=torch.float64)
    for b, length in enumerate(lengths):
        for t in range(length):
            S[b] = S[b] * decay[b, t, :, :, None].double()
            residual = v[b, t].double() - torch.einsum("hk,hkv->hv", k[b, t].double(), S[b])
            S[b] = S[b] + beta[b, t, :, None, None].double() * k[b, t].double()[..., None] * residual[:, None]
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t].double(), S[b])
    return o, S


def test_the_kda_recurrence_matches_float64_over_each_sequences_own_tokens():
    """Sequences of their own lengths (all of T, a few, none) from nonzero states, K != V: each token's output and
    the final states as the float64 delta rule's; a sequence's tokens past its length are not read (NaN there)."""
    gen = torch.Generator().manual_seed(11)
    B, T, H, K, V = 3, 17, 2, 12, 24
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    decay, beta = torch.rand(B, T, H, K, generator=gen) * 0.5 + 0.5, torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, K, V, generator=gen)
    lengths = [17, 5, 0]
    for t in (q, k, v, decay):
        t[1, 5:] = float("nan")
        t[2] = float("nan")
    want_o, want_S = _delta_rule(state, q, k, v, decay, beta, lengths)
    got_S = state.clone()
    got_o = cpu_kernels.kda_recurrence(got_S, q, k, v, decay, beta, torch.tensor(lengths))
    assert torch.allclose(got_S.double(), want_S, atol=1e-5, rtol=1e-5) and torch.equal(got_S[2], state[2])
    for b, length in enumerate(lengths):
        assert torch.allclose(got_o[b, :length].double(), want_o[b, :length], atol=1e-5, rtol=1e-5), b
    one = state[:1].clone()  # a decode step: one token, no lengths
    step = cpu_kernels.kda_recurrence(one, q[:1, :1], k[:1, :1], v[:1, :1], decay[:1, :1], beta[:1, :1])
    assert torch.allclose(step[0, 0].double(), want_o[0, 0], atol=1e-5, rtol=1e-5)


def test_the_kda_recurrence_refuses_what_it_cannot_run():
    with pytest.raises(cpu_kernels.KernelUnavailable, match="multiple of 8"):
        cpu_kernels.check_recurrence_supported(64, 12, "cpu")
    q = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ValueError, match="state \\[B, H, K, V\\]"):
        cpu_kernels.kda_recurrence(torch.zeros(1, 1, 8, 16), q, q, q, q, torch.zeros(1, 2, 1))
    with pytest.raises(ValueError, match="in place: float32 and contiguous"):
        cpu_kernels.kda_recurrence(torch.zeros(1, 1, 8, 8).mT, q, q, q, q, torch.zeros(1, 2, 1))
    with pytest.raises(ValueError, match="lengths must lie in"):
        cpu_kernels.kda_recurrence(torch.zeros(1, 1, 8, 8), q, q, q, q, torch.zeros(1, 2, 1), torch.tensor([3]))


def test_the_kda_prefill_refuses_tokens_its_prompts_do_not_add_up_to():
    """`kda_prefill` writes pool rows in place: shapes that do not add up are refused before any is touched."""
    H, K, taps, N = 2, 8, 4, 5
    t = torch.zeros(N, H * K)
    states, windows = torch.ones(3, H, K, K), torch.ones(3, taps - 1, 3 * H * K)
    args = (torch.zeros(N, H), [2, 2], [0, 1], windows, states, torch.zeros(taps, 3 * H * K), torch.zeros(H * K),
            torch.zeros(H), torch.ones(K), 1e-5, 1e-6)
    with pytest.raises(ValueError, match="N the sum of the lengths \\[2, 2\\]"):
        cpu_kernels.kda_prefill(t, t, t, t, t, *args)
    assert bool((states == 1).all()) and bool((windows == 1).all())


def test_the_sandboxs_zygote_loads_every_kernel_before_the_jail_for_the_workloads_that_call_them(monkeypatch):
    """A jailed engine process cannot reach the per-user kernel cache and starts with an empty private /tmp: without
    the zygote's preload (`module:function`), every build of an engine that calls our kernels compiled them again
    (~6 s of each llama_serve evaluation)."""
    from evaluators.sandbox import zygote
    from evo.workloads import get_workload
    from evo.workloads.base import CPU_KERNELS_PRELOAD
    from evo.workloads.generation_core.cpu_kernels import build

    assert all(CPU_KERNELS_PRELOAD in get_workload(name).engine_preload for name in ("llama", "llama_serve",
                                                                                       "kimi_linear"))
    loaded = []
    monkeypatch.setattr(build, "kernel_library", lambda name: loaded.append(name))
    zygote._preload(("torch", CPU_KERNELS_PRELOAD, "no_such_module:anything"))  # a failing entry is the engine's
    assert loaded == sorted(path.stem for path in build.HERE.glob("*.c")) and len(loaded) >= 5
