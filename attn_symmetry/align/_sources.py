"""Where the alignment reads A and B from: the whole models, loaded (``Whole``: a method that is
not streamed, an evaluation, ``--repair``), or the checkpoints, read a group of tensors at a
time (``Streamed``: the methods that ``matching.Method.streamed`` says can be, by their weights
or by running both models a layer at a time; ``_memory.streams``). Both give the same four
things: the element
g (``match``), the function check's reference logits (``reference``), a group of leaves of each
model (``read``) for the one pass that computes B' (``_apply.apply``), and the release of a group
once that pass is done with it (``release``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import time

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import matching
from attn_symmetry import repair as repair_lib
from attn_symmetry import runtime
from attn_symmetry import spec as spec_lib
from attn_symmetry.align import _eval_files, _function_check, _memory
from attn_symmetry.align._clock import Clock, Stage
from attn_symmetry.align._records import InputError, Inputs, Options, Params
from attn_symmetry.models import Model
from attn_symmetry.models import safetensors_io

Match = tuple[dict[str, Any], dict[str, Any]]  # (g, info) of align_model


def open_source(inputs: Inputs, options: Options, clock: Clock) -> Source:
  """The source the memory policy picks (``_memory.streams``): the whole models, loaded in the
  stage "load", or the checkpoints streamed. A streamed alignment allocates and frees a layer's
  buffers over and over: from here on the process returns each large buffer to the system as
  it is freed (``runtime.return_freed_buffers``), so that its resident memory is what it
  holds."""
  if _memory.streams(options):
    runtime.return_freed_buffers()
    return Streamed(inputs)
  with clock.stage("load") as stage:
    source = Whole.load(inputs)
    stage.summary = "both models in float32"
  return source


class Whole:
  """A's and B's float32 parameters as stored (norm scales not folded), loaded whole.

  The source is their only reference. With an evaluation they stay for its "before" path,
  which takes them out (``take``); without one, the pass releases each group of both once it
  is done with it (``release``), so that memory holds one model and a group, not two models.

  Attributes:
    inputs: what the check stage found.
    a, b: A's and B's nested parameters; None once taken.
  """

  def __init__(self, inputs: Inputs, a: Params, b: Params):
    self.inputs, self.a, self.b = inputs, a, b
    self._keep = inputs.batches is not None

  @classmethod
  def load(cls, inputs: Inputs) -> Whole:
    """Both models' float32 parameters, one stored tensor at a time.

    Raises:
      InputError: a tensor holds NaN or Inf (``safetensors_io.load_params``).
    """
    try:
      return cls(inputs, safetensors_io.load_params(inputs.a, inputs.model),
                 safetensors_io.load_params(inputs.b, inputs.model))
    except ValueError as e:
      raise InputError(str(e)) from None

  def match(self, options: Options, stage: Stage) -> Match:
    """(g, info) of ``matching.align_model`` of B to A on the scope, with the inputs the
    method needs (``provide``), timed as the stage's part "align_model", with the C heap's free
    pages released between compiling a program and running it."""
    inputs = self.inputs
    extra = matching.provided_arguments(
        options.method, options.matching, lambda needed: provide(inputs, options, needed,
                                                                 stage.say))
    with stage.part("align_model", "matching"), runtime.release_memory_after_compiles():
      element, info = matching.align_model(inputs.model.spec, self.a, self.b, scope=inputs.scope,
                                           method=options.method, **options.matching, **extra)
      jax.block_until_ready(element)
    return element, info

  def reference(self, folders: Sequence[str], inputs: jax.Array) -> dict[str, jax.Array]:
    """{folder: its source's logits on ``inputs``}: B's for "aligned_b", A's for "aligned_a"."""
    held = {"aligned_b": self.b, "aligned_a": self.a}
    return {name: _function_check.logits(self.inputs.model, held[name], inputs)
            for name in folders}

  def read(self, paths: Sequence[str]) -> tuple[Params, Params]:
    """(A's leaves, B's leaves) {path: array} at ``paths``."""
    return tuple({p: spec_lib.subtree(params, p) for p in paths} for params in (self.a, self.b))

  def release(self, paths: Sequence[str]) -> None:
    """Without an evaluation, drops the top-level groups of ``paths`` from A and B (a group
    of ``matching.stream_groups`` holds whole top-level groups); the last empties the source."""
    if self._keep:
      return
    for top in {p.split("/")[0] for p in paths}:
      del self.a[top], self.b[top]
    if not self.b:
      self.a = self.b = None

  def take(self) -> tuple[Params, Params]:
    """(A, B), leaving the source empty."""
    a, b = self.a, self.b
    self.a = self.b = None
    return a, b


def provide(inputs: Inputs, options: Options, needed: str, say: Callable[[str], None]
            ) -> dict[str, Any]:
  """The arguments of input ``needed`` (``matching.INPUTS``) from the command's data.

  ``ACTIVATIONS``: ``Model.batch_activations`` on the match batches (``--match-data``).
  ``LOSS``: the mean loss on the training batches (``--match-data``'s but its last quarter,
  else the evaluation file's first half: ``_check.split_for_learning``), the held-out batches
  (that last quarter, or the evaluation file's next quarter), the key of ``--seed`` and a
  progress line to the stage.
  ``REPAIR``: the model, whose training batches it reads as they are (their "inputs" and
  "mask"), and REPAIR's default rule, the one ``--repair`` uses.
  """
  if needed == matching.ACTIVATIONS:
    return dict(activations=inputs.model.batch_activations, match_batches=inputs.match)
  if needed == matching.REPAIR:
    return dict(model=inputs.model, model_inputs=None,
                repair_no_bias=repair_lib.NO_BIAS_RULES[0])
  metrics = _eval_files.metric_fn(inputs.model)

  def loss_fn(params, batch):
    sums = metrics(params, batch)
    return sums["loss"] / sums["count"]

  def progress(line):
    say(f"{options.method}: step {line['step']}/{line['steps']}, held-out barrier "
        f"{line['holdout_barrier']:.4g} (best {line['best_holdout_barrier']:.4g})")

  return dict(loss_fn=loss_fn, batches=inputs.train, holdout_batches=inputs.holdout,
              key=jax.random.key(options.seed), progress=progress)


class Streamed:
  """Both checkpoints, read a group of tensors at a time in their stored dtype (float64 read as
  float32, as ``load_params`` reads it); nothing is held between reads."""

  def __init__(self, inputs: Inputs):
    self.inputs = inputs

  def match(self, options: Options, stage: Stage) -> Match:
    """(g, info) of ``matching.align_model_streamed`` of B to A on the scope, the models read a
    group of leaves at a time (``read``), each group split over this process's devices where it
    has several (``_local_mesh``; info["devices"] says how many); each pass over the groups
    says one line to the stage. A method streamed by its activations
    (``matching.ACTIVATIONS``): ``_match_activations``.

    Raises:
      InputError: a tied tensor differs from what it ties, or a tensor holds NaN or Inf.
    """
    inputs = self.inputs
    try:
      for ckpt in (inputs.a, inputs.b):
        safetensors_io.check_tied(ckpt, inputs.model)
    except ValueError as e:
      raise InputError(str(e)) from None
    if matching.METHODS[options.method].streamed == matching.ACTIVATIONS:
      return self._match_activations(options, stage)
    shapes = {p: (s, np.dtype(np.float32)) for p, s in inputs.model.param_shapes.items()}
    mesh = _local_mesh()
    with runtime.release_memory_after_compiles():
      element, info = matching.align_model_streamed(inputs.model.spec, self.read, shapes,
                                                    scope=inputs.scope, method=options.method,
                                                    mesh=mesh, progress=stage.say,
                                                    on_group=stage.tick, **options.matching)
      jax.block_until_ready(element)
    return element, info | {"devices": 1 if mesh is None else mesh.devices.size}

  def _match_activations(self, options: Options, stage: Stage) -> Match:
    """(g, info) of ``matching.align_activations_streamed``: both models run side by side on
    the match batches a group of leaves at a time (``Model.activations_streamed``, the leaves
    ``read`` and computed in float32), one pass, or two where the sites wait for the residual's
    element; each pass says one line to the stage."""
    inputs, model = self.inputs, self.inputs.model

    def read(paths):
      return tuple({p: jnp.asarray(x, jnp.float32) for p, x in flat.items()}
                   for flat in self.read(paths))

    def forward():
      start = time.perf_counter()
      yield from model.activations_streamed(read, inputs.match)
      stage.say(f"a pass of both models over {len(inputs.match)} match batches, "
                f"{model.config.depth} layers read one at a time "
                f"({time.perf_counter() - start:.1f} s)")

    abstract = spec_lib.unflatten({p: jax.ShapeDtypeStruct(s, jnp.float32)
                                   for p, s in model.param_shapes.items()})
    shapes = jax.eval_shape(model.batch_activations, abstract, inputs.match[0])
    chosen = matching.MatchOptions(**options.matching)
    with runtime.release_memory_after_compiles():
      try:
        return matching.align_activations_streamed(model.spec, forward, shapes,
                                                   scope=inputs.scope, steps=chosen.steps,
                                                   residual=chosen.residual,
                                                   batches=len(inputs.match))
      except ValueError as e:
        raise InputError(str(e)) from None

  def reference(self, folders: Sequence[str], inputs: jax.Array) -> dict[str, jax.Array]:
    """{folder: its source's logits on ``inputs``}, each source loaded whole in turn and
    released (called only where four float32 models fit: ``_memory.keeps_models``)."""
    sources = {"aligned_b": self.inputs.b, "aligned_a": self.inputs.a}
    out = {}
    for name in folders:
      params = safetensors_io.load_params(sources[name], self.inputs.model)
      out[name] = _function_check.logits(self.inputs.model, params, inputs)
      del params
    return out

  def read(self, paths: Sequence[str]) -> tuple[Params, Params]:
    """(A's leaves, B's leaves) {path: array} at ``paths``.

    Raises:
      InputError: a tensor holds NaN or Inf.
    """
    narrow = lambda x: np.asarray(x, np.float32) if x.dtype.itemsize > 4 else x
    try:
      return tuple({p: narrow(x) for p, x in safetensors_io.read_leaves(ckpt, self.inputs.model,
                                                                        paths)}
                   for ckpt in (self.inputs.a, self.inputs.b))
    except ValueError as e:
      raise InputError(str(e)) from None

  def release(self, paths: Sequence[str]) -> None:
    """Nothing is held between reads."""


def _local_mesh() -> jax.sharding.Mesh | None:
  """A mesh of this process's devices where it has several (each group's work is split over
  them, ``matching.align_model_streamed``), else None."""
  devices = jax.local_devices()
  return jax.sharding.Mesh(np.array(devices), ("devices",)) if len(devices) > 1 else None


Source = Whole | Streamed
