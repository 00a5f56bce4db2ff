"""Re-initialisation protocols (docs/lmc.md, 'Re-initialisation').

From a trained model, the parameters of a scope (the first attention layer,
all attention layers, the first Transformer layer, or the full model) are
replaced by a fresh initialisation with another seed, and only they are
fine-tuned. A scope is given by the path prefixes that ``model.scope_paths``
returns ("layers_0/attention"; "" for everything); the trainable set is a tree
of Python bools over the parameters, which the optimiser turns into an optax
mask and which the training step uses to pass frozen leaves through untouched.

One more scope, ``SPAWN``, is the positive control: nothing is re-initialised,
every parameter of the base model is trained on, and the seed changes only the
order of the training data, so that the runs are children spawned from one
shared checkpoint (the base model after ``train.num_steps``). Such children
are expected to be linearly connected once the checkpoint is late enough: a
study that aligns them must not make their barrier worse, and should find an
element near the identity. ``scopes()`` lists every scope a setting may name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from attn_symmetry import models
from attn_symmetry import runtime
from attn_symmetry import spec as spec_lib

Params = dict[str, Any]

SPAWN = "spawn"


def scopes() -> tuple[str, ...]:
  """Every scope a setting may name: the model's (``models.SCOPES``, read now) and ``SPAWN``."""
  return (*models.SCOPES, SPAWN)


def scope_paths(model: models.Model, scope: str) -> tuple[str, ...]:
  """The path prefixes that ``scope`` trains (and the study aligns): the model's own for
  its scopes (``model.scope_paths``), every parameter ("") for ``SPAWN``."""
  return ("",) if scope == SPAWN else tuple(model.scope_paths(scope))


def _in_scope(path: str, prefix: str) -> bool:
  return prefix == "" or path == prefix or path.startswith(prefix + "/")


def trainable_mask(params: Params, prefixes: Sequence[str]) -> Params:
  """Tree of bools, True for the leaves under any of ``prefixes``.

  Raises:
    ValueError: if a prefix names no parameter, or no prefix is given.
  """
  if not prefixes:
    raise ValueError("a re-initialisation scope needs at least one parameter path prefix")
  paths = spec_lib.flatten(params)
  for prefix in prefixes:
    if not any(_in_scope(p, prefix) for p in paths):
      raise ValueError(f"scope path {prefix!r} names no parameter; parameters are "
                       f"{sorted(paths)[:8]}...")
  return spec_lib.unflatten({p: any(_in_scope(p, q) for q in prefixes) for p in paths})


def reinitialise(trained: Params, fresh: Params, mask: Params) -> Params:
  """``fresh`` where ``mask`` is True, ``trained`` elsewhere (same tree structure)."""
  return jax.tree.map(lambda t, f, m: f if m else t, trained, fresh, mask)


def _bits(x) -> np.ndarray:
  """The raw bits of a whole array (however it is placed), as unsigned integers."""
  x = runtime.host_array(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def changed_frozen(before: Params, after: Params, mask: Params) -> list[str]:
  """Paths of the frozen leaves (mask False) that are not bit-identical."""
  a, b, m = spec_lib.flatten(before), spec_lib.flatten(after), spec_lib.flatten(mask)
  return sorted(p for p, trainable in m.items()
                if not trainable and (a[p].shape != b[p].shape
                                      or not np.array_equal(_bits(a[p]), _bits(b[p]))))
