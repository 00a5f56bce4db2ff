"""Align and merge two Hugging Face checkpoints: ``attn-symmetry align`` and ``align_checkpoints``.

    attn-symmetry align MODEL_A MODEL_B --out DIR [--method full|ortho|perm|naive|learned]
                        [--scope ...]
                        [--merge 0.5] [--eval-text FILE | --eval-images DIR] [--dtype keep|float32]

    from attn_symmetry import align_checkpoints
    result = align_checkpoints("seed1", "seed2", out="aligned", merge=0.5)
    result.element, result.report, result.params     # g, the report, g . theta_B

MODEL_A and MODEL_B are local model folders of one architecture (GPT-2,
Llama, BERT or ViT; ``models.safetensors_io``), read and written without torch.
B is aligned to A by ``matching.align_model`` on the zoo model's symmetry spec
(head permutations and per-head matrices of every attention layer, FFN and
residual-stream factors), and re-parametrised as g . B, which computes the
same function. The stages, each announced by one progress line and timed in
the report:

1. check: both folders (config, tensor names, shapes and dtypes), their
   architectures against each other, the options, the output folder and the
   evaluation file. Every problem is refused here (or, for NaN weights, while
   loading) with a one-line ``InputError``, before anything is written;
2. load: both models' float32 parameters, one stored tensor at a time;
3. align: the element g and B' = g . B; squared distances ||A - B||, ||A - B'||
   per top-level parameter group (``layers_i``, ``embed``, ...);
4. evaluate (with an evaluation file, ``_eval_files``): loss and accuracy
   along (1 - lambda) A + lambda B ("before") and (1 - lambda) A + lambda B'
   ("after"), and their barriers (``lmc``);
5. save: DIR/aligned_b/ (B' in B's tensor names, shards and dtypes, with B's
   config and tokenizer files), DIR/merged/ with ``merge`` ((1 - merge) A +
   merge B' in A's layout), DIR/interpolation.json and .png with an
   evaluation file, DIR/report.json.

RMSNorm models (Llama): an orthogonal map of the residual stream is a
symmetry only once the norm scales are folded into the weights that read them
(``group_action.fold_norm_scales``). When the alignment uses one, A and B' are
compared, merged and saved folded: the same functions, with norm weights of one.

Memory and time. Peak memory stays within 3x the two checkpoints' size
(``benchmarks/bench_align_checkpoints.py``, GPT-2 small in float32): the
models are read one tensor at a time, B' is computed one top-level group of
leaves at a time with B's group released after it (B is kept only for an
evaluation), the merged model is computed leaf by leaf as it is written, and
the C heap's free pages are returned to the system after every stage and
between compiling the matching program and running it (``runtime``). jaxlib's
LAPACK kernels run on one OpenBLAS thread during the call
(``runtime.single_threaded_blas``): with OpenBLAS's own threads, matching's
batched inverses made GPT-2 small's alignment about 10x slower on 2 cores.

Outputs are written into a temporary folder inside DIR and then moved into
place; with ``overwrite`` the earlier outputs of this tool in DIR are replaced
and other files left alone. DIR may neither be nor contain nor lie inside
MODEL_A or MODEL_B, so nothing there is ever written.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from collections.abc import Callable, Sequence
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

OUTPUTS = ("aligned_b", "merged", "interpolation.json", "interpolation.png", "report.json")
MATCHING_OPTIONS = ("distance", "steps", "learning_rate", "max_rounds", "init", "refine", "solver")
DTYPES = ("keep", "float32")
Params = dict[str, Any]


class InputError(ValueError):
  """Bad input to ``align_checkpoints``, found before anything is written (one line)."""


class Alignment(NamedTuple):
  """What ``align_checkpoints`` returns.

  Attributes:
    model: the zoo ``Model`` of both checkpoints (``model.apply(params, inputs)``).
    params_a: A's float32 parameters (norm scales folded if
      report["folded_norm_scales"]).
    params: B' = g . B in float32, in the same parametrisation: what
      DIR/aligned_b holds.
    element: g, for ``group_action.apply_model(model.spec, params_b, g)``.
    report: the report, as written to DIR/report.json.
  """
  model: Model
  params_a: Params
  params: Params
  element: dict[str, Any]
  report: dict[str, Any]


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


# ----------------------------------------------------------------------------- check


def _architecture_difference(a: safetensors_io.Checkpoint, b: safetensors_io.Checkpoint
                             ) -> str | None:
  """None if A and B have one architecture, else what differs first: a config.json key whose
  value in B changes A's architecture, or else the field of the derived config."""
  if a.config == b.config:
    return None
  head = a.config.head
  for key in sorted(set(a.hf_config) | set(b.hf_config)):
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


