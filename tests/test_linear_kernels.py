"""The `linear_kernel` gene's CPU kernels (evo.workloads.llama.linear_kernels) against float64 products at the
row counts a decode step runs, and the gene's rules: lossy values marked, float32 weights required."""
from __future__ import annotations

import pytest
import torch

from evo.core.genome import GenomeError
from evo.workloads.base import DeviceInfo
from evo.workloads.llama.linear_kernels import LOSSY, PackedLinear
from evo.workloads.llama_serve.genes import gene_space
from evo.workloads.llama_serve.presets import PRESETS

# relative error of the product (Frobenius) each kernel must stay under: packed is float32 exact up to summation
# order; float16 weights round each weight to 11 bits; bfloat16 rounds weights, rows and products to 8 bits; int8 rounds weights and the call's activations to 8 bits
BOUNDS = {"packed": 1e-5, "fp16_weights": 1e-3, "bf16_weights": 1e-2, "int8_dynamic": 3e-2}


@pytest.mark.parametrize("kernel", sorted(BOUNDS))
def test_each_kernel_multiplies_any_row_count_within_its_bound(kernel):
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(200, 96, generator=gen) * 0.05  # [out, in]; 200 is no multiple of a vector width
    packed = PackedLinear.of(w, kernel)
    for rows in (1, 3, 16, 33):
        x = torch.randn(2, rows, 96, generator=gen)  # leading axes are kept
        got = packed(x)
        want = x.double() @ w.double().T
        assert got.shape == (2, rows, 200) and got.dtype == torch.float32
        assert ((got.double() - want).norm() / want.norm()).item() < BOUNDS[kernel], (kernel, rows)


def test_one_row_weights_multiply_a_single_row_by_torchs_copy():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(64, 32, generator=gen)
    packed = PackedLinear.of(w, "int8_dynamic", one_row=True)  # lossy for many rows, float32 for one
    x = torch.randn(1, 32, generator=gen)
    assert torch.allclose(packed(x), x @ w.T, rtol=1e-5, atol=1e-5)
    assert packed.one_row.shape == (32, 64) and PackedLinear.of(w, "packed").one_row is None


def test_the_gene_marks_lossy_kernels_and_needs_float32_weights():
    space = gene_space(PRESETS["cpu_small"], DeviceInfo("cpu", "cpu", 1))
    gene = next(g for g in space.genes if g.name == "linear_kernel")
    assert gene.default == "torch" and set(gene.lossy) == set(LOSSY) and "packed" not in gene.lossy
    with pytest.raises(GenomeError, match="weight_quant"):
        space.make({"linear_kernel": "packed", "weight_quant": "int8"})
    cuda = gene_space(PRESETS["cpu_small"], DeviceInfo("cuda", "cuda", 1))
    assert next(g for g in cuda.genes if g.name == "linear_kernel").values == ("torch",)


def test_an_unknown_kernel_is_refused_naming_the_kernels():
    with pytest.raises(ValueError, match="packed"):
        PackedLinear.of(torch.zeros(4, 4), "torch")
