"""Weight and activation matching: the group element that brings model B closest to model A.

docs/matching.md. Attention layers are matched in two stages (heads by a
linear assignment on invariant features, then the per-head QK matrix in GL(H)
or H(H) and VO matrix in GL(H)); FFN hidden units and the residual stream by
Weight Matching (Ainsworth et al. 2023) over a model's ``SymmetrySpec``, or, for the
method "activation", every factor and site from the two models' activations.

  match_attention             one attention layer or a layer stack.
  match_attention_exhaustive  Stage 2 after every head permutation (ablation).
  head_distances              Stage 1 costs between the heads of two layers.
  match_ffn                   Weight Matching of a spec's permutation/orthogonal factors.
  align_model                 all of it, for every factor and attention site in scope.
  align_activations_streamed  method "activation" on models run a group of leaves at a time
                              (``activation_statistics_bytes``: the sums it holds at once).
  learn_alignment             an element's factors fitted to a task loss.
  register_method             a whole-model method of one's own, next to the built-in ones.
  INPUTS                      what a method may need beyond the weights (``ACTIVATIONS``,
                              ``LOSS``, ``REPAIR``): ``Method.needs`` says which, and a
                              caller supplies them through one provider
                              (``provided_arguments``).
  MatchOptions                align_model's matching options, one field each: default, doc,
                              range (``AtLeast``, ``Positive``, ``OneOf``, ``SomeOf``, ``Flag``) and which
                              methods read it; ``OPTIONS`` its rows (``Option``). The align
                              command's flags and the study's config fields are generated from it.
  ACTIVATION_KEYS             the contract of the "activation" method's activations(params, batch):
                              the keys, by the spec's names, and their shapes.
  LEARN_INITS                 the starts of "learned" (option ``learn_init``).
  LEARN_SCHEDULES             its learning-rate schedules (option ``learn_schedule``).
  linear_assignment           exact LAP, batched and jittable (an auction in JAX; optax's Hungarian
                              algorithm below 512 rows on CPU).

Attention methods (``METHODS``, the paper's Table 1): "naive" (identity),
"perm" (Variant 1: the Stage 1 permutation, applied even where it raises the
distance), "ortho" (Variant 2: Stage 1 and the orthogonal Procrustes
solution) and "full" (a refinement from a start chosen by ``init``,
``INITS``: "procrustes", the paper's and the default, or "best" of it and the
least-squares starts, exact on planted problems; the refinement's ``solver``,
``SOLVERS``: "gauss_newton", the default, a few curvature steps stopped on a
tolerance, or "adam", the paper's plain gradient descent). In ``align_model`` the first
solve of every site applies the method's solution unconditionally and later
re-solves only when they lower the distance; ``refine`` (``REFINES``) chooses
whether "full" refines at every attention step ("every_round", the default)
or once after a Variant 2 descent ("final"); "perm", "ortho" and "full" (``STAGES``) are
stages of one computation, and ``align_model`` compiles one program for the three
(called with equal options: those of "full"). "learned" (``align_model`` only)
starts from "full" and trains the factors in scope that ``factors`` names (QK
and VO matrices, head and FFN permutations, the residual factor; all by
default) on the task loss of the interpolated model (``learn_alignment``); ``learn_init``
("full" or "activation") picks its start, ``learn_lam_band`` a band of lambda around
1/2 and ``learn_repair`` fits it on the REPAIRed path (``repair.repair_batch``). "activation" (``align_model`` only) decides every factor and site from the two
models' activations on ``match_batches`` (``activations(params, batch)``, keyed as
``ACTIVATION_KEYS`` says; ``Model.activations`` for the built-in families): correlations
and the exact assignment for permutations, Procrustes for an orthogonal residual, and per
site Stage 1 on the heads' logits and outputs and Stage 2 by least squares. ``METHODS``
maps every name to its ``Method``: the function that computes its element, the options it
reads (``MatchOptions`` says which for the built-in methods) and the arguments beyond them
(data: ``activations``, ``loss_fn``, batches). The built-in methods are registered beside
their code as the methods of ``register_method`` are (docs/extending.md), and
``align_model`` calls every one the same way.

bfloat16 and float16 parameters are matched in float32, and the elements are
float32 (float32 and float64 parameters are matched in their own dtype);
``group_action.apply_model`` applies them keeping the parameters' dtype.
Everything is jitted end to end, with no host callback, and imports jax, numpy and optax only.
"""

# The built-in methods register themselves as their modules load, in this order (METHODS).
from attn_symmetry.matching import _model  # naive, perm, ortho, full
from attn_symmetry.matching import _learned  # learned
from attn_symmetry.matching import _activation  # activation
from attn_symmetry.matching._activation import ACTIVATION_KEYS
from attn_symmetry.matching._activation import align_streamed as align_activations_streamed
from attn_symmetry.matching._activation import statistics_bytes as activation_statistics_bytes
from attn_symmetry.matching._assignment import head_permutations
from attn_symmetry.matching._assignment import linear_assignment
from attn_symmetry.matching._attention import DEFAULT_LEARNING_RATE
from attn_symmetry.matching._attention import DEFAULT_STEPS
from attn_symmetry.matching._attention import INITS
from attn_symmetry.matching._attention import SOLVERS
from attn_symmetry.matching._attention import STAGES
from attn_symmetry.matching._attention import match_attention
from attn_symmetry.matching._attention import match_attention_exhaustive
from attn_symmetry.matching._features import DISTANCES
from attn_symmetry.matching._features import head_distances
from attn_symmetry.matching._correction import FACTORS as LEARNED_FACTORS
from attn_symmetry.matching._correction import resolve as learned_factors
from attn_symmetry.matching._learned import learn_alignment
from attn_symmetry.matching._methods import ACTIVATIONS
from attn_symmetry.matching._methods import ALIGN_OPTIONS
from attn_symmetry.matching._methods import INPUTS
from attn_symmetry.matching._methods import LOSS
from attn_symmetry.matching._methods import METHODS
from attn_symmetry.matching._methods import REPAIR
from attn_symmetry.matching._methods import WEIGHTS
from attn_symmetry.matching._methods import Method
from attn_symmetry.matching._methods import provided_arguments
from attn_symmetry.matching._methods import register_method
from attn_symmetry.matching._options import DEFAULT_MAX_ROUNDS
from attn_symmetry.matching._options import LEARN_INITS
from attn_symmetry.matching._options import LEARN_SCHEDULES
from attn_symmetry.matching._options import OPTIONS
from attn_symmetry.matching._options import REFINES
from attn_symmetry.matching._options import RESIDUALS
from attn_symmetry.matching._options import AtLeast
from attn_symmetry.matching._options import Flag
from attn_symmetry.matching._options import MatchOptions
from attn_symmetry.matching._options import OneOf
from attn_symmetry.matching._options import Option
from attn_symmetry.matching._options import Positive
from attn_symmetry.matching._options import SomeOf
from attn_symmetry.matching._model import active_names
from attn_symmetry.matching._model import align_model
from attn_symmetry.matching._model import match_ffn
from attn_symmetry.matching._model import residual_spec
from attn_symmetry.matching._streamed import STREAMED_METHODS
from attn_symmetry.matching._streamed import align_model_streamed
from attn_symmetry.matching._streamed import layer_program_memory
from attn_symmetry.matching._streamed import leaf_sharding
from attn_symmetry.matching._streamed import stream_groups

METHODS.mark_built_in()