def _scope(model: Model, scope: str | Sequence[str]) -> list[str]:
  """Parameter path prefixes of a scope name (``models.SCOPES``) or of prefixes."""
  if isinstance(scope, str):
    scope = model.scope_paths(scope) if scope in SCOPES else [s for s in scope.split(",") if s]
  try:
    names = matching.active_names(model.spec, list(scope))
  except ValueError as e:
    raise InputError(f"--scope: {e} (scopes: {', '.join(SCOPES)}, or path prefixes)") from None
  if not names:
    raise InputError(f"--scope {','.join(scope)} holds no whole attention site or factor to align")
  return list(scope)


def _check(path_a, path_b, *, out, overwrite, method, scope, merge, dtype, eval_text, eval_images,
           num_lambdas, batch_size, seq_len, eval_batches, options) -> _Inputs:
  if method not in matching.METHODS:
    raise InputError(f"--method must be one of {', '.join(matching.METHODS)}, got {method!r}")
  if method == "learned" and eval_text is None and eval_images is None:
    raise InputError("--method learned trains on the task loss: give --eval-text or --eval-images")
  unknown = sorted(set(options) - set(MATCHING_OPTIONS))
  if unknown:
    raise InputError(f"unknown matching options {unknown}; known: {', '.join(MATCHING_OPTIONS)}")
  if options.get("distance", "frobenius") not in matching.DISTANCES:
    raise InputError(f"--distance must be one of {', '.join(matching.DISTANCES)}")
  if merge is not None and not 0.0 <= merge <= 1.0:
    raise InputError(f"--merge must lie in [0, 1], got {merge}")
  if dtype not in DTYPES:
    raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
  if eval_text is not None and eval_images is not None:
    raise InputError("give --eval-text or --eval-images, not both")
  evaluated = eval_text is not None or eval_images is not None
  needed = {"tokenizers": eval_text is not None, "PIL": eval_images is not None,
            "matplotlib": evaluated and out is not None}  # the tokenizer, images, the plot
  missing = [m for m, need in needed.items() if need and importlib.util.find_spec(m) is None]
  if missing:
    raise InputError(f"the evaluation needs {', '.join(missing)}, which is not installed: "
                     f"pip install 'attn_symmetry[align]'")
  for name, value, least in (("--lambdas", num_lambdas, 3), ("--batch-size", batch_size, 1),
                             ("--seq-len", seq_len, 1), ("--eval-batches", eval_batches, 1)):
    if int(value) != value or value < least:
      raise InputError(f"{name} must be an integer >= {least}, got {value}")
  try:
    a = safetensors_io.Checkpoint(path_a, "MODEL_A " + os.fspath(path_a))
    b = safetensors_io.Checkpoint(path_b, "MODEL_B " + os.fspath(path_b))
    difference = _architecture_difference(a, b)
    if difference:
      raise InputError(f"MODEL_A and MODEL_B have different architectures: {difference}")
    model = Model(a.config)
    safetensors_io.check_layout(a, model)
    safetensors_io.check_layout(b, model)
    if out is not None:
      _check_out(os.fspath(out), overwrite, (a, b))
    prefixes = _scope(model, scope)
    batches = None
    if eval_text is not None:
      _same_tokenizer(a, b)
      batches = _eval_files.text_batches(os.fspath(eval_text), a.path, model, a.hf_config,
                                         batch_size=batch_size, seq_len=seq_len,
                                         max_batches=eval_batches)
    elif eval_images is not None:
      batches = _eval_files.image_batches(os.fspath(eval_images), a.path, model, a.hf_config,
                                          batch_size=batch_size, max_batches=eval_batches)
  except InputError:
    raise
  except ValueError as e:
    raise InputError(str(e)) from None
  if method != "learned":
    return _Inputs(a, b, model, prefixes, batches)
  if len(batches) < 3:
    raise InputError(f"--method learned needs at least 3 evaluation batches (training, held out, "
                     f"curve); the data gives {len(batches)}")
  train, holdout = len(batches) // 2, (len(batches) - len(batches) // 2) // 2
  return _Inputs(a, b, model, prefixes, batches[train + holdout:], batches[:train],
                 batches[train:train + holdout])


