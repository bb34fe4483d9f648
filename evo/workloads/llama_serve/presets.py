"""The generation workload's presets: a Llama model (`evo.workloads.llama.model`) and the request trace
its engines are judged under (`evo.core.trace`), whose bounds are the verified domain.

Shape: R (the most requests in flight the judge sends: the trace's concurrency, at least 1), P (the
longest prompt), N (the most new tokens a request may ask for), V (the vocabulary). An engine holds
P + N positions per request. A config's `trace:` replaces the preset's trace within those bounds
(`evo.driver.config`): a longer prompt or output, or more requests in flight, is another preset.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from evo.core.trace import TraceSpec
from evo.workloads.llama.model import PRESETS as MODEL_PRESETS
from evo.workloads.llama.model import LlamaPreset, ModelSpec


@dataclass(frozen=True)
class ServePreset(LlamaPreset):
    """A Llama model and the trace its generation engines are judged and timed on."""

    trace: TraceSpec = field(default_factory=TraceSpec)

    @property
    def max_positions(self) -> int:
        return self.shape["P"] + self.shape["N"]

    def with_trace(self, trace: TraceSpec) -> ServePreset:
        """This preset judged on `trace`; ValueError naming the bound a trace passes."""
        if trace.concurrency < 1:
            raise ValueError(f"trace for preset {self.name!r}: concurrency must be 1 to R={self.shape['R']} (the most "
                             f"requests in flight engines are verified for), got {trace.concurrency}")
        over = [f"{what} {got} > {bound}" for what, got, bound in (
            ("prompt_len high", trace.prompt_len[1], self.shape["P"]),
            ("output_len high", trace.output_len[1], self.shape["N"]),
            ("concurrency", trace.concurrency, self.shape["R"]))
            if got > bound]
        if over:
            raise ValueError(f"trace for preset {self.name!r}: {', '.join(over)} (its verified bounds: prompts up to "
                             f"P={self.shape['P']}, outputs up to N={self.shape['N']}, R={self.shape['R']} in flight)")
        return replace(self, trace=trace)


def _preset(name: str, model: ModelSpec, trace: TraceSpec, dtype: str, device: str) -> ServePreset:
    shape = {"R": max(1, trace.concurrency), "P": trace.prompt_len[1], "N": trace.output_len[1], "V": model.vocab}
    return ServePreset(name, shape, dtype, device, model, trace)


PRESETS: dict[str, ServePreset] = {p.name: p for p in (
    # tests: the 2-layer toy model with its own LM head (tied to the embedding, this toy only repeats its last
    # prompt token, by a wide margin: greedy tokens would not tell a wrong engine from a right one; untied,
    # its top two logits are ~0.2 apart), a dozen short requests, 4 in flight
    _preset("cpu_small", replace(MODEL_PRESETS["cpu_small"].model, tie_embeddings=False),
            TraceSpec("closed", count=12, concurrency=4, prompt_len=(1, 24), output_len=(1, 12)), "float32", "cpu"),
    # issue 30's CPU preset: the 5.0 M model, 64 requests, prompts 16-256, outputs 16-128, 16 in flight
    _preset("cpu", MODEL_PRESETS["cpu"].model,
            TraceSpec("closed", count=64, concurrency=16, prompt_len=(16, 256), output_len=(16, 128)), "float32", "cpu"),
    # the Llama-3.2-1B shape on an H200: 256 requests, 64 in flight
    _preset("h200", MODEL_PRESETS["h200"].model,
            TraceSpec("closed", count=256, concurrency=64, prompt_len=(128, 1024), output_len=(64, 256)),
            "bfloat16", "cuda"),
)}
