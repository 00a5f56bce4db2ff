"""``StaticSpec``: a ``SymmetrySpec`` as a static argument of ``jax.jit``."""

from __future__ import annotations

from attn_symmetry import spec as spec_lib


class StaticSpec:
  """A spec as a static jit argument: hashed and compared by its content, so that a new but
  equal spec object reuses the compiled program."""

  def __init__(self, spec: spec_lib.SymmetrySpec):
    self.spec = spec
    self._key = (tuple(spec.factors.items()), tuple(spec.axes.items()),
                 tuple(spec.attention.items()),
                 tuple((k, tuple(v)) for k, v in spec.norm_scales.items()),
                 tuple((k, s.writers, tuple(s.norms.items())) for k, s in spec.streams.items()))

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, StaticSpec) and self._key == other._key
