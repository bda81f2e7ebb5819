"""Static checks of the import rules (LAYOUT.md §8.3): the model math never sees placement or hardware."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "flexgen_h2o"

# package -> packages of flexgen_h2o it must never import
FORBIDDEN = {
    "models": {"memory", "backend", "kv", "weights", "schedule", "engine", "run", "loader", "kernels"},
    # the compiled kernels sit beside the math: they call models/ops.py's reference, and nothing that places
    "kernels": {"memory", "backend", "kv", "weights", "schedule", "planner", "engine", "run", "loader", "frontends"},
    "memory": {"models", "kv", "weights", "schedule", "engine", "run", "loader"},
    "kv": {"memory", "weights", "schedule", "engine", "run", "loader"},
    "weights": {"kv", "schedule", "engine", "run"},
    "schedule": {"engine", "run", "loader"},
    "backend": {"models", "memory", "kv", "weights", "schedule", "engine", "run"},
    "planner": {"schedule", "engine", "run", "frontends", "hf", "eval"},
    "hf": {"memory", "weights", "schedule", "engine", "run", "frontends", "eval", "planner"},
    # torchrun's world, shares and pipeline links; the engine takes a link without importing them
    "distributed": {"engine", "run", "frontends", "eval", "hf"},
}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flexgen_h2o."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("flexgen_h2o.")}
    return found


def test_import_rules():
    violations = []
    for package, banned in FORBIDDEN.items():
        for path in (PKG / package).rglob("*.py"):
            bad = _imports(path) & banned
            if bad:
                violations.append(f"{path.relative_to(PKG)} imports {sorted(bad)}")
    assert not violations, violations


def test_zigzag_is_pure_python():
    assert _imports(PKG / "schedule" / "zigzag.py") == set()
    assert "import torch" not in (PKG / "schedule" / "zigzag.py").read_text()


def test_files_stay_small():
    too_long = [f"{p.relative_to(PKG)}: {n}" for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400]
    assert not too_long, too_long


def test_the_api_and_the_library_do_not_import_a_front_end():
    """Front ends (frontends/, run.py) sit on the library; the library's block loop is schedule/blocks.py."""
    assert "frontends" not in _imports(PKG / "api.py")
    assert "frontends" not in _imports(PKG / "engine.py")


def test_the_environment_switches_of_the_kernels_are_read_in_one_place():
    """kernels.resolve() reads FLEXGEN_H2O_FUSED_* and FLEXGEN_H2O_CPU_GEMM once per engine: no module of the
    math or the caches reads the environment (a switch flipped mid-run once mixed paths within a step)."""
    files = [p for folder in ("models", "kv", "schedule") for p in (PKG / folder).rglob("*.py")]
    readers = [str(p.relative_to(PKG)) for p in files if "os.environ" in p.read_text() or "getenv" in p.read_text()]
    assert readers == []
