"""The evaluate and save stages and the report: the interpolation curves, the merged model's
metrics, the plot, the report, and the staging folder that every output is written through,
which never loses what a user had."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from attn_symmetry import lmc
from attn_symmetry import runtime
from attn_symmetry._version import __version__
from attn_symmetry.align import _check, _eval_files
from attn_symmetry.align._records import Aligned, Inputs, OUTPUTS, Options, Params, Repaired
from attn_symmetry.align._sources import Whole
from attn_symmetry.models import Model


def evaluate(inputs: Inputs, options: Options, aligned: Aligned, source: Whole,
             repaired: Repaired | None = None) -> dict[str, Any]:
  """The evaluate stage: the curves of A to B ("before") and A to B' ("after") on the
  evaluation batches (``_curves``), and the merged models'. A and B are taken out of the whole
  models' ``source`` (``Whole.take``): released after it."""
  paths = {"before": source.take(), "after": (aligned.params_a, aligned.params)}
  return _curves(inputs.model, inputs.batches, paths, options.num_lambdas, options.merge,
                 None if repaired is None else repaired.params)


def _curves(model: Model, batches, paths: dict[str, tuple[Params, Params]], num_lambdas: int,
            merge: float | None = None, repaired: Params | None = None) -> dict[str, Any]:
  """Loss and accuracy along each path, and the path's barriers; with ``merge``, the merged
  model's (``_merged``), and with ``repaired`` (the REPAIRed merge) its loss and accuracy as
  the merge's "repaired"."""
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
    out["merged"] = _merged(out, merge, lambda path, lam: metrics(path, np.array([lam])))
  if repaired is not None:  # the path from the model to itself at lambda 0: the model itself
    loss, accuracy = _path_metrics(evaluator, repaired, repaired, batches, np.zeros(1))
    out["merged"]["repaired"] = {"loss": float(loss[0]), "accuracy": float(accuracy[0])}
  return out


def merged_line(curves: dict[str, Any]) -> str:
  """"; merged model (lambda 0.5): loss 2.31 (naive merge 2.80, A 2.25, B 2.27), accuracy
  ...", with REPAIR "; REPAIRed merged model (lambda 0.5): loss 2.28 (plain merge 2.31, naive
  merge 2.80, A 2.25, B 2.27), ...", or "" when nothing is merged."""
  if "merged" not in curves:
    return ""
  m = curves["merged"]
  if "repaired" in m:
    loss, accuracy = (f"{k} {m['repaired'][k]:.4g} (plain merge {m[k]:.4g}, naive merge "
                      f"{m['naive'][k]:.4g}, A {m['a'][k]:.4g}, B {m['b'][k]:.4g})"
                      for k in ("loss", "accuracy"))
    return f"; REPAIRed merged model (lambda {m['lambda']:g}): {loss}, {accuracy}"
  loss, accuracy = (f"{k} {m[k]:.4g} (naive merge {m['naive'][k]:.4g}, A {m['a'][k]:.4g}, "
                    f"B {m['b'][k]:.4g})" for k in ("loss", "accuracy"))
  return f"; merged model (lambda {m['lambda']:g}): {loss}, {accuracy}"


def verdict_line(merged: dict[str, Any]) -> str:
  """Whether the aligned merge (the REPAIRed one where there is one) beat the naive merge, the
  same average of A and B without alignment, on the evaluation's loss."""
  best = merged.get("repaired", merged)
  what = "the REPAIRed aligned merge" if "repaired" in merged else "the aligned merge"
  ours, naive = best["loss"], merged["naive"]["loss"]
  beat = "beat" if ours < naive else "did not beat"
  return (f"{what} {beat} the naive merge: loss {ours:.4g} against {naive:.4g} (accuracy "
          f"{best['accuracy']:.4g} against {merged['naive']['accuracy']:.4g})")


