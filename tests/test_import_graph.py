"""The package's import graph, .pyx and .pxd included: no cycles, and no import up the layers.

Every import counts, also those inside functions and under TYPE_CHECKING: a lazy import hides a knot
from Python, not from a reader."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagegate"

# What each part may import (besides itself). The key is the longest matching prefix of a module's name.
ALLOWED: dict[str, tuple[str, ...]] = {
    "pagegate": (),
    "pagegate.config": (),
    "pagegate.core": (),
    "pagegate.kernels": (),
    "pagegate.engine": ("pagegate.config", "pagegate.core", "pagegate.kernels"),
    "pagegate.gateway": ("pagegate.config", "pagegate.engine", "pagegate.core.page_map", "pagegate.core.stats"),
    "pagegate.clients": ("pagegate.gateway.proto",),
    "pagegate.deploy": ("pagegate.config", "pagegate.gateway"),
    "pagegate.testing": ("pagegate.config", "pagegate.core"),
    # the command line: serve (its first engine core started before the gateway's imports), simulate
    "pagegate.__main__": ("pagegate.gateway", "pagegate.core", "pagegate.engine.serving.core_spawn"),
}
# The engine's rooms sit below its loop: nothing in a room imports the loop or the modules that drive it.
ROOMS = ("pagegate.engine.loading", "pagegate.engine.sampling", "pagegate.engine.observe", "pagegate.engine.models",
         "pagegate.engine.kv_tiers", "pagegate.engine.lora")
LOOP = ("pagegate.engine.engine", "pagegate.engine.llm", "pagegate.engine.runner", "pagegate.engine.intake",
        "pagegate.engine.postprocess", "pagegate.engine.scheduler", "pagegate.engine.tp_workers",
        "pagegate.engine.forward", "pagegate.engine.memory.pool", "pagegate.engine.memory.elastic_pages",
        "pagegate.engine.serving.core_process", "pagegate.engine.serving.core_loop")
# the only importers of engine.py
ENGINE_FRONT = ("pagegate.engine.llm", "pagegate.engine.serving.core_loop")
# what the serving room reaches only through Engine's public face (and its `memory`), never by name or attribute
ENGINE_PARTS = ("pagegate.engine.runner", "pagegate.engine.runners", "pagegate.engine.encoder_runner",
                "pagegate.engine.scheduler")
REACHED_ATTRIBUTES = ("runner", "scheduler")

_CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\s|c?import\s+([\w.]+))", re.M)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> list[Path]:
    return sorted(p for ext in ("py", "pyx", "pxd") for p in PACKAGE.rglob(f"*.{ext}"))


def imported_names(path: Path) -> set[tuple[str, str]]:
    """(module, name) of each imported name: `import a.b` gives ("a.b", ""), `from a import b` ("a", "b")."""
    text = path.read_text()
    if path.suffix != ".py":
        names = {(m.group(2), "") for m in _CYTHON_IMPORT.finditer(text) if m.group(2)}
        froms = re.finditer(r"^\s*from\s+([\w.]+)\s+c?import\s+\(?([\w\s,]+)", text, re.M)
        return names | {(m.group(1), n.strip()) for m in froms for n in m.group(2).split(",") if n.strip()}
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names |= {(alias.name, "") for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names |= {(base, alias.name) for alias in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the pagegate modules it imports."""
    files = source_files()
    modules = {module_name(p) for p in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in files:
        name = module_name(path)
        for base, item in imported_names(path):
            target = f"{base}.{item}" if f"{base}.{item}" in modules else base  # a submodule, else a name in base
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer_of(name: str) -> str:
    return max((key for key in ALLOWED if _within(name, (key,))), key=len)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        layer = layer_of(module)
        for target in sorted(targets):
            if target != "pagegate" and not _within(target, (layer, *ALLOWED[layer])):  # the root: version, lazy names
                found.append(f"{module} -> {target}")
            if _within(module, ROOMS) and _within(target, LOOP):
                found.append(f"{module} -> {target} (a room importing the loop)")
            if target == "pagegate.engine.engine" and module not in ENGINE_FRONT:
                found.append(f"{module} -> {target} (only the engine's faces import engine.py)")
    return found


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "pagegate.core.block_pool" in graph["pagegate.core.block_tables"]  # a .pyx cimport
    assert "pagegate.engine.sampling.structured" in graph["pagegate.engine.sampling.params"]  # TYPE_CHECKING
    assert "pagegate.engine.engine" in graph["pagegate.engine.serving.core_loop"]
    assert "pagegate.engine.serving.core_loop" in graph["pagegate.engine.serving.core_process"]  # inside a function
    assert len(graph) > 100


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_checks_catch_a_cycle_and_an_upward_import():
    graph = {"pagegate.core.a": {"pagegate.core.b"}, "pagegate.core.b": {"pagegate.core.a", "pagegate.engine.x"},
             "pagegate.engine.x": set(), "pagegate.engine.sampling.s": {"pagegate.engine.runner"},
             "pagegate.engine.runner": set()}
    assert cycles(graph) == [["pagegate.core.a", "pagegate.core.b"]]
    assert upward_imports(graph) == ["pagegate.core.b -> pagegate.engine.x",
                                     "pagegate.engine.sampling.s -> pagegate.engine.runner (a room importing the loop)"]


def test_no_upward_imports():
    assert upward_imports(import_graph()) == []


def test_the_gateway_never_imports_the_engine_loop():
    """The engine loop runs in the core process; the gateway reaches it only through the serving room (its clients and frames)."""
    graph = import_graph()
    reached = [f"{module} -> {target}" for module, targets in sorted(graph.items())
               if _within(module, ("pagegate.gateway",)) for target in sorted(targets) if _within(target, LOOP)]
    # under torchrun a rank > 0 process runs `pagegate serve` too, and becomes a worker, never a gateway
    assert reached == ["pagegate.gateway.cli -> pagegate.engine.tp_workers"]


def test_the_core_frames_stay_in_the_serving_room():
    """Both halves of the engine-core seam live in pagegate.engine.serving; only they speak its frames."""
    graph = import_graph()
    speakers = sorted(module for module, targets in graph.items() if "pagegate.engine.serving.frames" in targets)
    assert speakers and all(_within(module, ("pagegate.engine.serving",)) for module in speakers), speakers
    room = [module for module in graph if _within(module, ("pagegate.engine.serving",))]
    assert not [f"{module} -> {target}" for module in room for target in graph[module]
                if _within(target, ("pagegate.gateway",))]
    # each rule is checked once a side, by the gateway's prepare and admission and the engine's intake: never
    # again on the way between them
    assert not [module for module in room if "pagegate.engine.limits" in graph[module]]


def engine_part_classes() -> set[str]:
    """The classes defined in the engine's parts (ENGINE_PARTS) and its memory package."""
    paths = [PACKAGE.parent / (module.replace(".", "/") + ".py") for module in ENGINE_PARTS]
    paths += sorted((PACKAGE / "engine" / "memory").glob("*.py"))
    return {node.name for path in paths for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)}


