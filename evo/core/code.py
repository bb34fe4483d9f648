"""Engine code as genome values: open stages, a content-addressed store, and checks before anything runs.

A workload may mark some stage implementations as *open* (`OpenStage`): a genome's code gene for such
a stage holds the content hash of a source file (`code_hash`), and that source replaces the
hand-written implementation. The source lives in a `CodeStore` (a folder of `<hash>.py` files in the
run directory); genomes stay small and hashable, and equal code dedupes to one hash.

`check_source` is the workload-independent part of the validation, done by the agent before it
submits and by the judge before an engine process sees the code: the source compiles (Python's
`compile`, which runs nothing), imports only the allow-list, names none of the builtins that load or
run other code nor the attributes that walk to other code's internals, and defines the declared entry
point with the declared parameters at top level. **This filter is a fast, readable early rejection of
obviously forbidden code, not a boundary**: Python offers many other paths to the same places (e.g.
`torch.os`, `torch.sys`, `torch.save` pass it), so code that passes may still do anything the process
it runs in can do. The boundary is the process: code genes run only inside a judge's confined engine
process (`evaluators.sandbox.jail`: no privileges, an allow-list view of the files, no network), in the
search, a benchmark and Serve alike.
`load_module` turns a checked source into a module and refuses to run anywhere but in such a process
(`allow_engine_code`, called there before the build); tests of the project's own seed sources opt in
with `trusted_code()`.

This module imports neither torch nor Ray nor MLflow.
"""
from __future__ import annotations

import ast
import hashlib
import linecache
import os
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Mapping

HASH_LENGTH = 16
_HASH = re.compile(rf"[0-9a-f]{{{HASH_LENGTH}}}")
ALLOWED_IMPORTS: tuple[str, ...] = ("torch", "triton", "math", "numpy")
# Builtins that load, run or reach outside code; the engine process is the boundary, this is the early word.
FORBIDDEN_NAMES: tuple[str, ...] = ("__import__", "exec", "eval", "compile", "open", "breakpoint", "input",
                                    "globals", "vars", "__builtins__", "__loader__", "__spec__")
# Attributes that walk from any object to every class, frame or module global (the usual sandbox escapes).
FORBIDDEN_ATTRIBUTES: tuple[str, ...] = ("__subclasses__", "__globals__", "__code__", "__closure__", "__mro__",
                                         "__bases__", "__base__", "__dict__", "__getattribute__", "__reduce__",
                                         "__reduce_ex__", "f_globals", "f_locals", "f_back", "f_builtins",
                                         "gi_frame", "tb_frame", "cr_frame")
MAX_SOURCE_BYTES = 200_000
START_MARK = "# EVOLVE-BLOCK-START"
END_MARK = "# EVOLVE-BLOCK-END"


class CodeError(ValueError):
    """Source that may not run: the message names what is wrong and what is allowed."""


def code_hash(source: str) -> str:
    """The identity of a source: the first 16 hex digits of the SHA-256 of its UTF-8 text."""
    return hashlib.sha256(source.encode()).hexdigest()[:HASH_LENGTH]


def is_code_hash(value: object) -> bool:
    return isinstance(value, str) and _HASH.fullmatch(value) is not None


@dataclass(frozen=True)
class OpenStage:
    """A stage whose implementation a genome may replace with source code.

    `gene` is the genome gene holding the code hash; `entry` the function the source must define, with
    exactly the parameter names `params`; `also_defines` names further top-level functions or constants
    the engine reads from the module (e.g. the other kernels of a Triton source); `seed` returns the
    hand-written implementation as a self-contained source (the starting point of every code lineage)."""

    gene: str
    stage: str
    entry: str
    params: tuple[str, ...]
    language: str  # "torch" or "triton": what the source is written against
    doc: str
    seed: Callable[[], str]
    allowed_imports: tuple[str, ...] = ALLOWED_IMPORTS
    also_defines: tuple[str, ...] = ()

    def signature(self) -> str:
        return f"def {self.entry}({', '.join(self.params)})"


