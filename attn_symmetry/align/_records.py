"""What ``align_checkpoints``'s stages pass one another (its options, what the check found, the
models loaded and aligned), what it returns, its errors and its constants."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from attn_symmetry import matching
from attn_symmetry import runtime
from attn_symmetry.models import Model
from attn_symmetry.models import safetensors_io

OUTPUTS = ("aligned_a", "aligned_b", "merged", "interpolation.json", "interpolation.png",
           "report.json")
MATCHING_OPTIONS = tuple(o.name for o in matching.OPTIONS)  # the fields of matching.MatchOptions
DTYPES = ("keep", "float32")
Params = dict[str, Any]


class InputError(ValueError):
  """Bad input to ``align_checkpoints``, found before anything is written (one line)."""


class AlignWarning(UserWarning):
  """Input that ``align_checkpoints`` accepts but that is likely a mistake (MODEL_A and MODEL_B
  the same folder); the command prints it as one line."""


class FunctionCheckError(InputError):
  """Aligned B (or A) does not compute B's (or A's) function to the tolerance on the function
  check's inputs (``_function_check.function_difference``); nothing is written (one line)."""


class Alignment(NamedTuple):
  """What ``align_checkpoints`` returns.

  Attributes:
    model: the zoo ``Model`` of both checkpoints (``model.apply(params, inputs)``).
    params_a: A's float32 parameters, or A' (norm scales folded, values rounded to
      the written dtypes: what DIR/aligned_a holds) if report["folded_norm_scales"];
      None for a streamed alignment whose four float32 models do not fit the memory budget.
    params: B' = g . B in float32, in the same parametrisation, values rounded to
      the written dtypes: what DIR/aligned_b holds; None where ``params_a`` is.
    element: g, for ``group_action.apply_model(model.spec, params_b, g)``.
    report: the report, as written to DIR/report.json.
  """
  model: Model
  params_a: Params
  params: Params
  element: dict[str, Any]
  report: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """``align_checkpoints``'s options (its Args), as the stages read them.

  Attributes:
    method: a name of ``matching.METHODS``.
    scope: a name of ``models.SCOPES``, comma-separated parameter path
      prefixes, or a tuple of prefixes.
    merge: lambda of the merged model (1 - lambda) A + lambda B', or None.
    dtype: one of ``DTYPES``.
    function_tolerance: the most relative logit difference the function check
      allows (``_function_check.function_difference``), or None for its default
      (``_function_check.default_tolerance`` of the written dtypes).
    out: the output folder, or None (nothing is written).
    overwrite: replace this tool's earlier outputs in ``out``.
    eval_text, eval_images: the evaluation file or image folder, or None.
    num_lambdas, batch_size, seq_len, eval_batches: the evaluation's points
      per path, examples per batch, tokens per text sequence, most batches.
    matching: ``align_model``'s options, named in ``MATCHING_OPTIONS``.
    memory_budget: the most bytes the alignment may hold (``_check.check_memory``), or None for
      the machine's memory.
  """
  method: str
  scope: str | tuple[str, ...]
  merge: float | None
  dtype: str
  function_tolerance: float | None
  out: str | None
  overwrite: bool
  eval_text: str | None
  eval_images: str | None
  num_lambdas: int
  batch_size: int
  seq_len: int
  eval_batches: int
  matching: Mapping[str, Any]
  memory_budget: int | None = None

  @property
  def streamed(self) -> bool:
    """Whether the models are read group by group (``_streamed.stream``): every method of
    ``matching.STREAMED_METHODS`` without an evaluation. "learned" and the evaluation hold
    both whole models."""
    return self.method in matching.STREAMED_METHODS and not self.evaluated

  @property
  def budget(self) -> int:
    """The memory budget in bytes: ``memory_budget``, else the machine's memory."""
    return self.memory_budget or runtime.physical_memory()

  @property
  def evaluated(self) -> bool:
    """Whether an evaluation file or folder is given."""
    return self.eval_text is not None or self.eval_images is not None


@dataclasses.dataclass
class Inputs:
  """What the check stage found."""
  a: safetensors_io.Checkpoint
  b: safetensors_io.Checkpoint
  model: Model
  scope: list[str]
  batches: list[dict[str, np.ndarray]] | None  # the curve's
  train: list[dict[str, np.ndarray]] | None = None  # method "learned": its training batches
  holdout: list[dict[str, np.ndarray]] | None = None  # and those it chooses its iterate on

  @property
  def parameters(self) -> int:
    """The number of the model's parameters."""
    return sum(math.prod(s) for s in self.model.param_shapes.values())


@dataclasses.dataclass
class Loaded:
  """A's and B's float32 parameters as stored (norm scales not folded), from the load stage.

  The holder is their only reference: the last stage that needs them takes
  them out (``take``), so that they are released once it is done with them
  (the align stage without an evaluation, else the evaluate stage).
  """
  a: Params | None
  b: Params | None

  def take(self) -> tuple[Params, Params]:
    """(A, B), leaving the holder empty."""
    a, b = self.a, self.b
    self.a = self.b = None
    return a, b


@dataclasses.dataclass
class Aligned:
  """What the align stage computed.

  Attributes:
    element: g (``matching.align_model``).
    info: ``align_model``'s info.
    folded: whether A and B' have their norm scales folded (``group_action.fold_norm_scales``):
      then A' (A folded) is written to aligned_a, the folder to compare with aligned_b.
    params_a: A, in that parametrisation (A' if folded, its values rounded to the dtypes it is
      written in: ``_function_check.round_to``).
    params: B' = g . B, in that parametrisation, its values rounded to the dtypes it is written in.
    distance: {"before": ||A - B||, "after": ||A - B'||}, each as ``_distances.distances`` gives it.
    function: the function check (``_function_check.function_check``): {"inputs": {"seed", "shape"},
      "aligned_b": B' against B and, if folded, "aligned_a": A' against A, each as
      ``_function_check.function_difference`` gives it}.
  """
  element: dict[str, Any]
  info: dict[str, Any]
  folded: bool
  params_a: Params
  params: Params
  distance: dict[str, dict[str, Any]]
  function: dict[str, Any]

  @property
  def compare(self) -> list[str]:
    """The two folders whose tensors lie close and are to be compared or merged: aligned_a and
    aligned_b when A was re-parametrised (folded), else MODEL_A itself and aligned_b."""
    return ["aligned_a" if self.folded else "MODEL_A", "aligned_b"]


def natural_order(name: str) -> list[Any]:
  """A sort key that orders the numbers inside names by value: layers_2 before layers_10."""
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
