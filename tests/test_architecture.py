"""The package map of docs/architecture.md holds: every import runs downwards in
:data:`LAYERS` (or stays in its package), no module imports itself back through others,
and the package root holds only the bottom layer and the entry point."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "mlperf_grpo"

LAYERS = ["cli", "train", "evaluate", "agent", "inference", "checkpoint", "tasks", "model", "logs", "plan", "config",
          "sandbox", "<root>"]
"""Top to bottom, as docs/architecture.md draws them."""

ROOT_MODULES = {"__init__", "rules", "errors", "environment", "step_dirs", "graceful_stop", "torchrun"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(("mlperf_grpo",) + (parts[:-1] if parts[-1] == "__init__" else parts))
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (module level and inside functions)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("mlperf_grpo"):
                found.add(target)
                break
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1] if len(parts) > 2 or parts[1] in LAYERS else "<root>") if len(parts) > 1 else len(LAYERS) - 1


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_imports_run_downwards():
    upward = [f"{a} -> {b}" for a, targets in _graph().items() for b in targets if _layer(b) < _layer(a)]
    assert not upward, "\n".join(sorted(upward))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_back():
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_root_holds_the_bottom_layer_and_the_entry_point_only():
    root = {p.stem for p in SRC.glob("*.py")}
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert root == ROOT_MODULES
    assert packages == set(LAYERS) - {"<root>"}


def test_files_and_functions_stay_readable():
    """No file over 450 lines, no function over 80, none with 9 or more parameters."""
    problems = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 450:
            problems.append(f"{path.relative_to(SRC)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                a = node.args
                count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                if length > 80:
                    problems.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {length} lines")
                if count >= 9:
                    problems.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {count} parameters")
    assert not problems, "\n".join(sorted(problems))
