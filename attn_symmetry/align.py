"""Align and merge two Hugging Face checkpoints: ``attn-symmetry align`` and ``align_checkpoints``.

    attn-symmetry align MODEL_A MODEL_B --out DIR [--method full|ortho|perm|naive|learned]
                        [--scope ...]
                        [--merge 0.5] [--eval-text FILE | --eval-images DIR] [--dtype keep|float32]
                        [--function-tolerance TOL]

    from attn_symmetry import align_checkpoints
    result = align_checkpoints("seed1", "seed2", out="aligned", merge=0.5)
    result.element, result.params, result.report   # g, B' = g . theta_B, the report

MODEL_A and MODEL_B are local model folders of one architecture (GPT-2,
Llama, GPT-NeoX, BERT or ViT) in safetensors or PyTorch ``.bin`` files
(``models.safetensors_io``), read and written without torch.
B is aligned to A by ``matching.align_model`` on the zoo model's symmetry spec
(head permutations and per-head matrices of every attention layer, FFN and
residual-stream factors), and re-parametrised as g . B, which computes the
same function. ``align_checkpoints`` runs five stages, one function each, and
each announced by one progress line and timed in the report (``_Clock``):

1. ``_check``: the options alone (``_check_options``: method, scope, merge,
   dtype, function tolerance, matching options, evaluation flags and sizes; no
   file is read), the packages the evaluation needs, then the folders
   (``_inspect``: config, tensor names, shapes and dtypes), their
   architectures against each other, the output folder and the evaluation
   file. Every problem is refused here (or, for NaN weights, while loading)
   with a one-line ``InputError``, before anything is written;
2. ``_load``: both models' float32 parameters, one stored tensor at a time;
3. ``_align``: the element g and B' = g . B; squared distances ||A - B||,
   ||A - B'|| per top-level parameter group (``layers_i``, ``embed``, ...);
   then the function check (``_function_check``): the logits of B and B' (and
   of A and A', when A is re-parametrised) on CHECK_BATCH random inputs of the
   model's kind, drawn from ``jax.random.key(CHECK_SEED)``, B' and A' rounded
   to the dtypes they are written in. Above ``function_tolerance`` (relative to
   the largest logit; by default the square root of the written dtype's
   epsilon) it stops with a ``FunctionCheckError`` that gives the difference,
   and nothing is written;
4. ``_evaluate`` (with an evaluation file, ``_eval_files``): loss and accuracy
   along (1 - lambda) A + lambda B ("before") and (1 - lambda) A' + lambda B'
   ("after"), and their barriers (``lmc``); with ``merge``, the merged
   model's loss and accuracy beside A's and B's (``_merged``; report "merged");
5. ``_save``: DIR/aligned_b/ (B' as safetensors in B's tensor names, shards
   and dtypes, with B's config and tokenizer files), DIR/aligned_a/ when A is
   re-parametrised (A' likewise, in A's), DIR/merged/ with ``merge``
   ((1 - merge) A' + merge B' in A's layout), DIR/interpolation.json and .png
   with an evaluation file, DIR/report.json.

One gauge. RMSNorm models (Llama): an orthogonal map of the residual stream is
a symmetry only once the norm scales are folded into the weights that read them
(``group_action.fold_norm_scales``). When the alignment uses one, A is
re-parametrised too: A' is A folded (the same function, norm weights of one),
and it is A' and B' that lie close, tensor for tensor, and are compared and
merged; aligned_a/ holds A'. Otherwise A' is A itself, and aligned_b/ lies
close to MODEL_A. report.json's "compare" names the two folders: ["aligned_a",
"aligned_b"] or ["MODEL_A", "aligned_b"].

Streaming. Every method but "learned", without an evaluation file, streams:
the check stage is followed by "align" (``matching.align_model_streamed``: the
descent reads both models one group of tensors at a time, a ``layers_i`` or the
embeddings or the final norm with the head, kept in their stored dtype and
computed in float32; a round is a pass over the layers plus the residual's
reduction) and "apply" (a last pass: each group of B' = g . B computed, rounded
and written tensor by tensor into the output folders, ``safetensors_io.FolderWriter``,
with the distances summed). Memory then holds a group of each model, not the
models, and does not grow with depth. The function check, ``Alignment.params``
and ``params_a`` need A, B and their aligned copies whole in float32: they are
computed only where four float32 models fit the memory budget
(``memory_budget``, ``--memory-budget``; default the machine's memory), and
otherwise the report's "function_check" says why it was skipped. "learned" trains
on the interpolated model's loss and an evaluation runs whole models: both load
the models whole (the stages below), and are refused before any work where that
does not fit the budget; so is a streamed alignment whose largest group does not.

Memory and time (whole models: "learned" or an evaluation). Peak memory stays within 3x the two checkpoints' size
(``benchmarks/bench_align_checkpoints.py``, GPT-2 small in float32): the
models are read one tensor at a time, B' is computed one top-level group of
leaves at a time with B's group released after it (B is kept only for an
evaluation: ``_Loaded``; the function check keeps only B's and A's logits on its
small batch, computed before they are released, and rounds B' and A' in place,
one leaf at a time), the merged model is computed leaf by leaf as it is
written, and the C heap's free pages are returned to the system after every
stage and between compiling the matching program and running it
(``runtime``). jaxlib's LAPACK kernels run on one OpenBLAS thread during the
call (``runtime.single_threaded_blas``): with OpenBLAS's own threads,
matching's batched inverses made GPT-2 small's alignment about 10x slower on
2 cores.

Outputs are written into a temporary folder inside DIR and then moved into
place; with ``overwrite`` the earlier outputs of this tool in DIR are replaced
and other files left alone. DIR may neither be nor contain nor lie inside
MODEL_A or MODEL_B, so nothing there is ever written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import _eval_files
from attn_symmetry import group_action
from attn_symmetry import lmc
from attn_symmetry import matching
from attn_symmetry import runtime
from attn_symmetry import spec as spec_lib
from attn_symmetry.models import SCOPES, Model
from attn_symmetry.models import convert
from attn_symmetry.models import safetensors_io

OUTPUTS = ("aligned_a", "aligned_b", "merged", "interpolation.json", "interpolation.png",
           "report.json")
MATCHING_OPTIONS = ("distance", "steps", "learning_rate", "max_rounds", "init", "refine", "solver",
                    "factors")
DTYPES = ("keep", "float32")
# The function check's random inputs: CHECK_BATCH examples (of CHECK_TOKENS tokens, or at most the
# model's max_len; or images of its size) drawn from jax.random.key(CHECK_SEED).
CHECK_SEED, CHECK_BATCH, CHECK_TOKENS = 0, 2, 16
Params = dict[str, Any]


class InputError(ValueError):
  """Bad input to ``align_checkpoints``, found before anything is written (one line)."""


class FunctionCheckError(InputError):
  """Aligned B (or A) does not compute B's (or A's) function to the tolerance on the function
  check's inputs (``_function_difference``); nothing is written (one line)."""


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


