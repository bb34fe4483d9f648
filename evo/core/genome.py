"""Engine genome and gene space: the typed record of an engine's design decisions.

A genome groups named genes into three domains (fusion, scheduling, memory). It is immutable,
serialises to canonical JSON and is identified by the hash of that JSON. A gene space declares, per
workload and device, which genes exist, which values each may take and which combinations are
illegal; `GeneSpace.validate` turns any violation into a `GenomeError` that names the gene, the value
and what is allowed.

A gene space also declares which genes the chosen engine ignores (`Ignored`): a canonical genome gives
them their defaults, so genomes that build the same engine share one hash and one measurement; every
genome the space makes, validates, samples or restricts to is canonical. A workload whose engine is a
pipeline of stages declares it once (`StagePipeline`), which generates the backend and fuse genes,
their constraint and the fused groups of a genome.

This module imports neither Ray nor MLflow nor torch.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from evo.core.code import is_code_hash

DOMAINS: tuple[str, ...] = ("fusion", "scheduling", "memory")
Scalar = bool | int | float | str | None


class GenomeError(ValueError):
    """A genome is not legal in its gene space (unknown gene, illegal value or combination)."""


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: equal objects give equal strings."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class Genome:
    """An engine's design decisions. `hash` is its identity, cache key and dedupe key."""

    workload: str
    fusion: tuple[tuple[str, Scalar], ...] = ()
    scheduling: tuple[tuple[str, Scalar], ...] = ()
    memory: tuple[tuple[str, Scalar], ...] = ()
    hash: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        for domain in DOMAINS:
            object.__setattr__(self, domain, tuple(sorted(getattr(self, domain))))
        digest = hashlib.sha256(self.to_json().encode()).hexdigest()[:16]
        object.__setattr__(self, "hash", digest)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Genome:
        unknown = set(data) - {"workload", *DOMAINS}
        if unknown:
            raise GenomeError(
                f"unknown genome keys {sorted(unknown)}; allowed: 'workload' and domains {list(DOMAINS)}"
            )
        if not isinstance(data.get("workload"), str):
            raise GenomeError(f"genome needs a string 'workload', got {data.get('workload')!r}")
        domains = {}
        for domain in DOMAINS:
            genes = data.get(domain, {})
            if not isinstance(genes, Mapping):
                raise GenomeError(f"genome domain {domain!r} must be an object of gene: value, got {genes!r}")
            domains[domain] = tuple(genes.items())
        return cls(workload=data["workload"], **domains)

    @classmethod
    def from_json(cls, text: str) -> Genome:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GenomeError(f"genome is not valid JSON: {exc}") from exc
        if not isinstance(data, Mapping):
            raise GenomeError(f"genome JSON must be an object, got {type(data).__name__}")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, **{d: dict(getattr(self, d)) for d in DOMAINS}}

    def to_json(self) -> str:
        return canonical_json(self.to_dict())

    def domain(self, name: str) -> dict[str, Scalar]:
        """The genes of one domain as a dict."""
        if name not in DOMAINS:
            raise GenomeError(f"unknown domain {name!r}; allowed: {list(DOMAINS)}")
        return dict(getattr(self, name))

    def values(self) -> dict[str, Scalar]:
        """All genes, flattened (gene names are unique across domains)."""
        return {k: v for d in DOMAINS for k, v in getattr(self, d)}

    def __getitem__(self, gene: str) -> Scalar:
        values = self.values()
        if gene not in values:
            raise KeyError(f"genome has no gene {gene!r}; genes: {sorted(values)}")
        return values[gene]

    def with_domain(self, name: str, genes: Mapping[str, Scalar]) -> Genome:
        """A copy whose domain `name` is replaced by `genes`."""
        data = self.to_dict()
        data[name] = dict(genes)
        return Genome.from_dict(data)

    def with_genes(self, **changes: Scalar) -> Genome:
        """A copy with some genes changed, each kept in the domain it belongs to."""
        data = self.to_dict()
        for gene, value in changes.items():
            home = [d for d in DOMAINS if gene in data[d]]
            if not home:
                raise GenomeError(f"genome has no gene {gene!r}; genes: {sorted(self.values())}")
            data[home[0]][gene] = value
        return Genome.from_dict(data)

    def describe(self) -> str:
        """One line for logs: every gene as name=value, by domain."""
        return " | ".join(
            ", ".join(f"{k}={v}" for k, v in getattr(self, d)) for d in DOMAINS
        )


