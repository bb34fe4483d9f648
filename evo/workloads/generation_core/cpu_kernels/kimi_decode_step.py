"""A Kimi Linear hybrid decoder's whole decode step in C (`kimi_decode_step.c`) over float32 weights and a state pool
held as torch tensors: `KimiDecodeStep(...)(embedded [n, D], pos [n]) -> logits [n, V]`, no Python between the step's
ops; and a KDA layer's prefill between its products (`kda_prefill`), by the same per-token code."""
from __future__ import annotations

import functools

import torch

from evo.workloads.generation_core.cpu_kernels.build import (FLOAT, I64, INT, PTR, KernelUnavailable,
                                                             kernel_function, kernel_library, require_cpu)
from evo.workloads.generation_core.cpu_kernels.kda_recurrence import MAX_DIM

KDA_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "forget_gate.f_a_proj.weight",
               "forget_gate.f_b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "b_proj.weight",
               "forget_gate.dt_bias")  # the C side's P_Q .. P_DT_BIAS; then a, the convolution, o_norm, o_proj, memory
DENSE_WEIGHTS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
MOE_WEIGHTS = ("gate.weight", "gate.e_score_correction_bias", "experts.gate_up_proj", "experts.down_proj",
               "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight")
STEP_DIMS, PER_LAYER = 23, 24  # the C side's KDIM_COUNT and KP_PER_LAYER
FEED_FORWARD = 2 + len(KDA_WEIGHTS) + 6  # the C side's KP_FF0: a layer's feed-forward pointers after its mixer's
MAX_EXPERTS = 512  # the C side's MAX_EXPERTS


@functools.cache
def _kernel():
    lib = kernel_library("kimi_decode_step")
    lib.evo_kimi_step_dims.restype = lib.evo_kimi_step_pointers_per_layer.restype = INT
    if lib.evo_kimi_step_dims() != STEP_DIMS or lib.evo_kimi_step_pointers_per_layer() != PER_LAYER:
        raise KernelUnavailable("kimi_decode_step.c and its wrapper disagree on the dims or a layer's pointers")
    return kernel_function("kimi_decode_step", "evo_kimi_forward", INT, (PTR,) * 7 + (I64, PTR))


