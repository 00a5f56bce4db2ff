"""No function of the library, the experiments or the benchmarks is longer than ``LIMIT`` lines.

A function's length is read from the source (``ast``): from its ``def`` line to its last line,
docstring included, decorators not.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("attn_symmetry", "experiments", "benchmarks")
LIMIT = 100


def long_functions(source: str, limit: int = LIMIT) -> list[tuple[str, int, int]]:
  """(name, first line, length) of every function or method in ``source`` longer than
  ``limit`` lines, nested ones included."""
  return [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
          for node in ast.walk(ast.parse(source))
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
          and node.end_lineno - node.lineno + 1 > limit]


def test_the_length_is_counted_from_def_to_the_last_line():
  body = "\n".join(f"  x{i} = {i}" for i in range(3))
  source = f"@staticmethod\ndef f():\n{body}\n\nclass C:\n  def g(self):\n    return 1\n"
  assert long_functions(source, limit=3) == [("f", 2, 4)]
  assert long_functions(source, limit=4) == []


def test_no_function_is_longer_than_the_limit():
  found = [f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
           for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
           for name, line, length in long_functions(path.read_text())]
  assert not found, f"functions longer than {LIMIT} lines: {found}"