def _same_tokenizer(a: safetensors_io.Checkpoint, b: safetensors_io.Checkpoint) -> None:
  files = [os.path.join(c.path, "tokenizer.json") for c in (a, b)]
  if all(os.path.isfile(f) for f in files):
    with open(files[0], "rb") as fa, open(files[1], "rb") as fb:
      if fa.read() != fb.read():
        raise InputError(f"{a.name} and {b.name} have different tokenizer.json files")


# ----------------------------------------------------------------------------- stages


def _learned_options(model: Model, inputs: _Inputs, say: Callable[[str], None]) -> dict[str, Any]:
  """``align_model``'s loss, batches and progress for method "learned": the mean loss of the
  evaluation file's first half, the iterate chosen on the next quarter (``_check``)."""
  metrics = _eval_files.metric_fn(model)

  def loss_fn(params, batch):
    sums = metrics(params, batch)
    return sums["loss"] / sums["count"]

  def progress(line):
    say(f"learned: step {line['step']}/{line['steps']}, held-out barrier "
        f"{line['holdout_barrier']:.4g} (best {line['best_holdout_barrier']:.4g})")

  return dict(loss_fn=loss_fn, batches=inputs.train, holdout_batches=inputs.holdout,
              progress=progress)


def _part_spec(spec: spec_lib.SymmetrySpec, paths: set[str]) -> spec_lib.SymmetrySpec:
  """``spec`` on the leaves ``paths`` alone: their factors, the sites among them, their norms."""
  axes = {p: a for p, a in spec.axes.items() if p in paths}
  used = {f for a in axes.values() for f in a if f is not None}
  attention = {s: site for s, site in spec.attention.items()
               if any(p.startswith(s + "/") for p in paths)}
  norm_scales = {s: tuple(r for r in readers if r in paths)
                 for s, readers in spec.norm_scales.items() if s in paths}
  return spec_lib.SymmetrySpec({f: spec.factors[f] for f in used}, axes, attention, norm_scales)


def _apply_by_group(spec: spec_lib.SymmetrySpec, params: Params, element: dict[str, Any], *,
                    consume: bool) -> Params:
  """g . params (``group_action.apply_model``), one top-level group of leaves (``layers_i``,
  ``embed``, ...) at a time, op by op: under one jit, jaxlib 0.10's CPU LAPACK kernels (the
  sites' inverses) could deadlock when two ran side by side. With ``consume``, each group is
  removed from ``params`` once transformed, so that one model and one group are held, not two
  models (every attention site lies inside one group)."""
  out: Params = {}
  for group in list(params):
    part = _part_spec(spec, set(spec_lib.flatten({group: params[group]})))
    names = set(part.factors) | set(part.attention)
    out[group] = group_action.apply_model(part, {group: params[group]},
                                          {k: v for k, v in element.items() if k in names})[group]
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
def _leaf_squares(flat_a: Params, flat_b: Params) -> tuple[Params, jax.Array]:
  """({path: ||a - b||^2}, ||A||^2), in one program."""
  gaps = {p: jnp.sum(jnp.square(a - flat_b[p])) for p, a in flat_a.items()}
  return gaps, sum(jnp.sum(jnp.square(a)) for a in flat_a.values())


def _distances(params_a: Params, params_b: Params) -> dict[str, Any]:
  """||A - B|| in total, relative to ||A||, and per top-level group of leaves."""
  gaps, norm = _leaf_squares(spec_lib.flatten(params_a), spec_lib.flatten(params_b))
  squares: dict[str, float] = {}
  for path, gap in gaps.items():
    group = path.split("/")[0]
    squares[group] = squares.get(group, 0.0) + float(gap)
  norm, total = float(norm), math.sqrt(sum(squares.values()))
  return {"total": total, "relative": total / math.sqrt(norm) if norm else 0.0,
          "per_layer": {g: math.sqrt(squares[g]) for g in sorted(squares, key=_natural)}}


