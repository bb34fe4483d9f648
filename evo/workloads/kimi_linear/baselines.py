"""Baselines a user would pick for serving a Kimi Linear model, as generation engines (`evo.workloads.generation`):

- `one_at_a_time`: our plainest engine (the gene space's default genome with max_running=1) behind
  llama_serve's `OneAtATime` wrapper: the next request admitted only when the previous one finished.
- `hf_static`: transformers' `KimiLinearForCausalLM` on our weights, driven by llama_serve's `HFStatic` (up to R
  waiting requests left-padded into one batch, one forward of the whole batch per step, finished rows riding
  along until the batch's last request is done). Left padding is exact for its KDA layers: transformers zeroes
  padded positions' hidden states before the mixer, so q, k, v are zero there and the recurrent state and the
  convolution's history stay zero. Its KDA kernels on the CPU are the module's pure-torch fallbacks
  (`chunk_kda` for the prompt, `fused_recurrent_kda` for each step, a torch causal convolution: no
  flash-linear-attention or `causal_conv1d` kernels there; transformers prints one line per missing kernel);
  its experts run transformers' eager loop (`_experts_implementation="eager"`).

Both decode greedily or draw each request's seeded samples (`evo.workloads.sampling.choose`), ignore eos and
carry `num_threads` for the engine's process to set. hf_static is offered only when transformers (>= 5.24,
which ships Kimi Linear) is importable.
"""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from evo.workloads.base import DeviceInfo
from evo.workloads.generation import GenerationEngine
from evo.workloads.kimi_linear.engine import build as build_engine
from evo.workloads.kimi_linear.genes import gene_space
from evo.workloads.kimi_linear.model import hf_config, load_weights
from evo.workloads.kimi_linear.presets import KimiPreset
from evo.workloads.llama_serve.baselines import HFStatic, OneAtATime


def _threads(device: DeviceInfo) -> int | None:
    return device.threads if device.kind == "cpu" else None


def transformers_has_kimi() -> bool:
    try:
        return importlib.util.find_spec("transformers.models.kimi_linear") is not None
    except ModuleNotFoundError:
        return False


def hf_model(preset: KimiPreset, device: DeviceInfo):
    """transformers' KimiLinearForCausalLM with our weights, in the preset's dtype, eager experts."""
    from transformers import KimiLinearForCausalLM

    config = hf_config(preset.model)
    config._experts_implementation = "eager"  # its grouped-mm experts are a CUDA path
    model = KimiLinearForCausalLM(config)
    model.load_state_dict(load_weights(preset.model), strict=True)
    target = torch.device("cuda" if device.kind == "cuda" else "cpu")
    return model.to(device=target, dtype=getattr(torch, preset.dtype)).eval()


class HFStaticKimi(HFStatic):
    """llama_serve's static batching over transformers' Kimi Linear (its DynamicCache holds the KDA layers'
    convolution and recurrent states beside the MLA layers' keys and values)."""


def hf_static(preset: KimiPreset, device: DeviceInfo) -> HFStaticKimi:
    return HFStaticKimi(hf_model(preset, device), preset.shape["R"], preset.max_positions, _threads(device))


def one_at_a_time(preset: KimiPreset, device: DeviceInfo) -> OneAtATime:
    genome = gene_space(preset, device).make({"max_running": 1})
    return OneAtATime(build_engine(genome, preset, device), preset.max_positions, _threads(device))


def baselines(preset: KimiPreset) -> dict[str, Callable[[DeviceInfo], GenerationEngine]]:
    """Name -> builder(DeviceInfo) -> generation engine, for each baseline available here."""
    out: dict[str, Callable[[DeviceInfo], GenerationEngine]] = {"one_at_a_time": lambda d: one_at_a_time(preset, d)}
    if transformers_has_kimi():
        out["hf_static"] = lambda d: hf_static(preset, d)
    return out
