"""The guards on forbidden functions, exercised in a child process (a guard is never taken down, so
it must not be installed in the test process itself)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, functools
    from evo.workloads.kda import WORKLOAD as kda, baselines, reference
    from evo.workloads.kda.reference import reference as bound_before        # an alias taken early
    from evaluators.sandbox.guard import ForbiddenCall, forbidden_targets, install_guards

    keep = {"method": kda.reference, "partial": functools.partial(baselines.chunk_pairwise, chunk_size=16)}
    calls = []
    install_guards(forbidden_targets(kda), calls.append)

    tried = {}
    for name, fn in {"alias": lambda: bound_before({}), "method": lambda: keep["method"]({}),
                     "class": lambda: type(kda).reference(kda, {}), "module": lambda: reference.recurrent_kda({}, None),
                     "partial": lambda: keep["partial"](None, None, None, None, None)}.items():
        try:
            fn()
            tried[name] = "ran"
        except ForbiddenCall as exc:
            tried[name] = str(exc)
    print(json.dumps({"tried": tried, "calls": calls}))
""")


def test_guards_cover_the_function_objects_wherever_they_are_reached_from():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(v.startswith("engine called") for v in seen["tried"].values()), seen
    assert len(seen["calls"]) == len(seen["tried"])  # each call reported before the error was raised
    assert "evo.workloads.kda.baselines.chunk_pairwise" in seen["calls"]