@dataclass(frozen=True)
class Gene:
    """One named design decision, its legal values (in preference order) and its default."""

    name: str
    domain: str
    values: tuple[Scalar, ...]
    default: Scalar
    doc: str
    # values that trade precision for speed (bfloat16 weights at a float32 preset, int8 weights): an engine with
    # one is judged only under the accuracy contract's budget mode; an exact run's space leaves them out
    lossy: tuple[Scalar, ...] = ()

    def __post_init__(self) -> None:
        if self.domain not in DOMAINS:
            raise ValueError(f"gene {self.name!r}: domain {self.domain!r} not in {DOMAINS}")
        if self.default not in self.values:
            raise ValueError(f"gene {self.name!r}: default {self.default!r} not in {self.values}")
        if not set(self.lossy) <= set(self.values):
            raise ValueError(f"gene {self.name!r}: lossy values {self.lossy} must be among its values {self.values}")


@dataclass(frozen=True)
class CodeGene:
    """A gene whose value is the content hash of a source file (see `evo.core.code`), for a stage the workload
    marks as open. Omitted from a genome, the stage runs its hand-written implementation."""

    name: str
    domain: str
    doc: str

    def __post_init__(self) -> None:
        if self.domain not in DOMAINS:
            raise ValueError(f"code gene {self.name!r}: domain {self.domain!r} not in {DOMAINS}")


@dataclass(frozen=True)
class Constraint:
    """A rule over several genes. `violation` returns a message when the genome breaks it."""

    name: str
    violation: Callable[[Mapping[str, Scalar]], str | None]


@dataclass(frozen=True)
class Ignored:
    """Genes the built engine does not read while `when(values)` holds (e.g. torch-only genes of a genome
    whose engine gene picks another engine). A canonical genome gives them their defaults. `when` should
    read only genes that no rule ignores (an engine choice), so one pass decides."""

    genes: tuple[str, ...]
    when: Callable[[Mapping[str, Scalar]], bool]
    reason: str


