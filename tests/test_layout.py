"""The package layout keeps the data flow readable (docs/design.md): every import points down the layers of
the design note's table, no import circles, few modules loose at the package root, the run directory's
contract (``trainmon.run``) independent of everything else, and the TensorBoard plugin reading runs only
through ``trainmon.run`` and ``trainmon.read`` (without torch)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = {"trainmon": ROOT / "trainmon", "trainmon_tb": ROOT / "tb_plugin" / "trainmon_tb"}
# the modules a reader meets first; everything else lives in a folder named after its stage
ROOT_MODULES = {"__init__", "__main__", "monitor", "device", "demo", "rundir"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """Every module ``module`` imports, at module level or inside functions: ``from package import name``
    imports the submodule ``package.name`` when there is one (a native extension counts), else ``package``.
    Imports under ``if TYPE_CHECKING:`` are left out: they never run."""
    out: set[str] = set()

    def is_module(name: str) -> bool:
        if name in modules:
            return True
        package, _, leaf = name.rpartition(".")
        folder = PACKAGES.get(package.split(".")[0])
        if folder is None:
            return False
        where = folder.joinpath(*package.split(".")[1:])
        return any(where.glob(f"{leaf}.c")) or any(where.glob(f"{leaf}.*.so"))

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                out.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    out.add(sub if is_module(sub) else base)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = _imports(path, name, path.name == "__init__.py", set(modules))
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def design_layers(text: str | None = None) -> list[tuple[str, ...]]:
    """The rows of the design note's table of folders, top to bottom: the paths each row names
    (``trainmon/config/`` a folder, ``trainmon/monitor.py`` a module)."""
    text = DESIGN.read_text(encoding="utf-8") if text is None else text
    section = text.split("## The folders, in layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [tuple(re.findall(r"`([^`]+)`", row.split(" | ", 1)[0])) for row in rows]


def _path_of(module: str) -> str:
    """``trainmon.config.schema`` -> ``trainmon/config/schema.py``; the plugin's modules under tb_plugin/."""
    parts = module.split(".")
    top = "tb_plugin/trainmon_tb" if parts[0] == "trainmon_tb" else "trainmon"
    path = str(_modules()[module].relative_to(PACKAGES[parts[0]]))
    return f"{top}/{path}"


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int:
    """The row of ``module``: the row naming its file, else the row naming the deepest folder above it."""
    path = _path_of(module)
    found = [
        (len(p), i)
        for i, row in enumerate(layers)
        for p in row
        if p == path or (p.endswith("/") and path.startswith(p))
    ]
    assert found, f"{module} ({path}) is in no row of the table in docs/design.md"
    return max(found)[1]


def upward_imports(graph: dict[str, set[str]], layer: dict[str, int]) -> list[str]:
    """Imports of a module by a module in a lower row than its own (the table reads top to bottom)."""
    return sorted(
        f"{a} (row {layer[a]}) imports {b} (row {layer[b]})"
        for a, targets in graph.items()
        for b in targets
        if layer[a] > layer[b]
    )


def test_every_import_points_down_the_layers_of_the_design_note():
    layers = design_layers()
    assert layers[-1] == ("trainmon/run/",) and len(layers) >= 15
    graph = import_graph()
    layer = {m: layer_of(m, layers) for m in graph}
    assert upward_imports(graph, layer) == []
    assert len({row for row in layer.values()}) == len(layers)  # every row holds a module


def test_the_order_check_finds_an_import_up_the_table():
    graph = {"a.top": {"a.low"}, "a.low": {"a.mid"}, "a.mid": set()}
    assert upward_imports(graph, {"a.top": 0, "a.mid": 1, "a.low": 2}) == [
        "a.low (row 2) imports a.mid (row 1)"
    ]
    assert upward_imports(graph, {"a.top": 0, "a.low": 1, "a.mid": 1}) == []  # one row: either way
    text = (
        "## The folders, in layers\n\n| folder | one line |\n|---|---|\n| `x/`, `y.py` | a |\n| `z/` | b |\n"
    )
    assert design_layers(text) == [("x/", "y.py"), ("z/",)]


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    assert len(graph) > 100  # the walk found the package
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_few_modules_lie_loose_at_the_package_root():
    loose = {p.stem for p in PACKAGES["trainmon"].glob("*.py")}
    assert loose <= ROOT_MODULES, sorted(loose - ROOT_MODULES)
    assert len(loose) <= 6


def test_the_run_contract_imports_no_torch_and_nothing_else_of_trainmon():
    graph = import_graph()
    for name, path in _modules().items():
        if not (name == "trainmon.run" or name.startswith("trainmon.run.")):
            continue
        imported = _imports(path, name, path.name == "__init__.py", set(graph))
        assert not any(m == "torch" or m.startswith("torch.") for m in imported), name
        others = {m for m in graph[name] if not m.startswith("trainmon.run.")}
        assert others <= {"trainmon"}, (name, others)


def test_the_plugin_reads_runs_only_through_run_and_read():
    graph = import_graph()
    allowed = ("trainmon.run", "trainmon.read")
    for name, targets in graph.items():
        if name.startswith("trainmon_tb"):
            trainmon = {t for t in targets if t.split(".")[0] == "trainmon" and t != "trainmon"}
            assert all(t.startswith(allowed) for t in trainmon), (name, trainmon)


def test_the_plugin_loads_without_torch():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        "import trainmon_tb.loader, trainmon_tb.plugin\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('trainmon.'))\n"
        "assert all(m.startswith(('trainmon.run', 'trainmon.read')) for m in loaded), loaded\n"
        "print(len(loaded))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 5


def _public_definitions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {n.name for n in tree.body if isinstance(n, kinds) and not n.name.startswith("_")}


def test_every_path_of_a_run_is_spelled_in_run_layout_alone():
    layout = _public_definitions(PACKAGES["trainmon"] / "run" / "layout.py")
    assert {"rank_dir", "stats_rank_dir", "anomalies_rank_dir"} <= layout
    for name, path in _modules().items():
        if name != "trainmon.run.layout":
            assert not (_public_definitions(path) & layout), (name, _public_definitions(path) & layout)


def test_the_run_contract_names_each_thing_once():
    seen: dict[str, str] = {}
    for name, path in sorted(_modules().items()):
        if name.startswith("trainmon.run."):
            for defined in _public_definitions(path):
                assert defined not in seen, f"{defined} is defined in {seen[defined]} and {name}"
                seen[defined] = name
