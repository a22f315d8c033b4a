"""Lines of code of Python files: lines holding code, not blank, comment or docstring lines.

    python tools/loc.py headway/decode            # per file, then the total
    python tools/loc.py headway/decode/step.py

A docstring is a string that is the first statement of a module, class or function; a line counts
when some token on it is code (a line with code and a trailing comment counts).
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
        tokenize.ENCODING}


def docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers covered by docstrings."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def lines_of_code(source: str) -> int:
    docs = docstring_lines(ast.parse(source))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in SKIP or tok.start[0] in docs:
            continue
        code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code)


def main(argv: list[str]) -> int:
    files = sorted(f for a in argv or ["headway"] for f in ([Path(a)] if a.endswith(".py") else Path(a).rglob("*.py")))
    total = 0
    for f in files:
        n = lines_of_code(f.read_text())
        total += n
        print(f"{n:6d}  {len(f.read_text().splitlines()):6d}  {f}")
    print(f"{total:6d}  lines of code in {len(files)} files (second column: all lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
