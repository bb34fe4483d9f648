"""The blocked output stage as CUDA C, compiled with NVRTC through CuPy (gene output_backend='cuda'):
O = Qg S_start + M U per chunk, Qg = l2norm(q) * scale * exp(G) recomputed from q and g, as
`kernels.output_blocked_kernel` computes it, in float32 FMAs (no tensor cores: a second implementation
to check and time against Triton's, not a faster one yet).

One block per (chunk, head, 32 V columns), 256 threads: 32 V columns x 8 row groups. Qg [C, K] is built
in shared memory (float32, C*K*4 <= 48 KB); S, U and M are read from global memory (S and U coalesced
along V, M broadcast within a warp). Dtypes are compile-time macros: bf16 tensors are read as their
uint16 bits and written rounded to nearest even. `ptx()` compiles to PTX without a GPU or driver
(NVRTC only); `CudaOutput` loads it with `cupy.RawModule` on CUDA.
"""
from __future__ import annotations

import functools

SOURCE = r'''
typedef unsigned short bf16_t;
__device__ __forceinline__ float from_bf16(bf16_t x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ bf16_t to_bf16(float x) {
    unsigned int bits = __float_as_uint(x);
    bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even (finite values)
    return (bf16_t)(bits >> 16);
}
#if IN_BF16
typedef bf16_t in_t;
#define LOAD_IN(p, i) from_bf16((p)[i])
#define STORE_IN(p, i, x) ((p)[i] = to_bf16(x))
#else
typedef float in_t;
#define LOAD_IN(p, i) ((p)[i])
#define STORE_IN(p, i, x) ((p)[i] = (x))
#endif
#if WS_BF16
typedef bf16_t ws_t;
#define LOAD_WS(p, i) from_bf16((p)[i])
#else
typedef float ws_t;
#define LOAD_WS(p, i) ((p)[i])
#endif
#if M_BF16
typedef bf16_t m_t;
#define LOAD_M(p, i) from_bf16((p)[i])
#else
typedef float m_t;
#define LOAD_M(p, i) ((p)[i])
#endif

// grid (N, B*H, ceil(V / 32)), block (32, 8); CHUNK = C, KDIM = K compile-time
extern "C" __global__ void output_cuda(const in_t* q, const in_t* g, const m_t* M, const ws_t* Us, const ws_t* Ss,
                                       in_t* o, int T, int Tp, int NT, float scale, int H, int V) {
    __shared__ float qg[CHUNK * KDIM];
    __shared__ float rq[CHUNK];
    const int n = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int tid = threadIdx.y * 32 + threadIdx.x;
    // Qg: one thread per K column walks the chunk's rows (the cumsum of g), then rows are normalised
    for (int k = tid; k < KDIM; k += 256) {
        float G = 0.0f;
        for (int i = 0; i < CHUNK; ++i) {
            const int t = n * CHUNK + i;
            float qv = 0.0f, gv = 0.0f;
            if (t < T) {
                const long long off = ((long long)(b * T + t) * H + h) * KDIM + k;
                qv = LOAD_IN(q, off);
                gv = LOAD_IN(g, off);
            }
            G += gv;
            qg[i * KDIM + k] = qv * expf(G);
        }
    }
    for (int i = tid; i < CHUNK; i += 256) {
        const int t = n * CHUNK + i;
        float ss = 0.0f;
        if (t < T) {
            const long long base = ((long long)(b * T + t) * H + h) * KDIM;
            for (int k = 0; k < KDIM; ++k) { const float x = LOAD_IN(q, base + k); ss += x * x; }
        }
        rq[i] = scale / sqrtf(ss + 1e-6f);
    }
    __syncthreads();
    const int v = blockIdx.z * 32 + threadIdx.x;
    if (v >= V) return;
    float acc[CHUNK / 8];
    #pragma unroll
    for (int r = 0; r < CHUNK / 8; ++r) acc[r] = 0.0f;
    const long long s_base = ((long long)bh * NT + n) * KDIM * V;
    for (int k = 0; k < KDIM; ++k) {
        const float s = LOAD_WS(Ss, s_base + (long long)k * V + v);
        #pragma unroll
        for (int r = 0; r < CHUNK / 8; ++r) acc[r] += qg[(threadIdx.y + 8 * r) * KDIM + k] * s;
    }
    const long long row0 = (long long)bh * Tp + (long long)n * CHUNK;
    #pragma unroll
    for (int r = 0; r < CHUNK / 8; ++r) acc[r] *= rq[threadIdx.y + 8 * r];
    for (int s = 0; s < CHUNK; ++s) {
        const float u = LOAD_WS(Us, (row0 + s) * V + v);
        #pragma unroll
        for (int r = 0; r < CHUNK / 8; ++r) acc[r] += LOAD_M(M, (row0 + threadIdx.y + 8 * r) * CHUNK + s) * u;
    }
    #pragma unroll
    for (int r = 0; r < CHUNK / 8; ++r) {
        const int t = n * CHUNK + threadIdx.y + 8 * r;
        if (t < T) STORE_IN(o, ((long long)(b * T + t) * H + h) * V + v, acc[r]);
    }
}
'''
SHARED_LIMIT = 48 * 1024  # static shared memory of one block