@functools.cache
def _prefill_kernel():
    _kernel()  # the same library, its layout checked
    return kernel_function("kimi_decode_step", "evo_kda_prefill", None,
                           (I64, I64, I64, FLOAT, FLOAT) + (PTR,) * 5 + (I64, PTR, I64, PTR, PTR, I64) + (PTR,) * 7)


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, gate: torch.Tensor,
                beta: torch.Tensor, lengths: list[int], rows: list[int], windows: torch.Tensor, states: torch.Tensor,
                conv: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor, o_norm: torch.Tensor, rms_eps: float,
                l2_eps: float) -> torch.Tensor:
    """A KDA layer's prefill after its products, prompts from position 0, in C (`kimi_decode_step.c`'s
    `evo_kda_prefill`): q, k, v, f f_b^T (decay), g_a g_b^T (gate) [N, HK] and b [N, H] of the prompts' tokens packed
    (lengths, in order; overwritten), each prompt's window [taps-1, 3HK] and state [H, K, K] (pool rows `rows` of
    `windows` and `states`) zeroed, then advanced over its tokens: the convolution, SiLU, the l2 norms, the gates
    (with dt_bias [HK] and a [H] = -exp(A_log)), the delta rule, each head's RMSNorm (o_norm [K]) times its gate.
    Returns o [N, HK]: o_proj's input. Float32, contiguous."""
    N, HK = q.shape
    H, K = states.shape[1], states.shape[2]
    tensors = (q, k, v, decay, gate, beta, windows, states, conv, dt_bias, a, o_norm)
    if (sum(lengths) != N or len(rows) != len(lengths) or H * K != HK or beta.shape != (N, H)
            or any(t.shape != (N, HK) for t in (k, v, decay, gate)) or conv.shape != (windows.shape[1] + 1, 3 * HK)
            or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors)):
        raise ValueError(f"kda_prefill: q, k, v, decay, gate [N, H K] and beta [N, H] with N the sum of the lengths "
                         f"{lengths}, states [rows, H, K, K], windows [rows, taps-1, 3 H K], conv [taps, 3 H K], "
                         f"float32 and contiguous; got q {tuple(q.shape)}, beta {tuple(beta.shape)}, states "
                         f"{tuple(states.shape)}, windows {tuple(windows.shape)}, conv {tuple(conv.shape)}")
    o = torch.empty_like(q)
    at = torch.tensor(rows, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    _prefill_kernel()(H, K, conv.shape[0], rms_eps, l2_eps, conv.data_ptr(), dt_bias.data_ptr(), a.data_ptr(),
                      o_norm.data_ptr(), windows.data_ptr(), windows.stride(0), states.data_ptr(), states.stride(0),
                      at[0].data_ptr(), at[1].data_ptr(), len(rows), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                      decay.data_ptr(), gate.data_ptr(), beta.data_ptr(), o.data_ptr())
    return o


def check_kimi_step_supported(spec, dtype: torch.dtype, device: torch.device | str) -> None:
    """Raises KernelUnavailable (what is wrong, what is allowed) unless the step can run the decoder `spec` (a
    `KimiSpec`) in `dtype`; builds it."""
    require_cpu(device, "Kimi Linear decode step")
    sizes = {"hidden": spec.hidden, "kda_head_dim": spec.kda_head_dim, "intermediate": spec.intermediate,
             "moe_intermediate": spec.moe_intermediate, "mla_heads x kv_lora_rank": spec.mla_heads * spec.kv_lora_rank,
             "shared width": spec.moe_intermediate * spec.shared_experts, "q_lora_rank": spec.q_lora_rank or 0}
    odd = {name: size for name, size in sizes.items() if size % 8}
    problems = []
    if dtype != torch.float32:
        problems.append(f"float32 weights (got {dtype})")
    if odd:
        problems.append(f"sizes that are multiples of 8 (got {odd})")
    if spec.kda_head_dim > MAX_DIM or spec.experts > MAX_EXPERTS:
        problems.append(f"KDA heads of at most {MAX_DIM} and at most {MAX_EXPERTS} experts (got {spec.kda_head_dim}, "
                        f"{spec.experts})")
    if problems:
        raise KernelUnavailable("the Kimi Linear decode step kernel needs " + "; ".join(problems))
    _kernel()


def _float(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", torch.float32).contiguous()


PANEL = 16  # the C side's PANEL: a product's weight of at least this many outputs is stored in panels


def _product(w: torch.Tensor) -> torch.Tensor:
    """A product's weight [..., O, K] as the C side's `product` reads it: from PANEL outputs up, panels of PANEL
    outputs [..., ceil(O / PANEL), K, PANEL] (zeros past O); fewer outputs as they are. Float32, contiguous."""
    w = _float(w)
    O, K = w.shape[-2:]
    if O < PANEL:
        return w
    padded = torch.nn.functional.pad(w, (0, 0, 0, -O % PANEL))  # [..., O', K]
    return padded.view(*w.shape[:-2], -1, PANEL, K).transpose(-1, -2).contiguous()


class KimiDecodeStep:
    """The step over `weights` (transformers' names, as `evo.workloads.kimi_linear.model` gives them) and the pool's
    per-layer memory (KDA: state [rows, H, K, K] and window [rows, taps-1, 3HK]; MLA: the compressed cache [rows, L,
    R + rope]; float32, contiguous, written in place), the MLA latent's RMSNorm epsilon and q and k's l2-norm one. It
    keeps every tensor it points at alive."""

    def __init__(self, spec, weights: dict[str, torch.Tensor], memory: list[list[torch.Tensor]], latent_eps: float,
                 l2_eps: float) -> None:
        check_kimi_step_supported(spec, torch.float32, "cpu")
        kinds, pointers, alive = [], [], []
        rows = memory[0][0].shape[0]
        for t in (t for layer in memory for t in layer):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.shape[0] != rows:
                raise ValueError(f"KimiDecodeStep: every layer's memory float32, contiguous, {rows} rows; got "
                                 f"{tuple(t.shape)} {t.dtype}{'' if t.is_contiguous() else ', not contiguous'}")
        strides = {"state": 0, "window": 0, "cache_row": 0, "cache_pos": 0, "positions": 0}

        def keep(t: torch.Tensor) -> int:
            alive.append(t)
            return t.data_ptr()

        for i, (mixer, ffn) in enumerate(zip(spec.layer_types, spec.mlp_types)):
            p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            layer = [keep(_float(weights[p + "input_layernorm.weight"])),
                     keep(_float(weights[p + "post_attention_layernorm.weight"]))]
            if mixer == "linear_attention":
                state, window = memory[i]
                strides["state"], strides["window"] = state.stride(0), window.stride(0)
                layer += [keep(_product(weights[a + name])) for name in KDA_WEIGHTS[:-1]]
                layer += [keep(_float(weights[a + KDA_WEIGHTS[-1]]))]  # dt_bias
                layer += [keep(-_float(weights[a + "forget_gate.A_log"]).flatten().exp()),  # a_h = -exp(A_log)
                          keep(_float(weights[a + "conv1d.weight"][:, 0].T)),  # [taps, 3HK]
                          keep(_float(weights[a + "o_norm.weight"])), keep(_product(weights[a + "o_proj.weight"])),
                          keep(state), keep(window)]
            else:
                (cache,) = memory[i]
                strides["cache_row"], strides["cache_pos"], strides["positions"] = (cache.stride(0), cache.stride(1),
                                                                                     cache.shape[1])
                H, nope, dv, R = spec.mla_heads, spec.qk_nope_dim, spec.v_head_dim, spec.kv_lora_rank
                per_head = _float(weights[a + "kv_b_proj.weight"]).view(H, nope + dv, R)
                o = _float(weights[a + "o_proj.weight"])  # [D, H dv]
                o_latent = torch.einsum("dhv,hvr->dhr", o.view(-1, H, dv), per_head[:, nope:]).reshape(o.shape[0], -1)
                q = (["q_proj.weight"] if spec.q_lora_rank is None else ["q_a_proj.weight"])
                layer += [keep(_product(weights[a + q[0]])), keep(_product(weights[a + "kv_a_proj_with_mqa.weight"])),
                          keep(_float(weights[a + "kv_a_layernorm.weight"])), keep(per_head[:, :nope].contiguous()),
                          keep(_product(o_latent)), keep(cache)]
                low_rank = [0, 0] if spec.q_lora_rank is None else [keep(_float(weights[a + "q_a_layernorm.weight"])),
                                                                    keep(_product(weights[a + "q_b_proj.weight"]))]
                layer += low_rank + [0] * (FEED_FORWARD - len(layer) - len(low_rank))
            names = DENSE_WEIGHTS if ffn == "dense" else MOE_WEIGHTS
            layer += [keep(_float(weights[m + name]) if name.endswith("bias") else _product(weights[m + name]))
                      for name in names]
            layer += [0] * (PER_LAYER - len(layer))
            pointers += layer
            kinds += [int(mixer != "linear_attention"), int(ffn != "dense")]
        pointers += [keep(_float(weights["model.norm.weight"])), keep(_product(weights["lm_head.weight"]))]
        s = spec
        self.dims = torch.tensor([s.layers, s.hidden, s.vocab, s.kda_heads, s.kda_head_dim, s.conv_kernel, s.mla_heads,
                                  s.qk_nope_dim, s.qk_rope_dim, s.kv_lora_rank, s.experts, s.top_k, s.expert_groups,
                                  s.topk_groups, int(s.renormalize), s.moe_intermediate,
                                  s.moe_intermediate * s.shared_experts, s.intermediate, strides["state"],
                                  strides["window"], strides["cache_row"], strides["cache_pos"],
                                  s.q_lora_rank or 0] + kinds,
                                 dtype=torch.int64)
        self.eps = torch.tensor([s.rms_eps, latent_eps, l2_eps, s.routed_scaling, s.qk_head_dim ** -0.5],
                                dtype=torch.float32)
        self.pointers = torch.tensor(pointers, dtype=torch.int64)
        self.spec, self.rows, self.max_positions = spec, rows, strides["positions"] or None
        self._alive, self._memory = alive, memory
        self._call = _kernel()

    def __call__(self, embedded: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One decode step: embedded [n, D] float32 (row r's token), pos [n] (its position; row r of the pool): the
        logits [n, V] float32; each row's state, window and cache advanced by its token (`forward`'s one-token
        segments)."""
        n = embedded.shape[0]
        return self.forward(embedded, list(range(n)), [int(p) for p in pos.tolist()], [1] * n)

    def forward(self, embedded: torch.Tensor, rows: list[int], starts: list[int], lengths: list[int]) -> torch.Tensor:
        """The tokens of segments (segment i: lengths[i] tokens of pool row rows[i] from position starts[i]; one from
        position 0 starts from a zeroed state and window), embedded [N, D] float32 packed in order: the logits
        [len(rows), V] of each segment's last token; each row's state, window and cache advanced over its tokens.
        A prefill is its prompts as segments from 0 (or chunks of them, in order, each call after the last)."""
        D, limit = self.spec.hidden, self.max_positions if self.max_positions is not None else 2**62
        N = embedded.shape[0]
        ok = (embedded.shape == (N, D) and embedded.dtype == torch.float32 and len(rows) == len(starts) == len(lengths)
              and 0 < len(rows) and sum(lengths) == N and len(set(rows)) == len(rows)
              and all(0 <= r < self.rows for r in rows) and all(n >= 1 for n in lengths)
              and all(0 <= s and s + n <= limit for s, n in zip(starts, lengths)))
        if not ok:
            raise ValueError(f"KimiDecodeStep.forward: embedded [N, {D}] float32 and segments (distinct rows in "
                             f"[0, {self.rows}), positions [start, start + length) within [0, {limit}), lengths >= 1 "
                             f"adding up to N); got {tuple(embedded.shape)} {embedded.dtype}, rows {rows}, starts "
                             f"{starts}, lengths {lengths}")
        embedded = embedded.contiguous()
        segments = torch.tensor([rows, starts, lengths], dtype=torch.int64)
        logits = torch.empty(len(rows), self.spec.vocab, dtype=torch.float32)
        rc = self._call(self.dims.data_ptr(), self.pointers.data_ptr(), self.eps.data_ptr(), embedded.data_ptr(),
                        segments[0].data_ptr(), segments[1].data_ptr(), segments[2].data_ptr(), len(rows),
                        logits.data_ptr())
        if rc != 0:
            raise MemoryError("kimi_decode_step: the kernel could not allocate its scratch")
        return logits


__all__ = ["KimiDecodeStep", "check_kimi_step_supported", "kda_prefill"]
