"""The one pass that turns g into the aligned folders, whatever the source (``_sources``): for
each group of leaves (``matching.stream_groups``), both models in canonical form where g needs
it (``group_action.canonical_form``), then one unit of leaves at a time, apply (B' = g . B), measure the distances, round to the written dtypes and write; then the function
check (``apply``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from attn_symmetry import group_action
from attn_symmetry import lmc
from attn_symmetry import matching
from attn_symmetry import spec as spec_lib
from attn_symmetry.align import _distances, _function_check, _memory
from attn_symmetry.align._clock import Stage
from attn_symmetry.align._records import Aligned, Inputs, Options, Params
from attn_symmetry.align._sources import Source
from attn_symmetry.models import safetensors_io

# One fused program per leaf shape: the merged model is written leaf by leaf, and eagerly each
# leaf would take three leaf-sized buffers ((1 - lam) a, lam b and their sum).
interpolate = jax.jit(lmc.interpolate)


def apply(source: Source, inputs: Inputs, options: Options, element: dict[str, Any],
          info: dict[str, Any], tmp: str | None, stage: Stage) -> Aligned:
  """B' = g . B (and A' = A in canonical form, where g needs it: the norm scales folded, and
  with ``--residual orthogonal`` the LayerNorm stream's writers projected and biases divided
  by the gains; B is brought to that form before g acts), a group of leaves read from
  ``source`` at a time (``_read_group``), then one unit of leaves at a time (``_leaf_units``:
  an attention site's leaves, or one leaf): B' computed, the distances before and after
  summed, both rounded to the dtypes they are written in, and written to the folders of
  ``_writers`` in ``tmp`` (none without ``tmp``). The source releases each group once it is
  done (``release``), so the pass holds a group of each model besides what the source holds.

  A' and B' are kept whole where four float32 models fit the memory budget
  (``_memory.keeps_models``; always with whole models): then the function check
  (``_function_check.function_check``) runs on them against the source's logits, computed
  before the pass. Otherwise the folders written into ``tmp`` are read back with their sources
  a layer at a time and checked so (``_function_check.streamed_function_check``); without
  ``tmp`` the check is skipped, which the report says.

  Raises:
    FunctionCheckError: B' (or A') does not compute B's (or A's) function to the tolerance.
  """
  model = inputs.model
  folded, keep = bool(info.get("folded_norm_scales")), _memory.keeps_models(model, options)
  folders = ("aligned_b", "aligned_a") if folded else ("aligned_b",)
  check_inputs = _function_check.check_inputs(model)
  reference = {}
  if keep:
    with stage.part("function_check", "function check"):
      reference = source.reference(folders, check_inputs)
  dtypes = {name: _function_check.written_dtypes(ckpt, model, options.dtype)
            for name, ckpt in (("aligned_a", inputs.a), ("aligned_b", inputs.b))}
  writers = _writers(inputs, options, folded, tmp)
  kept: tuple[Params, Params] = ({}, {})
  squares = {"before": ({}, 0.0), "after": ({}, 0.0)}
  spec = element_spec(inputs, options)
  group_action.check_model_element(spec, element)  # once: each unit below skips it
  groups = matching.stream_groups(spec)
  for done, paths in enumerate(groups, 1):
    group = _read_group(spec, paths, source.read(paths), folded)
    for unit in _leaf_units(spec, paths):
      a, b, aligned = _apply_unit(spec, unit, group, element)
      for when, other in (("before", b), ("after", aligned)):
        squares[when] = _add_squares(squares[when], _distances.squares(a, other))
      del b
      aligned = _round(aligned, dtypes["aligned_b"])
      a = _round(a, dtypes["aligned_a"]) if folded else a
      _write(writers, a, aligned, options.merge)
      if keep:
        kept[0].update(a)
        kept[1].update(aligned)
      del a, aligned
    del group
    source.release(paths)
    stage.tick("apply, B' = g . B", done, len(groups))
  for writer in writers.values():
    writer.close()
  params_a, params = (spec_lib.unflatten(x) if keep else None for x in kept)
  function = _check_function(inputs, options, folded, check_inputs, reference,
                             (params_a, params), tmp, stage)
  distance = {when: _distances.distance_report(*value) for when, value in squares.items()}
  return Aligned(element, info, folded, params_a, params, distance, function)


def element_spec(inputs: Inputs, options: Options) -> spec_lib.SymmetrySpec:
  """The spec whose group g belongs to (``matching.residual_spec``): the model's, or with
  ``--residual orthogonal`` the one whose stream factor is "mean_zero_orthogonal", its
  LayerNorm gains listed as norm scales (``group_action.canonical_form``)."""
  residual = options.matching.get("residual", matching.MatchOptions().residual)
  spec = inputs.model.spec
  return matching.residual_spec(spec, residual, matching.active_names(spec, inputs.scope))


def _read_group(spec: spec_lib.SymmetrySpec, paths: Sequence[str], read: tuple[Params, Params],
                folded: bool) -> tuple[Params, Params]:
  """(A's leaves, B's leaves) of one group (``matching.stream_groups``, which keeps each norm
  scale with its readers and, for a mean-zero orthogonal stream, its LayerNorm bias), flat and
  in float32; where g needs it, both in ``group_action.canonical_form`` of the group's part of
  ``spec`` (norm scales folded into their readers; for a LayerNorm stream, writers projected
  onto 1-perp and biases beta / gamma): A' and the form g acts on."""
  out = []
  for flat in read:
    flat = {p: jnp.asarray(x, jnp.float32) for p, x in flat.items()}
    if folded:
      flat = spec_lib.flatten(group_action.canonical_form(spec.part(paths),
                                                          spec_lib.unflatten(flat)))
    out.append(flat)
  return out[0], out[1]


