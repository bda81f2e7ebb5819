"""Static checks of the import rules (docs/architecture.md, the level table): every module of flexgen_h2o, packages
and top-level modules alike, imports only from its level and below; no two modules import each other, however
indirectly; no module takes another's private names; a function-level import has a reason; the model math never
sees placement or hardware."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "flexgen_h2o"
TOP = "flexgen_h2o"

# level -> the packages and top-level modules on it (TOP: the package's own __init__, which loads names on first
# use). A module imports from its own level and below, at module level or inside a function.
LEVELS = {
    0: {"files", "quant", "formats", "config", "backend"},
    1: {"models", "kernels", "memory"},
    2: {"weights", "kv", "sampling"},
    3: {"planner", "schedule", "hf"},
    4: {"engine", "loader", "metrics", "distributed"},
    5: {"calibrate", "model_probe", "api", "convert"},        # the machine's rates time the engine itself
    6: {"frontends", "eval", "run", TOP},
}

# imports the levels allow but the design does not: part -> parts it must never import
FORBIDDEN = {
    "models": {"backend", "memory", "kernels"},               # the math never sees placement or hardware
    "kernels": {"backend", "memory"},                         # the compiled kernels sit beside the math
    "memory": {"models"},
    "kv": {"memory", "weights"},
    "weights": {"kv"},
    "planner": {"schedule", "hf"},
    "hf": {"memory", "weights", "schedule", "planner"},
    "distributed": {"engine", "hf"},                          # the engine takes a link without importing them
}

# entry points whose import must not load torch: `python -m flexgen_h2o.run --help` and its flag errors stay fast,
# the CLI lists policies before torch loads (kv/registry.py), config.py is plain data. Every module these import
# at module level is torch-free too; such a module may import a torch-loading one inside a function.
TORCH_FREE = ("flexgen_h2o", "flexgen_h2o.run", "flexgen_h2o.frontends.cli", "flexgen_h2o.config",
              "flexgen_h2o.kv.registry")
HEAVY = {"torch", "transformers"}
# optional or heavy packages a function imports where it needs them (setup.py's extras; transformers and its hub)
OPTIONAL = {"transformers", "huggingface_hub", "gguf", "accelerate", "matplotlib", "wonderwords", "rouge_score"}
# other function-level imports, each with its reason: (module, what it imports) -> why
LATE = {
    ("flexgen_h2o.kernels.build", "torch.utils.cpp_extension"): "pulls in setuptools: only a compile needs it",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _owner(module: str) -> str:
    """The level table's name for a module: its package under flexgen_h2o, or the top-level module."""
    return module.split(".")[1] if module != TOP else TOP


LEVEL_OF = {part: level for level, parts in LEVELS.items() for part in parts}


@dataclass(frozen=True)
class Import:
    source: str          # the importing module
    target: str          # a module of flexgen_h2o, or an outside module's dotted name
    line: int
    late: bool           # inside a function
    typing: bool         # under `if TYPE_CHECKING:` (no import at run time)

    @property
    def inside(self) -> bool:
        return self.target == TOP or self.target.startswith(TOP + ".")