# ----------------------------------------------------------------------------- what the stages pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Options:
  """``align_checkpoints``'s options (its Args), as the stages read them.

  Attributes:
    method: a name of ``matching.METHODS``.
    scope: a name of ``models.SCOPES``, comma-separated parameter path
      prefixes, or a tuple of prefixes.
    merge: lambda of the merged model (1 - lambda) A + lambda B', or None.
    dtype: one of ``DTYPES``.
    function_tolerance: the most relative logit difference the function check
      allows (``_function_difference``), or None for its default
      (``_default_tolerance`` of the written dtypes).
    out: the output folder, or None (nothing is written).
    overwrite: replace this tool's earlier outputs in ``out``.
    eval_text, eval_images: the evaluation file or image folder, or None.
    num_lambdas, batch_size, seq_len, eval_batches: the evaluation's points
      per path, examples per batch, tokens per text sequence, most batches.
    matching: ``align_model``'s options, named in ``MATCHING_OPTIONS``.
    memory_budget: the most bytes the alignment may hold (``_check_memory``), or None for
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
    """Whether the models are read group by group (``_stream``): every method of
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
class _Inputs:
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
class _Loaded:
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
class _Aligned:
  """What the align stage computed.

  Attributes:
    element: g (``matching.align_model``).
    info: ``align_model``'s info.
    folded: whether A and B' have their norm scales folded (``group_action.fold_norm_scales``):
      then A' (A folded) is written to aligned_a, the folder to compare with aligned_b.
    params_a: A, in that parametrisation (A' if folded, its values rounded to the dtypes it is
      written in: ``_round_to``).
    params: B' = g . B, in that parametrisation, its values rounded to the dtypes it is written in.
    distance: {"before": ||A - B||, "after": ||A - B'||}, each as ``_distances`` gives it.
    function: the function check (``_function_check``): {"inputs": {"seed", "shape"},
      "aligned_b": B' against B and, if folded, "aligned_a": A' against A, each as
      ``_function_difference`` gives it}.
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


# ----------------------------------------------------------------------------- streamed


def _reader(inputs: _Inputs) -> Callable[[Sequence[str]], tuple[Params, Params]]:
  """``read(paths)`` -> (A's leaves, B's leaves) {path: array} at ``paths``, in their stored
  dtype (float64 read as float32, as ``load_params`` reads it).

  Raises (when called):
    InputError: a tensor holds NaN or Inf.
  """
  narrow = lambda x: np.asarray(x, np.float32) if x.dtype.itemsize > 4 else x

  def read(paths):
    try:
      return tuple({p: narrow(x) for p, x in safetensors_io.read_leaves(ckpt, inputs.model, paths)}
                   for ckpt in (inputs.a, inputs.b))
    except ValueError as e:
      raise InputError(str(e)) from None

  return read


def _local_mesh() -> jax.sharding.Mesh | None:
  """A mesh of this process's devices where it has several (each group's work is split over
  them, ``matching.align_model_streamed``), else None."""
  devices = jax.local_devices()
  return jax.sharding.Mesh(np.array(devices), ("devices",)) if len(devices) > 1 else None


def _match_streamed(inputs: _Inputs, options: _Options) -> tuple[dict[str, Any], dict[str, Any]]:
  """(g, info) of ``matching.align_model_streamed`` of B to A on the scope, the models read
  a group of leaves at a time (``_reader``), each group split over this process's devices
  where it has several (``_local_mesh``; info["devices"] says how many)."""
  try:
    for ckpt in (inputs.a, inputs.b):
      safetensors_io.check_tied(ckpt, inputs.model)
  except ValueError as e:
    raise InputError(str(e)) from None
  shapes = {p: (s, np.dtype(np.float32)) for p, s in inputs.model.param_shapes.items()}
  mesh = _local_mesh()
  with runtime.release_memory_after_compiles():
    element, info = matching.align_model_streamed(inputs.model.spec, _reader(inputs), shapes,
                                                  scope=inputs.scope, method=options.method,
                                                  mesh=mesh, **options.matching)
    jax.block_until_ready(element)
  return element, info | {"devices": 1 if mesh is None else mesh.devices.size}


def _writers(inputs: _Inputs, options: _Options, folded: bool, tmp: str | None
             ) -> dict[str, safetensors_io.FolderWriter]:
  """The folders written group by group into ``tmp``: aligned_b, aligned_a if folded, merged
  with ``merge``; none without ``tmp``."""
  if tmp is None:
    return {}
  like = {"aligned_b": inputs.b} | ({"aligned_a": inputs.a} if folded else {})
  if options.merge is not None:
    like["merged"] = inputs.a
  return {name: safetensors_io.FolderWriter(os.path.join(tmp, name), ckpt, inputs.model,
                                            dtype=options.dtype) for name, ckpt in like.items()}


def _leaf_units(spec: spec_lib.SymmetrySpec, paths: Sequence[str]
                ) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
  """The leaves ``paths`` of one group (``matching.stream_groups``) in the units that
  ``_apply_streamed`` computes one at a time: (leaves read, leaves written) with the leaves of
  each attention site written together (its element acts on them jointly) and every other leaf
  alone; the leaves read add the norm scales that a written leaf reads, to fold them in. A
  scale is written by its own unit (folded, it is ones)."""
  sites = [[p for p in paths if p.startswith(s + "/")] for s in spec.attention]
  units = [u for u in sites if u]
  inside = {p for u in units for p in u}
  units += [[p] for p in paths if p not in inside]
  scales = {}
  for scale, readers in spec.norm_scales.items():
    for reader in readers:
      scales.setdefault(reader, []).append(scale)
  return [(tuple(dict.fromkeys([*u, *(s for p in u for s in scales.get(p, ()))])), tuple(u))
          for u in units]


def _apply_streamed(inputs: _Inputs, options: _Options, element: dict[str, Any],
                    info: dict[str, Any], tmp: str | None, stage: _Stage) -> _Aligned:
  """A pass over the groups of leaves (``matching.stream_groups``), one unit of leaves at a
  time (``_leaf_units``: an attention site's leaves, or one leaf): the unit of A and B read,
  folded where g needs it, B' = g . B, both rounded to the dtypes they are written in, the
  distances before and after summed, and the unit written to the folders of ``_writers`` in
  ``tmp``; so this pass holds a few leaves of each model, not a group. A' and B' are kept
  whole only where four float32 models fit the memory budget (``_keeps_models``): then the function check (``_function_check``) runs on them, and
  otherwise it is skipped, which the report says.

  Raises:
    FunctionCheckError: B' (or A') does not compute B's (or A's) function to the tolerance.
  """
  model, spec = inputs.model, inputs.model.spec
  folded, keep = bool(info.get("folded_norm_scales")), _keeps_models(model, options)
  check_inputs = _check_inputs(model)
  reference = {}
  if keep:
    with stage.part("function_check", "function check"):
      sources = {"aligned_b": inputs.b} | ({"aligned_a": inputs.a} if folded else {})
      for name, ckpt in sources.items():
        reference[name] = _logits(model, safetensors_io.load_params(ckpt, model), check_inputs)
  dtypes = {name: _written_dtypes(ckpt, model, options.dtype)
            for name, ckpt in (("aligned_a", inputs.a), ("aligned_b", inputs.b))}
  writers = _writers(inputs, options, folded, tmp)
  read, kept_a, kept_b = _reader(inputs), {}, {}
  squares = {"before": ({}, 0.0), "after": ({}, 0.0)}
  group_action.check_model_element(spec, element)  # once: each unit below skips it
  for paths in matching.stream_groups(spec):
    for computed, emitted in _leaf_units(spec, paths):
      a, b = ({p: jnp.asarray(x, jnp.float32) for p, x in flat.items()} for flat in read(computed))
      part = spec.part(computed)
      if folded:
        a, b = (spec_lib.flatten(group_action.fold_norm_scales(part, spec_lib.unflatten(x)))
                for x in (a, b))
      names = set(part.factors) | set(part.attention)
      aligned = spec_lib.flatten(group_action.apply_model(
          part, spec_lib.unflatten(b), {k: v for k, v in element.items() if k in names},
          check_element=False))
      a, b, aligned = ({p: x[p] for p in emitted} for x in (a, b, aligned))
      for when, other in (("before", b), ("after", aligned)):
        groups, norm = _squares(a, other)
        total = squares[when][0]
        squares[when] = ({g: total.get(g, 0.0) + groups.get(g, 0.0) for g in {*total, *groups}},
                         squares[when][1] + norm)
      del b
      aligned = {p: _rounded(x, dtypes["aligned_b"][p]) for p, x in aligned.items()}
      if folded:
        a = {p: _rounded(x, dtypes["aligned_a"][p]) for p, x in a.items()}
      written = {"aligned_b": aligned, "aligned_a": a, "merged": {
          p: _interpolate(a[p], aligned[p], options.merge) for p in a} if "merged" in writers else {}}
      for name, writer in writers.items():
        writer.put(written[name])
      del written
      if keep:
        kept_a.update(a)
        kept_b.update(aligned)
      del a, aligned
  for writer in writers.values():
    writer.close()
  params_a, params = (spec_lib.unflatten(x) if keep else None for x in (kept_a, kept_b))
  if keep:
    written = {"aligned_b": (inputs.b, params)} | ({"aligned_a": (inputs.a, params_a)} if folded
                                                    else {})
    with stage.part("function_check", "function check"):
      function = _function_check(model, options, check_inputs, reference, written)
  else:
    function = {"skipped": f"A, B and their aligned copies in float32 "
                           f"({_gb(4 * _whole_bytes(model))}) do not fit the memory budget "
                           f"{_gb(options.budget)}"}
  distance = {when: _distance_report(*value) for when, value in squares.items()}
  return _Aligned(element, info, folded, params_a, params, distance, function)


def _stream(inputs: _Inputs, options: _Options, clock: _Clock) -> Alignment:
  """``align_checkpoints``'s streamed stages after the check: "align" (g, ``_match_streamed``)
  and "apply" (B' group by group, ``_apply_streamed``, written with the report into ``out``)."""
  with clock.stage("align") as stage:
    element, info = _match_streamed(inputs, options)
    stage.summary = (f"method {options.method}, {info.get('rounds', 0)} rounds, reading "
                     f"{len(matching.stream_groups(inputs.model.spec))} groups of tensors one at "
                     "a time" + (f", each split over {info['devices']} devices"
                                 if info.get("devices", 1) > 1 else ""))
  with clock.stage("apply") as stage:
    staging = (contextlib.nullcontext() if options.out is None
               else _staging(options.out, options.overwrite))
    with staging as tmp:
      aligned = _apply_streamed(inputs, options, element, info, tmp, stage)
      report = _report(inputs, options, aligned, None, clock.seconds)
      if tmp is not None:
        stage.stop()
        _write_json(report)(os.path.join(tmp, "report.json"))
    before, after = aligned.distance["before"], aligned.distance["after"]
    check = aligned.function.get("aligned_b")
    stage.summary = (f"B' = g . B group by group, distance {before['total']:.6g} -> "
                     f"{after['total']:.6g} (relative {before['relative']:.4g} -> "
                     f"{after['relative']:.4g}), " +
                     (f"aligned B's logits within {check['relative']:.2g} of B's" if check else
                      f"function check skipped: {aligned.function['skipped']}") +
                     (f"; written to {options.out}" if options.out else ""))
  return Alignment(inputs.model, aligned.params_a, aligned.params, element, report)


# ----------------------------------------------------------------------------- timing


class _Clock:
  """The stages' progress lines and seconds.

  ``with clock.stage("load") as stage: ...; stage.summary = "both models"``
  records the block's seconds as ``clock.seconds["load"]``, returns the C
  heap's free pages to the system (``runtime.release_free_memory``: each stage
  starts from the live arrays), and says "load: both models (2.1 s)". A stage
  that raises says nothing.

  Attributes:
    say: called with each progress line.
    seconds: {stage or part name: seconds}, in the order they ended (the
      report's "time_s").
  """

  def __init__(self, say: Callable[[str], None] | None = None):
    self.say = say or (lambda line: None)
    self.seconds: dict[str, float] = {}

  def stage(self, name: str) -> _Stage:
    return _Stage(self, name)


class _Stage(contextlib.AbstractContextManager):
  """One stage of a ``_Clock``: a context manager whose body sets ``summary``."""

  def __init__(self, clock: _Clock, name: str):
    self.clock, self.name, self.summary = clock, name, ""
    self._start = 0.0  # set on entering the block
    self._stopped = False
    self._parts: list[tuple[str, str]] = []  # (label, key of clock.seconds)

  def __enter__(self) -> _Stage:
    self._start = time.perf_counter()
    return self

  def __exit__(self, exc_type, *_) -> None:
    if exc_type is None:
      self.stop()
      runtime.release_free_memory()
      parts = "".join(f", of which {label} {self.clock.seconds[key]:.1f} s"
                      for label, key in self._parts)
      self.clock.say(f"{self.name}: {self.summary} ({self.clock.seconds[self.name]:.1f} s{parts})")

  def say(self, line: str) -> None:
    """A progress line from inside the stage."""
    self.clock.say(line)

  def stop(self) -> None:
    """Records the stage's seconds now rather than at its end (later calls change nothing): the
    save stage stops its clock just before it writes the report that holds them."""
    if not self._stopped:
      self.clock.seconds[self.name] = time.perf_counter() - self._start
      self._stopped = True

  @contextlib.contextmanager
  def part(self, key: str, label: str) -> Iterator[None]:
    """Times a step of the stage as ``clock.seconds[key]`` (a step in several blocks: their
    sum), releases the heap's free pages after it, and names it in the stage's line ("(12.0 s,
    of which LABEL 9.5 s)")."""
    start = time.perf_counter()
    yield
    self.clock.seconds[key] = self.clock.seconds.get(key, 0.0) + time.perf_counter() - start
    runtime.release_free_memory()
    if (label, key) not in self._parts:
      self._parts.append((label, key))


# ----------------------------------------------------------------------------- check: the options


def _check_options(options: _Options) -> None:
  """Refuses bad options from the options alone: no file is read and nothing is imported (the
  methods are those ``matching.METHODS`` holds now).

  Raises:
    InputError: the first bad option, naming its command-line flag.
  """
  if options.method not in matching.METHODS:
    raise InputError(f"--method must be one of {', '.join(matching.METHODS)}, got "
                     f"{options.method!r}")
  if options.method == "learned" and not options.evaluated:
    raise InputError("--method learned trains on the task loss: give --eval-text or --eval-images")
  unknown = sorted(set(options.matching) - set(MATCHING_OPTIONS))
  if unknown:
    raise InputError(f"unknown matching options {unknown}; known: {', '.join(MATCHING_OPTIONS)}")
  if options.matching.get("distance", "frobenius") not in matching.DISTANCES:
    raise InputError(f"--distance must be one of {', '.join(matching.DISTANCES)}")
  _check_factors(options)
  _check_scope(options.scope)
  if options.merge is not None and not 0.0 <= options.merge <= 1.0:
    raise InputError(f"--merge must lie in [0, 1], got {options.merge}")
  if options.dtype not in DTYPES:
    raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {options.dtype!r}")
  tolerance = options.function_tolerance
  if tolerance is not None and (isinstance(tolerance, bool) or
                                not isinstance(tolerance, (int, float)) or not tolerance > 0):
    raise InputError(f"--function-tolerance must be a positive number, got {tolerance!r}")
  budget = options.memory_budget
  if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                             or not budget > 0):
    raise InputError(f"--memory-budget must be a positive number of GB, got {budget!r}")
  if options.eval_text is not None and options.eval_images is not None:
    raise InputError("give --eval-text or --eval-images, not both")
  for name, value, least in (("--lambdas", options.num_lambdas, 3),
                             ("--batch-size", options.batch_size, 1),
                             ("--seq-len", options.seq_len, 1),
                             ("--eval-batches", options.eval_batches, 1)):
    if int(value) != value or value < least:
      raise InputError(f"{name} must be an integer >= {least}, got {value}")