@dataclass(frozen=True)
class StagePipeline:
    """Stages that run in order, each on a backend, adjacent ones optionally fused into one function.

    The one place the fused-group rule is written. It generates the genes `backend_<stage>` (values
    `backends`, the first the default) and `fuse_<a>_<b>` for each boundary between adjacent stages
    (a bool, default `fused[i]`), the constraint that the stages of a fused group share one backend,
    and a genome's fused groups (`groups`). Agents read the structure from here, never from names."""

    stages: tuple[str, ...]
    backends: tuple[Scalar, ...]
    fused: tuple[bool, ...] = ()  # default of each boundary's fuse gene; (): none fused
    fuse_docs: tuple[str, ...] = ()  # one per boundary; (): a generic doc
    backend_doc: str = "how the {stage} stage runs"  # formatted with the stage
    domain: str = "fusion"
    constraint_name: str = "fused stages share one backend"

    def __post_init__(self) -> None:
        links = max(len(self.stages) - 1, 0)
        if not self.stages or len(set(self.stages)) != len(self.stages):
            raise ValueError(f"a stage pipeline needs distinct stage names, got {self.stages!r}")
        if not self.backends:
            raise ValueError(f"stage pipeline {self.stages!r}: give at least one backend value")
        for what, given in (("fused", self.fused), ("fuse_docs", self.fuse_docs)):
            if given and len(given) != links:
                raise ValueError(f"stage pipeline {self.stages!r}: {what} has {len(given)} entries, the pipeline "
                                 f"has {links} boundaries (give one per boundary, or none)")
        if self.domain not in DOMAINS:
            raise ValueError(f"stage pipeline {self.stages!r}: domain {self.domain!r} not in {DOMAINS}")

    def backend_gene(self, stage: str) -> str:
        """The name of the gene choosing `stage`'s backend."""
        if stage not in self.stages:
            raise GenomeError(f"unknown stage {stage!r}; stages: {list(self.stages)}")
        return f"backend_{stage}"

    def boundaries(self) -> tuple[tuple[str, str, str], ...]:
        """(fuse gene, left stage, right stage) for each pair of adjacent stages, in pipeline order."""
        return tuple((f"fuse_{a}_{b}", a, b) for a, b in zip(self.stages, self.stages[1:]))

    def gene_names(self) -> tuple[str, ...]:
        """Every gene this pipeline generates: the fuse genes, then the backend genes."""
        return tuple(g for g, _, _ in self.boundaries()) + tuple(self.backend_gene(s) for s in self.stages)

    def fuse_genes(self) -> tuple[Gene, ...]:
        """One bool gene per boundary, its default first among its values."""
        out = []
        for i, (name, a, b) in enumerate(self.boundaries()):
            default = self.fused[i] if self.fused else False
            doc = self.fuse_docs[i] if self.fuse_docs else f"run stages {a} and {b} as one function"
            out.append(Gene(name, self.domain, (default, not default), default, doc))
        return tuple(out)

    def backend_genes(self) -> tuple[Gene, ...]:
        """One gene per stage over `backends`, the first the default."""
        return tuple(Gene(self.backend_gene(s), self.domain, self.backends, self.backends[0],
                          self.backend_doc.format(stage=s)) for s in self.stages)

    def genes(self) -> tuple[Gene, ...]:
        """The fuse genes, then the backend genes."""
        return self.fuse_genes() + self.backend_genes()

    def links(self, values: Mapping[str, Scalar]) -> tuple[bool, ...]:
        """Whether each boundary is fused, from a genome's values."""
        return tuple(values.get(name) is True for name, _, _ in self.boundaries())

    def partition(self, links: Iterable[bool]) -> list[tuple[str, ...]]:
        """Stages grouped by fused boundaries (one flag per boundary), in pipeline order."""
        groups = [[self.stages[0]]]
        for stage, linked in zip(self.stages[1:], links):
            if linked:
                groups[-1].append(stage)
            else:
                groups.append([stage])
        return [tuple(g) for g in groups]

    def groups(self, values: Mapping[str, Scalar]) -> list[tuple[tuple[str, ...], Scalar]]:
        """A genome's fused groups, each with the backend of its first stage (shared, when legal)."""
        return [(g, values.get(self.backend_gene(g[0]))) for g in self.partition(self.links(values))]

    def constraint(self) -> Constraint:
        """The stages of a fused group share one backend (the message names the genes to change)."""
        return Constraint(self.constraint_name, self._same_backend_when_fused)

    def _same_backend_when_fused(self, values: Mapping[str, Scalar]) -> str | None:
        for gene, left, right in self.boundaries():
            lg, rg = self.backend_gene(left), self.backend_gene(right)
            bl, br = values.get(lg), values.get(rg)
            if values.get(gene) is True and bl != br:
                return (f"{gene}=True joins stages {left!r} and {right!r}, but {lg}={bl!r} and {rg}={br!r}; "
                        f"give both one backend or set {gene}=False")
        return None