def _known(name: str) -> str:
    """The longest prefix of a dotted name that is a module of the package."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


@cache
def _lazy_exports(package: str) -> dict[str, str]:
    """Names a package loads on first use (PEP 562) -> their module: a dict of name -> module, or of submodule ->
    names, at the package's top level."""
    out: dict[str, str] = {}
    for node in ast.parse(MODULES[package].read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                if not isinstance(key, ast.Constant) or not isinstance(key.value, str):
                    continue
                if isinstance(value, ast.Constant) and value.value in MODULES:
                    out[key.value] = value.value
                elif isinstance(value, ast.Tuple) and f"{package}.{key.value}" in MODULES:
                    out.update({e.value: f"{package}.{key.value}" for e in value.elts if isinstance(e, ast.Constant)})
    return out


def _from_targets(module: str, node: ast.ImportFrom) -> list[tuple[str, str]]:
    """(target module, imported name) for each name of a `from X import ...`."""
    if node.level:
        base = module.split(".") if _is_package(module) else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        where = ".".join(base + ([node.module] if node.module else []))
    else:
        where = node.module or ""
    if not (where == TOP or where.startswith(TOP + ".")):
        return [(where, a.name) for a in node.names]
    out = []
    for alias in node.names:
        sub = f"{where}.{alias.name}"
        if sub in MODULES:                                  # a submodule
            out.append((sub, alias.name))
        elif where in MODULES and _is_package(where) and alias.name in _lazy_exports(where):
            out.append((_lazy_exports(where)[alias.name], alias.name))
        else:                                               # a name the module (or package __init__) binds
            out.append((_known(where), alias.name))
    return out


@cache
def imports(module: str) -> tuple[tuple[Import, str | None], ...]:
    """Every import statement's targets in a module, with the name imported (None for `import x`)."""
    found: list[tuple[Import, str | None]] = []

    def visit(node: ast.AST, late: bool, typing: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    name = alias.name
                    target = _known(name) if name == TOP or name.startswith(TOP + ".") else name
                    found.append((Import(module, target, child.lineno, late, typing), None))
            elif isinstance(child, ast.ImportFrom):
                for target, name in _from_targets(module, child):
                    found.append((Import(module, target, child.lineno, late, typing), name))
            inner = late or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            guarded = typing or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            visit(child, inner, guarded)

    visit(ast.parse(MODULES[module].read_text()), False, False)
    return tuple(found)


def _edges(module: str, *, late: bool = True, typing: bool = False) -> set[str]:
    return {i.target for i, _ in imports(module) if i.inside and i.target != module
            and (late or not i.late) and (typing or not i.typing)}


def _where(i: Import) -> str:
    return f"{MODULES[i.source].relative_to(PKG.parent)}:{i.line}"


@cache
def loads(module: str) -> frozenset[str]:
    """Every module importing `module` runs at import time: module-level imports and the packages above each."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parent = m.rpartition(".")[0]
        todo += [p for p in [parent] if p in MODULES] + sorted(_edges(m, late=False))
    return frozenset(seen)


def heavy(target: str) -> bool:
    """Whether importing a module (of the package, or outside it) loads torch or transformers."""
    if target.split(".")[0] in HEAVY:
        return True
    if target not in MODULES:
        return False
    return any(not i.inside and not i.late and not i.typing and i.target.split(".")[0] in HEAVY
               for m in loads(target) for i, _ in imports(m))


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    part.append(m)
                    if m == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_every_module_has_a_level():
    owners = {_owner(m) for m in MODULES}
    assert sorted(owners - set(LEVEL_OF)) == [] and sorted(set(LEVEL_OF) - owners) == []


def test_imports_go_down_the_levels():
    up = [f"{_where(i)}: {_owner(i.source)} (level {LEVEL_OF[_owner(i.source)]}) imports {i.target} "
          f"(level {LEVEL_OF[_owner(i.target)]})"
          for m in MODULES for i, _ in imports(m)
          if i.inside and LEVEL_OF[_owner(i.target)] > LEVEL_OF[_owner(i.source)]]
    assert not up, "\n".join(up)


def test_forbidden_imports():
    bad = [f"{_where(i)}: {i.source} imports {i.target}" for m in MODULES for i, _ in imports(m)
           if i.inside and _owner(i.target) in FORBIDDEN.get(_owner(i.source), ())]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    """Module by module, function-level imports included (a cycle hidden in a function is still a cycle); an
    `if TYPE_CHECKING:` import is for annotations only and runs nothing."""
    cycles = [" <-> ".join(part) for part in _components({m: _edges(m) for m in MODULES})]
    assert not cycles, "\n".join(cycles)


def _module_aliases(module: str) -> dict[str, str]:
    """Local name -> the module of the package it names (`import flexgen_h2o.x as y`, `from flexgen_h2o import x`)."""
    out = {}
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            out.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
        elif isinstance(node, ast.ImportFrom):
            for (target, name), alias in zip(_from_targets(module, node), node.names):
                if target in MODULES and target.endswith("." + name):
                    out[alias.asname or name] = target
    return out


def test_private_names_stay_private():
    """No `from x import _y` and no `x._y` on an imported module: a helper another module needs is public."""
    bad = [f"{_where(i)}: imports {name} from {i.target}" for m in MODULES for i, name in imports(m)
           if i.inside and name and name.startswith("_") and not name.startswith("__")]
    for m in MODULES:
        aliases = _module_aliases(m)
        for node in ast.walk(ast.parse(MODULES[m].read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = aliases.get(ast.unparse(node.value), ast.unparse(node.value))
                if owner in MODULES and owner != m:
                    bad.append(f"{MODULES[m].relative_to(PKG.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_the_torch_free_entry_points_load_no_torch():
    assert [m for m in TORCH_FREE if heavy(m)] == []


def test_function_level_imports_have_a_reason():
    """A function imports late only an optional package, a torch-loading module from a torch-free one
    (TORCH_FREE), or what LATE names with its reason; anything else goes at the top of the module, where the
    import graph (and these tests) can see it."""
    torch_free = set().union(*(loads(m) for m in TORCH_FREE))

    def excused(i: Import) -> bool:
        return ((not i.inside and i.target.split(".")[0] in OPTIONAL)
                or (i.source in torch_free and heavy(i.target))
                or any(i.source == s and (i.target == t or i.target.startswith(t + ".")) for s, t in LATE))

    hidden: dict[str, list[str]] = {}
    for m in MODULES:
        for i, name in imports(m):
            if i.late and not excused(i):
                hidden.setdefault(f"{_where(i)}: {i.target}", []).append(name or "")
    lines = [where + (f" ({', '.join(filter(None, names))})" if any(names) else "") for where, names in hidden.items()]
    assert not lines, "\n".join(lines)


def test_zigzag_is_pure_python():
    assert [i.target for i, _ in imports("flexgen_h2o.schedule.zigzag")
            if i.inside or i.target.split(".")[0] in HEAVY] == []


def test_files_stay_small():
    too_long = [f"{p.relative_to(PKG)}: {n}" for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400]
    assert not too_long, too_long


def test_the_api_and_the_library_do_not_import_a_front_end():
    """Front ends (frontends/, run.py) sit on the library; the library's block loop is schedule/blocks.py."""
    for module in ("flexgen_h2o.api", "flexgen_h2o.engine"):
        assert [t for t in _edges(module, typing=True) if _owner(t) in ("frontends", "run")] == []


def test_the_environment_switches_of_the_kernels_are_read_in_one_place():
    """kernels.resolve() reads FLEXGEN_H2O_FUSED_* and FLEXGEN_H2O_CPU_GEMM once per engine: no module of the
    math or the caches reads the environment (a switch flipped mid-run once mixed paths within a step)."""
    files = [p for folder in ("models", "kv", "schedule") for p in (PKG / folder).rglob("*.py")]
    readers = [str(p.relative_to(PKG)) for p in files if "os.environ" in p.read_text() or "getenv" in p.read_text()]
    assert readers == []
