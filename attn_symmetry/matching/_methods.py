"""The whole-model matching methods by name: one registration per method.

``METHODS`` maps each method's name to its ``Method``: the options of
``align_model`` it reads (callers key saved results by them, so that a
result is recomputed when one of them changes and only then; for a built-in
method, the table ``MatchOptions`` says which) and, for a method registered
from outside the package (``register_method``), the function that computes
its element. The built-in methods ("naive", "perm", "ortho", "full",
"learned", "activation") run inside ``align_model``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attn_symmetry import registry
from attn_symmetry.matching import _attention
from attn_symmetry.matching import _options

# The options of ``align_model`` that a method may name (``MatchOptions``' fields but those of
# the built-in descent alone: ``max_rounds``).
ALIGN_OPTIONS = _options.METHOD_OPTIONS


@dataclasses.dataclass(frozen=True)
class Method:
  """One whole-model matching method.

  Attributes:
    name: the method's name (``align_model(method=...)``, ``study.methods``).
    options: the entries of ``ALIGN_OPTIONS`` it reads.
    descent: whether it runs ``align_model``'s coordinate descent, and so reads the
      descent's own options too (``max_rounds``): the built-in methods but "naive"
      (``_options.DESCENTS``).
    align: None for a built-in method (``align_model`` runs it); for a
      registered one, ``align(spec, params_a, params_b, *, scope, **options)``
      -> (element, info): a group element of ``spec`` (as
      ``group_action.identity_model``'s) that brings B close to A, acting only
      inside ``scope`` (parameter path prefixes), and a dict of
      JSON-convertible diagnostics. ``info["folded_norm_scales"]`` True says
      the element needs both endpoints' norm scales folded
      (``group_action.fold_norm_scales``), as an orthogonal residual does.
  """
  name: str
  options: tuple[str, ...]
  align: Callable[..., tuple[dict[str, Any], dict[str, Any]]] | None = None
  descent: bool = False

  def reads(self, given: Mapping[str, Any]) -> tuple[str, ...]:
    """The matching options it reads, in ``MatchOptions``' order, when called with the
    options ``given``: its ``options``, the descent's own if ``descent``, but an option
    whose ``requires`` ``given`` does not meet ("full" reads ``learning_rate`` only with the
    "adam" solver)."""
    return _options.reads(self.options, self.name, self.descent, given)


METHODS: registry.Registry = registry.Registry(
    (name, Method(name, _options.built_in_options(name), descent=name in _options.DESCENTS))
    for name in _attention.METHODS)


def register_method(name: str, align: Callable[..., tuple[dict[str, Any], dict[str, Any]]], *,
                    options: Sequence[str] = ()) -> Method:
  """Adds a whole-model matching method (``Method``); returns it.

  Raises:
    ValueError: the name is taken, ``align`` is not callable, or ``options``
      names something other than ``ALIGN_OPTIONS``.
  """
  if name in METHODS:
    raise ValueError(f"matching method {name!r} is already registered")
  if not callable(align):
    raise ValueError(f"matching method {name!r}: align must be callable, got {align!r}")
  unknown = sorted(set(options) - set(ALIGN_OPTIONS))
  if unknown:
    raise ValueError(f"matching method {name!r}: unknown options {unknown}; a method reads "
                     f"some of {ALIGN_OPTIONS}")
  METHODS[name] = Method(name, tuple(options), align)
  return METHODS[name]
