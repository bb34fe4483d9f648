"""An engine kept open for Serve in the same confined process kind the judge evaluates engines in.

A Serve replica is a client of its engine, as the judge is: it never builds the engine or imports a
genome's code itself. `ServedEngine` asks an `Evaluator` (the judge's pieces) to launch an engine
process from the zygote (jail, seccomp, cgroups, filtered environment, the allow-list view), build
the engine there and verify it over every check case and a fresh draw over the verified domain; then
each request is one call over the same channel and shared arenas, its outputs copied by the replica
at the answer and the candidate frozen between calls. A sample of the answered calls is re-scored
against the float64 reference later, off the request path (`rescore`), by the replica's own thread.
"""
from __future__ import annotations

import secrets
import threading
import time
from typing import Mapping

import torch

from evaluators.judge.evaluator import Evaluator
from evaluators.sandbox.process import EngineProcess, EngineProcessError
from evaluators.settings import EvaluatorSettings

CALL_TIMEOUT_S = 120.0  # one request's engine call; past it the engine process is killed


class ServedEngineError(RuntimeError):
    """The engine failed its verification, a call, or died: it serves nothing more."""


class ServedEngine:
    """One verified engine in its own confined process. Calls are serialised (one engine process);
    `close()` kills the whole candidate."""

    def __init__(self, workload: str, preset: str, genome_json: str, sources: Mapping[str, str] | None = None,
                 settings: EvaluatorSettings | None = None) -> None:
        self.judge = Evaluator(workload, preset, settings or EvaluatorSettings(), seed=secrets.randbits(31),
                               name="serve")
        self.device = self.judge.device
        self._lock = threading.Lock()
        self._calls = 0
        label, spec = self.judge.resolve(genome_json, sources)
        self.label = label
        self._process: EngineProcess | None = self.judge.engine_process(guarded=bool(spec.get("guarded")))
        try:
            self.check_message, self.max_rel_error = self._start(spec)
        except BaseException:
            self.close()
            raise

    def _start(self, spec: dict) -> tuple[str, float]:
        settings = self.judge.settings
        deadline = time.perf_counter() + settings.build_timeout_s + settings.eval_timeout_s
        torch.set_num_threads(1)  # the replica's own work (copies, references) stays off the engine's cores
        problem, _ = self.judge.hold(self._process, spec, deadline)
        if problem is None:
            problem, worst = self.judge.verify_held(self._process, deadline)
        if problem is not None:
            raise ServedEngineError(f"engine {self.label} failed its verification in the sandbox: {problem}")
        return (f"passed every check case and a fresh draw over the verified domain in a "
                f"{settings.sandbox} sandbox (max rel error {worst:.2e})"), worst

    def __call__(self, **inputs: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The engine's outputs for one call (CPU tensors, the replica's own copies)."""
        with self._lock:
            if self._process is None:
                raise ServedEngineError(f"engine {self.label} is closed")
            self._calls += 1
            on_device = {k: None if v is None else v.to(self.device) for k, v in inputs.items()}
            try:
                outputs, problem = self.judge.request(self._process, on_device, f"request call {self._calls}",
                                                      CALL_TIMEOUT_S)
            except EngineProcessError as exc:
                raise ServedEngineError(f"engine {self.label}: {exc.kind}: {exc}") from exc
        if problem is not None:
            raise ServedEngineError(f"engine {self.label}: {problem}")
        return {k: v.cpu() for k, v in outputs.items()}

    def rescore(self, inputs: Mapping[str, torch.Tensor | None], outputs: Mapping[str, torch.Tensor]) -> tuple[str, float]:
        """A served call against the float64 reference: (the problem or "", the relative error)."""
        return self.judge.rescore(inputs, outputs)

    def close(self) -> None:
        with self._lock:
            if self._process is not None:
                self._process.close()
                self._process = None
            self.judge.close()
