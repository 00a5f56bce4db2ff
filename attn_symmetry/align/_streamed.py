"""The streamed stages, "align" and "apply": g from both models read a group of tensors at a time
(``matching.align_model_streamed``), then B' computed and written a few tensors at a time
(``attn_symmetry.align``'s docstring, Streaming)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import group_action
from attn_symmetry import matching
from attn_symmetry import runtime
from attn_symmetry import spec as spec_lib
from attn_symmetry.align import _check, _distances, _function_check, _outputs
from attn_symmetry.align._clock import Clock, Stage
from attn_symmetry.align._records import Aligned, Alignment, InputError, Inputs, Options, Params
from attn_symmetry.models import safetensors_io


def _reader(inputs: Inputs) -> Callable[[Sequence[str]], tuple[Params, Params]]:
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


def _match_streamed(inputs: Inputs, options: Options, stage: Stage
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
  """(g, info) of ``matching.align_model_streamed`` of B to A on the scope, the models read
  a group of leaves at a time (``_reader``), each group split over this process's devices
  where it has several (``_local_mesh``; info["devices"] says how many); each pass over the
  groups says one line to the stage."""
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
                                                  mesh=mesh, progress=stage.say,
                                                  on_group=stage.tick, **options.matching)
    jax.block_until_ready(element)
  return element, info | {"devices": 1 if mesh is None else mesh.devices.size}


def _writers(inputs: Inputs, options: Options, folded: bool, tmp: str | None
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


def _apply_streamed(inputs: Inputs, options: Options, element: dict[str, Any],
                    info: dict[str, Any], tmp: str | None, stage: Stage) -> Aligned:
  """A pass over the groups of leaves (``matching.stream_groups``), one unit of leaves at a
  time (``_leaf_units``: an attention site's leaves, or one leaf): the unit of A and B read,
  folded where g needs it, B' = g . B, both rounded to the dtypes they are written in, the
  distances before and after summed, and the unit written to the folders of ``_writers`` in
  ``tmp``; so this pass holds a few leaves of each model, not a group. A' and B' are kept
  whole only where four float32 models fit the memory budget (``_check.keeps_models``): then
  the function check (``_function_check.function_check``) runs on them. Otherwise the folders
  written into ``tmp`` are read back with their sources a layer at a time and checked so
  (``_function_check.streamed_function_check``); without ``tmp`` the check is skipped, which
  the report says.

  Raises:
    FunctionCheckError: B' (or A') does not compute B's (or A's) function to the tolerance.
  """
  model, spec = inputs.model, inputs.model.spec
  folded, keep = bool(info.get("folded_norm_scales")), _check.keeps_models(model, options)
  check_inputs = _function_check.check_inputs(model)
  reference = {}
  if keep:
    with stage.part("function_check", "function check"):
      sources = {"aligned_b": inputs.b} | ({"aligned_a": inputs.a} if folded else {})
      for name, ckpt in sources.items():
        params = safetensors_io.load_params(ckpt, model)
        reference[name] = _function_check.logits(model, params, check_inputs)
        del params
  dtypes = {name: _function_check.written_dtypes(ckpt, model, options.dtype)
            for name, ckpt in (("aligned_a", inputs.a), ("aligned_b", inputs.b))}
  writers = _writers(inputs, options, folded, tmp)
  read, kept_a, kept_b = _reader(inputs), {}, {}
  squares = {"before": ({}, 0.0), "after": ({}, 0.0)}
  group_action.check_model_element(spec, element)  # once: each unit below skips it
  in_turn = matching.stream_groups(spec)
  for done, paths in enumerate(in_turn, 1):
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
        groups, norm = _distances.squares(a, other)
        total = squares[when][0]
        squares[when] = ({g: total.get(g, 0.0) + groups.get(g, 0.0) for g in {*total, *groups}},
                         squares[when][1] + norm)
      del b
      rounded = _function_check.rounded
      aligned = {p: rounded(x, dtypes["aligned_b"][p]) for p, x in aligned.items()}
      if folded:
        a = {p: rounded(x, dtypes["aligned_a"][p]) for p, x in a.items()}
      merged = ({p: _outputs.interpolate(a[p], aligned[p], options.merge) for p in a}
                if "merged" in writers else {})
      written = {"aligned_b": aligned, "aligned_a": a, "merged": merged}
      for name, writer in writers.items():
        writer.put(written[name])
      del written, merged
      if keep:
        kept_a.update(a)
        kept_b.update(aligned)
      del a, aligned
    stage.tick("apply, B' = g . B", done, len(in_turn))
  for writer in writers.values():
    writer.close()
  params_a, params = (spec_lib.unflatten(x) if keep else None for x in (kept_a, kept_b))
  if keep:
    written = {"aligned_b": (inputs.b, params)} | ({"aligned_a": (inputs.a, params_a)} if folded
                                                    else {})
    with stage.part("function_check", "function check"):
      function = _function_check.function_check(model, options, check_inputs, reference, written)
  elif tmp is not None:
    written = {name: (source, safetensors_io.Checkpoint(os.path.join(tmp, name), name))
               for name, source in (("aligned_b", inputs.b), ("aligned_a", inputs.a))
               if name in writers}
    with stage.part("function_check", "function check"):
      function = _function_check.streamed_function_check(model, options, check_inputs, written)
  else:
    four = _check.gb(4 * _check.whole_bytes(model))
    function = {"skipped": f"A, B and their aligned copies in float32 ({four}) do not fit the "
                           f"memory budget {_check.gb(options.budget)}, and without an output "
                           "folder nothing is written to read back a layer at a time"}
  distance = {when: _distances.distance_report(*value) for when, value in squares.items()}
  return Aligned(element, info, folded, params_a, params, distance, function)


def stream(inputs: Inputs, options: Options, clock: Clock) -> Alignment:
  """``align_checkpoints``'s streamed stages after the check: "align" (g, ``_match_streamed``)
  and "apply" (B' group by group, ``_apply_streamed``, written with the report into ``out``).
  Both allocate and free a layer's buffers over and over: from here on the process returns each
  large buffer to the system as it is freed (``runtime.return_freed_buffers``), so that its
  resident memory is what it holds."""
  runtime.return_freed_buffers()
  with clock.stage("align") as stage:
    element, info = _match_streamed(inputs, options, stage)
    stage.summary = (f"method {options.method}, {info.get('rounds', 0)} rounds, reading "
                     f"{len(matching.stream_groups(inputs.model.spec))} groups of tensors one at "
                     "a time" + (f", each split over {info['devices']} devices"
                                 if info.get("devices", 1) > 1 else ""))
  with clock.stage("apply") as stage:
    staging = (contextlib.nullcontext() if options.out is None
               else _outputs.staging(options.out, options.overwrite))
    with staging as tmp:
      aligned = _apply_streamed(inputs, options, element, info, tmp, stage)
      report = _outputs.report(inputs, options, aligned, None, clock.seconds)
      if tmp is not None:
        stage.stop()
        _outputs.write_json(report)(os.path.join(tmp, "report.json"))
    before, after = aligned.distance["before"], aligned.distance["after"]
    check = aligned.function.get("aligned_b")
    stage.summary = (f"B' = g . B group by group, distance {before['total']:.6g} -> "
                     f"{after['total']:.6g} (relative {before['relative']:.4g} -> "
                     f"{after['relative']:.4g}), " +
                     (f"aligned B's logits within {check['relative']:.2g} of B's" +
                      (" (read back a layer at a time)" if aligned.function.get("streamed")
                       else "") if check else
                      f"function check skipped: {aligned.function['skipped']}") +
                     (f"; written to {options.out}" if options.out else ""))
  return Alignment(inputs.model, aligned.params_a, aligned.params, element, report)
