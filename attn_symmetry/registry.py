"""The tables that extensions register into, and a block that undoes what it registered.

The package keeps three registries, each a ``Registry`` (a dict from a name to its entry)
filled by one register function (docs/extending.md):

  models.FAMILIES      model families      ``models.register_family``
  matching.METHODS     matching methods    ``matching.register_method``
  data.DATASETS        data sets           ``data.register_dataset``

Their built-in entries are those the package registers itself: given when the registry is
made, or recorded by ``Registry.mark_built_in`` once the package's own registrations ran.

``scoped()`` is a block whose registrations do not outlive it, for a test or a notebook::

  with registry.scoped():
    models.register_family(my_family)
    ...                                # my_family is known here
  # every registry holds again what it held before the block

This module imports nothing but the standard library, so the pure core can hold a registry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

_REGISTRIES: list[Registry] = []  # every registry made, in order


class Registry(dict):
  """A name -> entry table of extensions (a plain dict), known to ``scoped``.

  Args:
    entries: the built-in entries, (name, entry) pairs or a mapping.
  """

  def __init__(self, entries: Iterable[tuple[str, Any]] | dict[str, Any] = ()):
    super().__init__(entries)
    self._built_in = dict(self)
    _REGISTRIES.append(self)

  def mark_built_in(self) -> None:
    """Records the present entries as the package's own: what ``scoped`` restores a registry
    to when it is made during the block (its module first imported inside it)."""
    self._built_in = dict(self)

  def restore(self, entries: dict[str, Any]) -> None:
    """Holds exactly ``entries`` again, in place: views of its keys (``models.FAMILIES``) and
    every module's reference to it stay valid."""
    self.clear()
    self.update(entries)


@contextlib.contextmanager
def scoped() -> Iterator[None]:
  """A block after which every registry holds what it held before (whatever the block
  registered, replaced or removed, and also when it raises); a registry made during the block
  holds its built-in entries. Blocks nest."""
  saved = [(r, dict(r)) for r in _REGISTRIES]
  try:
    yield
  finally:
    for r in _REGISTRIES[len(saved):]:
      r.restore(r._built_in)  # pylint: disable=protected-access
    for r, entries in saved:
      r.restore(entries)
