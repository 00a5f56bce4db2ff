"""What ``align_checkpoints``'s stages pass one another (its options, the one table of them; what
the check found; what the pass computed), what it returns, its errors and its constants."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from attn_symmetry import matching
from attn_symmetry.models import SCOPES, Model
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


def gigabytes(text: str) -> float:
  """The command line's parser of ``--memory-budget``: GB (decimal) to bytes."""
  return float(text) * 1e9


def option(default: Any, flag: str, doc: str, *, exclusive: str | None = None, **cli: Any) -> Any:
  """One field of ``Options``: its default (``align_checkpoints``'), its command-line ``flag``
  and ``doc`` (the flag's help), the group of flags it excludes the others of (``exclusive``),
  and argparse's other arguments for the flag (``type``, ``metavar``, ``choices``, ``action``,
  ``required``)."""
  return dataclasses.field(default=default, metadata=dict(flag=flag, doc=doc,
                                                          exclusive=exclusive, cli=cli))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """``align_checkpoints``'s options, the one table of them: each field is one option, with its
  default and, in its metadata (``option``), its command-line flag and doc. The command's flags
  are generated from it (``_cli.add_arguments``), ``align_checkpoints`` takes its fields as
  keyword arguments, and the stages read it. A new option is one field here plus the code that
  reads it.

  ``matching`` holds ``align_model``'s options, named in ``MATCHING_OPTIONS`` (the fields of
  ``matching.MatchOptions``, whose own table gives their flags). Paths are kept as strings, a
  scope of prefixes as a tuple; ``memory_budget`` is in bytes (its flag, in GB).
  """
  out: str | None = option(None, "--out", "output folder", metavar="DIR", required=True)
  method: str = option(
      "full", "--method",
      "; ".join(f"{m.name}: {m.doc}" for m in matching.METHODS.values())
      + "; or a method that an --import module registers (default full). A method that "
      "trains on a loss trains on --match-data and picks its iterate on its last quarter, the "
      "curve drawn on the evaluation file; without --match-data it trains on the evaluation "
      "batches' first half, picks on the next quarter, and the curve is the last quarter")
  scope: str | tuple[str, ...] = option(
      "full", "--scope", f"{', '.join(SCOPES)} (default full), or comma-separated parameter "
      "path prefixes such as layers_0/attention")
  merge: float | None = option(None, "--merge",
                               "also write (1 - LAMBDA) A + LAMBDA aligned B to DIR/merged",
                               type=float, metavar="LAMBDA")
  eval_text: str | None = option(None, "--eval-text", "text to evaluate the paths on",
                                 metavar="FILE", exclusive="evaluation")
  eval_images: str | None = option(None, "--eval-images", "DIR/LABEL/*.png images (ViT)",
                                   metavar="DIR", exclusive="evaluation")
  match_data: str | None = option(
      None, "--match-data",
      "data the models are run on for --method activation, --learn-init activation and "
      "--repair, and that --method learned trains on: a text file (read with the folder's tokenizer.json) for a text model, a "
      "DIR/LABEL/*.png folder for ViT", metavar="FILE")
  repair: bool = option(
      False, "--repair",
      "REPAIR the merge: DIR/merged is the merged model with each channel's statistics on "
      "--match-data reset to the interpolation of A's and aligned B's, folded into its weights "
      "(needs --merge and --match-data)", action="store_true")
  dtype: str = option("keep", "--dtype",
                      "keep each tensor's stored dtype (default) or write float32",
                      choices=DTYPES)
  function_tolerance: float | None = option(
      None, "--function-tolerance",
      "most relative logit difference between B and aligned B (A and aligned A) on a few random "
      "inputs before anything is written (default: sqrt of the written dtype's epsilon, 3.5e-4 "
      "in float32)", type=float, metavar="TOL")
  overwrite: bool = option(False, "--overwrite", "replace this tool's earlier outputs in DIR",
                           action="store_true")
  num_lambdas: int = option(11, "--lambdas", "points on each path (default 11)", type=int,
                            metavar="LAMBDAS")
  batch_size: int = option(8, "--batch-size", "examples per evaluation batch (default 8)",
                           type=int)
  seq_len: int = option(128, "--seq-len", "tokens per text sequence (default 128)", type=int)
  eval_batches: int = option(8, "--eval-batches", "most evaluation batches (default 8)",
                             type=int)
  match_batches: int = option(8, "--match-batches",
                              "most batches of --match-data (default 8; --batch-size examples of "
                              "--seq-len tokens each)", type=int)
  seed: int = option(0, "--seed",
                     "seed of what the method draws at random (default 0; the lambda band of "
                     "--learn-lam-band); recorded in report.json", type=int)
  matching: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  memory_budget: float | None = option(
      None, "--memory-budget",
      "most memory the alignment may hold, in GB (default: the machine's); an alignment that "
      "needs more is refused before any work",
      type=gigabytes, metavar="GB")

  def __post_init__(self):
    fspath = lambda path: None if path is None else os.fspath(path)
    for name in ("out", "eval_text", "eval_images", "match_data"):
      object.__setattr__(self, name, fspath(getattr(self, name)))
    if not isinstance(self.scope, str):
      object.__setattr__(self, "scope", tuple(self.scope))
    object.__setattr__(self, "matching", dict(self.matching))

  @classmethod
  def from_keywords(cls, **keywords: Any) -> Options:
    """The options of ``align_checkpoints``'s keyword arguments: a field's name sets the field,
    any other name a matching option (an unknown one is refused by the check stage)."""
    names = {f.name for f in dataclasses.fields(cls)} - {"matching"}
    return cls(**{k: v for k, v in keywords.items() if k in names},
               matching={k: v for k, v in keywords.items() if k not in names})

  @classmethod
  def flag(cls, name: str) -> str:
    """The command-line flag of field ``name``: ``num_lambdas`` -> ``--lambdas``."""
    return next(f.metadata["flag"] for f in dataclasses.fields(cls) if f.name == name)

  @property
  def evaluated(self) -> bool:
    """Whether an evaluation file or folder is given."""
    return self.eval_text is not None or self.eval_images is not None

  @property
  def needs(self) -> tuple[str, ...]:
    """The inputs beyond the weights (``matching.INPUTS``) that the method needs with its
    matching options (``Method.needs``)."""
    return matching.METHODS[self.method].needs(self.matching)


