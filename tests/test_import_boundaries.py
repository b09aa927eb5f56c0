"""The package graph of dflash_train/ is one-way: the stages (extract, train, evaluate) sit
on the layers below them (store_schema, target_model, drafter and the top-level modules such
as run_layout and run_reader) and never the other way round; train -> evaluate (validation
replays with eval's code) is the only edge between stages; only the cli, quickstart and ranks
(which runs extract and train in one process per core) drive extract. Every import counts, a
deferred one inside a function included: it is a dependency all the same.
`python -m tests.test_import_boundaries` prints the graph."""

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_train"
STAGES = {"extract", "train", "evaluate"}
DRIVERS = {"cli", "quickstart", "ranks", "__main__"}
"""What runs the stages for a user: may import any of them."""
STAGE_EDGES = {("train", "evaluate")}
"""The one edge between stages."""


def _unit(module: str) -> str:
    """The graph's node a module belongs to: its first name below dflash_train."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(package)"


def _module_name(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if not node.level:
        return [node.module or ""]
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return [".".join(base + ([node.module] if node.module else []))]


def package_graph() -> dict[str, set[str]]:
    """unit -> the units it imports (itself left out)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        module, is_package = _module_name(path)
        source = _unit(module)
        graph[source]  # a unit importing nothing is still a node
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _imported(node, module, is_package):
                if target.startswith("dflash_train.") and _unit(target) != source:
                    graph[source].add(_unit(target))
    return dict(graph)


def _forbidden(source: str, target: str) -> str | None:
    if target not in STAGES or source in DRIVERS:
        return None
    if source not in STAGES:
        return f"{source} lies below the stages but imports {target}"
    if (source, target) not in STAGE_EDGES:
        return f"stage {source} imports stage {target} (only train -> evaluate is allowed)"
    return None


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle between units, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_stage_is_imported_from_below_and_stages_meet_only_train_to_evaluate():
    graph = package_graph()
    problems = sorted(p for s, targets in graph.items() for t in targets
                      if (p := _forbidden(s, t)))
    assert not problems, "\n".join(problems)


def test_the_package_graph_has_no_cycle():
    cycle = _cycle(package_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_rules_catch_the_edges_they_forbid():
    # the checker itself: each rule fires on an edge it exists to forbid
    assert _forbidden("drafter", "train")
    assert _forbidden("evaluate", "train")
    assert _forbidden("run_reader", "evaluate")
    assert _forbidden("train", "extract")
    assert _forbidden("train", "evaluate") is None and _forbidden("cli", "extract") is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


if __name__ == "__main__":
    for unit, targets in sorted(package_graph().items()):
        print(f"{unit} -> {', '.join(sorted(targets)) or '(nothing)'}")
