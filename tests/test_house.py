"""The layout of the house, checked from the code's own imports (every `import` statement, function-level ones too):
no import circle anywhere in the project; `common/`'s own modules import neither the LLM plumbing nor the tasks (they
are DQN's whole dependency set); the tasks import nothing of `common/llm/` (a user's task needs no trainer); and no
module of `common/` or `tasks/` grows past about 400 lines, except the sandbox's two sides (one security boundary,
read whole); and the tests' index, tests/README.md, names every file of tests/."""

import ast
from pathlib import Path

from conftest import ROOT

PACKAGES = ("common", "tasks")
LONG_MODULES_ALLOWED = {"tasks/sandbox.py", "tasks/confinement.py"}


def project_files() -> list[Path]:
    scripts = sorted(ROOT.glob("*.py"))
    return scripts + sorted(p for folder in (*PACKAGES, "tools", "benchmarks", "assets") for p in (ROOT / folder).rglob(
        "*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it (a `from package import module` counts as the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import a.b.c` reaches a.b.c's package chain: the longest known
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in project_files()}
    return {name: imports_of(path, set(files)) - {name} for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_a_circle():
    """The negative control: a made-up graph with one loop of three and a self-contained pair outside it."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_circle_in_the_project():
    graph = import_graph()
    assert "common.llm.lifecycle" in graph and "tasks.base" in graph  # the walk sees the house
    assert circles(graph) == []


def test_each_room_imports_only_downwards():
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith("common.") and not name.startswith("common.llm"):
            assert not {t for t in targets if t.startswith(("common.llm", "tasks"))}, name  # DQN needs none of it
        if name == "tasks" or name.startswith("tasks."):
            assert not {t for t in targets if t.startswith("common.llm")}, name
    assert "common.llm.lifecycle" in graph["grpo_llm"] and "common.llm.run" not in graph["dqn_atari"]


def test_no_module_over_about_400_lines():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name not in LONG_MODULES_ALLOWED:
                assert len(path.read_text().splitlines()) <= 420, name


def test_the_tests_index_names_every_file_of_the_tests():
    """A test file, worker or task added under tests/ without its line in tests/README.md fails here."""
    index = (ROOT / "tests" / "README.md").read_text()
    files = sorted(path.relative_to(ROOT / "tests") for path in (ROOT / "tests").rglob("*.py"))
    assert Path("test_house.py") in files and Path("workers/balance_worker.py") in files  # the walk sees the tests
    assert [str(path) for path in files if f"`{path.name}`" not in index and f"tests/{path}`" not in index] == []
