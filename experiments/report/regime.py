"""The sweeps of the full model (width, data size): their tables and trends, from the committed runs.

A sweep (``Sweep``, ``SWEEPS``) is a set of settings of ``experiments/configs/cpu_paper.py``
that differ in one quantity x and study the "full" scope (every model trained from scratch
on five seeds): the ViT's and the byte-level GPT-2's widths (head count fixed, head
dimension w / heads), and the training data's size at width 64. ``sweep_table`` sets a
sweep's committed points side by side: per point, each method's mean loss barrier over the
pairs with its 95 % interval over seeds (``seed_statistics.jackknife``), each method's
barrier in % of naive, and how the runs ended (``report.training_cell``); ``width_table``
is the ViT's width sweep with its points under a more patient rule.

The trend is a slope against log2 x (below, "width" for x), in a paired design: a seed
keeps its name, and its data order, at every point of a sweep, so the pair (a, b) is
measured at every width. With k widths x_i = log2 w_i and y_{p,i} pair p's value at width i,
each pair's least-squares slope is

    b_p = sum_i c_i y_{p,i},   c_i = (x_i - mean(x)) / sum_j (x_j - mean(x))^2,

the change per doubling of the width, and the sweep's slope is the mean of b_p over the pairs
measured at every point (``paired_slope``), with the leave-one-seed-out jackknife interval
over them (``seed_statistics.jackknife``; t with n_seeds - 1 degrees of freedom): the seed is
the unit, and whatever a seed's runs share across widths is inside its unit. With three or
more points the same is done for the curvature, the pair's coefficient on the quadratic
contrast q_i (x_i^2 less its least-squares fit on 1 and x_i), sum_i q_i y_{p,i} / sum_i q_i^2:
an interval away from 0 says the points do not lie on a line. ``slope`` is the unpaired form,
kept for points whose pairs do not match: per-width means m_i with seed-level errors SE_i
taken as independent, SE_b^2 = sum_i c_i^2 SE_i^2, df the fewest seeds at any width less one.
``endpoints`` says how each point's runs ended (plateau or step budget, ``run.json``'s
"training"), beside every slope.

``control_table`` reports the positive control (``CONTROL``: children spawned from one
checkpoint, the "spawn" scope of ``experiments/train/reinit.py``): each method's barrier, its paired
difference to naive judged against ``CONTROL_MARGIN``, and how near the element it found is to
the identity. ``plot_sweep`` draws a sweep (``python -m experiments.report.regime`` writes
``results/<sweep.figure>`` for every sweep with a committed point).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from matplotlib import figure

from experiments.configs import cpu_paper
from experiments.report import committed
from experiments.report import report
from experiments.report import seed_statistics as ss
from experiments.workdir import atomic_io

# The order of the columns: these first, then any other method a point has, by name.
METHOD_ORDER = ("naive", "full", "activation", "learned")


class Sweep(NamedTuple):
  """Settings that differ in one quantity x, studied in the "full" scope.

  Attributes:
    key: a name for the sweep (figure file, anchors).
    title: what is swept, for the figure's title.
    axis: the x axis's label.
    points: x -> the setting that has it.
    label: the table's cell for x.
    figure: the file under results/ that ``plot_sweep`` writes.
  """
  key: str
  title: str
  axis: str
  points: dict[float, str]
  label: Callable[[float], str]
  figure: str


_HEADS = cpu_paper.SWEEP_HEADS
_width_axis = f"width ({_HEADS} heads, head dim = width / {_HEADS})"
_width_label = lambda w: f"{w:g} ({int(w) // _HEADS})"
VIT_WIDTH = Sweep("vit_width", "ViT on Fashion-MNIST, full model re-initialised, by width",
                  _width_axis, dict(cpu_paper.WIDTH_SWEEP), _width_label, "width_sweep.png")
GPT2_WIDTH = Sweep("gpt2_width", "byte-level GPT-2 on Wikipedia, full model re-initialised, "
                   "by width", _width_axis, dict(cpu_paper.LM_WIDTH_SWEEP), _width_label,
                   "width_sweep_gpt2.png")
VIT_DATA = Sweep("vit_data", "ViT on Fashion-MNIST at width 64, by training images",
                 "training images", {5000: "data_vit_fashion_5k", 20000: "data_vit_fashion_20k",
                                     54000: cpu_paper.WIDTH_SWEEP[64]},
                 lambda n: f"{n:,.0f}", "data_sweep_vit.png")
GPT2_DATA = Sweep("gpt2_data", "byte-level GPT-2 at width 64, by training bytes",
                  "fraction of the training split's articles",
                  {0.25: "data_gpt2_wiki_quarter", 0.5: "data_gpt2_wiki_half",
                   1.0: cpu_paper.LM_WIDTH_SWEEP[64]}, lambda f: f"{f:g}", "data_sweep_gpt2.png")
GPT2_DEPTH6 = Sweep("gpt2_width_depth6", "byte-level GPT-2 on Wikipedia at 6 layers (the lm_* "
                    "protocol), full model re-initialised, by width", _width_axis,
                    dict(cpu_paper.DEPTH6_WIDTHS), _width_label, "width_sweep_gpt2_depth6.png")
SWEEPS = (VIT_WIDTH, GPT2_WIDTH, VIT_DATA, GPT2_DATA, GPT2_DEPTH6)


class Slope(NamedTuple):
  """A least-squares slope against log2 width and its 95 % interval (module docstring):
  ``paired`` when it is the mean of per-pair slopes with a seed-level interval, and then
  ``curvature`` (per pair, its interval) with three or more points."""
  estimate: float
  low: float
  high: float
  se: float
  df: int
  paired: bool = False
  curvature: ss.Interval | None = None


def _contrasts(x: Sequence[float]) -> tuple[list[float], list[float] | None]:
  """(the slope's weights c_i, the curvature's weights q_i / sum q^2 or None under three
  distinct points) on the points x_i (module docstring)."""
  mean = sum(x) / len(x)
  sxx = sum((v - mean) ** 2 for v in x)
  c = [(v - mean) / sxx for v in x]
  if len(set(x)) < 3:
    return c, None
  square = [v * v for v in x]
  fit_slope = sum(ci * s for ci, s in zip(c, square))
  fit_mean = sum(square) / len(x)
  q = [s - fit_mean - fit_slope * (v - mean) for v, s in zip(x, square)]
  qq = sum(v * v for v in q)
  return c, [v / qq for v in q]


def paired_slope(xs: Sequence[float], per_point: Sequence[Sequence[ss.Pair]]) -> Slope | None:
  """The mean of the per-pair slopes against log2 x over the pairs with a finite value at every
  point, with its leave-one-seed-out interval, and the curvature likewise (module docstring).

  Args:
    xs: the points' x, at least two distinct.
    per_point: each point's pairs (seed a, seed b, value).

  Returns:
    ``Slope`` (paired), or None with fewer than two distinct points or too few seeds measured
    at every point (``seed_statistics.why_no_interval``).
  """
  x = [math.log2(v) for v in xs]
  if len(set(x)) < 2:
    return None
  values = [{(a, b): v for a, b, v in pairs if v is not None and math.isfinite(v)}
            for pairs in per_point]
  common = sorted(set.intersection(*(set(v) for v in values)))
  c, q = _contrasts(x)
  of = lambda w, key: sum(wi * v[key] for wi, v in zip(w, values))
  slope_ = ss.jackknife([(a, b, of(c, (a, b))) for a, b in common])
  if slope_ is None:
    return None
  curvature = None if q is None else ss.jackknife([(a, b, of(q, (a, b))) for a, b in common])
  return Slope(slope_.estimate, slope_.low, slope_.high, slope_.se, slope_.num_seeds - 1, True,
               curvature)


def slope(widths: Sequence[int], intervals: Sequence[ss.Interval]) -> Slope | None:
  """The slope of the per-width estimates against log2 width (module docstring).

  Args:
    widths: the widths, at least two distinct.
    intervals: each width's estimate and its seed-level standard error.

  Returns:
    ``Slope``, or None with fewer than two distinct widths.
  """
  x = [math.log2(w) for w in widths]
  if len(set(x)) < 2:
    return None
  mean = sum(x) / len(x)
  sxx = sum((v - mean) ** 2 for v in x)
  c = [(v - mean) / sxx for v in x]
  b = sum(ci * i.estimate for ci, i in zip(c, intervals))
  se = math.sqrt(sum((ci * i.se) ** 2 for ci, i in zip(c, intervals)))
  df = min(i.num_seeds for i in intervals) - 1
  half = ss.t_quantile(0.975, df) * se
  return Slope(b, b - half, b + half, se, df)


def _pairs(res: dict[str, Any], method: str, ratio: bool) -> list[ss.Pair]:
  """(a, b, value) of every pair: the loss barrier, or its ratio to naive in %; none where
  the point lacks the method."""
  out = []
  if not all(method in p["methods"] for p in res["pairs"]):
    return out
  for p in res["pairs"]:
    value = p["methods"][method]["loss_barrier"]
    if ratio:
      value = report.ratio_pct(value, p["methods"]["naive"]["loss_barrier"])
    out.append((p["a"], p["b"], value))
  return out


def _committed(results_root: str, points: dict[float, str] | None = None
               ) -> list[tuple[float, str, dict[str, Any], dict[str, Any]]]:
  """(x, setting, run.json, the "full" scope's results.json) of each committed point of
  ``points`` (x -> setting; the ViT's width sweep by default)."""
  out = []
  for width, setting in sorted((points or VIT_WIDTH.points).items()):
    if (run := committed.find(results_root, setting)) is not None:
      out.append((width, setting, run.record(), run.results("full")))
  return out


def show_interval(i: ss.Interval | None, digits: int) -> str:
  """"estimate [low, high]" to ``digits`` decimals; "n/a" without an interval."""
  if i is None:
    return "n/a"
  return f"{i.estimate:.{digits}f} [{i.low:.{digits}f}, {i.high:.{digits}f}]"


def methods_of(results: Sequence[dict[str, Any]]) -> tuple[str, ...]:
  """The methods that every pair of some results.json has (a point run before a method existed
  lacks it: its cells say n/a), in ``METHOD_ORDER`` and then by name, each followed by its
  REPAIRed path where one has it (naive first: the ratios divide by it)."""
  held = set().union(*(set.intersection(*(set(p["methods"]) for p in res["pairs"]))
                       for res in results if res["pairs"]))
  base = [m for m in held if not m.endswith(report.REPAIRED)]
  order = [*(m for m in METHOD_ORDER if m in base), *sorted(m for m in base
                                                            if m not in METHOD_ORDER)]
  return tuple(n for m in order for n in (m, m + report.REPAIRED) if n in held)


def _header(sweep: Sweep, methods: Sequence[str]) -> list[str]:
  x = "width (head dim)" if sweep.axis == _width_axis else sweep.axis
  return [f"| {x} | seeds | " + " | ".join(f"{m}: loss barrier" for m in methods) + " | " +
          " | ".join(f"{m} (% of naive)" for m in methods[1:]) + " | training | wall time |",
          "|" + "---|" * (2 + 2 * len(methods) - 1 + 2)]


def _slope_of(points: Sequence[tuple[float, str, dict, dict]], method: str, ratio: bool
              ) -> Slope | None:
  """``method``'s slope over the ``points`` that have it: paired (``paired_slope``) where the
  pairs measured at every point carry enough seeds, else unpaired (``slope``)."""
  held = [(x, _pairs(res, method, ratio)) for x, *_, res in points]
  held = [(x, pairs) for x, pairs in held if pairs]
  if not held:
    return None
  paired = paired_slope([x for x, _ in held], [pairs for _, pairs in held])
  if paired is not None:
    return paired
  kept = [(x, i) for x, pairs in held if (i := ss.jackknife(pairs)) is not None]
  return slope([x for x, _ in kept], [i for _, i in kept]) if kept else None


def trends(results_root: str, sweep: Sweep, ratio: bool = True) -> dict[str, Slope | None]:
  """Each aligned method's slope per doubling of x (REPAIRed paths too, but naive's) of the
  barrier in % of naive (``ratio``) or of the loss barrier itself, over the committed points of
  ``sweep`` that have it ({} when none is committed)."""
  points = _committed(results_root, sweep.points)
  if not points:
    return {}
  methods = methods_of([res for *_, res in points])
  return {m: _slope_of(points, m, ratio) for m in methods
          if m.removesuffix(report.REPAIRED) != "naive"}


def loss_unit(results_root: str, sweep: Sweep) -> str:
  """"bits" when every committed point of ``sweep`` measures its loss in bits (per byte), else
  "nats"."""
  points = _committed(results_root, sweep.points)
  return "bits" if points and all(res.get("loss_unit", "").startswith("bits")
                                  for *_, res in points) else "nats"


def endpoints(results_root: str, sweep: Sweep) -> str:
  """How each committed point's runs of the "full" scope ended: "x: k plateau, j budget" per
  point (``run.json``'s "training"; "n/a" for a point recorded without it)."""
  cells = []
  for x, _, run, _ in _committed(results_root, sweep.points):
    runs = [m for name, m in run.get("training", {}).items() if name.startswith("reinit/full/")]
    stops = [r.get("stopped") or "unfinished" for r in runs]
    how = ", ".join(f"{stops.count(k)} {k}" for k in ("plateau", "budget", "unfinished")
                    if stops.count(k)) or "n/a"
    cells.append(f"{sweep.label(x)}: {how}")
  return "; ".join(cells)


def sweep_table(results_root: str, sweep: Sweep) -> str:
  """Markdown: the committed points of ``sweep``, one row per x, then the slope of each
  method's barrier (nats or bits, and % of naive) per doubling of x, paired where the pairs
  match (``paired_slope``), with its curvature, and how each point's runs ended."""
  points = _committed(results_root, sweep.points)
  if not points:
    return f"No point of the sweep '{sweep.title}' is committed yet."
  methods = methods_of([res for *_, res in points])
  lines = _header(sweep, methods)
  lines += [_row(sweep, x, run, res, methods)[0] for x, _, run, res in points]
  what = "the width" if sweep.axis == _width_axis else sweep.axis
  bits = all(res.get("loss_unit", "").startswith("bits") for *_, res in points)
  lines += ["", f"Slope per doubling of {what} (module docstring of "
                "`experiments/report/regime.py`: paired, each pair's least-squares slope against "
                "log2 of it, then their mean with a 95 % interval over seeds; unpaired where the "
                "pairs do not match), and the curvature per pair with three or more points:",
            "", "| statistic | slope per doubling | 95 % interval | design | curvature "
                "[95 % interval] | points |", "|---|---|---|---|---|---|"]
  for label, ratio, unit, digits in (("loss barrier", False, " bits" if bits else " nats", 4),
                                     ("% of naive", True, " points", 1)):
    for m in (methods[1:] if ratio else methods):
      s = _slope_of(points, m, ratio)
      xs = ", ".join(sweep.label(x) for x, *_, res in points if _pairs(res, m, ratio))
      lines.append(f"| {m}: {label} | " + _slope_cells(s, unit, digits) + f" | {xs} |")
  lines += ["", f"How the runs ended, per point: {endpoints(results_root, sweep)}."]
  return "\n".join(lines)


def _slope_cells(s: Slope | None, unit: str, digits: int) -> str:
  """"slope | [low, high] | design | curvature [interval]" cells; n/a without a slope."""
  if s is None:
    return "n/a | n/a | | "
  curvature = ("" if s.curvature is None else
               f"{s.curvature.estimate:+.{digits}f} [{s.curvature.low:+.{digits}f}, "
               f"{s.curvature.high:+.{digits}f}]")
  return (f"{s.estimate:+.{digits}f}{unit} | [{s.low:+.{digits}f}, {s.high:+.{digits}f}] | "
          f"{'paired' if s.paired else 'unpaired'} | {curvature}")


def width_table(results_root: str) -> str:
  """Markdown: the ViT's width sweep (``sweep_table``), then its points rerun under the more
  patient rule (``cpu_paper.PATIENT_SWEEP``), where committed."""
  if not _committed(results_root, VIT_WIDTH.points):
    return "No point of the width sweep is committed yet."
  lines = [sweep_table(results_root, VIT_WIDTH)]
  patient = _committed(results_root, cpu_paper.PATIENT_SWEEP)
  if patient:
    methods = methods_of([res for *_, res in patient])
    lines += ["", "The same points under a rule with a 1,000-step window (patience 10):", "",
              *_header(VIT_WIDTH, methods),
              *(_row(VIT_WIDTH, x, run, res, methods)[0] for x, _, run, res in patient)]
  return "\n".join(lines)


def other_sweeps_table(results_root: str) -> str:
  """Markdown: every sweep but the ViT's width sweep, each under a heading of its title."""
  return "\n\n".join(f"**{sweep.title[0].upper() + sweep.title[1:]}** "
                      f"(figure: [{sweep.figure}]({sweep.figure}))\n\n"
                      + sweep_table(results_root, sweep) for sweep in SWEEPS[1:])


def _row(sweep: Sweep, x: float, run: dict[str, Any], res: dict[str, Any],
         methods: Sequence[str]
         ) -> tuple[str, dict[str, ss.Interval | None], dict[str, ss.Interval | None]]:
  """(the table row of one point, each method's barrier and ratio intervals)."""
  b = {m: ss.jackknife(_pairs(res, m, ratio=False)) for m in methods}
  r = {m: ss.jackknife(_pairs(res, m, ratio=True)) for m in methods[1:]}
  seeds = b["naive"].num_seeds if b["naive"] else "n/a"
  row = [sweep.label(x), str(seeds),
         *(show_interval(b[m], 4) for m in methods),
         *(show_interval(r[m], 1) for m in methods[1:]),
         report.training_cell(run.get("training", {}), "full"), f"{run['wall_seconds'] / 60:.0f} min"]
  return "| " + " | ".join(row) + " |", b, r


# The positive control (cpu_paper's "control_vit_fashion_spawn"): children of one checkpoint.
CONTROL = "control_vit_fashion_spawn"
# An aligned pair's barrier may exceed the naive one by at most this much (nats) and count as
# no worse: the report's floor under which a barrier is evaluation noise (report.RATIO_FLOOR),
# fixed before the control ran.
CONTROL_MARGIN = report.RATIO_FLOOR


def _identity_cell(res: dict[str, Any], method: str) -> str:
  """The element's distance to the identity over the pairs (``scope_study.identity_closeness``):
  the fraction of permutation entries left in place, and the largest relative distance
  ||g - I||_F / ||I||_F of a matrix factor."""
  fixed, dist = [], []
  for p in res["pairs"]:
    ident = p["methods"][method].get("matching", {}).get("identity")
    if ident is None:
      return "n/a"
    fixed += list(ident["fixed_points"].values())
    dist += list(ident["relative_distance"].values())
  cells = []
  if fixed:
    cells.append(f"permutation entries left in place: mean {100 * sum(fixed) / len(fixed):.1f} %, "
                 f"least {100 * min(fixed):.1f} %")
  if dist:
    cells.append(f"matrices' ‖g − I‖/‖I‖: mean {sum(dist) / len(dist):.3f}, largest {max(dist):.3f}")
  return "; ".join(cells) or "n/a"


def control_verdict(difference: ss.Difference, margin: float = CONTROL_MARGIN) -> str:
  """Whether a method leaves the control's pairs connected: "no worse" when the seed-level
  interval of (method − naive) lies below ``margin``, "worse" when it lies above it,
  "undetermined" otherwise."""
  i = difference.interval
  if i is None:
    return "undetermined"
  return "no worse" if i.high <= margin else "worse" if i.low > margin else "undetermined"


def control_table(results_root: str) -> str:
  """Markdown: the positive control's barriers per method with seed-level intervals, each
  method's paired difference to naive and its verdict against ``CONTROL_MARGIN``, the element's
  distance to the identity, and how the base model and the children ended."""
  control = committed.find(results_root, CONTROL)
  if control is None:
    return "The positive control is not committed yet."
  run, res = control.record(), control.results("spawn")
  lines = [f"| method | loss barrier | method − naive | verdict (margin {CONTROL_MARGIN:g} nats) "
           "| element against the identity |", "|---|---|---|---|---|"]
  naive = _pairs(res, "naive", ratio=False)
  for m in methods_of([res]):
    b = ss.jackknife(_pairs(res, m, ratio=False))
    if m == "naive":
      lines.append(f"| naive | {show_interval(b, 4)} | | | |")
      continue
    d = ss.paired_difference(_pairs(res, m, ratio=False), naive)
    lines.append(f"| {m} | {show_interval(b, 4)} | {show_interval(d.interval, 4)} | "
                 f"{control_verdict(d)} | {_identity_cell(res, m)} |")
  lines += ["", f"Training: {report.training_cell(run.get('training', {}), 'spawn')}; "
                f"wall time {run['wall_seconds'] / 60:.0f} min."]
  return "\n".join(lines)


FIGURE = VIT_WIDTH.figure  # under results/, written by ``python -m experiments.report.regime``


def plot_sweep(results_root: str, path: str, sweep: Sweep = VIT_WIDTH) -> str | None:
  """PNG of each method's mean loss barrier against x (log scale), with its 95 % interval
  over seeds as a band, and of the same in % of naive; None when no point is committed."""
  points = _committed(results_root, sweep.points)
  if not points:
    return None
  xs = [x for x, *_ in points]
  methods = methods_of([res for *_, res in points])
  fig = figure.Figure(figsize=(9, 3.6))
  axes = fig.subplots(1, 2)
  for ax, ratio, shown, ylabel in ((axes[0], False, methods, "loss barrier"),
                                   (axes[1], True, methods[1:], "loss barrier, % of naive")):
    for m in shown:
      cis = [ss.jackknife(_pairs(res, m, ratio)) for *_, res in points]
      kept = [(x, i) for x, i in zip(xs, cis) if i is not None]
      ax.plot([x for x, _ in kept], [i.estimate for _, i in kept], "o-", label=m,
              color=report.COLORS.get(m))
      ax.fill_between([x for x, _ in kept], [i.low for _, i in kept],
                      [i.high for _, i in kept], alpha=0.2, color=report.COLORS.get(m))
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [sweep.label(x) for x in xs])
    ax.set_xlabel(sweep.axis)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.suptitle(f"{sweep.title}: mean over pairs, 95 % interval over seeds")
  fig.tight_layout()
  atomic_io.save_figure(fig, path, dpi=120)
  return path


if __name__ == "__main__":  # python -m experiments.report.regime: every committed sweep's figure
  for _sweep in SWEEPS:
    print(plot_sweep(committed.RESULTS_ROOT, os.path.join(committed.RESULTS_ROOT, _sweep.figure),
                     _sweep))
