"""Our own CPU kernels for the generation engines: C (AVX2 + FMA), compiled on first use by the machine's C compiler
into a per-user cache and called through ctypes on tensors' memory (no Python between a kernel's loops, no torch
headers to compile: a build takes well under a second).

`decode_attention`: grouped-query attention of one decode position per row over each row's own keys (float32 or
bfloat16 cache), each key and value read once for the query heads that share it. `add_rms_norm`: RMSNorm after a
residual add, float32 rows, in one pass over each row. `LlamaDecodeStep`: a Llama-family decoder's whole decode
step for n rows (both of the above inside it), float32, bfloat16 or int8 (grouped) weights streamed once for all
rows, bfloat16 ones on AMX tiles where the CPU has them. `kda_recurrence`: the KDA delta rule over sequences of
tokens (a prompt, or one decode token per row), each head's state updated in place in one pass a token.
`KimiDecodeStep`: a Kimi Linear hybrid's whole decode step for n rows (KDA and compressed-MLA mixers, dense and MoE
feed-forwards, the recurrence above inside it), float32; `kda_prefill`: a KDA layer's prompts between its products,
by the step's own per-token code.
"""
from evo.workloads.generation_core.cpu_kernels.build import KernelUnavailable, kernel_library
from evo.workloads.generation_core.cpu_kernels.decode_attention import (check_attention_supported,
                                                                        decode_attention)
from evo.workloads.generation_core.cpu_kernels.kda_recurrence import check_recurrence_supported, kda_recurrence
from evo.workloads.generation_core.cpu_kernels.kimi_decode_step import (KimiDecodeStep, check_kimi_step_supported,
                                                                        kda_prefill)
from evo.workloads.generation_core.cpu_kernels.llama_decode_step import (LlamaDecodeStep, StepShape,
                                                                         amx_bf16_available, amx_tiles,
                                                                         check_step_supported, q8_rows)
from evo.workloads.generation_core.cpu_kernels.rms_norm import add_rms_norm, check_norm_supported

__all__ = ["KernelUnavailable", "KimiDecodeStep", "LlamaDecodeStep", "StepShape", "add_rms_norm", "amx_bf16_available",
           "amx_tiles", "check_attention_supported", "check_kimi_step_supported", "check_norm_supported",
           "check_recurrence_supported", "check_step_supported", "decode_attention", "kda_prefill", "kda_recurrence",
           "kernel_library", "q8_rows"]