def _check_factors(options: _Options) -> None:
  """``--factors``: names of ``matching.LEARNED_FACTORS``, for ``--method learned`` only (which
  of them the model has in the scope is ``_inspect``'s check)."""
  if "factors" not in options.matching:
    return
  factors = options.matching["factors"]
  if options.method != "learned":
    raise InputError(f"--factors chooses what --method learned trains; --method is "
                     f"{options.method!r}")
  if (not isinstance(factors, (list, tuple)) or not factors
      or any(f not in matching.LEARNED_FACTORS for f in factors)):
    raise InputError(f"--factors must list some of {', '.join(matching.LEARNED_FACTORS)}, "
                     f"got {factors!r}")


def _scope_prefixes(scope: str | Sequence[str]) -> list[str] | None:
  """The parameter path prefixes that ``scope`` lists, or None for a name of ``models.SCOPES``
  (whose prefixes depend on the model: ``Model.scope_paths``)."""
  if isinstance(scope, str):
    return None if scope in SCOPES else [s for s in scope.split(",") if s]
  return list(scope)


def _check_scope(scope: str | Sequence[str]) -> None:
  """Refuses a scope that lists no prefix, or one that is not a string (whether each prefix
  names parameters of the model is ``_scope``'s check)."""
  prefixes = _scope_prefixes(scope)
  if prefixes is None:
    return
  for p in prefixes:
    if not isinstance(p, str):
      raise InputError(f"--scope: scope entries must be path prefixes (str), got {p!r} "
                       f"(scopes: {', '.join(SCOPES)}, or path prefixes)")
  if not prefixes:
    raise InputError(f"--scope {','.join(prefixes)} holds no whole attention site or factor to "
                     "align")


def _check_extras(options: _Options) -> None:
  """Refuses an evaluation whose packages (the ``align`` extra) are not installed: the
  tokenizer for text, PIL for images, matplotlib for the plot of the curves."""
  needed = {"tokenizers": options.eval_text is not None, "PIL": options.eval_images is not None,
            "matplotlib": options.evaluated and options.out is not None}
  missing = [m for m, need in needed.items() if need and importlib.util.find_spec(m) is None]
  if missing:
    raise InputError(f"the evaluation needs {', '.join(missing)}, which is not installed: "
                     f"pip install 'attn_symmetry[align]'")


# ----------------------------------------------------------------------------- check: the files


