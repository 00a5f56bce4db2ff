"""||A - B|| between two models' parameters, in total, relative to ||A|| and per top-level group
of leaves."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from attn_symmetry import spec as spec_lib
from attn_symmetry.align._records import Params, natural_order


@jax.jit
def _leaf_squares(leaves_a: Sequence[jax.Array], leaves_b: Sequence[jax.Array]
                  ) -> tuple[list[jax.Array], jax.Array]:
  """([||a - b||^2 per leaf pair], ||A||^2), in one program; leaves passed as sequences, so
  that the program is compiled once per shapes, not once per set of paths."""
  gaps = [jnp.sum(jnp.square(a - b)) for a, b in zip(leaves_a, leaves_b)]
  return gaps, sum(jnp.sum(jnp.square(a)) for a in leaves_a)


def squares(flat_a: Params, flat_b: Params) -> tuple[dict[str, float], float]:
  """({top-level group: ||a - b||^2 over its leaves}, ||A||^2) of flat leaves."""
  paths = list(flat_a)
  gaps, norm = _leaf_squares([flat_a[p] for p in paths], [flat_b[p] for p in paths])
  gaps = dict(zip(paths, gaps))
  squares: dict[str, float] = {}
  for path, gap in gaps.items():
    group = path.split("/")[0]
    squares[group] = squares.get(group, 0.0) + float(gap)
  return squares, float(norm)


def distance_report(squares: Mapping[str, float], norm: float) -> dict[str, Any]:
  """||A - B|| in total, relative to ||A||, and per top-level group, from ``squares``."""
  total = math.sqrt(sum(squares.values()))
  return {"total": total, "relative": total / math.sqrt(norm) if norm else 0.0,
          "per_layer": {g: math.sqrt(squares[g]) for g in sorted(squares, key=natural_order)}}


def distances(params_a: Params, params_b: Params) -> dict[str, Any]:
  """||A - B|| in total, relative to ||A||, and per top-level group of leaves."""
  return distance_report(*squares(spec_lib.flatten(params_a), spec_lib.flatten(params_b)))