@dataclasses.dataclass
class Inputs:
  """What the check stage found."""
  a: safetensors_io.Checkpoint
  b: safetensors_io.Checkpoint
  model: Model
  scope: list[str]
  batches: list[dict[str, np.ndarray]] | None  # the curve's
  train: list[dict[str, np.ndarray]] | None = None  # a method that needs a loss: its training
  holdout: list[dict[str, np.ndarray]] | None = None  # and held-out batches
  match: list[dict[str, np.ndarray]] | None = None  # --match-data's (_eval_files.match_batches)
  untied_head: bool = False  # --residual orthogonal untied A's and B's tied head (models.untie_head)

  @property
  def parameters(self) -> int:
    """The number of the model's parameters."""
    return sum(math.prod(s) for s in self.model.param_shapes.values())


@dataclasses.dataclass
class Aligned:
  """What the pass computed (``_apply.apply``).

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


@dataclasses.dataclass
class Repaired:
  """What the repair stage computed (``_repair.repaired_merge``).

  Attributes:
    params: the REPAIRed merge, a checkpoint of the model (what DIR/merged holds).
    points: {"layers_i/attention" | "layers_i/mlp": {"channels", "corrected", "degenerate",
      "shift_folded", "mean_gap", "scale_gap"}}: ``repair.repair``'s info without its [C]
      arrays.
  """
  params: Params
  points: dict[str, dict[str, Any]]


def natural_order(name: str) -> list[Any]:
  """A sort key that orders the numbers inside names by value: layers_2 before layers_10."""
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