def options(C: int, K: int, in_bf16: bool, ws_bf16: bool, m_bf16: bool) -> tuple[str, ...]:
    """NVRTC options of one specialisation; ValueError when the chunk's Qg does not fit shared memory."""
    if C % 8 or (C * K + C) * 4 > SHARED_LIMIT:
        raise ValueError(f"the CUDA output needs chunk_size % 8 == 0 and (C*K + C)*4 <= {SHARED_LIMIT} bytes of"
                         f" shared memory, got C={C}, K={K}; use the triton output_backend")
    return (f"-DCHUNK={C}", f"-DKDIM={K}", f"-DIN_BF16={int(in_bf16)}", f"-DWS_BF16={int(ws_bf16)}",
            f"-DM_BF16={int(m_bf16)}", "--std=c++14")


def ptx(opts: tuple[str, ...], arch: str = "compute_90") -> str:
    """PTX of the source for `opts`, by NVRTC alone (no GPU or driver needed; cupy must be installed)."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(SOURCE, "kda_output.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [*opts, f"--gpu-architecture={arch}"])
    except nvrtc.NVRTCError as exc:
        raise RuntimeError(f"NVRTC failed on the CUDA output: {exc}; log: {nvrtc.getProgramLog(prog)}") from exc
    out = nvrtc.getPTX(prog)
    nvrtc.destroyProgram(prog)
    return out.decode() if isinstance(out, bytes) else out


@functools.lru_cache(maxsize=16)
def _kernel(opts: tuple[str, ...]):
    import cupy

    return cupy.RawModule(code=SOURCE, options=opts, backend="nvrtc").get_function("output_cuda")


class CudaOutput:
    """Launches the CUDA output on the tensors' CUDA device and torch's current stream."""

    def __call__(self, q, g, M, Us, Ss, o, T: int, Tp: int, NT: int, scale: float, H: int, C: int) -> None:
        import cupy
        import numpy as np
        import torch

        K, V, BH = q.shape[-1], o.shape[-1], q.shape[0] * H
        kernel = _kernel(options(C, K, q.dtype == torch.bfloat16, Us.dtype == torch.bfloat16,
                                 M.dtype == torch.bfloat16))
        ptr = lambda t: np.uint64(t.data_ptr())  # noqa: E731  device pointers as 64-bit kernel arguments
        with cupy.cuda.ExternalStream(torch.cuda.current_stream(q.device).cuda_stream):
            kernel((NT, BH, -(-V // 32)), (32, 8),
                   (ptr(q), ptr(g), ptr(M), ptr(Us), ptr(Ss), ptr(o), np.int32(T), np.int32(Tp), np.int32(NT),
                    np.float32(scale), np.int32(H), np.int32(V)))
