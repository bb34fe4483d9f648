"""A tiny workload for evaluator tests: a running sum over time, o[b, t] = s0[b] + sum_{u<=t} x[b, u].

It is a `Workload` like a real one, reached by its dotted path `NAME` (no registration). Its gene
`impl` selects the correct engine or one of several deliberately broken ones, so every evaluator
status can be reached on purpose.
"""
from __future__ import annotations

import os
import time
from typing import Mapping

from evo.core.code import CodeError, OpenStage, load_module
from evo.core.genome import CodeGene, Gene, GeneSpace, Genome
from evo.workloads.base import NO_SOURCES, CheckCase, DeviceInfo, Engine, MachineRates, Preset, Roofline, Workload
from evo.workloads.lazy import lazy

torch = lazy("torch")  # as a workload's package would: agents hold the gene space only

IMPLS = (
    "cumsum",  # correct
    "loop",  # correct, different summation order
    "zeros",  # returns zeros
    "nan",  # one NaN
    "inplace",  # writes into its input
    "wrong_shape",  # drops the last time step
    "wrong_dtype",  # returns float64
    "missing",  # forgets final_state
    "noisy",  # relative error 1e-4: fails float32, passes bfloat16
    "bf16_compute",  # computes a float32 preset in bfloat16
    "raise_build",  # build raises
    "raise_run",  # every call raises
    "raise_small",  # raises only on the small check case
    "slow_build",  # build sleeps 0.3 s
    "threads_probe",  # correct; raises unless torch.get_num_threads() equals its `threads` gene
    "hang",  # every call sleeps for an hour (the pool must kill it)
    "exit",  # every call kills its process (the pool must replace it)
    "oom",  # every call runs out of memory (as torch reports it)
    "slow",  # correct; build sleeps 2 s (keeps evaluations in flight, e.g. while a node leaves)
    "shared_outputs",  # right values, but final_state is a view into o
    "strided",  # right values, o returned as a non-contiguous view
    "alias_input",  # returns its input tensor as o
)

NAME = "tests.fake_workload"  # what evaluators and configs name it by (evo.workloads.get_workload)
SEEN_SEEDS: list[int] = []  # every seed make_inputs was given, in order

# The open stage: a code gene whose source replaces the running sum (evo.core.code), for code-agent tests.
SUM_SEED = '''"""The running sum of the fake workload: o[b, t] = initial_state[b] + sum over u <= t of x[b, u].

x: [B, T, D]; initial_state: [B, D] or None. Return o, [B, T, D], in x's dtype.
"""
import torch


def running_sum(x, initial_state):
    # EVOLVE-BLOCK-START
    o = x.cumsum(1)
    # EVOLVE-BLOCK-END
    if initial_state is not None:
        o = o + initial_state[:, None, :]
    return o
'''
SUM_STAGE = OpenStage(gene="code_sum", stage="running_sum", entry="running_sum", params=("x", "initial_state"),
                      language="torch", doc="the running sum over time", seed=lambda: SUM_SEED)


def _engine(impl: str, threads: int) -> Engine:
    def engine(x: torch.Tensor, initial_state: torch.Tensor | None = None) -> dict:
        # x: [B, T, D]; initial_state: [B, D] or None
        x_in = x
        if impl == "hang":
            time.sleep(3600)
        if impl == "exit":
            os._exit(3)
        if impl == "oom":
            raise torch.OutOfMemoryError("deliberate: tried to allocate 512.00 GiB")
        if impl == "raise_run":
            raise RuntimeError("deliberate failure at run time")
        if impl == "raise_small" and x.shape[1] < 16:
            raise IndexError("deliberate failure on short sequences")
        if impl == "threads_probe" and threads and torch.get_num_threads() != threads:
            raise RuntimeError(f"threads_probe: running on {torch.get_num_threads()} threads, not {threads}")
        if impl == "inplace":
            x = x.cumsum_(1)
        elif impl == "loop":
            x_ = x.clone()
            for t in range(1, x.shape[1]):
                x_[:, t] += x_[:, t - 1]
            x = x_
        elif impl == "bf16_compute":
            x = x.to(torch.bfloat16).cumsum(1, dtype=torch.bfloat16).to(x.dtype)
        else:
            x = x.cumsum(1)
        o = x if initial_state is None else x + initial_state[:, None, :]
        if impl == "zeros":
            o = torch.zeros_like(o)
        elif impl == "nan":
            o = o.clone()
            o[0, 0, 0] = float("nan")
        elif impl == "noisy":
            o = o * (1 + 1e-4)
        out = {"o": o, "final_state": o[:, -1].clone()}
        if impl == "shared_outputs":
            o = o.contiguous()
            out = {"o": o, "final_state": o.view(-1)[: o.shape[0] * o.shape[2]].view(o.shape[0], o.shape[2])}
        if impl == "strided":
            out["o"] = o.transpose(0, 1).contiguous().transpose(0, 1)
        elif impl == "alias_input":
            out["o"] = x_in
        if impl == "wrong_shape":
            out["o"] = o[:, :-1]
        elif impl == "wrong_dtype":
            out["o"] = o.double()
        elif impl == "missing":
            del out["final_state"]
        return out

    if threads:
        engine.num_threads = threads
    return engine


