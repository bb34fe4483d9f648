"""The serving engine's gene space, and the plan its scheduler and KV pool are built from.

Model genes are the `llama` workload's, by import: fusion (packed projections, fused norm, rotary,
attention form), threads, the KV layout and dtype, the weights' dtype, layout and int8 quantisation, the CPU kernel the projections run
on (lossy values among them: bfloat16 at a float32 preset, int8, float16 or int8 packed weights), and the open stages' code genes. The call engine's
`kv_alloc`, `prefill` and `decode_step` do not apply (a pooled cache is preallocated; this engine schedules
its own prefill and decode step). Added here, the engine's own decisions: how requests are batched and
admitted, how prefill shares a step with decoding, how the KV pool is laid out (slots or paged blocks),
how the batched decode step runs and whether it speculates (prompt lookup, verified exactly).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from evo.core.genome import Constraint, Gene, GeneSpace, Genome, Ignored, Scalar
from evo.workloads.base import DeviceInfo
from evo.workloads.generation_core import cpu_kernels
from evo.workloads.generation_core.exchange import exchange_gene
from evo.workloads.llama import genes as _llama
from evo.workloads.llama import open_code as _open_code
from evo.workloads.llama_serve.presets import ServePreset

MAX_RUNNING = (1, 2, 4, 8, 16, 32, 64)
PREFILL_CHUNKS = (16, 32, 64, 128, 256)
PREFILLS_PER_STEP = (1, 2, 4, 16, 64)
PREFILL_ROWS = ("each", "together")
KV_BLOCKS = (16, 32, 64)
DECODE_ATTENTION = ("stage", "kernel")
NORM_KERNEL = ("stage", "kernel")
NATIVE_PRODUCTS = ("vectors", "amx")  # amx: offered where this process can run AMX-BF16 tiles
NATIVE_MAX_ROWS = (1, 2, 4, 8, 16, 64)  # 64: the largest max_running, so every step
SPEC_TOKENS = (2, 4, 8)
SPEC_MIN_NGRAMS = (1, 2, 3)
SPEC_MAX_ROWS = (1, 4, 16, 64)  # 64: the largest max_running, so always
# the llama genes this engine does not read: a pool is preallocated; prefill and the step are scheduled here
NOT_SHARED = ("kv_alloc", "prefill", "prefill_chunk", "decode_step")


# the speed levers, most leverage first (the `levers` agent's sweep): how a step reads the weights (and their bytes),
# how a step runs (our C step, up to how many rows, on which units; traced or compiled), how it reads the KV cache
# (our kernel, bfloat16 bytes), our norm kernel, how many steps an exchange runs, speculation
LEVERS = ("linear_kernel", "decode_step", "native_max_rows", "native_products", "decode_attention", "kv_dtype",
          "norm_kernel", "steps_per_exchange", "speculation")


def _batching_genes(preset: ServePreset) -> list[Gene]:
    R = max(1, preset.shape["R"])
    running = tuple(m for m in MAX_RUNNING if m <= 2 * R) or (1,)
    default = min((m for m in running if m >= R), default=running[-1])  # room for every request in flight
    return [
        Gene("batching", "scheduling", ("continuous", "static"), "continuous",
             "continuous: a waiting request is admitted as soon as a running one ends; static: a new batch is "
             "admitted only when the whole running batch has finished"),
        Gene("max_running", "scheduling", running, default,
             "the most requests admitted at once (prefilling or decoding); the decoding ones run as one batch"),
    ]


def _prefill_genes() -> list[Gene]:
    return [
        Gene("prefill", "scheduling", ("whole", "chunked"), "whole",
             "whole: a request's prompt in one forward; chunked: one chunk of it per step while the running "
             "requests keep decoding (vLLM's chunked prefill)"),
        Gene("prefill_chunk", "scheduling", PREFILL_CHUNKS, 64, "prompt tokens per chunk (prefill=chunked)"),
        Gene("max_prefills_per_step", "scheduling", PREFILLS_PER_STEP, PREFILLS_PER_STEP[-1],
             "the most requests that run a prefill forward (whole, or one chunk) in a step, oldest first "
             "(the largest value: every admitted request)"),
        Gene("prefill_rows", "scheduling", PREFILL_ROWS, "each",
             "each: one forward per prefilling request (its whole prompt or chunk); together: the step's prefills "
             "(up to max_prefills_per_step requests) in one forward, each request's tokens a row padded to the "
             "longest, under a per-row causal mask, so the weights are read once for all of them (vLLM packs "
             "the prefill tokens of several requests into one batch)"),
    ]


def _native_products() -> tuple[str, ...]:
    return NATIVE_PRODUCTS if cpu_kernels.amx_bf16_available() else NATIVE_PRODUCTS[:1]


def _step_genes(device: DeviceInfo) -> list[Gene]:
    threads = next(g for g in _llama._scheduling_genes(device) if g.name == "threads")  # the llama gene, as it is
    # compiled on CUDA only: on the 2-core CPU host (torch 2.13, inductor) a build took 10-30 s per batch size
    # and the step ran no faster: 16 rows 7.1 ms compiled (over the whole pool) vs 5.0 ms eager; 1 row 1.8 ms,
    # as fast as eager's one-row path. traced on the CPU: the same static step recorded by torch.jit.trace in
    # ~0.03 s, run by TorchScript without Python between its ops (5.0 M model, one thread: 1 row 1.3-1.9 ms
    # against eager's 1.8-2.0; 16 rows 3.5-4.3 against 2.9-3.4: the whole pool's keys cost more than Python)
    # native on the CPU: our C step (generation_core.cpu_kernels.llama_decode_step), the whole forward in one call
    steps = ("eager", "compiled") if device.kind == "cuda" else ("eager", "traced", "native")
    products = _native_products()  # amx only where the CPU has AMX-BF16
    return [
        Gene("decode_step", "scheduling", steps, "eager",
             "the batched decode forward as eager torch (attending to the keys up to the furthest row), or with "
             "static shapes: the batch padded to the next power of two, attention over every position of the pool "
             "under the mask, built once per batch size the first time it occurs: torch.compile'd (CUDA), or "
             "recorded by torch.jit.trace and run by TorchScript (CPU; linear_kernel=torch only); or native (CPU): "
             "our C decode step, the whole forward of every decoding row in one call with no Python or dispatch "
             "between its ops (AVX2, FMA; each weight streamed once for all rows, each row over its own keys), "
             "float32 weights (linear_kernel=torch) or bfloat16 ones (linear_kernel=bf16_weights) with float32 "
             "activations, over the slot pool"),
        threads,
    ] + ([Gene("native_max_rows", "scheduling", NATIVE_MAX_ROWS, 4,
               "decode_step=native runs a step of at most this many decoding rows in C, a larger one eagerly (the C "
               "step streams the weights at one to a few rows as fast as the memory allows, while more rows are "
               "bound by its AVX2 arithmetic, where oneDNN's bfloat16 tiles or MKL may be faster)"),
          Gene("native_products", "memory", products, "vectors",
               "how decode_step=native multiplies bfloat16 weights (linear_kernel=bf16_weights): vectors: AVX2 FMA "
               "over float32 rows, each weight widened as read; amx (where the CPU has AMX-BF16): the weights stored "
               "as AMX tiles, each product's rows rounded to bfloat16 (as bf16_weights' eager calls round them) and "
               "multiplied 16 rows a pass on the tile unit, float32 sums (SmolLM2-135M's products, one thread: "
               "~the same time at 1 and at 16 rows)", lossy=tuple(v for v in products if v == "amx")),
          Gene("decode_attention", "fusion", DECODE_ATTENTION, "stage",
               "stage: a batched decode step's attention is the attention stage (SDPA or the matmul form over the "
               "keys up to the furthest row, under a per-row mask); kernel: our C kernel (AVX2, FMA; "
               "generation_core.cpu_kernels), each row over its own keys only, each key and value read once for the "
               "query heads that share it, a float32 or bfloat16 cache read as stored (decode_step=eager, or the steps "
               "decode_step=native runs eagerly)"),
          Gene("norm_kernel", "fusion", NORM_KERNEL, "stage",
               "stage: every RMSNorm (and the residual add before it) is the norm stage; kernel: our C kernel (AVX2, "
               "FMA), the add and the norm in one pass over each row, float32 activations (decode_step=eager; the "
               "norm stage's code is then not run)")]
         if device.kind == "cpu" else [])


def _speculation_genes() -> list[Gene]:
    return [
        Gene("speculation", "scheduling", ("off", "prompt_lookup"), "off",
             "off: a decode step makes one token per request; prompt_lookup: each request drafts the tokens that "
             "followed the latest earlier occurrence of its last 1-3 tokens in its prompt and output (vLLM's n-gram "
             "proposer), and one batched forward verifies every draft: exact, it keeps only the drafted tokens equal "
             "to what plain decoding picks (greedy or the seeded draw), and the pick after them"),
        Gene("spec_tokens", "scheduling", SPEC_TOKENS, 4,
             "the most tokens a request drafts per step (speculation=prompt_lookup), clamped to its tokens left"),
        Gene("spec_min_ngram", "scheduling", SPEC_MIN_NGRAMS, 2,
             "the shortest suffix of a request's context a draft may match (1: any earlier occurrence of its last "
             "token drafts; longer: fewer, likelier drafts)"),
        Gene("spec_max_rows", "scheduling", SPEC_MAX_ROWS, 4,
             "speculate only while at most this many requests decode (a verify forward costs more per row than a "
             "plain step: it pays off at a few rows, as vLLM turns speculation off above a batch size)"),
    ]


def _pool_genes() -> list[Gene]:
    return [
        Gene("kv_pool", "memory", ("slots", "paged"), "slots",
             "slots: one preallocated pool of max_running rows x P+N positions, a request owns a row (the decoding "
             "ones kept in the first rows, so the step attends to a view); paged: a pool of fixed blocks, a block "
             "table per request, blocks taken as it grows and freed when it ends (attention gathers its blocks)"),
        Gene("kv_block", "memory", KV_BLOCKS, 16, "positions per block of the paged pool (kv_pool=paged)"),
    ]


def _shared_memory_genes(preset: ServePreset) -> list[Gene]:
    return [g for g in _llama._memory_genes(preset) if g.name not in NOT_SHARED]


def _compiled_step_needs_slots(values: Mapping[str, Scalar]) -> str | None:
    step = values.get("decode_step")
    if step in ("compiled", "traced", "native") and values.get("kv_pool") != "slots":
        return (f"decode_step={step!r} runs its step over the slot pool, not over kv_pool="
                f"{values.get('kv_pool')!r}; set kv_pool=slots or decode_step=eager")
    return None


# the native step's weights: float32, bfloat16 as bf16_weights rounds them, int8 in groups as q8_weights holds them
NATIVE_KERNELS = ("torch", "bf16_weights", "q8_weights")


def _native_step_needs_float_weights(values: Mapping[str, Scalar]) -> str | None:
    if values.get("decode_step") != "native":
        return None
    kernel = values.get("linear_kernel", "torch")
    if kernel not in NATIVE_KERNELS or values.get("weight_dtype") != "float32" or values.get("weight_quant") != "none":
        return (f"decode_step='native' reads float32 weights (linear_kernel=torch), bfloat16 ones "
                f"(linear_kernel=bf16_weights) or int8 ones in groups (q8_weights), from weight_dtype='float32' and "
                f"weight_quant='none'; got linear_kernel={kernel!r}, weight_dtype={values.get('weight_dtype')!r}, "
                f"weight_quant={values.get('weight_quant')!r}; set those or decode_step=eager")
    return None


def _q8_weights_need_native_step(values: Mapping[str, Scalar]) -> str | None:
    if values.get("linear_kernel") == "q8_weights" and values.get("decode_step") != "native":
        return (f"linear_kernel='q8_weights' is read as int8 only by our C step (decode_step=native); with "
                f"decode_step={values.get('decode_step')!r} every product would multiply its dequantised values as "
                f"bf16_weights does (the loss of both); set decode_step=native or another linear_kernel")
    return None


def _amx_needs_native_bf16(values: Mapping[str, Scalar]) -> str | None:
    if values.get("native_products") == "amx" and (values.get("decode_step") != "native"
                                                   or values.get("linear_kernel") != "bf16_weights"):
        return (f"native_products='amx' multiplies bfloat16 weights in our C step: it needs decode_step='native' and "
                f"linear_kernel='bf16_weights' (got {values.get('decode_step')!r}, {values.get('linear_kernel')!r}); "
                f"set those or native_products=vectors")
    return None


def _traced_step_needs_torch_kernel(values: Mapping[str, Scalar]) -> str | None:
    if values.get("decode_step") == "traced" and values.get("linear_kernel", "torch") != "torch":
        return (f"decode_step='traced' records the step with torch.jit.trace, which cannot hold linear_kernel="
                f"{values.get('linear_kernel')!r}'s prepacked weights (oneDNN's or fbgemm's); set linear_kernel=torch "
                f"or decode_step=eager")
    return None


def _kernels_need_eager_step(values: Mapping[str, Scalar]) -> str | None:
    for gene in ("decode_attention", "norm_kernel"):
        if values.get(gene) == "kernel" and values.get("decode_step", "eager") not in ("eager", "native"):
            return (f"{gene}='kernel' is called from Python between the step's ops, which decode_step="
                    f"{values.get('decode_step')!r} records without; set decode_step=eager or {gene}=stage")
    return None


def _norm_kernel_needs_float32(values: Mapping[str, Scalar]) -> str | None:
    if values.get("norm_kernel") == "kernel" and values.get("weight_dtype", "float32") != "float32":
        return (f"norm_kernel='kernel' takes float32 activations, not weight_dtype={values.get('weight_dtype')!r}; set "
                f"weight_dtype=float32 or norm_kernel=stage")
    return None


def gene_space(preset: ServePreset, device: DeviceInfo) -> GeneSpace:
    """Genes legal for `preset` on `device` (names are a contract with operators, configs and the workload)."""
    genes = (_llama._fusion_genes(device) + _batching_genes(preset) + _prefill_genes() + _step_genes(device)
             + _shared_memory_genes(preset) + _llama.kernel_genes(device, native_step=True) + _pool_genes()
             + _speculation_genes() + [exchange_gene()])
    constraints = (
        Constraint("decode_step compiled or traced needs kv_pool slots", _compiled_step_needs_slots),
        Constraint("decode_step traced needs linear_kernel torch", _traced_step_needs_torch_kernel),
        Constraint("our CPU kernels need decode_step eager or native", _kernels_need_eager_step),
        Constraint("decode_step native needs float32, bf16_weights or q8_weights weights",
                   _native_step_needs_float_weights),
        Constraint("linear_kernel q8_weights needs decode_step native", _q8_weights_need_native_step),
        Constraint("native_products amx needs decode_step native and bf16_weights", _amx_needs_native_bf16),
        Constraint("norm_kernel kernel needs float32 activations", _norm_kernel_needs_float32),
        Constraint("kv_dtype no wider than weight_dtype", _llama._kv_no_wider_than_weights),
        Constraint("a packed linear_kernel needs float32 weights", _llama._packed_kernel_needs_float32),
    )
    ignored = [
        Ignored(("prefill_chunk",), lambda v: v.get("prefill") == "whole", "prefill=whole has no chunks"),
        Ignored(("prefill_rows",), lambda v: v.get("max_prefills_per_step") == 1,
                "max_prefills_per_step=1 runs one prefill a step"),
        Ignored(("kv_block",), lambda v: v.get("kv_pool") == "slots", "kv_pool=slots has no blocks"),
        Ignored(("spec_tokens", "spec_min_ngram", "spec_max_rows"), lambda v: v.get("speculation") == "off",
                "speculation=off drafts no tokens"),
        _llama.INT8_IGNORES_LAYOUT,
        _llama.PACKED_IGNORES_LAYOUT,
        _llama.TORCH_KERNEL_HAS_ONE_WAY,
    ]
    if device.kind == "cpu":
        ignored.append(Ignored(("native_max_rows",), lambda v: v.get("decode_step") != "native",
                               "only decode_step=native runs steps in C"))
        ignored.append(Ignored(("native_max_rows",), lambda v: v.get("max_running") == 1,
                               "max_running=1 steps one row, which every native_max_rows runs in C"))
    if device.kind == "cuda":
        ignored.append(Ignored(("sdpa_backend",), lambda v: v.get("attention") == "matmul",
                               "attention=matmul calls no SDPA kernel"))
    names = {g.name for g in genes}
    return GeneSpace("llama_serve", tuple(genes), constraints, _open_code.code_genes(preset, device), tuple(ignored),
                     levers=tuple(lever for lever in LEVERS if lever in names))  # decode_attention: CPU only


def llama_genome(genome: Genome, preset: ServePreset, device: DeviceInfo) -> Genome:
    """The `llama` genome whose engine supplies this genome's layers: the llama space's default with every
    gene the two spaces share (and the code genes) copied over."""
    space = _llama.gene_space(preset, device, native_step=True)
    names = {g.name for g in space.genes} | set(space.code_gene_names())
    shared = {name: value for name, value in genome.values().items() if name in names and name not in NOT_SHARED}
    return space.make({**space.default().values(), **shared})


@dataclass(frozen=True)
class ServePlan:
    """The scheduling and pool genes of a validated genome, typed: what the generator reads."""

    batching: str
    max_running: int
    prefill: str
    prefill_chunk: int
    max_prefills_per_step: int
    decode_step: str
    kv_pool: str
    kv_block: int
    kv_layout: str
    speculation: str
    spec_tokens: int
    spec_min_ngram: int = 2
    spec_max_rows: int = 4
    prefill_rows: str = "each"
    decode_attention: str = "stage"
    norm_kernel: str = "stage"
    native_max_rows: int = 64
    native_products: str = "vectors"

    @classmethod
    def from_genome(cls, genome: Genome) -> ServePlan:
        v = genome.values()
        return cls(batching=str(v["batching"]), max_running=int(v["max_running"]), prefill=str(v["prefill"]),
                   prefill_chunk=int(v["prefill_chunk"]), max_prefills_per_step=int(v["max_prefills_per_step"]),
                   decode_step=str(v["decode_step"]), kv_pool=str(v["kv_pool"]), kv_block=int(v["kv_block"]),
                   kv_layout=str(v["kv_layout"]), speculation=str(v["speculation"]),
                   spec_tokens=int(v["spec_tokens"]), spec_min_ngram=int(v["spec_min_ngram"]),
                   spec_max_rows=int(v["spec_max_rows"]), prefill_rows=str(v["prefill_rows"]),
                   decode_attention=str(v.get("decode_attention", "stage")),
                   norm_kernel=str(v.get("norm_kernel", "stage")),
                   native_max_rows=int(v.get("native_max_rows", 64)),
                   native_products=str(v.get("native_products", "vectors")))

    @property
    def drafted(self) -> int:
        """The most tokens a request drafts a step (0: no speculation): the scheduler's spec_tokens."""
        return self.spec_tokens if self.speculation != "off" else 0