def check_source(source: str, stage: OpenStage) -> None:
    """Raise CodeError unless `source` may be built for `stage` (nothing of it is run here)."""
    if not isinstance(source, str):
        raise CodeError(f"source for {stage.gene} must be text, got {type(source).__name__}")
    if len(source.encode()) > MAX_SOURCE_BYTES:
        raise CodeError(f"source for {stage.gene} is {len(source.encode())} bytes; at most {MAX_SOURCE_BYTES} allowed")
    try:
        tree = ast.parse(source, filename=f"<{stage.gene}>")
        compile(tree, f"<{stage.gene}>", "exec")
    except SyntaxError as exc:
        raise CodeError(f"source for {stage.gene} does not compile: {exc.msg} at line {exc.lineno}: "
                        f"{(exc.text or '').strip()!r}") from exc
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise CodeError(f"line {node.lineno}: relative import 'from {'.' * node.level}{node.module or ''}' "
                                f"is not allowed; import only {list(stage.allowed_imports)}")
            modules = [node.module or ""]
        else:
            modules = []
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in FORBIDDEN_NAMES:
                raise CodeError(f"line {node.lineno}: {name!r} is not allowed in engine code (it loads or runs "
                                f"other code); forbidden names: {list(FORBIDDEN_NAMES)}")
            if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
                raise CodeError(f"line {node.lineno}: attribute {node.attr!r} is not allowed in engine code (it "
                                f"reaches other code's internals); forbidden attributes: {list(FORBIDDEN_ATTRIBUTES)}")
        for module in modules:
            if module.split(".")[0] not in stage.allowed_imports and module != "__future__":
                raise CodeError(f"line {node.lineno}: import of {module!r} is not allowed; engine code may import "
                                f"only {list(stage.allowed_imports)} (and their submodules)")
    entries = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == stage.entry]
    if not entries:
        raise CodeError(f"source for {stage.gene} must define the entry point {stage.signature()} at top level; "
                        f"found top-level functions {[n.name for n in tree.body if isinstance(n, ast.FunctionDef)]}")
    entry = entries[-1]
    args = entry.args
    params = tuple(a.arg for a in (*args.posonlyargs, *args.args))
    if isinstance(entry, ast.AsyncFunctionDef) or params != stage.params or args.vararg or args.kwarg \
            or args.kwonlyargs:
        raise CodeError(f"entry point {stage.entry} of {stage.gene} must be {stage.signature()}; "
                        f"found def {stage.entry}({ast.unparse(args)})")
    missing = [name for name in stage.also_defines if name not in _top_level_names(tree)]
    if missing:
        raise CodeError(f"source for {stage.gene} must also define {missing} at top level (the engine reads "
                        f"{list(stage.also_defines)} besides {stage.entry})")


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at top level by def, class or plain assignment."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def check_sources(genome_values: Mapping[str, object], sources: Mapping[str, str],
                  stages: Iterable[OpenStage]) -> dict[str, str]:
    """For every open stage a genome sets: its source, present, matching its hash and checked.
    Returns {gene: source}; raises CodeError naming the gene when any is missing or bad."""
    chosen = {}
    for stage in stages:
        digest = genome_values.get(stage.gene)
        if digest is None:
            continue
        source = sources.get(digest)
        if source is None:
            raise CodeError(f"gene {stage.gene}={digest}: no source with that hash was given; "
                            f"sources given: {sorted(sources)}")
        if code_hash(source) != digest:
            raise CodeError(f"gene {stage.gene}={digest}: the source given hashes to {code_hash(source)}")
        try:
            check_source(source, stage)
        except CodeError as exc:
            raise CodeError(f"gene {stage.gene}={digest}: {exc}") from exc
        chosen[stage.gene] = source
    return chosen


_engine_code_allowed = False  # set in an engine's confined process only (evaluators.sandbox.engine_process)
MODULE_PREFIX = "evo_code_"  # the sys.modules names of loaded code genes


def engine_code_allowed() -> bool:
    """Whether this process may run a genome's code (an engine's confined process, or a trusted_code block)."""
    return _engine_code_allowed


def allow_engine_code() -> None:
    """Mark this process as an engine's confined process: `load_module` may run code genes here."""
    global _engine_code_allowed
    _engine_code_allowed = True


@contextmanager
def trusted_code() -> Iterator[None]:
    """Let `load_module` run in this process for the block: for tests of the project's own seed sources,
    which are not engine code an agent wrote."""
    global _engine_code_allowed
    before, _engine_code_allowed = _engine_code_allowed, True
    try:
        yield
    finally:
        _engine_code_allowed = before


def load_module(source: str, stage: OpenStage) -> types.ModuleType:
    """Execute a checked source as a module and return it (engine processes only: CodeError elsewhere).
    The source is put in linecache under a stable name, so tracebacks, `inspect.getsource` and Triton's
    JIT can read it."""
    if not _engine_code_allowed:
        raise CodeError(f"load_module refuses to run the code gene {stage.gene} in this process (pid {os.getpid()}):"
                        " a genome's code runs only inside a judge's confined engine process"
                        " (evaluators.sandbox.engine_process), where the search, benchmarks and Serve build engines")
    check_source(source, stage)
    name = f"{MODULE_PREFIX}{stage.stage}_{code_hash(source)}"
    filename = f"<evo-code {stage.gene} {code_hash(source)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    # registered before it runs: torch.compile and @dataclass look a function's module up by name
    module = sys.modules.setdefault(name, module)
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - the isolated engine process
    return module


def marked_blocks(source: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the text between each START_MARK line and its END_MARK line."""
    blocks, start = [], None
    offset = 0
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        if stripped == START_MARK and start is None:
            start = offset + len(line)
        elif stripped == END_MARK and start is not None:
            blocks.append((start, offset))
            start = None
        offset += len(line)
    return blocks


class CodeStore:
    """Sources by content hash, one `<hash>.py` file each under `root` (written once, atomically)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, digest: str) -> Path:
        if not is_code_hash(digest):
            raise CodeError(f"{digest!r} is not a code hash ({HASH_LENGTH} lowercase hex digits)")
        return self.root / f"{digest}.py"

    def put(self, source: str) -> str:
        digest = code_hash(source)
        path = self.path(digest)
        if not path.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(source)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        return digest

    def get(self, digest: str) -> str:
        path = self.path(digest)
        try:
            source = path.read_text()
        except FileNotFoundError as exc:
            raise CodeError(f"no source {digest} in the code store {self.root}") from exc
        if code_hash(source) != digest:
            raise CodeError(f"{path} is damaged: its text hashes to {code_hash(source)}")
        return source

    def has(self, digest: str) -> bool:
        return is_code_hash(digest) and self.path(digest).exists()

    def sources_for(self, genome_values: Mapping[str, object], code_genes: Iterable[str]) -> dict[str, str]:
        """{hash: source} for every code gene the genome sets (CodeError when one is not stored)."""
        return {v: self.get(v) for g in code_genes if is_code_hash(v := genome_values.get(g))}