def _architecture_difference(a: safetensors_io.Checkpoint, b: safetensors_io.Checkpoint
                             ) -> str | None:
  """None if A and B have one architecture, else what differs first: a config.json key whose
  value in B changes A's architecture (``model_type`` before the others, so that two families
  are named as such), or else the field of the derived config."""
  if a.config == b.config:
    return None
  head = a.config.head
  for key in sorted(set(a.hf_config) | set(b.hf_config), key=lambda k: (k != "model_type", k)):
    va, vb = a.hf_config.get(key), b.hf_config.get(key)
    if va == vb:
      continue
    swapped = {k: v for k, v in a.hf_config.items() if k != key}
    if key in b.hf_config:
      swapped[key] = vb
    try:
      changes = convert.config_from_hf(swapped, head) != a.config
    except ValueError:
      changes = True
    if changes:
      return f"config.json's {key} is {va!r} in {a.name} but {vb!r} in {b.name}"
  field = next(f.name for f in dataclasses.fields(a.config)
               if getattr(a.config, f.name) != getattr(b.config, f.name))
  return (f"{field} is {getattr(a.config, field)!r} in {a.name} but {getattr(b.config, field)!r} "
          f"in {b.name}")


def _check_out(out: str, overwrite: bool, inputs: Sequence[safetensors_io.Checkpoint]) -> None:
  real = os.path.realpath(out)
  for ckpt in inputs:
    model = os.path.realpath(ckpt.path)
    if real == model or real.startswith(model + os.sep) or model.startswith(real + os.sep):
      raise InputError(f"--out {out} overlaps {ckpt.name}: nothing is written in or around an "
                       "input folder")
  if os.path.exists(out) and not os.path.isdir(out):
    raise InputError(f"--out {out} is a file")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise InputError(f"--out {out} already holds {len(os.listdir(out))} entries; pass --overwrite "
                     "to replace this tool's outputs there")
  parent = real
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.access(parent, os.W_OK | os.X_OK):
    raise InputError(f"--out {out}: {parent} is not writable")


def _gb(nbytes: float) -> str:
  return f"{nbytes / 1e9:.2f} GB"


def _whole_bytes(model: Model) -> int:
  """Bytes of one whole model in float32."""
  return 4 * sum(math.prod(s) for s in model.param_shapes.values())


def _group_bytes(model: Model) -> tuple[int, tuple[str, ...]]:
  """(bytes in float32, paths) of the largest group that the streamed alignment reads at a
  time (``matching.stream_groups``), of one model."""
  size = lambda paths: 4 * sum(math.prod(model.param_shapes[p]) for p in paths)
  paths = max(matching.stream_groups(model.spec), key=size)
  return size(paths), paths


def _keeps_models(model: Model, options: _Options) -> bool:
  """Whether A, B and their aligned copies are held whole in float32, four models: always
  with an evaluation or "learned"; when streamed, only where they fit ``options.budget``,
  for the function check and ``Alignment.params``."""
  return not options.streamed or 4 * _whole_bytes(model) <= options.budget


def _check_memory(a: safetensors_io.Checkpoint, b: safetensors_io.Checkpoint, model: Model,
                  options: _Options) -> None:
  """Refuses, before any work, an alignment that needs more than ``options.budget``: the
  streamed one holds two groups of leaves of each model in float32 (as read and aligned:
  ``_group_bytes``); "learned" and an evaluation hold both whole models twice in float32.

  Raises:
    InputError: naming the checkpoints' size, what the alignment needs, and the budget.
  """
  sizes = f"MODEL_A {_gb(a.nbytes)}, MODEL_B {_gb(b.nbytes)} as stored"
  budget = f"the memory budget {_gb(options.budget)} (--memory-budget)"
  if options.streamed:
    group, paths = _group_bytes(model)
    if 4 * group > options.budget:
      top = sorted({p.split("/")[0] for p in paths}, key=_natural)
      raise InputError(f"the checkpoints ({sizes}) are read a group of tensors at a time, and "
                       f"the largest ({', '.join(top)}: {_gb(group)} per model in float32) "
                       f"needs {_gb(4 * group)} as read and aligned, above {budget}")
  elif 4 * _whole_bytes(model) > options.budget:
    why = "--method learned" if options.method == "learned" else "the evaluation"
    raise InputError(f"{why} holds both whole models in float32, read and aligned: "
                     f"{_gb(4 * _whole_bytes(model))} for the checkpoints ({sizes}), above "
                     f"{budget}; without an evaluation, methods "
                     f"{', '.join(matching.STREAMED_METHODS)} read one layer at a time")


def _scope(model: Model, scope: str | Sequence[str]) -> list[str]:
  """Parameter path prefixes of a scope name (``models.SCOPES``) or of prefixes."""
  prefixes = _scope_prefixes(scope)
  if prefixes is None:
    prefixes = model.scope_paths(scope)
  try:
    names = matching.active_names(model.spec, prefixes)
  except ValueError as e:
    raise InputError(f"--scope: {e} (scopes: {', '.join(SCOPES)}, or path prefixes)") from None
  if not names:
    raise InputError(f"--scope {','.join(prefixes)} holds no whole attention site or factor to "
                     "align")
  return prefixes


def _factors_in_scope(model: Model, prefixes: list[str], factors: Sequence[str]) -> None:
  """Refuses a factor of ``--factors`` that ``model`` has no symmetry for in the scope."""
  try:
    matching.learned_factors(model.spec, matching.active_names(model.spec, prefixes), factors)
  except ValueError as e:
    message = str(e).removeprefix("factors: ")
    raise InputError(f"--factors: {message} ({model.config.family} model, scope "
                     f"{','.join(prefixes) or 'full'})") from None


def _same_tokenizer(a: safetensors_io.Checkpoint, b: safetensors_io.Checkpoint) -> None:
  files = [os.path.join(c.path, "tokenizer.json") for c in (a, b)]
  if all(os.path.isfile(f) for f in files):
    with open(files[0], "rb") as fa, open(files[1], "rb") as fb:
      if fa.read() != fb.read():
        raise InputError(f"{a.name} and {b.name} have different tokenizer.json files")


def _read_pair(path_a: str | os.PathLike, path_b: str | os.PathLike
               ) -> tuple[safetensors_io.Checkpoint, safetensors_io.Checkpoint, Model]:
  """Both folders' configs and tensor tables, checked to be of one architecture whose zoo model
  their tensors fit (ValueError naming the folder otherwise)."""
  a = safetensors_io.Checkpoint(path_a, "MODEL_A " + os.fspath(path_a))
  b = safetensors_io.Checkpoint(path_b, "MODEL_B " + os.fspath(path_b))
  difference = _architecture_difference(a, b)
  if difference:
    raise InputError(f"MODEL_A and MODEL_B have different architectures: {difference}")
  model = Model(a.config)
  safetensors_io.check_layout(a, model)
  safetensors_io.check_layout(b, model)
  return a, b, model


def _evaluation_batches(options: _Options, a: safetensors_io.Checkpoint,
                        b: safetensors_io.Checkpoint, model: Model
                        ) -> list[dict[str, np.ndarray]] | None:
  """The evaluation file's batches (``_eval_files``, with A's tokenizer or image processor
  config), or None without one."""
  if options.eval_text is not None:
    _same_tokenizer(a, b)
    return _eval_files.text_batches(options.eval_text, a.path, model, a.hf_config,
                                    batch_size=options.batch_size, seq_len=options.seq_len,
                                    max_batches=options.eval_batches)
  if options.eval_images is not None:
    return _eval_files.image_batches(options.eval_images, a.path, model, a.hf_config,
                                     batch_size=options.batch_size,
                                     max_batches=options.eval_batches)
  return None


