"""Settings of the code agent (`operators.code_agent`): the `code_agent` section of a run config."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from operators.llm.client import Budget, LlmSettings


@dataclass(frozen=True)
class CodeAgentSettings:
    llm: LlmSettings = field(default_factory=LlmSettings)  # the OpenAI-compatible endpoint, model, key variable, prices
    budget: Budget = field(default_factory=Budget)  # calls, tokens, dollars and call wall time for the whole run
    max_repairs: int = 2  # replies that fail to apply, compile or validate are sent back this many times
    concurrency: int = 1  # proposals worked on at once (background threads of the agent's actor)
    queue: int = 2  # proposals kept in the works; the agent hands over finished ones and never blocks a generation
    critique: bool = True  # after each result, ask the model for the lesson it teaches (else a plain record)
    lessons_dir: str | None = None  # where lessons files live across runs; default <out_dir>/lessons
    lessons_in_prompt: int = 8  # newest lessons entries shown to the model
    relatives: int = 6  # results of the parent and its relatives shown to the model
    stages: tuple[str, ...] | None = None  # code genes it may edit (e.g. [code_intra]); default every open stage

    def __post_init__(self) -> None:
        for name in ("max_repairs", "concurrency", "queue", "lessons_in_prompt", "relatives"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name in ("concurrency", "queue")
                                                                                  else 0):
                raise ValueError(f"code_agent.{name} must be an integer >= "
                                 f"{1 if name in ('concurrency', 'queue') else 0}, got {value!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> CodeAgentSettings:
        data = dict(data or {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in code_agent; allowed: {names}")
        if "llm" in data:
            data["llm"] = LlmSettings.from_dict(data["llm"] or {})
        if "budget" in data:
            data["budget"] = Budget.from_dict(data["budget"] or {})
        if data.get("stages") is not None:
            data["stages"] = tuple(data["stages"])
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {"llm": self.llm.to_dict(), "budget": dataclasses.asdict(self.budget),
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("llm", "budget")},
                "stages": list(self.stages) if self.stages is not None else None}
