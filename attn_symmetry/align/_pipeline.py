"""``align_checkpoints``: the stages in order (``attn_symmetry.align``'s docstring)."""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable

from attn_symmetry import matching
from attn_symmetry import runtime
from attn_symmetry import tasks
from attn_symmetry.align import _agreement, _apply, _check, _outputs, _repair, _sources
from attn_symmetry.align._clock import Clock
from attn_symmetry.align._records import Aligned, Alignment, Inputs, Options


@runtime.single_threaded_blas()  # jaxlib's LAPACK kernels: one thread each (runtime)
def align_checkpoints(path_a: str | os.PathLike, path_b: str | os.PathLike,
                      options: Options | None = None, *,
                      progress: Callable[[str], None] | None = None,
                      progress_bar: Callable[[str, int, int], None] | None = None,
                      **keywords) -> Alignment:
  """Aligns checkpoint B to checkpoint A (``attn_symmetry.align``'s docstring) and, with ``out``,
  writes the results.

  Args:
    path_a, path_b: Hugging Face model folders of one architecture.
    options: the options (``Options``; the command builds them from its flags), or None to
      take them from ``keywords``.
    progress: called with one line per stage (e.g. ``print``).
    progress_bar: called as ``progress_bar(pass, groups done, groups)`` during the passes over
      the groups of tensors (the command's: ``_clock.ProgressBar``).
    **keywords: without ``options``, the fields of ``Options`` (``out``, ``method``, ``scope``,
      ``merge``, ...; each field's doc says what it does) and ``align_model``'s matching options,
      the fields of ``matching.MatchOptions`` (``MATCHING_OPTIONS``) that the method reads
      (``matching.Method.reads``).

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
    TypeError: ``options`` is not an ``Options``, or is given with ``keywords``.
  """
  if options is None:
    options = Options.from_keywords(**keywords)
  elif not isinstance(options, Options) or keywords:
    raise TypeError("align_checkpoints takes one Options or keyword arguments, not both; got "
                    f"{options!r} and {', '.join(keywords) or 'no keywords'}")
  clock = Clock(progress, progress_bar)
  with clock.stage("check") as stage:
    inputs = _check.check(path_a, path_b, options)
    stage.summary = _check.summary(inputs)
  source = _sources.open_source(inputs, options, clock)
  with _outputs.staging(options.out, options.overwrite) as tmp:
    aligned = _align(source, inputs, options, clock, tmp)
    repaired = None
    if options.repair:
      with clock.stage("repair") as stage:
        repaired = _repair.repaired_merge(inputs, options, aligned, tmp)
        stage.summary = _repair.summary(repaired)
    curves = agreed = None
    if inputs.batches is not None and inputs.model.task == tasks.FEATURES:
      with clock.stage("evaluate") as stage:
        agreed = _agreement.evaluate(inputs, options, aligned, *source.take())
        stage.summary = (f"sentence embeddings of {len(_agreement.MODELS)} models on "
                         f"{agreed['sentences']} sentences")
    elif inputs.batches is not None:
      with clock.stage("evaluate") as stage:
        curves = _outputs.evaluate(inputs, options, aligned, source, repaired)
        stage.summary = (f"{options.num_lambdas} lambdas x 2 paths on {len(inputs.batches)} "
                         f"batches, loss barrier {curves['before']['barrier']['loss']:.4g} -> "
                         f"{curves['after']['barrier']['loss']:.4g}" +
                         _outputs.merged_line(curves))
      if tmp is not None:
        with clock.stage("save") as stage:
          _outputs.save_curves(curves, tmp)
          stage.summary = ", ".join(_outputs.placed(options.out, tmp))
    report = _outputs.report(inputs, options, aligned, curves, repaired, clock.seconds, agreed)
    if tmp is not None:
      _outputs.write_report(report, tmp)
  return Alignment(inputs.model, aligned.params_a, aligned.params, aligned.element, report)


def _align(source: _sources.Source, inputs: Inputs, options: Options,
           clock: Clock, tmp: str | None) -> Aligned:
  """g (``source.match``) and the pass that computes B' and writes it into ``tmp``
  (``_apply.apply``): with whole models one stage, "align"; streamed two, "align" (rounds of
  passes over the groups) and "apply" (the last pass)."""
  with clock.stage("align") as stage:
    element, info = source.match(options, stage)
    if isinstance(source, _sources.Whole):
      aligned = _apply.apply(source, inputs, options, element, info, tmp, stage)
      stage.summary = f"method {options.method}, {_done(aligned, options)}"
      return aligned
    groups = len(matching.stream_groups(inputs.model.spec))
    if "passes" in info:  # streamed by its activations
      stage.summary = (f"method {options.method}, {info['passes']} passes of both models over "
                       f"{info['batches']} match batches, a layer at a time")
    else:
      stage.summary = (f"method {options.method}, {info.get('rounds', 0)} rounds, reading "
                       f"{groups} groups of tensors one at a time" +
                       (f", each split over {info['devices']} devices"
                        if info.get("devices", 1) > 1 else ""))
  with clock.stage("apply") as stage:
    aligned = _apply.apply(source, inputs, options, element, info, tmp, stage)
    stage.summary = f"B' = g . B group by group, {_done(aligned, options)}"
  return aligned


def _done(aligned: Aligned, options: Options) -> str:
  """What the pass found: the distances before and after, the function check, and where it
  wrote."""
  before, after = aligned.distance["before"], aligned.distance["after"]
  check = aligned.function.get("aligned_b")
  if check is None:
    checked = f"function check skipped: {aligned.function['skipped']}"
  else:
    checked = (f"aligned B's {aligned.function.get('outputs', 'logits')} within "
               f"{check['relative']:.2g} of B's" +
               (" (read back a layer at a time)" if aligned.function.get("streamed") else ""))
  return (f"distance {before['total']:.6g} -> {after['total']:.6g} (relative "
          f"{before['relative']:.4g} -> {after['relative']:.4g}), {checked}" +
          (f"; written to {options.out}" if options.out else ""))


def _signature() -> inspect.Signature:
  """``align_checkpoints``'s signature with every field of ``Options`` and every matching
  option as a keyword argument at its default, before ``**keywords``."""
  params = list(inspect.signature(align_checkpoints).parameters.values())
  fields = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
            for f in dataclasses.fields(Options) if f.name != "matching"]
  table = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default)
           for o in matching.OPTIONS]
  return inspect.Signature(params[:-1] + fields + table + params[-1:])


align_checkpoints.__signature__ = _signature()
