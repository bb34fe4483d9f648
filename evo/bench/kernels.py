"""`python -m evo kernels CONFIG [--genomes FILE] [--json]`: each genome's compiled kernels, without running
them: what the compiler reports (registers, spilled bytes, shared memory) and what the workload's model
predicts (HBM bytes, time), per kernel and per genome. The default genome comes first. The workload
provides the facts (`Workload.kernel_facts`); this module only lists and prints them.
"""
from __future__ import annotations

import json
from dataclasses import asdict

from evo.bench.bench import genomes_from_file
from evo.core.genome import Genome
from evo.driver.config import RunConfig
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo

NO_KERNELS = "this workload has no compiled kernels"


def kernel_report(config: RunConfig, genomes_file: str | None = None, compile: bool = True) -> list[dict]:
    """One entry per genome (the default first, then the file's, each once): `genome` (its flat genes),
    `label`, totals `hbm_bytes` and `model_ms`, and `kernels` (one dict per launch); [] when the
    workload has no compiled kernels. ValueError names a bad genome file."""
    workload = get_workload(config.workload)
    preset = workload.presets()[config.preset]
    device = DeviceInfo(preset.device, preset.device, config.evaluators.threads)
    space = workload.gene_space(preset, device)
    genomes: dict[str, Genome] = {space.default().hash: space.default()}
    for genome in genomes_from_file(genomes_file, space) if genomes_file else []:
        genomes.setdefault(genome.hash, genome)
    out = []
    for genome in genomes.values():
        facts = workload.kernel_facts(genome, preset, device, compile=compile)
        if facts is None:
            return []
        kernels = [asdict(f) for f in facts]
        out.append({"genome": genome.values(), "hash": genome.hash, "label": workload.label(genome),
                    "hbm_bytes": sum(k["hbm_bytes"] for k in kernels), "model_ms": sum(k["model_ms"] for k in kernels),
                    "kernels": kernels})
    return out


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple | list):
        return "x".join(map(str, value))
    return str(value)


def table(report: list[dict]) -> str:
    """The report as text: per genome a header line with its totals, then one row per kernel."""
    if not report:
        return NO_KERNELS
    lines = []
    columns = ("kernel", "registers", "spill B", "spill load B", "shared B", "grid", "HBM GB", "model ms")
    for entry in report:
        lines.append(f"{entry['label']}: modelled {entry['hbm_bytes'] / 1e9:.2f} GB HBM, {entry['model_ms']:.3f} ms"
                     + ("" if entry["kernels"] else " (no compiled kernels: another engine)"))
        rows = [(k["name"], _cell(k["registers"]), _cell(k["spill_bytes"]), _cell(k["spill_load_bytes"]),
                 _cell(k["shared_bytes"]), _cell(k["grid"]), f"{k['hbm_bytes'] / 1e9:.3f}", f"{k['model_ms']:.3f}")
                for k in entry["kernels"]]
        widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
        if rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
            lines += ["  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def as_json(report: list[dict]) -> str:
    return json.dumps(report, indent=1)
