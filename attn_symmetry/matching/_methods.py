"""The whole-model matching methods by name: one registration per method.

``METHODS`` maps each method's name to its ``Method``: the options of
``align_model`` it reads (callers key saved results by them, so that a
result is recomputed when one of them changes and only then) and, for a
method registered from outside the package (``register_method``), the
function that computes its element. The built-in methods ("naive", "perm",
"ortho", "full", "learned") run inside ``align_model``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from attn_symmetry import registry
from attn_symmetry.matching import _attention

# ``align_model``'s matching options: Stage 1's distance; the "full" refinement's steps,
# learning rate, start, schedule and solver; the factors that "learned" trains.
ALIGN_OPTIONS = ("distance", "steps", "learning_rate", "init", "refine", "solver", "factors")
_FULL_OPTIONS = ALIGN_OPTIONS[:-1]


@dataclasses.dataclass(frozen=True)
class Method:
  """One whole-model matching method.

  Attributes:
    name: the method's name (``align_model(method=...)``, ``study.methods``).
    options: the entries of ``ALIGN_OPTIONS`` it reads.
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


_BUILT_IN = {"naive": (), "perm": ("distance",), "ortho": ("distance",), "full": _FULL_OPTIONS,
             "learned": ALIGN_OPTIONS}
METHODS: registry.Registry = registry.Registry(
    (name, Method(name, _BUILT_IN[name])) for name in _attention.METHODS)


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
