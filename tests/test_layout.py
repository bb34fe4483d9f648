"""The package's import graph, read from the source with `ast`: no cycle, and data flows one way.

Layers, lowest first; a module may import its own layer and the layers below it, never above. The
core also imports neither Ray nor MLflow, and no workload imports Ray, MLflow or the layers above.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("evo", "operators", "evaluators")

# (layer name, module prefixes in it), lowest first
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("evo.core",)),
    ("workloads", ("evo.workloads",)),
    ("operators", ("operators",)),
    # the judge's rooms (evaluators/): the sandbox knows nothing of judges, served twins and the pool are peers
    ("evaluators.settings", ("evaluators", "evaluators.settings")),
    ("evaluators.machine", ("evaluators.machine",)),
    ("evaluators.sandbox", ("evaluators.sandbox",)),
    ("evaluators.judge", ("evaluators.judge",)),
    ("evaluators.served", ("evaluators.served",)),
    ("evaluators.pool", ("evaluators.pool",)),
    ("evidence", ("evo.evidence",)),
    ("driver", ("evo.driver",)),
    ("serving", ("evo.serving",)),
    ("bench", ("evo.bench",)),
    ("entry", ("evo.cli", "evo.__main__", "evo.registry", "evo")),
)
# third-party modules a layer must not import
EVALUATOR_ROOMS = tuple(layer for layer, _ in LAYERS if layer.startswith("evaluators."))
FORBIDDEN_THIRD_PARTY = {"core": ("ray", "mlflow"), "workloads": ("ray", "mlflow"), "operators": ("mlflow",),
                         **{room: ("mlflow",) if room == "evaluators.pool" else ("ray", "mlflow")
                            for room in EVALUATOR_ROOMS}}
# operators and evaluators are peers: neither imports the other; nor do the served twins and the Ray pool
PEERS = {*((a, b) for room in EVALUATOR_ROOMS for a, b in (("operators", room), (room, "operators"))),
         ("evaluators.served", "evaluators.pool"), ("evaluators.pool", "evaluators.served")}


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def imports_of(name: str, path: Path) -> set[str]:
    """Every module name `path` imports (absolute, relative resolved; `from a import b` also yields a.b)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    graph = {}
    for name, path in files.items():
        graph[name] = {m for m in imports_of(name, path) if m in files and m != name}
        graph[name] -= {m for m in graph[name] if name.startswith(m + ".")}  # a package's own __init__
    return graph


def layer_of(module: str) -> str:
    best = max(((len(p), layer) for layer, prefixes in LAYERS for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"module {module} belongs to no layer; add it to LAYERS in {__file__}"
    return best[1]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_flow_down_the_layers():
    order = {layer: i for i, (layer, _) in enumerate(LAYERS)}
    broken = []
    for module, deps in import_graph().items():
        mine = layer_of(module)
        for dep in deps:
            theirs = layer_of(dep)
            if order[theirs] > order[mine] or (mine, theirs) in PEERS:
                broken.append(f"{module} ({mine}) imports {dep} ({theirs})")
    assert not broken, "imports against the layering:\n" + "\n".join(sorted(broken))


def test_the_core_and_workloads_import_neither_ray_nor_mlflow():
    files = module_files()
    broken = []
    for module, path in files.items():
        banned = FORBIDDEN_THIRD_PARTY.get(layer_of(module), ())
        for name in imports_of(module, path):
            if name.split(".")[0] in banned:
                broken.append(f"{module} imports {name}")
    assert not broken, "\n".join(sorted(broken))


def test_the_checker_sees_a_cycle_and_a_layer_break():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert layer_of("evo.core.search") == "core" and layer_of("evo.serving.app") == "serving"
    assert layer_of("evo.cli") == "entry"


def test_no_workload_is_named_outside_its_folder():
    """`grep -rni kda` over evo/ outside evo/workloads/, evaluators/ and operators/ finds nothing."""
    listed = sorted(p.relative_to(ROOT).as_posix() for package in PACKAGES for p in (ROOT / package).rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts)
    hits = []
    for rel in listed:
        if rel.startswith("evo/workloads/"):
            continue
        for number, line in enumerate((ROOT / rel).read_text(errors="replace").splitlines(), 1):
            if re.search(r"kda", line, re.IGNORECASE):
                hits.append(f"{rel}:{number}: {line.strip()}")
    if hits:
        pytest.fail("a workload's name outside evo/workloads/:\n" + "\n".join(hits))


@pytest.mark.parametrize("room", [layer.split(".")[1] for layer in EVALUATOR_ROOMS if layer != "evaluators.settings"])
def test_each_room_of_the_judge_offers_what_its_face_says(room):
    import importlib

    face = importlib.import_module(f"evaluators.{room}")
    assert face.__doc__ and face.OFFERS
    for name in face.OFFERS:
        assert getattr(face, name) is not None, f"evaluators.{room} offers {name}"
    with pytest.raises(AttributeError, match="offers"):
        getattr(face, "not_offered")
