"""Every function in dflash_train/ stays small enough to read in one go: fewer than 10
parameters and at most 60 lines; the extract pipeline's steps take at most 6 parameters,
since each is meant to be one stage with its inputs spelled out."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_train"
MAX_PARAMS = 9
MAX_LINES = 60
STRICTER = {"extract/pipeline.py": 6}
"""Files held to fewer parameters, relative to the package."""


def _param_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    named = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    return named + (args.vararg is not None) + (args.kwarg is not None)


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _oversized() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        max_params = STRICTER.get(relative, MAX_PARAMS)
        for node in _functions(path):
            params, lines = _param_count(node), node.end_lineno - node.lineno + 1
            if params > max_params or lines > MAX_LINES:
                found.append(f"{relative}:{node.lineno} {node.name}: {params} parameters, "
                             f"{lines} lines")
    return found


def test_no_function_is_too_long_or_takes_too_many_parameters():
    assert _oversized() == []


def test_the_check_sees_the_package():
    assert any(True for _ in _functions(PACKAGE / "train" / "checkpoint.py"))