@dataclass(frozen=True)
class GeneSpace:
    """What is legal for one workload on one device, and which genes each engine ignores."""

    workload: str
    genes: tuple[Gene, ...]
    constraints: tuple[Constraint, ...] = ()
    code_genes: tuple[CodeGene, ...] = ()  # optional genes holding code hashes (absent: hand-written code)
    ignored: tuple[Ignored, ...] = ()  # genes the chosen engine does not read (canonical: their defaults)
    pipeline: StagePipeline | None = None  # the stages whose backend/fuse genes this space holds, if any
    # the genes the workload names as its speed levers, most leverage first (how a step reads the weights, their
    # bytes, steps per exchange, speculation): the `levers` agent sweeps them one value at a time
    levers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = {g.name for g in self.genes}
        unknown_levers = [name for name in self.levers if name not in names]
        if unknown_levers:
            raise ValueError(f"the {self.workload} gene space names levers {unknown_levers} it does not declare; "
                             f"genes: {sorted(names)}")
        for rule in self.ignored:
            unknown = sorted(set(rule.genes) - names)
            if unknown:
                raise ValueError(f"ignored-genes rule {rule.reason!r} names genes {unknown} that the {self.workload} "
                                 f"gene space does not declare; genes: {sorted(names)}")
        if self.pipeline is not None:
            missing = sorted(set(self.pipeline.gene_names()) - names)
            if missing:
                raise ValueError(f"the {self.workload} gene space declares the stage pipeline {self.pipeline.stages} "
                                 f"but not its genes {missing}; add pipeline.genes() to the genes")

    def code_gene_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.code_genes)

    def gene(self, name: str) -> Gene:
        for gene in self.genes:
            if gene.name == name:
                return gene
        raise GenomeError(f"unknown gene {name!r}; genes of {self.workload}: {[g.name for g in self.genes]}")

    def in_domain(self, domain: str) -> tuple[Gene, ...]:
        return tuple(g for g in self.genes if g.domain == domain)

    def default(self) -> Genome:
        return self.make({g.name: g.default for g in self.genes})

    def make(self, values: Mapping[str, Scalar]) -> Genome:
        """A validated, canonical genome from flat gene values; missing genes take their defaults."""
        known = {g.name for g in self.genes} | set(self.code_gene_names())
        unknown = sorted(set(values) - known)
        if unknown:
            raise GenomeError(f"unknown genes {unknown} for workload {self.workload!r}; allowed: {sorted(known)}")
        domains: dict[str, dict[str, Scalar]] = {d: {} for d in DOMAINS}
        for gene in self.genes:
            domains[gene.domain][gene.name] = values.get(gene.name, gene.default)
        for gene in self.code_genes:
            if values.get(gene.name) is not None:
                domains[gene.domain][gene.name] = values[gene.name]
        return self.validate(Genome.from_dict({"workload": self.workload, **domains}))

    def ignored_genes(self, values: Mapping[str, Scalar]) -> frozenset[str]:
        """The genes the engine chosen by `values` does not read (see `Ignored`)."""
        return frozenset(name for rule in self.ignored if rule.when(values) for name in rule.genes)

    def canonical(self, genome: Genome) -> Genome:
        """`genome` with every gene its engine ignores at its default: one genome per engine built.
        Only rewrites; `validate` checks the genome and returns its canonical form."""
        values = genome.values()
        changes = {}
        for name in self.ignored_genes(values):
            default = self.gene(name).default
            if name in values and not _legal(values[name], (default,)):
                changes[name] = default
        return genome.with_genes(**changes) if changes else genome

    def completed(self, genome: Genome) -> Genome:
        """`genome` with each declared gene it lacks at its default: a genome stored before those genes were
        added to its workload (a registered champion, a run's best) builds the engine it built then, because a
        gene is added with the default that keeps the engine as it was. Unknown or illegal genes are left for
        `validate` to refuse."""
        data = genome.to_dict()
        missing = [g for g in self.genes if not any(g.name in data[d] for d in DOMAINS)]
        for gene in missing:
            data[gene.domain][gene.name] = gene.default
        return Genome.from_dict(data) if missing else genome

    def validate(self, genome: Genome) -> Genome:
        """The canonical form of `genome` (see `canonical`) if it is legal, else raise GenomeError saying
        what is wrong. A legal genome that is not canonical (e.g. from a journal written before its genes
        were declared ignored) is canonicalised, not rejected; constraints judge the canonical form."""
        if genome.workload != self.workload:
            raise GenomeError(f"genome is for workload {genome.workload!r}, this gene space is for {self.workload!r}")
        for domain in DOMAINS:
            given = genome.domain(domain)
            declared = {g.name: g for g in self.in_domain(domain)}
            code = {g.name for g in self.code_genes if g.domain == domain}
            for name in given:
                if name in code:
                    if not is_code_hash(given[name]):
                        raise GenomeError(f"code gene {name!r} has value {given[name]!r}; it takes the content hash "
                                          f"of a source (16 lowercase hex digits), or is omitted for the hand-written "
                                          f"implementation")
                elif name not in declared:
                    raise GenomeError(
                        f"unknown gene {name!r} in domain {domain!r}; allowed in {domain}: {sorted(set(declared) | code)}"
                    )
            for name, gene in declared.items():
                if name not in given:
                    raise GenomeError(f"gene {name!r} missing from domain {domain!r}; allowed values: {list(gene.values)}")
                value = given[name]
                if not _legal(value, gene.values):
                    raise GenomeError(
                        f"gene {name!r} has illegal value {value!r}; allowed: {list(gene.values)}"
                    )
        genome = self.canonical(genome)
        values = genome.values()
        for constraint in self.constraints:
            message = constraint.violation(values)
            if message:
                raise GenomeError(f"illegal combination ({constraint.name}): {message}")
        return genome

    def is_legal(self, genome: Genome) -> bool:
        try:
            self.validate(genome)
        except GenomeError:
            return False
        return True

    def sample(self, rng: np.random.Generator, max_tries: int = 1000) -> Genome:
        """A uniformly drawn legal genome (rejection sampling over the declared values), canonical."""
        for _ in range(max_tries):
            values = {g.name: g.values[int(rng.integers(len(g.values)))] for g in self.genes}
            try:
                return self.make(values)
            except GenomeError:
                continue
        raise RuntimeError(f"no legal genome found in {max_tries} draws from the {self.workload} gene space")

    def restrict(self, allowed: Mapping[str, Iterable[Scalar]]) -> GeneSpace:
        """A narrower space: gene -> the subset of its values a run may use (e.g. eager backends only)."""
        genes = {g.name: g for g in self.genes}
        narrowed = []
        for name, values in allowed.items():
            gene = self.gene(name)
            values = tuple(values)
            illegal = [v for v in values if not _legal(v, gene.values)]
            if illegal or not values:
                raise GenomeError(f"cannot restrict gene {name!r} to {list(values)}: allowed values are {list(gene.values)}")
            default = gene.default if _legal(gene.default, values) else values[0]
            narrowed.append(replace(gene, values=values, default=default, lossy=tuple(v for v in gene.lossy if v in values)))
        genes.update({g.name: g for g in narrowed})
        # the same constraints, ignored-genes rules and pipeline: its genomes are canonical here too
        return replace(self, genes=tuple(genes[g.name] for g in self.genes))

    def exact_only(self) -> GeneSpace:
        """The space without lossy values (`Gene.lossy`): what an exact-mode run searches."""
        narrowed = {g.name: [v for v in g.values if v not in g.lossy] for g in self.genes if g.lossy}
        return self.restrict(narrowed) if narrowed else self

    def lossy_values(self, values: Mapping[str, Scalar]) -> dict[str, Scalar]:
        """The genes of `values` set to a lossy value (name -> value)."""
        lossy = {g.name: g.lossy for g in self.genes if g.lossy}
        return {name: value for name, value in values.items() if name in lossy and value in lossy[name]}

    def describe(self) -> list[dict[str, Any]]:
        """The gene table (for docs, configs and logs); `constraint` names the rules that mention the gene."""
        return [
            {"gene": g.name, "domain": g.domain, "values": list(g.values), "default": g.default,
             "constraint": "; ".join(self.constraints_of(g.name)), "doc": g.doc}
            for g in self.genes
        ] + [{"gene": g.name, "domain": g.domain, "values": ["<code hash>"], "default": None,
              "constraint": "; ".join(self.constraints_of(g.name)), "doc": g.doc} for g in self.code_genes]

    def constraints_of(self, gene: str) -> list[str]:
        """The names of the constraints that involve `gene`: the stage pipeline's rule for its genes, and
        every constraint whose name mentions the gene (a rule is a function, so its name is what it says)."""
        names = [c.name for c in self.constraints if re.search(rf"\b{re.escape(gene)}\b", c.name)]
        if self.pipeline is not None and gene in self.pipeline.gene_names():
            names.insert(0, self.pipeline.constraint_name)
        return list(dict.fromkeys(names))


def _legal(value: Any, allowed: Iterable[Scalar]) -> bool:
    # bool is an int in Python: True must not pass for 1, nor 1 for True.
    return any(type(value) is type(a) and value == a for a in allowed)
