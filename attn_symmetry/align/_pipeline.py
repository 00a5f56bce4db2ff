"""``align_checkpoints``: the stages in order (``attn_symmetry.align``'s docstring)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from attn_symmetry import runtime
from attn_symmetry.align import _check, _in_memory, _outputs, _streamed
from attn_symmetry.align._clock import Clock
from attn_symmetry.align._records import Alignment, Options


@runtime.single_threaded_blas()  # jaxlib's LAPACK kernels: one thread each (runtime)
def align_checkpoints(path_a: str | os.PathLike, path_b: str | os.PathLike, *,
                      out: str | os.PathLike | None = None, method: str = "full",
                      scope: str | Sequence[str] = "full", merge: float | None = None,
                      eval_text: str | os.PathLike | None = None,
                      eval_images: str | os.PathLike | None = None, dtype: str = "keep",
                      function_tolerance: float | None = None, overwrite: bool = False,
                      num_lambdas: int = 11, batch_size: int = 8, seq_len: int = 128,
                      eval_batches: int = 8,
                      progress: Callable[[str], None] | None = None,
                      progress_bar: Callable[[str, int, int], None] | None = None,
                      memory_budget: float | None = None,
                      **options: Any) -> Alignment:
  """Aligns checkpoint B to checkpoint A (``attn_symmetry.align``'s docstring) and, with ``out``,
  writes the results.

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
    progress_bar: called as ``progress_bar(pass, groups done, groups)`` during the streamed
      passes over the groups of tensors (the command's: ``_clock.ProgressBar``).
    memory_budget: the most bytes the alignment may hold (default: the machine's memory);
      an alignment that needs more is refused before any work (``_check.check_memory``).
    **options: ``align_model``'s matching options, the fields of ``matching.MatchOptions``
      (``MATCHING_OPTIONS``), those the method reads (``matching.Method.reads``).

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
  opts = Options(method=method, scope=scope if isinstance(scope, str) else tuple(scope),
                 merge=merge, dtype=dtype, function_tolerance=function_tolerance,
                 out=fspath(out), overwrite=overwrite,
                 eval_text=fspath(eval_text), eval_images=fspath(eval_images),
                 num_lambdas=num_lambdas, batch_size=batch_size, seq_len=seq_len,
                 eval_batches=eval_batches, matching=options, memory_budget=memory_budget)
  clock = Clock(progress, progress_bar)
  with clock.stage("check") as stage:
    inputs = _check.check(path_a, path_b, opts)
    a, b = inputs.a, inputs.b
    stage.summary = (f"{a.config.family} ({inputs.model.task}), {inputs.parameters / 1e6:.2f}M "
                     f"parameters; A {'+'.join(a.dtypes)} {a.nbytes / 1e6:.1f} MB, B "
                     f"{'+'.join(b.dtypes)} {b.nbytes / 1e6:.1f} MB")
  if opts.streamed:
    return _streamed.stream(inputs, opts, clock)
  with clock.stage("load") as stage:
    loaded = _in_memory.load(inputs)
    stage.summary = "both models in float32"
  with clock.stage("align") as stage:
    aligned = _in_memory.align(inputs, opts, loaded, stage)
    before, after = aligned.distance["before"], aligned.distance["after"]
    function = aligned.function["aligned_b"]
    stage.summary = (f"method {method}, distance {before['total']:.6g} -> {after['total']:.6g} "
                     f"(relative {before['relative']:.4g} -> {after['relative']:.4g}), aligned "
                     f"B's logits within {function['relative']:.2g} of B's")
  curves = None
  if inputs.batches is not None:
    with clock.stage("evaluate") as stage:
      curves = _outputs.evaluate(inputs, opts, aligned, loaded)
      stage.summary = (f"{num_lambdas} lambdas x 2 paths on {len(inputs.batches)} batches, loss "
                       f"barrier {curves['before']['barrier']['loss']:.4g} -> "
                       f"{curves['after']['barrier']['loss']:.4g}" + _outputs.merged_line(curves))
  report = _outputs.report(inputs, opts, aligned, curves, clock.seconds)
  if opts.out is not None:
    with clock.stage("save") as stage:
      stage.summary = ", ".join(_outputs.save(inputs, opts, aligned, curves, report, stage))
  return Alignment(inputs.model, aligned.params_a, aligned.params, aligned.element, report)