def engine_reaches(source: str, classes: set[str]) -> list[str]:
    """Where `source` reaches past Engine's public face: an `x.runner` / `x.scheduler` attribute, or an `isinstance`
    that asks whether something is one of `classes` (line: what)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in REACHED_ATTRIBUTES:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} if len(node.args) > 1 else set()
            found += [(node.lineno, f"isinstance(..., {name})") for name in sorted(named & classes)]
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_the_checks_catch_a_reach_into_the_engine():
    source = ("def f(engine, runner):\n    engine.runner.lora.install()\n    assert isinstance(runner, ModelRunner)\n"
              "    return engine.scheduler.pool, isinstance(runner, (int, str)), engine.memory.limit\n")
    assert engine_reaches(source, {"ModelRunner"}) == ["2: .runner", "3: isinstance(..., ModelRunner)",
                                                       "4: .scheduler"]


def test_the_serving_room_uses_only_the_engines_public_face():
    """The core process turns frames into calls on Engine (and its memory: pagegate.engine.memory); it names no
    runner or scheduler class, reaches no `.runner` / `.scheduler` and asks no `isinstance` of the engine's parts."""
    graph = import_graph()
    room = sorted(module for module in graph if _within(module, ("pagegate.engine.serving",)))
    assert not [f"{module} -> {target}" for module in room for target in sorted(graph[module])
                if _within(target, ENGINE_PARTS)]
    classes = engine_part_classes()
    assert {"ModelRunner", "EncoderRunner", "Scheduler", "KVPool"} <= classes
    reaches = [f"{path.name}:{reach}" for path in sorted((PACKAGE / "engine" / "serving").glob("*.py"))
               for reach in engine_reaches(path.read_text(), classes)]
    assert reaches == []


def test_the_gateway_process_never_imports_torch():
    """So it never starts an OpenMP thread team of its own (one owner of every thread: the core)."""
    code = ("import sys, pagegate.gateway.cli, pagegate.engine.serving.core_client, pagegate.engine.serving.replicas; "
            "print(sorted(m for m in ('torch', 'pagegate.engine.engine') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_no_private_names_cross_modules():
    """`from a import _b` reaches into a's privates (grpc_server once took routes_api._model_card)."""
    modules = {module_name(p) for p in source_files()}
    private = [f"{module_name(path)} <- {base}.{item}" for path in source_files()
               for base, item in imported_names(path)
               if base.startswith("pagegate") and item.startswith("_") and f"{base}.{item}" not in modules]
    assert private == []


def test_engine_py_is_small():
    """The loop keeps add/abort/step/sample/fork/finish and stats, and one line into memory/ for each of sleep, wake,
    resize and adapters in and out; the rest lives in its rooms."""
    path = PACKAGE / "engine" / "engine.py"
    assert len(path.read_text().splitlines()) <= 230
    assert len(import_graph()["pagegate.engine.engine"]) <= 11
