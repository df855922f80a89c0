"""The shape of the code: the longest functions and the largest files of src/protofl.

Standalone (stdlib ``ast`` only): ``python scripts/code_shape.py [ROOT]``, ROOT defaulting to
``src/protofl`` beside this script. Prints the 15 longest functions and methods (lines, qualified
name, file), the 15 largest files (lines) and how many functions run over 80 lines and files over
800 lines.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TOP = 15
LONG_FUNCTION = 80
LARGE_FILE = 800


def function_lengths(source: str) -> list[tuple[int, str]]:
    """``(lines, qualified name)`` of every function and method in ``source`` (decorators
    included)."""
    out: list[tuple[int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    out.append(((child.end_lineno or child.lineno) - first + 1, name))
                walk(child, f"{name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return out


def shape(root: Path) -> tuple[list[tuple[int, str, str]], list[tuple[int, str]]]:
    """Every function ``(lines, name, file)`` and every file ``(lines, file)``, longest first."""
    functions: list[tuple[int, str, str]] = []
    files: list[tuple[int, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        text = path.read_text(encoding="utf-8")
        files.append((len(text.splitlines()), rel))
        functions.extend((n, name, rel) for n, name in function_lengths(text))
    functions.sort(key=lambda f: (-f[0], f[2], f[1]))
    files.sort(key=lambda f: (-f[0], f[1]))
    return functions, files


def report(root: Path) -> str:
    functions, files = shape(root)
    lines = [f"{TOP} longest functions:"]
    lines += [f"  {n:5d}  {name}  ({rel})" for n, name, rel in functions[:TOP]]
    lines.append(f"{TOP} largest files:")
    lines += [f"  {n:5d}  {rel}" for n, rel in files[:TOP]]
    long_functions = sum(1 for f in functions if f[0] > LONG_FUNCTION)
    large_files = sum(1 for f in files if f[0] > LARGE_FILE)
    lines.append(f"functions over {LONG_FUNCTION} lines: {long_functions} of {len(functions)}")
    lines.append(f"files over {LARGE_FILE} lines: {large_files} of {len(files)}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "src" / "protofl"
    print(report(root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
