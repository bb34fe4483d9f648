"""The generation workload's presets: a Llama model (`evo.workloads.llama.model`) and the request trace
its engines are judged under (`evo.core.trace`), whose bounds are the verified domain.

Shape: R (the most requests in flight the judge sends: the trace's concurrency, at least 1), P (the
longest prompt), N (the most new tokens a request may ask for), V (the vocabulary). An engine holds
P + N positions per request. A config's `trace:` replaces the preset's trace within those bounds
(`evo.driver.config`): a longer prompt or output, or more requests in flight, is another preset.

Besides the fixed presets, `hf:<folder>[,R=4,P=24,N=12,count=12,dtype=float32,device=cpu]` names the Hugging
Face checkpoint in that folder (the `llama` workload's reader, `evo.workloads.llama.model`) under a closed
trace of `count` requests, R in flight, prompts 1 to P, outputs 1 to N; `PresetTable` resolves it when named.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from evo.core.trace import TraceSpec
from evo.workloads.base import Preset
from evo.workloads.llama.model import PRESETS as MODEL_PRESETS
from evo.workloads.llama.model import LlamaPreset, ModelSpec, is_checkpoint_name, read_checkpoint_spec, split_checkpoint_name
from evo.workloads.llama.model import PresetTable as _LlamaPresetTable


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


CHECKPOINT_DEFAULTS: dict[str, object] = {"R": 4, "P": 24, "N": 12, "count": 12, "dtype": "float32", "device": "cpu"}
_CHOICES = {"dtype": ("float32", "bfloat16"), "device": ("cpu", "cuda")}


@dataclass(frozen=True)
class CheckpointOptions:
    """What an `hf:` preset name says besides its model: the folder, the trace, dtype and device."""

    folder: Path
    trace: TraceSpec
    dtype: str
    device: str


def checkpoint_options(name: str) -> CheckpointOptions:
    """`hf:<folder>[,key=value...]` or `gguf:<source>[,...]` (keys and defaults: CHECKPOINT_DEFAULTS) -> its folder
    (a GGUF imported), and a closed trace of `count` requests, R in flight, prompts 1 to P, outputs 1 to N.
    ValueError names the option that is wrong and what is allowed. Every generation workload's checkpoint presets
    are named this way."""
    folder, options = split_checkpoint_name(name)
    settings = dict(CHECKPOINT_DEFAULTS)
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in settings:
            raise ValueError(f"preset {name!r}: option {option!r} must be key=value with key one of "
                             f"{', '.join(CHECKPOINT_DEFAULTS)} (defaults {_defaults()})")
        if key in _CHOICES:
            if value not in _CHOICES[key]:
                raise ValueError(f"preset {name!r}: {key} must be one of {', '.join(_CHOICES[key])}, got {value!r}")
            settings[key] = value
        elif not (value.isdecimal() and int(value) >= 1):
            raise ValueError(f"preset {name!r}: {key} must be an integer >= 1, got {value!r}")
        else:
            settings[key] = int(value)
    R, P, N, count = (int(settings[k]) for k in ("R", "P", "N", "count"))
    trace = TraceSpec("closed", count=count, concurrency=R, prompt_len=(1, P), output_len=(1, N))
    return CheckpointOptions(folder, trace, str(settings["dtype"]), str(settings["device"]))


def checkpoint_preset(name: str) -> ServePreset:
    """The preset `hf:<folder>[,key=value...]` names (`checkpoint_options`); ValueError also for what the folder lacks."""
    options = checkpoint_options(name)
    return _preset(name, read_checkpoint_spec(options.folder), options.trace, options.dtype, options.device)


def _defaults() -> str:
    return ",".join(f"{k}={v}" for k, v in CHECKPOINT_DEFAULTS.items())


class PresetTable(_LlamaPresetTable):
    """The fixed presets, plus `hf:<folder>[,R=..,P=..,N=..,count=..,dtype=..,device=..]` resolved (its
    config.json read) when first named by `resolve`: the `llama` workload's table, with a generation workload's
    presets (kimi_linear passes its own checkpoint_preset)."""

    def __init__(self, presets: dict, resolve=checkpoint_preset) -> None:
        super().__init__(presets)
        self.resolve = resolve  # hf: name -> preset (a workload's own checkpoint_preset)

    def __missing__(self, name: str) -> Preset:
        if not is_checkpoint_name(name):
            raise KeyError(name)
        self[name] = preset = self.resolve(name)
        return preset


PRESET_TABLE = PresetTable(PRESETS)  # what the workload's presets() returns: PRESETS and hf: names