def _path_metrics(evaluator, params_a: Params, params_b: Params, batches, lams: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
  """([P] loss, [P] accuracy) of (1 - lam) A + lam B at each of ``lams``, over ``batches``."""
  sums = lmc.evaluate_path(evaluator, params_a, params_b, batches, lams, chunk_size=1)
  return sums["loss"] / sums["count"], sums["correct"] / sums["count"]


def _merged(curves: dict[str, Any], merge: float,
            evaluate: Callable[[str, float], tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
  """The merged model (1 - merge) A' + merge B' (what out/merged holds) beside the naive merge
  (1 - merge) A + merge B and the endpoints: {"lambda", "loss", "accuracy", "naive": {"loss",
  "accuracy"}, "a": {...}, "b": {...}, "beats_naive": the merge's loss below the naive one's}
  on the evaluation batches. Each point is read off its curve ("after", "before") when
  ``merge`` is one of its lambdas, else evaluated (``evaluate(path, merge)``); the endpoints are
  the curve's ends (A' computes A's function, B' B's)."""
  lams = np.asarray(curves["lambdas"])
  hit = np.flatnonzero(np.abs(lams - merge) <= 1e-12)

  def at(path: str, i: int | None) -> dict[str, float]:
    if i is None:
      return dict(zip(("loss", "accuracy"), (float(x[0]) for x in evaluate(path, merge))))
    return {"loss": curves[path]["loss"][i], "accuracy": curves[path]["accuracy"][i]}

  point = at("after", hit[0] if hit.size else None)
  naive = at("before", hit[0] if hit.size else None)
  return {"lambda": merge, **point, "naive": naive, "a": at("after", 0), "b": at("after", -1),
          "beats_naive": point["loss"] < naive["loss"]}


def plot(curves: dict[str, Any], path: str) -> None:
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


def report(inputs: Inputs, options: Options, aligned: Aligned, curves: dict[str, Any] | None,
           repaired: Repaired | None, seconds: dict[str, float],
           agreed: dict[str, Any] | None = None) -> dict[str, Any]:
  """The report (DIR/report.json); ``seconds`` (the clock's, still filling) is its "time_s".

  "merged" holds, with an evaluation and ``merge``, the plain merge's loss and accuracy beside
  the naive merge's, A's and B's (and with REPAIR the repaired merge's, "repaired"); with
  REPAIR, also "repair", the info of each repaired point (``Repaired.points``). A bare
  encoder's evaluation is "agreement" (``_agreement.evaluate``)."""
  a, b, model = inputs.a, inputs.b, inputs.model
  info = aligned.info
  report = {
      "model_a": os.path.abspath(a.path), "model_b": os.path.abspath(b.path),
      "model_type": a.hf_config.get("model_type"), "config": dataclasses.asdict(model.config),
      "parameters": inputs.parameters, "stored_dtypes": {"a": a.dtypes, "b": b.dtypes},
      "dtype": options.dtype, "checkpoint_bytes": {"a": a.nbytes, "b": b.nbytes},
      "method": options.method, "seed": options.seed,
      "scope": options.scope if isinstance(options.scope, str) else list(options.scope),
      "scope_paths": inputs.scope, "merge": options.merge, "repair": options.repair,
      "options": runtime.jsonable(_check.options_used(options.method, dict(options.matching))),
      "folded_norm_scales": aligned.folded, "compare": aligned.compare,
      "untied_head": inputs.untied_head,
      "rounds": int(info["rounds"]) if "rounds" in info else 0,
      "distance": aligned.distance, "function_check": aligned.function,
  }
  if options.method in info:  # the method's own diagnostics, by its name
    report[options.method] = runtime.jsonable(info[options.method])
  if "devices" in info:  # the streamed alignment: the devices each group was split over
    report["devices"] = info["devices"]
  if inputs.match is not None:
    report["match_data"] = {"path": options.match_data, "batches": len(inputs.match),
                            "batch_shape": list(inputs.match[0][inputs.model.input_key].shape)}
  merged = {} if curves is None else curves.get("merged", {})
  if repaired is not None:
    merged = {"lambda": options.merge, **merged, "repair": repaired.points}
  if merged:
    report["merged"] = merged
  if curves is not None:
    report["barrier"] = {name: curves[name]["barrier"] for name in ("before", "after")}
    report["eval"] = {"text": options.eval_text or None, "images": options.eval_images or None,
                      "batches": len(inputs.batches), "batch_size": options.batch_size,
                      "predictions": float(sum(np.sum(x["weights"]) for x in inputs.batches))}
    if inputs.train is not None:  # a method that trains on a loss: on what, judged on what
      report["eval"] |= {"training_data": options.match_data or "the evaluation file's first "
                                                               "half",
                         "training_batches": len(inputs.train),
                         "holdout_batches": len(inputs.holdout)}
  if agreed is not None:
    report["agreement"] = agreed
    report["eval"] = {"text": options.eval_text, "batches": len(inputs.batches),
                      "batch_size": options.batch_size, "sentences": agreed["sentences"]}
  report["time_s"] = seconds
  report["attn_symmetry"] = provenance()
  return report


def provenance() -> dict[str, Any]:
  """The package's version, and where it runs from a git checkout, the commit and whether
  the package's files differ from it ("modified"); commit None otherwise."""
  out = {"version": __version__, "commit": None}
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  git = lambda *args: subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                                     timeout=10, check=True).stdout.strip()
  if os.path.exists(os.path.join(root, ".git")):
    with contextlib.suppress(OSError, subprocess.SubprocessError):
      out["commit"] = git("rev-parse", "HEAD")
      out["modified"] = bool(git("status", "--porcelain", "--untracked-files=no", "--",
                                 "attn_symmetry"))
  return out


def save_curves(curves: dict[str, Any], tmp: str) -> None:
  """The save stage: the curves into ``tmp`` (interpolation.json and .png)."""
  write_json(curves)(os.path.join(tmp, "interpolation.json"))
  plot(curves, os.path.join(tmp, "interpolation.png"))


def write_report(report: dict[str, Any], tmp: str) -> None:
  """The report into ``tmp`` (report.json), after every stage has ended: its "time_s" is
  whole."""
  write_json(report)(os.path.join(tmp, "report.json"))


def placed(out: str, tmp: str) -> list[str]:
  """The paths in ``out`` of what ``tmp`` holds, report.json last (written after the stages)."""
  return [os.path.join(out, name) for name in OUTPUTS
          if name == "report.json" or os.path.lexists(os.path.join(tmp, name))]


@contextlib.contextmanager
def staging(out: str | None, overwrite: bool) -> Iterator[str | None]:
  """A temporary folder inside ``out`` to write the outputs in (None without ``out``: nothing
  is written); when the block ends without an error, its entries are moved to ``out`` (with
  ``overwrite``, every earlier ``OUTPUTS`` moved aside first and removed once the new ones are
  in place).

  Nothing a user had is ever removed by an error: the temporary folders go, earlier outputs
  moved aside come back, and ``out`` itself is removed only if this call made it and it is
  empty again (``os.rmdir``)."""
  if out is None:
    yield None
    return
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


def write_json(value: Any) -> Callable[[str], None]:
  def write(path):
    with open(path, "w", encoding="utf-8") as f:
      json.dump(value, f, indent=2)
      f.write("\n")
  return write