def _leaf_units(spec: spec_lib.SymmetrySpec, paths: Sequence[str]) -> list[tuple[str, ...]]:
  """The leaves ``paths`` of one group (``matching.stream_groups``) in the units that ``apply``
  computes and writes one at a time: the leaves of each attention site together (its element
  acts on them jointly) and every other leaf alone."""
  sites = [[p for p in paths if p.startswith(s + "/")] for s in spec.attention]
  units = [u for u in sites if u]
  inside = {p for u in units for p in u}
  units += [[p] for p in paths if p not in inside]
  return [tuple(u) for u in units]


def _apply_unit(spec: spec_lib.SymmetrySpec, unit: Sequence[str], group: tuple[Params, Params],
                element: dict[str, Any]) -> tuple[Params, Params, Params]:
  """(A, B, B' = g . B) at the leaves of ``unit``, flat, from its group's leaves (``group``:
  A's, B's, as ``_read_group`` gives them)."""
  a, b = ({p: flat[p] for p in unit} for flat in group)
  part = spec.part(unit)
  names = set(part.factors) | set(part.attention)
  aligned = spec_lib.flatten(group_action.apply_model(
      part, spec_lib.unflatten(b), {k: v for k, v in element.items() if k in names},
      check_element=False))
  return a, b, {p: aligned[p] for p in unit}


def _add_squares(total: tuple[dict[str, float], float], unit: tuple[dict[str, float], float]
                 ) -> tuple[dict[str, float], float]:
  """The sum of two ``_distances.squares``: per top-level group, and ||A||^2."""
  (groups, norm), (more, more_norm) = total, unit
  return ({g: groups.get(g, 0.0) + more.get(g, 0.0) for g in {*groups, *more}},
          norm + more_norm)


def _round(flat: Params, dtypes: dict[str, Any]) -> Params:
  """``flat``'s leaves rounded to the dtypes they are written in (``_function_check.rounded``)."""
  return {p: _function_check.rounded(x, dtypes[p]) for p, x in flat.items()}


def _writers(inputs: Inputs, options: Options, folded: bool, tmp: str | None
             ) -> dict[str, safetensors_io.FolderWriter]:
  """The folders written unit by unit into ``tmp``: aligned_b, aligned_a if folded, merged
  with ``merge`` (but with ``repair``: the repair stage writes it, ``_repair``); none without
  ``tmp``."""
  if tmp is None:
    return {}
  like = {"aligned_b": inputs.b} | ({"aligned_a": inputs.a} if folded else {})
  if options.merge is not None and not options.repair:
    like["merged"] = inputs.a
  return {name: safetensors_io.FolderWriter(os.path.join(tmp, name), ckpt, inputs.model,
                                            dtype=options.dtype) for name, ckpt in like.items()}


def _write(writers: dict[str, safetensors_io.FolderWriter], a: Params, aligned: Params,
           merge: float | None) -> None:
  """One unit into each folder of ``writers``: B' to aligned_b, A' to aligned_a, and
  (1 - merge) A' + merge B' to merged, computed here leaf by leaf."""
  for name, writer in writers.items():
    if name == "merged":
      writer.put({p: interpolate(a[p], aligned[p], merge) for p in a})
    else:
      writer.put(aligned if name == "aligned_b" else a)


def _check_function(inputs: Inputs, options: Options, folded: bool, check_inputs: Any,
                    reference: dict[str, Any], kept: tuple[Params | None, Params | None],
                    tmp: str | None, stage: Stage) -> dict[str, Any]:
  """The function check of ``apply`` (the stage's part "function_check"): on A' and B' where
  they are kept, else on the folders written into ``tmp`` read back, else skipped (the reason,
  as "skipped")."""
  model, (params_a, params) = inputs.model, kept
  if params is None and tmp is None:
    return {"skipped": _memory.not_kept(model, options)}
  with stage.part("function_check", "function check"):
    if params is not None:
      written = {"aligned_b": (inputs.b, params)} | ({"aligned_a": (inputs.a, params_a)}
                                                      if folded else {})
      return _function_check.function_check(model, options, check_inputs, reference, written)
    written = {name: (source, safetensors_io.Checkpoint(os.path.join(tmp, name), name))
               for name, source in (("aligned_b", inputs.b), ("aligned_a", inputs.a))
               if name != "aligned_a" or folded}
    return _function_check.streamed_function_check(model, options, check_inputs, written)
