"""The modules of ``attn_symmetry`` and ``experiments`` import one another without a cycle.

The graph is read from the source, not from an import: every ``import x`` and ``from x import
y`` statement of a module, at module level, inside functions and classes, and under ``if``s
(``TYPE_CHECKING`` included), with relative names resolved against the module's package. Only
modules of the two packages are nodes. The edges:

* ``import a.b.c`` is an edge to ``a.b.c`` (the deepest of its names that is in the repo);
* ``from a.b import n`` is an edge to the submodule ``a.b.n`` when there is one, and otherwise
  to ``a.b`` itself: a name that ``a/b/__init__.py`` defines needs that file run to its end.

Package ``__init__`` rule: importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py``
first, but that implicit import of the parents is no edge. Python puts a package in
``sys.modules`` before it runs its ``__init__``, and finds a submodule through the package's
path, not its namespace, so a child imported while its parent's ``__init__`` is still running
(``attn_symmetry/__init__.py`` importing ``attn_symmetry.attention``, which imports
``from attn_symmetry import tasks``) sees nothing half-made. Only what a module names counts:
``from a.b import NAME`` for a NAME defined in ``a/b/__init__.py`` is an edge to the package,
and a cycle through it is an error like any other. ``importlib.import_module`` and other
dynamic imports are not read.

A cycle is a strongly connected component of more than one module, or a module importing itself.
"""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("attn_symmetry", "experiments")


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> source file, for every module of ``PACKAGES``."""
  modules = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      modules[".".join(parts)] = path
  return modules


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
  """The absolute name that ``from ... import`` statement ``node`` of ``module`` imports from."""
  if not node.level:
    return node.module
  package = module.split(".") if is_package else module.split(".")[:-1]
  base = package[:len(package) - (node.level - 1)]
  assert len(base) == len(package) - (node.level - 1) and base, (
      f"{module}: relative import beyond the top-level package (line {node.lineno})")
  return ".".join(base + ([node.module] if node.module else []))


def _deepest_known(name: str, known) -> str | None:
  parts = name.split(".")
  for end in range(len(parts), 0, -1):
    if ".".join(parts[:end]) in known:
      return ".".join(parts[:end])
  return None


def imports(module: str, source: str, known) -> set[str]:
  """The in-repo modules that ``module`` (code ``source``) imports, by the module docstring's
  rules."""
  is_package = known[module].name == "__init__.py"
  edges = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      targets = [_deepest_known(alias.name, known) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      origin = _absolute(module, is_package, node)
      targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known
                 else _deepest_known(origin, known) for alias in node.names]
    else:
      continue
    edges.update(t for t in targets if t is not None)
  return edges


@functools.cache
def import_graph() -> dict[str, set[str]]:
  known = _modules()
  return {m: imports(m, path.read_text(encoding="utf-8"), known) for m, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module, and the modules that import
  themselves (Tarjan's algorithm, iterative), each sorted."""
  index, low, on_stack, stack, found = {}, {}, set(), [], []
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      node, successors = work[-1]
      child = next(successors, None)
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
        component = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.append(member)
          if member == node:
            break
        if len(component) > 1 or node in graph[node]:
          found.append(sorted(component))
  return found


def _cycle_path(component: list[str], graph: dict[str, set[str]]) -> str:
  """One closed import path through ``component``, for the error message: 'a -> b -> a'."""
  members, start = set(component), component[0]
  # Breadth-first from start back to start, inside the component.
  parents, frontier = {}, [start]
  while frontier:
    following = []
    for node in frontier:
      for child in sorted(graph[node] & members):
        if child == start:
          path = [node]
          while path[-1] != start:
            path.append(parents[path[-1]])
          return " -> ".join([start, *reversed(path[:-1]), start])
        if child not in parents:
          parents[child] = node
          following.append(child)
    frontier = following
  raise AssertionError(f"no cycle through {start}")


def test_the_graph_is_read_as_the_rules_say():
  graph = import_graph()
  assert set(graph) >= {"attn_symmetry", "attn_symmetry.data._catalog", "experiments.train",
                        "experiments.configs.default"}
  # from pkg import submodule: an edge to the submodule, not the package.
  assert "attn_symmetry.tasks" in graph["attn_symmetry.data._catalog"]
  assert "attn_symmetry" not in graph["attn_symmetry.data._catalog"]
  # Imports inside functions count: attn_symmetry/__init__.py imports align on first use.
  assert "attn_symmetry.align" in graph["attn_symmetry"]


def test_the_rules_resolve_relative_names_and_package_names():
  known = {"p": ROOT / "p/__init__.py", "p.a": ROOT / "p/a.py", "p.q": ROOT / "p/q/__init__.py",
           "p.q.b": ROOT / "p/q/b.py"}
  source = ("from . import a\nfrom .q import b, NAME\nimport p.q.b as bb\n"
            "def f():\n  from .. import q\n  import os\n")
  assert imports("p.q.b", source, known) == {"p.q", "p.q.b"}
  assert imports("p.q", "from . import b\nfrom .. import a\n", known) == {"p.q.b", "p.a"}
  assert imports("p.a", "from p import NAME\nfrom p.q import b\n", known) == {"p", "p.q.b"}
  graph = {"p": {"p.a"}, "p.a": {"p.q.b"}, "p.q": set(), "p.q.b": {"p.a"}, "s": {"s"}}
  assert cycles(graph) == [["p.a", "p.q.b"], ["s"]]
  assert _cycle_path(["p.a", "p.q.b"], graph) == "p.a -> p.q.b -> p.a"
  assert _cycle_path(["s"], graph) == "s -> s"


def test_no_import_cycle():
  graph = import_graph()
  found = [_cycle_path(c, graph) for c in cycles(graph)]
  assert not found, "import cycles: " + "; ".join(found)