def _split_for_learning(batches: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
  """Method "learned"'s split of the evaluation batches: (curve, training, held out), the first
  half for training, the next quarter held out to choose the iterate, the rest for the curve.

  Raises:
    InputError: fewer than 3 batches.
  """
  if len(batches) < 3:
    raise InputError(f"--method learned needs at least 3 evaluation batches (training, held out, "
                     f"curve); the data gives {len(batches)}")
  train, holdout = len(batches) // 2, (len(batches) - len(batches) // 2) // 2
  return batches[train + holdout:], batches[:train], batches[train:train + holdout]


def _inspect(path_a: str | os.PathLike, path_b: str | os.PathLike, options: _Options) -> _Inputs:
  """The checks that read files: both folders (``_read_pair``), the output folder, the scope on
  the model, the evaluation file and its batches. Nothing is written.

  Raises:
    InputError: the first problem (every ValueError of the readers becomes one).
  """
  try:
    a, b, model = _read_pair(path_a, path_b)
    _check_memory(a, b, model, options)
    if options.out is not None:
      _check_out(options.out, options.overwrite, (a, b))
    prefixes = _scope(model, options.scope)
    if "factors" in options.matching:
      _factors_in_scope(model, prefixes, options.matching["factors"])
    batches = _evaluation_batches(options, a, b, model)
  except InputError:
    raise
  except ValueError as e:
    raise InputError(str(e)) from None
  if options.method != "learned":
    return _Inputs(a, b, model, prefixes, batches)
  return _Inputs(a, b, model, prefixes, *_split_for_learning(batches))


def _check(path_a: str | os.PathLike, path_b: str | os.PathLike, options: _Options) -> _Inputs:
  """The check stage: the options (``_check_options``), the evaluation's packages
  (``_check_extras``), then the files (``_inspect``)."""
  _check_options(options)
  _check_extras(options)
  return _inspect(path_a, path_b, options)


# ----------------------------------------------------------------------------- load and align


def _load(inputs: _Inputs) -> _Loaded:
  """The load stage: both models' float32 parameters, one stored tensor at a time.

  Raises:
    InputError: a tensor holds NaN or Inf (``safetensors_io.load_params``).
  """
  try:
    return _Loaded(safetensors_io.load_params(inputs.a, inputs.model),
                   safetensors_io.load_params(inputs.b, inputs.model))
  except ValueError as e:
    raise InputError(str(e)) from None


def _learned_options(model: Model, inputs: _Inputs, say: Callable[[str], None]) -> dict[str, Any]:
  """``align_model``'s loss, batches and progress for method "learned": the mean loss of the
  evaluation file's first half, the iterate chosen on the next quarter (``_split_for_learning``)."""
  metrics = _eval_files.metric_fn(model)

  def loss_fn(params, batch):
    sums = metrics(params, batch)
    return sums["loss"] / sums["count"]

  def progress(line):
    say(f"learned: step {line['step']}/{line['steps']}, held-out barrier "
        f"{line['holdout_barrier']:.4g} (best {line['best_holdout_barrier']:.4g})")

  return dict(loss_fn=loss_fn, batches=inputs.train, holdout_batches=inputs.holdout,
              progress=progress)


def _match(inputs: _Inputs, options: _Options, loaded: _Loaded, say: Callable[[str], None]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
  """(g, info) of ``matching.align_model`` of B to A on the scope, with the C heap's free pages
  released between compiling a program and running it."""
  extra = _learned_options(inputs.model, inputs, say) if options.method == "learned" else {}
  with runtime.release_memory_after_compiles():
    element, info = matching.align_model(inputs.model.spec, loaded.a, loaded.b,
                                         scope=inputs.scope, method=options.method,
                                         **options.matching, **extra)
    jax.block_until_ready(element)
  return element, info


def _align(inputs: _Inputs, options: _Options, loaded: _Loaded, stage: _Stage) -> _Aligned:
  """The align stage: g (``_match``, timed as the stage's part "align_model"), A and B folded
  where g needs it, B' = g . B, the distances before and after, and the function check
  (``_function_check``, the part "function_check"): B's logits (and A's, if folded) on a few
  random inputs, taken before B (and A) are released and compared with those of B' (and A') as
  they are written.

  Without an evaluation, A and B are taken out of ``loaded`` and each of B's groups is released
  as soon as its part of B' is computed; with one, they stay there for the "before" path.

  Raises:
    FunctionCheckError: B' (or A') does not compute B's (or A's) function to the tolerance.
  """
  with stage.part("align_model", "matching"):
    element, info = _match(inputs, options, loaded, stage.say)
  model, keep = inputs.model, inputs.batches is not None
  params_a, params_b = (loaded.a, loaded.b) if keep else loaded.take()
  folded = bool(info.get("folded_norm_scales"))
  check_inputs = _check_inputs(model)
  with stage.part("function_check", "function check"):
    reference = {"aligned_b": _logits(model, params_b, check_inputs)}
    if folded:
      reference["aligned_a"] = _logits(model, params_a, check_inputs)
  if folded:
    params_a = group_action.fold_norm_scales(model.spec, params_a)
    params_b = group_action.fold_norm_scales(model.spec, params_b)
  before = _distances(params_a, params_b)
  aligned = _apply_by_group(model.spec, params_b, element, consume=not keep or folded)
  del params_b
  after = _distances(params_a, aligned)
  written = {"aligned_b": (inputs.b, aligned)} | ({"aligned_a": (inputs.a, params_a)} if folded
                                                  else {})
  with stage.part("function_check", "function check"):
    function = _function_check(model, options, check_inputs, reference, written)
  return _Aligned(element, info, folded, params_a, aligned, {"before": before, "after": after},
                  function)


def _apply_by_group(spec: spec_lib.SymmetrySpec, params: Params, element: dict[str, Any], *,
                    consume: bool) -> Params:
  """g . params (``group_action.apply_model``), one top-level group of leaves (``layers_i``,
  ``embed``, ...) at a time, op by op: under one jit, jaxlib 0.10's CPU LAPACK kernels (the
  sites' inverses) could deadlock when two ran side by side. With ``consume``, each group is
  removed from ``params`` once transformed, so that one model and one group are held, not two
  models (every attention site lies inside one group). The element is checked once, not once
  per group."""
  group_action.check_model_element(spec, element)
  out: Params = {}
  for group in list(params):
    part = spec.part(spec_lib.flatten({group: params[group]}))
    names = set(part.factors) | set(part.attention)
    out[group] = group_action.apply_model(part, {group: params[group]},
                                          {k: v for k, v in element.items() if k in names},
                                          check_element=False)[group]
    jax.block_until_ready(out[group])
    if consume:
      del params[group]
  return out


# One fused program per leaf shape: the merged model is written leaf by leaf, and eagerly each
# leaf would take three leaf-sized buffers ((1 - lam) a, lam b and their sum).
_interpolate = jax.jit(lmc.interpolate)


def _natural(name: str) -> list[Any]:
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


@jax.jit
def _leaf_squares(leaves_a: Sequence[jax.Array], leaves_b: Sequence[jax.Array]
                  ) -> tuple[list[jax.Array], jax.Array]:
  """([||a - b||^2 per leaf pair], ||A||^2), in one program; leaves passed as sequences, so
  that the program is compiled once per shapes, not once per set of paths."""
  gaps = [jnp.sum(jnp.square(a - b)) for a, b in zip(leaves_a, leaves_b)]
  return gaps, sum(jnp.sum(jnp.square(a)) for a in leaves_a)


def _squares(flat_a: Params, flat_b: Params) -> tuple[dict[str, float], float]:
  """({top-level group: ||a - b||^2 over its leaves}, ||A||^2) of flat leaves."""
  paths = list(flat_a)
  gaps, norm = _leaf_squares([flat_a[p] for p in paths], [flat_b[p] for p in paths])
  gaps = dict(zip(paths, gaps))
  squares: dict[str, float] = {}
  for path, gap in gaps.items():
    group = path.split("/")[0]
    squares[group] = squares.get(group, 0.0) + float(gap)
  return squares, float(norm)


def _distance_report(squares: Mapping[str, float], norm: float) -> dict[str, Any]:
  """||A - B|| in total, relative to ||A||, and per top-level group, from ``_squares``."""
  total = math.sqrt(sum(squares.values()))
  return {"total": total, "relative": total / math.sqrt(norm) if norm else 0.0,
          "per_layer": {g: math.sqrt(squares[g]) for g in sorted(squares, key=_natural)}}


def _distances(params_a: Params, params_b: Params) -> dict[str, Any]:
  """||A - B|| in total, relative to ||A||, and per top-level group of leaves."""
  return _distance_report(*_squares(spec_lib.flatten(params_a), spec_lib.flatten(params_b)))


# ----------------------------------------------------------------------------- the function check


def _check_inputs(model: Model) -> jax.Array:
  """The function check's inputs, drawn from ``jax.random.key(CHECK_SEED)`` as the model reads
  them (``model.input_key``): CHECK_BATCH rows of min(CHECK_TOKENS, max_len) uniform token ids
  [B, T] (int32), or CHECK_BATCH standard normal images [B, S, S, C] (float32)."""
  key, config = jax.random.key(CHECK_SEED), model.config
  if model.input_key == "image":
    return jax.random.normal(key, (CHECK_BATCH, config.image_size, config.image_size,
                                   config.num_channels), jnp.float32)
  return jax.random.randint(key, (CHECK_BATCH, min(CHECK_TOKENS, config.max_len)), 0,
                            config.vocab_size, jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _logits(model: Model, params: Params, inputs: jax.Array) -> jax.Array:
  """``model``'s float32 logits on ``inputs``: [B, classes] or [B, T, V]."""
  return model.apply(params, inputs)[0].astype(jnp.float32)


def _written_dtypes(ckpt: safetensors_io.Checkpoint, model: Model, dtype: str
                    ) -> dict[str, np.dtype]:
  """{parameter path: the dtype ``safetensors_io.save_params`` writes its tensor in}, laid out
  as ``ckpt``: the tensor's stored dtype (``dtype="keep"``) or float32."""
  table, _ = convert.param_table(model.config)
  if dtype == "float32":
    return {path: np.dtype(np.float32) for path in table}
  return {path: safetensors_io.DTYPES[ckpt.tensors[ckpt.names[src.key]].dtype]
          for path, src in table.items()}


def _round_to(params: Params, dtypes: Mapping[str, np.dtype]) -> None:
  """Rounds, in place, every leaf of ``params`` whose written dtype (``dtypes``) is narrower
  than float32 (bfloat16, float16) to that dtype's values, kept in float32: the function check
  then evaluates what is written, and writing rounds nothing further. One leaf is replaced at a
  time, so the rounded model never coexists with a whole copy of itself."""
  for path, dtype in dtypes.items():
    if dtype.itemsize >= 4:
      continue
    *parents, name = path.split("/")
    node = params
    for parent in parents:
      node = node[parent]
    node[name] = _rounded(node[name], dtype)


def _rounded(leaf: jax.Array, dtype: np.dtype) -> jax.Array:
  """``leaf``'s values rounded to ``dtype`` where it is narrower than float32, in float32."""
  return leaf if dtype.itemsize >= 4 else leaf.astype(dtype).astype(jnp.float32)


def _default_tolerance(dtypes: Iterable[np.dtype]) -> float:
  """The function check's default relative tolerance for a folder written in ``dtypes``: the
  square root of the machine epsilon of the least precise of them and float32 (the
  computation's): 3.5e-4 in float32, 3.1e-2 with float16 tensors, 8.8e-2 with bfloat16 ones."""
  return max(math.sqrt(float(jnp.finfo(d).eps)) for d in (*dtypes, np.dtype(np.float32)))


def _function_difference(reference: jax.Array, logits: jax.Array, tolerance: float
                         ) -> dict[str, float]:
  """How far ``logits`` lie from the ``reference`` logits (both [B, ...]).

  Returns:
    {"max_abs": max |logits - reference|, "scale": max |reference| (the logits' scale),
    "relative": max_abs / scale, "tolerance": the most relative difference allowed}.
  """
  reference, logits = np.asarray(reference, np.float64), np.asarray(logits, np.float64)
  max_abs = float(np.max(np.abs(logits - reference)))
  scale = float(np.max(np.abs(reference)))
  relative = max_abs / scale if scale else (0.0 if max_abs == 0 else math.inf)
  return {"max_abs": max_abs, "scale": scale, "relative": relative, "tolerance": tolerance}


def _function_check(model: Model, options: _Options, inputs: jax.Array,
                    reference: Mapping[str, jax.Array],
                    written: Mapping[str, tuple[safetensors_io.Checkpoint, Params]]
                    ) -> dict[str, Any]:
  """Checks that each folder to be written computes its source's function.

  Args:
    model: the zoo model.
    options: the dtype to write (``_written_dtypes``) and the tolerance (``function_tolerance``,
      else ``_default_tolerance`` of the folder's dtypes).
    inputs: the check's inputs (``_check_inputs``).
    reference: {"aligned_b": B's logits, "aligned_a": A's} on ``inputs``.
    written: {folder: (the checkpoint whose layout it takes, its float32 parameters)} for
      "aligned_b" (B') and, if folded, "aligned_a" (A'); each is rounded in place to the dtypes
      it is written in (``_round_to``) and then evaluated.

  Returns:
    {"inputs": {"seed", "shape"}, folder: ``_function_difference`` of its logits from its
    reference, for each folder}.

  Raises:
    FunctionCheckError: a folder's relative difference is above its tolerance (or NaN).
  """
  out: dict[str, Any] = {"inputs": {"seed": CHECK_SEED, "shape": list(inputs.shape)}}
  for folder, (ckpt, params) in written.items():
    dtypes = _written_dtypes(ckpt, model, options.dtype)
    _round_to(params, dtypes)
    tolerance = options.function_tolerance or _default_tolerance(set(dtypes.values()))
    out[folder] = d = _function_difference(reference[folder], _logits(model, params, inputs),
                                           tolerance)
    if not d["relative"] <= tolerance:
      source = {"aligned_b": "B", "aligned_a": "A"}[folder]
      what = "aligned B" if folder == "aligned_b" else "aligned A (A with its norm scales folded)"
      raise FunctionCheckError(
          f"{what} does not compute {source}'s function: on {inputs.shape[0]} random inputs its "
          f"logits differ from {source}'s by up to {d['max_abs']:.4g} ({d['relative']:.3g} of the "
          f"logits' scale {d['scale']:.4g}), above --function-tolerance {tolerance:.3g}; nothing "
          "is written")
  return out


# ----------------------------------------------------------------------------- evaluate and save


def _evaluate(inputs: _Inputs, options: _Options, aligned: _Aligned, loaded: _Loaded
              ) -> dict[str, Any]:
  """The evaluate stage: the curves of A to B ("before") and A to B' ("after") on the
  evaluation batches (``_curves``). A and B are taken out of ``loaded``: released after it."""
  paths = {"before": loaded.take(), "after": (aligned.params_a, aligned.params)}
  return _curves(inputs.model, inputs.batches, paths, options.num_lambdas, options.merge)


def _curves(model: Model, batches, paths: dict[str, tuple[Params, Params]], num_lambdas: int,
            merge: float | None = None) -> dict[str, Any]:
  """Loss and accuracy along each path, and the path's barriers; with ``merge``, the merged
  model's (``_merged``)."""
  evaluator = lmc.path_evaluator(_eval_files.metric_fn(model))
  metrics = lambda path, lams: _path_metrics(evaluator, *paths[path], batches, lams)
  lams = lmc.lambdas(num_lambdas)
  out: dict[str, Any] = {"lambdas": lams.tolist()}
  for name in paths:
    loss, accuracy = metrics(name, lams)
    out[name] = {"loss": loss.tolist(), "accuracy": accuracy.tolist(),
                 "barrier": {"loss": lmc.barrier(lams, loss),
                             "accuracy": lmc.barrier(lams, accuracy, higher_is_better=True)}}
  if merge is not None:
    out["merged"] = _merged(out, merge, lambda lam: metrics("after", np.array([lam])))
  return out


def _merged_line(curves: dict[str, Any]) -> str:
  """"; merged model (lambda 0.5): loss 2.31 (A 2.25, B 2.27), accuracy ..." or "" when
  nothing is merged."""
  if "merged" not in curves:
    return ""
  m = curves["merged"]
  loss, accuracy = (f"{k} {m[k]:.4g} (A {m['a'][k]:.4g}, B {m['b'][k]:.4g})"
                    for k in ("loss", "accuracy"))
  return f"; merged model (lambda {m['lambda']:g}): {loss}, {accuracy}"


def _path_metrics(evaluator, params_a: Params, params_b: Params, batches, lams: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
  """([P] loss, [P] accuracy) of (1 - lam) A + lam B at each of ``lams``, over ``batches``."""
  sums = lmc.evaluate_path(evaluator, params_a, params_b, batches, lams, chunk_size=1)
  return sums["loss"] / sums["count"], sums["correct"] / sums["count"]


def _merged(curves: dict[str, Any], merge: float,
            evaluate: Callable[[float], tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
  """The merged model (1 - merge) A' + merge B' (what out/merged holds) beside its endpoints:
  {"lambda", "loss", "accuracy", "a": {"loss", "accuracy"}, "b": {...}} on the evaluation
  batches. Read off the "after" curve when ``merge`` is one of its lambdas, else evaluated
  (``evaluate(merge)``); the endpoints are the curve's ends (A' computes A's function, B' B's)."""
  after, lams = curves["after"], np.asarray(curves["lambdas"])
  at = lambda i: {"loss": after["loss"][i], "accuracy": after["accuracy"][i]}
  hit = np.flatnonzero(np.abs(lams - merge) <= 1e-12)
  point = at(hit[0]) if hit.size else dict(zip(("loss", "accuracy"),
                                               (float(x[0]) for x in evaluate(merge))))
  return {"lambda": merge, **point, "a": at(0), "b": at(-1)}


def _plot(curves: dict[str, Any], path: str) -> None:
  # A bare Figure (no pyplot): the caller's plotting backend, in a notebook say, stays as it is.
  from matplotlib import figure  # pylint: disable=g-import-not-at-top

  fig = figure.Figure(figsize=(9, 3.5), layout="constrained")
  axes = fig.subplots(1, 2)
  for ax, metric in zip(axes, ("loss", "accuracy")):
    for name, style in (("before", "--"), ("after", "-")):
      barrier = curves[name]["barrier"][metric]
      ax.plot(curves["lambdas"], curves[name][metric], style, marker=".",
              label=f"{name} alignment (barrier {barrier:.4g})")
    ax.set_xlabel("lambda (0: A, 1: B)")
    ax.set_ylabel(metric)
    ax.legend()
  fig.savefig(path, dpi=120)


def _report(inputs: _Inputs, options: _Options, aligned: _Aligned, curves: dict[str, Any] | None,
            seconds: dict[str, float]) -> dict[str, Any]:
  """The report (DIR/report.json); ``seconds`` (the clock's, still filling) is its "time_s"."""
  a, b, model = inputs.a, inputs.b, inputs.model
  info = aligned.info
  report = {
      "model_a": os.path.abspath(a.path), "model_b": os.path.abspath(b.path),
      "model_type": a.hf_config.get("model_type"), "config": dataclasses.asdict(model.config),
      "parameters": inputs.parameters, "stored_dtypes": {"a": a.dtypes, "b": b.dtypes},
      "dtype": options.dtype, "checkpoint_bytes": {"a": a.nbytes, "b": b.nbytes},
      "method": options.method,
      "scope": options.scope if isinstance(options.scope, str) else list(options.scope),
      "scope_paths": inputs.scope, "merge": options.merge, "options": dict(options.matching),
      "folded_norm_scales": aligned.folded, "compare": aligned.compare,
      "rounds": int(info["rounds"]) if "rounds" in info else 0,
      "distance": aligned.distance, "function_check": aligned.function,
  }
  if "learned" in info:
    report["learned"] = runtime.jsonable(info["learned"])
  if "devices" in info:  # the streamed alignment: the devices each group was split over
    report["devices"] = info["devices"]
  if curves is not None:
    report["barrier"] = {name: curves[name]["barrier"] for name in ("before", "after")}
    if "merged" in curves:
      report["merged"] = curves["merged"]
    report["eval"] = {"text": options.eval_text or None, "images": options.eval_images or None,
                      "batches": len(inputs.batches), "batch_size": options.batch_size,
                      "predictions": float(sum(np.sum(x["weights"]) for x in inputs.batches))}
    if options.method == "learned":
      report["eval"] |= {"training_batches": len(inputs.train),
                         "holdout_batches": len(inputs.holdout)}
  report["time_s"] = seconds
  return report


def _save(inputs: _Inputs, options: _Options, aligned: _Aligned, curves: dict[str, Any] | None,
          report: dict[str, Any], stage: _Stage) -> list[str]:
  """The save stage: A' (A with its norm scales folded, if they are) to out/aligned_a, B' to
  out/aligned_b, with ``merge`` the merged model to out/merged, the curves to
  out/interpolation.json and .png, and last the report, its clock stopped just before
  (``_replace_outputs``). Returns the paths written."""
  a, b, model, dtype = inputs.a, inputs.b, inputs.model, options.dtype
  writers = {}
  if aligned.folded:
    writers["aligned_a"] = lambda p: safetensors_io.save_params(p, a, model, aligned.params_a,
                                                                dtype=dtype)
  writers["aligned_b"] = lambda p: safetensors_io.save_params(p, b, model, aligned.params,
                                                              dtype=dtype)
  if options.merge is not None:
    flat_a, merge = spec_lib.flatten(aligned.params_a), options.merge
    writers["merged"] = lambda p: safetensors_io.save_params(
        p, a, model, aligned.params, dtype=dtype,
        leaf_fn=lambda path, leaf: _interpolate(flat_a[path], leaf, merge))
  if curves is not None:
    writers["interpolation.json"] = _write_json(curves)
    writers["interpolation.png"] = lambda p: _plot(curves, p)

  def write_report(path):
    stage.stop()
    _write_json(report)(path)

  writers["report.json"] = write_report
  _replace_outputs(options.out, options.overwrite, writers)
  return [os.path.join(options.out, name) for name in writers]


def _replace_outputs(out: str, overwrite: bool, writers: dict[str, Callable[[str], None]]) -> None:
  """Runs ``writers[name](tmp/name)`` in a temporary folder inside ``out`` (``_staging``), then
  moves each result to ``out/name``."""
  with _staging(out, overwrite) as tmp:
    for name, write in writers.items():
      write(os.path.join(tmp, name))
      runtime.release_free_memory()


@contextlib.contextmanager
def _staging(out: str, overwrite: bool) -> Iterator[str]:
  """A temporary folder inside ``out`` to write the outputs in; when the block ends without
  an error, its entries are moved to ``out`` (with ``overwrite``, every earlier ``OUTPUTS``
  moved aside first and removed once the new ones are in place).

  Nothing a user had is ever removed by an error: the temporary folders go, earlier outputs
  moved aside come back, and ``out`` itself is removed only if this call made it and it is
  empty again (``os.rmdir``)."""
  made = not os.path.exists(out)
  os.makedirs(out, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".attn-symmetry-", dir=out)
  aside, done = None, False
  try:
    yield tmp
    aside = tempfile.mkdtemp(prefix=".attn-symmetry-old-", dir=out)
    kept = [name for name in (OUTPUTS if overwrite else ())
            if os.path.lexists(os.path.join(out, name))]
    placed: list[str] = []
    try:
      for name in kept:
        os.replace(os.path.join(out, name), os.path.join(aside, name))
      for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
        placed.append(name)
    except BaseException:
      for name in placed:
        os.replace(os.path.join(out, name), os.path.join(tmp, name))
      for name in os.listdir(aside):
        os.replace(os.path.join(aside, name), os.path.join(out, name))
      raise
    done = True
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
    if aside is not None and done:  # the earlier outputs, replaced
      shutil.rmtree(aside, ignore_errors=True)
    elif aside is not None:  # emptied by the restore above; kept if anything is left in it
      with contextlib.suppress(OSError):
        os.rmdir(aside)
    if made and not os.listdir(out):  # an error before anything was placed
      os.rmdir(out)


def _write_json(value: Any) -> Callable[[str], None]:
  def write(path):
    with open(path, "w", encoding="utf-8") as f:
      json.dump(value, f, indent=2)
      f.write("\n")
  return write


# ----------------------------------------------------------------------------- the function


@runtime.single_threaded_blas()  # jaxlib's LAPACK kernels: one thread each (runtime)
def align_checkpoints(path_a: str | os.PathLike, path_b: str | os.PathLike, *,
                      out: str | os.PathLike | None = None, method: str = "full",
                      scope: str | Sequence[str] = "full", merge: float | None = None,
                      eval_text: str | os.PathLike | None = None,
                      eval_images: str | os.PathLike | None = None, dtype: str = "keep",
                      function_tolerance: float | None = None, overwrite: bool = False, num_lambdas: int = 11, batch_size: int = 8,
                      seq_len: int = 128, eval_batches: int = 8,
                      progress: Callable[[str], None] | None = None,
                      memory_budget: float | None = None,
                      **options: Any) -> Alignment:
  """Aligns checkpoint B to checkpoint A (module docstring) and, with ``out``, writes the results.

  Args:
    path_a, path_b: Hugging Face model folders of one architecture.
    out: output folder (None: nothing is written); must be empty unless
      ``overwrite``.
    method: "full", "ortho", "perm", "naive" or "learned" (``matching.align_model``);
      "learned" needs ``eval_text`` or ``eval_images``: it trains on the first
      half of the batches, chooses its iterate on the next quarter, and the
      curve is evaluated on the last quarter.
    scope: a name of ``models.SCOPES`` or parameter path prefixes (a list, or
      one comma-separated string): what is aligned; the rest stays identity.
    merge: with ``out``, also write (1 - merge) A + merge B' to out/merged.
    eval_text, eval_images: an evaluation file or image folder
      (``_eval_files``); the interpolation curves and barriers are then
      computed (and written with ``out``).
    dtype: "keep" (every tensor in its stored dtype) or "float32".
    function_tolerance: the most relative difference (to the largest logit) allowed between
      the logits of B and B', and of A and A', on the function check's random inputs; None: the
      square root of the machine epsilon of the least precise dtype written (3.5e-4 in
      float32, 8.8e-2 with bfloat16 tensors).
    overwrite: replace this tool's earlier outputs in ``out``.
    num_lambdas, batch_size, seq_len, eval_batches: the evaluation: points
      on each path, examples per batch, tokens per text sequence, most batches.
    progress: called with one line per stage (e.g. ``print``).
    memory_budget: the most bytes the alignment may hold (default: the machine's memory);
      an alignment that needs more is refused before any work (``_check_memory``).
    **options: ``align_model``'s distance, steps, learning_rate, max_rounds,
      init, refine and solver; for method "learned", factors (a tuple of
      ``matching.LEARNED_FACTORS``; default every one the scope has).

  Returns:
    ``Alignment(model, params_a, params, element, report)``: the zoo model, A's
    and B' = g . B's float32 parameters (norm scales folded if
    report["folded_norm_scales"]; what aligned_a, or MODEL_A, and aligned_b hold), the
    element g and the report.

  Raises:
    InputError: bad input (one line naming the folder, file, tensor, config
      key or option), before anything is written.
    FunctionCheckError: (an InputError) B' or A' does not compute B's or A's function to
      ``function_tolerance``; nothing is written.
  """
  fspath = lambda path: None if path is None else os.fspath(path)
  opts = _Options(method=method, scope=scope if isinstance(scope, str) else tuple(scope),
                  merge=merge, dtype=dtype, function_tolerance=function_tolerance,
                  out=fspath(out), overwrite=overwrite,
                  eval_text=fspath(eval_text), eval_images=fspath(eval_images),
                  num_lambdas=num_lambdas, batch_size=batch_size, seq_len=seq_len,
                  eval_batches=eval_batches, matching=options, memory_budget=memory_budget)
  clock = _Clock(progress)
  with clock.stage("check") as stage:
    inputs = _check(path_a, path_b, opts)
    a, b = inputs.a, inputs.b
    stage.summary = (f"{a.config.family} ({inputs.model.task}), {inputs.parameters / 1e6:.2f}M "
                     f"parameters; A {'+'.join(a.dtypes)} {a.nbytes / 1e6:.1f} MB, B "
                     f"{'+'.join(b.dtypes)} {b.nbytes / 1e6:.1f} MB")
  if opts.streamed:
    return _stream(inputs, opts, clock)
  with clock.stage("load") as stage:
    loaded = _load(inputs)
    stage.summary = "both models in float32"
  with clock.stage("align") as stage:
    aligned = _align(inputs, opts, loaded, stage)
    before, after = aligned.distance["before"], aligned.distance["after"]
    function = aligned.function["aligned_b"]
    stage.summary = (f"method {method}, distance {before['total']:.6g} -> {after['total']:.6g} "
                     f"(relative {before['relative']:.4g} -> {after['relative']:.4g}), aligned "
                     f"B's logits within {function['relative']:.2g} of B's")
  curves = None
  if inputs.batches is not None:
    with clock.stage("evaluate") as stage:
      curves = _evaluate(inputs, opts, aligned, loaded)
      stage.summary = (f"{num_lambdas} lambdas x 2 paths on {len(inputs.batches)} batches, loss "
                       f"barrier {curves['before']['barrier']['loss']:.4g} -> "
                       f"{curves['after']['barrier']['loss']:.4g}" + _merged_line(curves))
  report = _report(inputs, opts, aligned, curves, clock.seconds)
  if opts.out is not None:
    with clock.stage("save") as stage:
      stage.summary = ", ".join(_save(inputs, opts, aligned, curves, report, stage))
  return Alignment(inputs.model, aligned.params_a, aligned.params, aligned.element, report)


# ----------------------------------------------------------------------------- command line


def _add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("model_a", metavar="MODEL_A", help="HF model folder A (the reference)")
  parser.add_argument("model_b", metavar="MODEL_B", help="HF model folder B (aligned to A)")
  parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
  parser.add_argument("--method", default="full",
                      help="full (default), ortho, perm, naive, or learned (with an evaluation file: "
                           "trained on its first half, chosen on the next quarter, the curve on "
                           "the last quarter), or a method that an --import module registers")
  parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                      help="import MODULE first (repeatable; the current folder is on the path): "
                           "a module that registers a matching method or a model family")
  parser.add_argument("--scope", default="full",
                      help=f"{', '.join(SCOPES)} (default full), or comma-separated parameter "
                           "path prefixes such as layers_0/attention")
  parser.add_argument("--merge", type=float, metavar="LAMBDA",
                      help="also write (1 - LAMBDA) A + LAMBDA aligned B to DIR/merged")
  data = parser.add_mutually_exclusive_group()
  data.add_argument("--eval-text", metavar="FILE", help="text to evaluate the paths on")
  data.add_argument("--eval-images", metavar="DIR", help="DIR/LABEL/*.png images (ViT)")
  parser.add_argument("--dtype", default="keep", choices=DTYPES,
                      help="keep each tensor's stored dtype (default) or write float32")
  parser.add_argument("--function-tolerance", type=float, metavar="TOL",
                      help="most relative logit difference between B and aligned B (A and "
                           "aligned A) on a few random inputs before anything is written "
                           "(default: sqrt of the written dtype's epsilon, 3.5e-4 in float32)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace this tool's earlier outputs in DIR")
  parser.add_argument("--lambdas", type=int, default=11, help="points on each path (default 11)")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=128, help="tokens per text sequence")
  parser.add_argument("--eval-batches", type=int, default=8, help="most evaluation batches")
  parser.add_argument("--steps", type=int, help="Stage 2 Adam steps of the full method")
  parser.add_argument("--learning-rate", type=float, help="Stage 2 Adam learning rate")
  parser.add_argument("--max-rounds", type=int, help="most rounds of coordinate descent")
  parser.add_argument("--init", help="start of the full method's refinement: procrustes, best")
  parser.add_argument("--refine", help="when full refines: every_round, final")
  parser.add_argument("--solver", help="the full method's refinement: gauss_newton, adam")
  parser.add_argument("--distance", help="Stage 1 head distance")
  parser.add_argument("--factors", type=lambda text: tuple(f for f in text.split(",") if f),
                      help="what --method learned trains, comma-separated: some of "
                           f"{','.join(matching.LEARNED_FACTORS)} (default: every one the "
                           "scope has)")
  parser.add_argument("--memory-budget", type=float, metavar="GB",
                      help="most memory the alignment may hold, in GB (default: the machine's); "
                           "an alignment that needs more is refused before any work")
  parser.add_argument("--quiet", action="store_true", help="no progress lines")
  parser.add_argument("--compilation-cache", metavar="DIR", default=runtime.COMPILATION_CACHE,
                      help="JAX's persistent compilation cache: a later alignment of the same "
                           "architecture skips compiling (default "
                           f"{runtime.COMPILATION_CACHE}; '' off)")


def _run(args: argparse.Namespace, prog: str) -> int:
  options = {k: getattr(args, k) for k in MATCHING_OPTIONS if getattr(args, k) is not None}
  if args.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
  say = None if args.quiet else lambda line: print(f"[align] {line}", file=sys.stderr, flush=True)
  try:
    _import_modules(args.imports)
    align_checkpoints(args.model_a, args.model_b, out=args.out, method=args.method,
                      scope=args.scope, merge=args.merge, eval_text=args.eval_text,
                      eval_images=args.eval_images, dtype=args.dtype,
                      function_tolerance=args.function_tolerance, overwrite=args.overwrite,
                      num_lambdas=args.lambdas, batch_size=args.batch_size, seq_len=args.seq_len,
                      eval_batches=args.eval_batches, progress=say,
                      memory_budget=None if args.memory_budget is None
                      else args.memory_budget * 1e9, **options)
  except InputError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 2
  return 0


def _import_modules(names: Sequence[str]) -> None:
  """Imports the ``--import`` modules, the current folder first on the path, so that the
  methods and families they register are known to the alignment.

  Raises:
    InputError: a module is not found (an error inside a module that is found propagates
      with its traceback).
  """
  if names and os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  for name in names:
    try:
      importlib.import_module(name)
    except ModuleNotFoundError as e:
      if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
        raise  # the module was found and fails on an import of its own
      raise InputError(f"--import {name}: no module named {e.name!r} in the current folder or "
                       "on the Python path") from e


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m attn_symmetry.align MODEL_A MODEL_B --out DIR ...``."""
  parser = argparse.ArgumentParser(prog="python -m attn_symmetry.align",
                                   description=__doc__.split("\n", 1)[0])
  _add_arguments(parser)
  return _run(parser.parse_args(argv), parser.prog)


def cli(argv: Sequence[str] | None = None) -> int:
  """The ``attn-symmetry`` console script: ``attn-symmetry align MODEL_A MODEL_B --out DIR ...``."""
  parser = argparse.ArgumentParser(prog="attn-symmetry")
  commands = parser.add_subparsers(dest="command", required=True)
  _add_arguments(commands.add_parser("align", help="align (and merge) two HF checkpoints",
                                     description=__doc__.split("\n", 1)[0]))
  return _run(parser.parse_args(argv), "attn-symmetry align")


if __name__ == "__main__":
  sys.exit(main())