def _evaluate(model: Model, batches, paths: dict[str, tuple[Params, Params]], num_lambdas: int
              ) -> dict[str, Any]:
  """Loss and accuracy along each path, and the path's barriers."""
  evaluator = lmc.path_evaluator(_eval_files.metric_fn(model))
  lams = lmc.lambdas(num_lambdas)
  out: dict[str, Any] = {"lambdas": lams.tolist()}
  for name, (params_a, params_b) in paths.items():
    sums = lmc.evaluate_path(evaluator, params_a, params_b, batches, lams, chunk_size=1)
    loss, accuracy = sums["loss"] / sums["count"], sums["correct"] / sums["count"]
    out[name] = {"loss": loss.tolist(), "accuracy": accuracy.tolist(),
                 "barrier": {"loss": lmc.barrier(lams, loss),
                             "accuracy": lmc.barrier(lams, accuracy, higher_is_better=True)}}
  return out


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


def _save(out: str, overwrite: bool, writers: dict[str, Callable[[str], None]]) -> None:
  """Runs ``writers[name](tmp/name)`` in a temporary folder inside ``out``, then moves each
  result to ``out/name`` (with ``overwrite``, first removing every earlier ``OUTPUTS``)."""
  os.makedirs(out, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".attn-symmetry-", dir=out)
  try:
    for name, write in writers.items():
      write(os.path.join(tmp, name))
      runtime.release_free_memory()
    for name in OUTPUTS if overwrite else ():
      target = os.path.join(out, name)
      if os.path.isdir(target) and not os.path.islink(target):
        shutil.rmtree(target)
      elif os.path.lexists(target):
        os.remove(target)
    for name in writers:
      os.replace(os.path.join(tmp, name), os.path.join(out, name))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


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
                      overwrite: bool = False, num_lambdas: int = 11, batch_size: int = 8,
                      seq_len: int = 128, eval_batches: int = 8,
                      progress: Callable[[str], None] | None = None,
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
    overwrite: replace this tool's earlier outputs in ``out``.
    num_lambdas, batch_size, seq_len, eval_batches: the evaluation: points
      on each path, examples per batch, tokens per text sequence, most batches.
    progress: called with one line per stage (e.g. ``print``).
    **options: ``align_model``'s distance, steps, learning_rate, max_rounds,
      init, refine and solver.

  Returns:
    ``Alignment(model, params_a, params, element, report)``.

  Raises:
    InputError: bad input (one line naming the folder, file, tensor, config
      key or option), before anything is written.
  """
  say = progress or (lambda line: None)
  times: dict[str, float] = {}
  start = time.perf_counter()
  inputs = _check(path_a, path_b, out=out, overwrite=overwrite, method=method, scope=scope,
                  merge=merge, dtype=dtype, eval_text=eval_text, eval_images=eval_images,
                  num_lambdas=num_lambdas, batch_size=batch_size, seq_len=seq_len,
                  eval_batches=eval_batches, options=options)
  a, b, model = inputs.a, inputs.b, inputs.model
  times["check"] = time.perf_counter() - start
  size = sum(math.prod(s) for s in model.param_shapes.values())
  say(f"check: {a.config.family} ({model.task}), {size / 1e6:.2f}M parameters; A "
      f"{'+'.join(a.dtypes)} {a.nbytes / 1e6:.1f} MB, B {'+'.join(b.dtypes)} {b.nbytes / 1e6:.1f} MB "
      f"({times['check']:.1f} s)")

  start = time.perf_counter()
  try:
    params_a = safetensors_io.load_params(a, model)
    params_b = safetensors_io.load_params(b, model)
  except ValueError as e:
    raise InputError(str(e)) from None
  times["load"] = time.perf_counter() - start
  runtime.release_free_memory()  # each stage starts from the live arrays (runtime's docstring)
  say(f"load: both models in float32 ({times['load']:.1f} s)")

  start = time.perf_counter()
  if method == "learned":
    options = dict(options, **_learned_options(model, inputs, say))
  with runtime.release_memory_after_compiles():
    element, info = matching.align_model(model.spec, params_a, params_b, scope=inputs.scope,
                                         method=method, **options)
    jax.block_until_ready(element)
  times["align_model"] = time.perf_counter() - start
  runtime.release_free_memory()
  raw = (params_a, params_b) if inputs.batches is not None else None
  folded = bool(info.get("folded_norm_scales"))
  if folded:
    params_a = group_action.fold_norm_scales(model.spec, params_a)
    params_b = group_action.fold_norm_scales(model.spec, params_b)
  before = _distances(params_a, params_b)
  aligned = _apply_by_group(model.spec, params_b, element, consume=raw is None or folded)
  del params_b
  after = _distances(params_a, aligned)
  times["align"] = time.perf_counter() - start
  runtime.release_free_memory()
  say(f"align: method {method}, distance {before['total']:.6g} -> {after['total']:.6g} "
      f"(relative {before['relative']:.4g} -> {after['relative']:.4g}) ({times['align']:.1f} s, "
      f"of which matching {times['align_model']:.1f} s)")

  curves = None
  if inputs.batches is not None:
    start = time.perf_counter()
    curves = _evaluate(model, inputs.batches, {"before": raw, "after": (params_a, aligned)},
                       num_lambdas)
    del raw
    times["evaluate"] = time.perf_counter() - start
    runtime.release_free_memory()
    say(f"evaluate: {num_lambdas} lambdas x 2 paths on {len(inputs.batches)} batches, loss barrier "
        f"{curves['before']['barrier']['loss']:.4g} -> {curves['after']['barrier']['loss']:.4g} "
        f"({times['evaluate']:.1f} s)")

  report = {
      "model_a": os.path.abspath(a.path), "model_b": os.path.abspath(b.path),
      "model_type": a.hf_config.get("model_type"), "config": dataclasses.asdict(model.config),
      "parameters": size, "stored_dtypes": {"a": a.dtypes, "b": b.dtypes}, "dtype": dtype,
      "checkpoint_bytes": {"a": a.nbytes, "b": b.nbytes},
      "method": method, "scope": scope if isinstance(scope, str) else list(scope),
      "scope_paths": inputs.scope, "merge": merge,
      "options": {k: v for k, v in options.items() if k in MATCHING_OPTIONS},
      "folded_norm_scales": folded, "rounds": int(info["rounds"]) if "rounds" in info else 0,
      "distance": {"before": before, "after": after},
  }
  if "learned" in info:
    report["learned"] = runtime.jsonable(info["learned"])
  if curves is not None:
    report["barrier"] = {name: curves[name]["barrier"] for name in ("before", "after")}
    report["eval"] = {"text": os.fspath(eval_text) if eval_text else None,
                      "images": os.fspath(eval_images) if eval_images else None,
                      "batches": len(inputs.batches), "batch_size": batch_size,
                      "predictions": float(sum(np.sum(x["weights"]) for x in inputs.batches))}
    if method == "learned":
      report["eval"] |= {"training_batches": len(inputs.train),
                         "holdout_batches": len(inputs.holdout)}
  report["time_s"] = times
  if out is not None:
    out = os.fspath(out)
    start = time.perf_counter()
    writers = {"aligned_b": lambda p: safetensors_io.save_params(p, b, model, aligned, dtype=dtype)}
    if merge is not None:
      flat_a = spec_lib.flatten(params_a)
      writers["merged"] = lambda p: safetensors_io.save_params(
          p, a, model, aligned, dtype=dtype,
          leaf_fn=lambda path, leaf: _interpolate(flat_a[path], leaf, merge))
    if curves is not None:
      writers["interpolation.json"] = _write_json(curves)
      writers["interpolation.png"] = lambda p: _plot(curves, p)

    def write_report(path):
      times["save"] = time.perf_counter() - start
      _write_json(report)(path)

    writers["report.json"] = write_report
    _save(out, overwrite, writers)
    say(f"save: {', '.join(os.path.join(out, w) for w in writers)} ({times['save']:.1f} s)")
  return Alignment(model, params_a, aligned, element, report)


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
                      eval_images=args.eval_images, dtype=args.dtype, overwrite=args.overwrite,
                      num_lambdas=args.lambdas, batch_size=args.batch_size, seq_len=args.seq_len,
                      eval_batches=args.eval_batches, progress=say, **options)
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