def _code_engine(running_sum) -> Engine:
    def engine(x: torch.Tensor, initial_state: torch.Tensor | None = None) -> dict:
        o = running_sum(x, initial_state)
        return {"o": o, "final_state": o[:, -1].clone()}

    return engine


class FakeWorkload(Workload):
    name = "fake"
    input_names = ("x", "initial_state")
    output_names = ("o", "final_state")

    def presets(self) -> dict[str, Preset]:
        shape = {"B": 2, "T": 64, "D": 16}
        return {
            "cpu": Preset("cpu", shape, "float32", "cpu"),
            "cpu_bf16": Preset("cpu_bf16", shape, "bfloat16", "cpu"),
            "cuda": Preset("cuda", shape, "float32", "cuda"),
        }

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        return GeneSpace(
            "fake",
            (
                Gene("impl", "fusion", IMPLS, "cumsum", "which engine"),
                Gene("threads", "scheduling", (0, 1, 2), 0, "engine.num_threads (0: unset)"),
                Gene("pad", "memory", (False, True), False, "unused"),
            ),
            code_genes=(CodeGene(SUM_STAGE.gene, "fusion", SUM_STAGE.doc),),
        )

    def open_stages(self, preset: Preset, device: DeviceInfo) -> tuple[OpenStage, ...]:
        return (SUM_STAGE,)

    def free_axes(self, preset: Preset) -> dict[str, tuple[int, ...]]:
        return {"B": (1, preset.shape["B"]), "T": (8, preset.shape["T"]), "D": (preset.shape["D"], preset.shape["D"] + 1)}

    def check_cases(self, preset: Preset) -> list[list[CheckCase]]:
        small = {**preset.shape, "T": 8}
        return [
            [CheckCase("small", small, "normal"),
             CheckCase("small_wide_b1", {**small, "B": 1, "D": small["D"] + 1}, "normal")],
            [CheckCase("preset", dict(preset.shape), "normal"),
             CheckCase("preset_state", dict(preset.shape), "large", with_initial_state=True)],
        ]

    def make_inputs(self, case: CheckCase, dtype: str, device: str, seed: int) -> dict:
        SEEN_SEEDS.append(seed)
        gen = torch.Generator().manual_seed(seed)
        B, T, D = case.shape["B"], case.shape["T"], case.shape["D"]
        scale = 100.0 if case.distribution == "large" else 1.0
        dt = getattr(torch, dtype)
        x = (torch.randn(B, T, D, generator=gen) * scale).to(device=device, dtype=dt)
        s0 = torch.randn(B, D, generator=gen).to(device=device, dtype=dt) if case.with_initial_state else None
        return {"x": x, "initial_state": s0}

    def reference(self, inputs: dict) -> dict:
        o = inputs["x"].double().cumsum(1)
        if inputs.get("initial_state") is not None:
            o = o + inputs["initial_state"].double()[:, None, :]
        return {"o": o, "final_state": o[:, -1]}

    def build(self, genome: Genome, preset: Preset, device: DeviceInfo,
              sources: Mapping[str, str] = NO_SOURCES) -> Engine:
        digest = genome.values().get(SUM_STAGE.gene)
        if digest is not None:
            if digest not in sources:
                raise CodeError(f"no source for {SUM_STAGE.gene}={digest}")
            return _code_engine(load_module(sources[digest], SUM_STAGE).running_sum)
        impl = genome["impl"]
        if impl == "raise_build":
            raise RuntimeError("deliberate failure at build time")
        if impl == "slow_build":
            time.sleep(0.3)
        if impl == "slow":
            time.sleep(2.0)
        return _engine(impl, genome["threads"])

    def baselines(self, preset: Preset) -> dict:
        return {"torch_cumsum": lambda device: _engine("cumsum", 0), "broken": lambda device: _engine("zeros", 0)}

    def roofline(self, preset: Preset, rates: MachineRates) -> Roofline:
        n = preset.shape["B"] * preset.shape["T"] * preset.shape["D"]
        return Roofline(flops=float(n), bytes=float(2 * n * 4), rates=rates)


WORKLOAD = FakeWorkload()


def genome_json(impl: str = "cumsum", threads: int = 0) -> str:
    space = WORKLOAD.gene_space(WORKLOAD.presets()["cpu"], DeviceInfo("cpu", "cpu"))
    return space.make({"impl": impl, "threads": threads}).to_json()
