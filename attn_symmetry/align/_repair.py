"""The repair stage (``--repair``): the merged model REPAIRed on the match data and written to
DIR/merged in the pass's stead (``repaired_merge``).

``repair.repair`` moves each channel of the merge (1 - lambda) A' + lambda B' (every attention
output and FFN hidden unit) to the interpolation of the endpoints' statistics on the match
batches and folds the affine map into the weights that write the point: the result is a
standard checkpoint of the same architecture, written laid out as A (as the plain merge is).
"""

from __future__ import annotations

import os
from typing import Any

from attn_symmetry import repair as repair_lib
from attn_symmetry.align._records import Aligned, InputError, Inputs, Options, Repaired
from attn_symmetry.models import safetensors_io

# What the report keeps of each point of ``repair.repair``'s info (not its [C] arrays).
POINT_INFO = ("channels", "corrected", "degenerate", "shift_folded", *repair_lib.GAPS)


def repaired_merge(inputs: Inputs, options: Options, aligned: Aligned, tmp: str | None
                   ) -> Repaired:
  """REPAIR of (1 - merge) A' + merge B' on ``inputs.match`` (``repair.repair``, on the pass's
  whole A' and B', rounded to their written dtypes), written into ``tmp``/merged (nothing
  without ``tmp``).

  Raises:
    InputError: the activations of A', B' or the merge are not finite (naming the point).
  """
  try:
    params, info = repair_lib.repair(inputs.model, aligned.params_a, aligned.params,
                                     options.merge, inputs.match)
  except ValueError as e:
    raise InputError(str(e)) from None
  if tmp is not None:
    safetensors_io.save_params(os.path.join(tmp, "merged"), inputs.a, inputs.model, params,
                               dtype=options.dtype)
  points = {name: {k: point[k] for k in POINT_INFO} for name, point in info.items()}
  return Repaired(params, points)


def summary(repaired: Repaired) -> str:
  """The stage's line: the points, the channels corrected and those left as they are."""
  points = repaired.points.values()
  total = lambda key: sum(int(p[key]) for p in points)
  folded = "shifts and scales" if all(p["shift_folded"] for p in points) else (
      "scales only (no bias to take the shift)" if not any(p["shift_folded"] for p in points)
      else "scales, and shifts where a bias takes them")
  return (f"{len(repaired.points)} points, {total('corrected')} of {total('channels')} channels "
          f"corrected, {total('degenerate')} degenerate left as they are; folded {folded}")

