"""Where full-model LMC holds: the width sweep's table and trend, from the committed runs.

The settings ``width_vit_fashion_<w>`` of ``experiments/configs/cpu_paper.py`` train the
same model at widths w (head count fixed, head dimension w / heads) from scratch on five
seeds each, and study the "full" scope. ``width_table`` sets the committed ones side by
side: per width, each method's mean loss barrier over the pairs with its 95 % interval over
seeds (``seed_statistics.jackknife``), each method's barrier in % of naive, and how the
runs ended (``report.training_cell``).

The trend is a slope against log2 width. With k widths x_i = log2 w_i, per-width
estimates m_i (the mean over that width's pairs) and their seed-level standard errors
SE_i, the least-squares slope is

    b = sum_i c_i m_i,   c_i = (x_i - mean(x)) / sum_j (x_j - mean(x))^2,

the change per doubling of the width. The widths' models share no parameters, so the m_i
are taken as independent (they share the seeds' data orders, a dependence this error leaves
out) and SE_b^2 = sum_i c_i^2 SE_i^2; the interval is b +- t_{0.975, df} SE_b
with df the fewest seeds at any width less one (conservative: each SE_i rests on that many
seeds or more). The slope is fitted to the per-width means, not to the pairs, so that
its error follows the seeds as every other interval here does.

``control_table`` reports the positive control (``CONTROL``: children spawned from one
checkpoint, the "spawn" scope of ``experiments/train/reinit.py``): each method's barrier, its paired
difference to naive judged against ``CONTROL_MARGIN``, and how near the element it found is to
the identity. ``plot_width`` draws the sweep (``python -m experiments.report.regime`` writes
``results/width_sweep.png``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from matplotlib import figure

from experiments.configs import cpu_paper
from experiments.report import report
from experiments.report import seed_statistics as ss
from experiments.workdir import atomic_io

METHODS = ("naive", "full", "learned")


class Slope(NamedTuple):
  """A least-squares slope against log2 width and its 95 % interval (module docstring)."""
  estimate: float
  low: float
  high: float
  se: float
  df: int


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
  """(a, b, value) of every pair: the loss barrier, or its ratio to naive in %."""
  out = []
  for p in res["pairs"]:
    value = p["methods"][method]["loss_barrier"]
    if ratio:
      value = report.ratio_pct(value, p["methods"]["naive"]["loss_barrier"])
    out.append((p["a"], p["b"], value))
  return out


def _committed(results_root: str, sweep: dict[int, str] | None = None
               ) -> list[tuple[int, str, dict[str, Any], dict[str, Any]]]:
  """(width, setting, run.json, the "full" scope's results.json) of each committed point of
  ``sweep`` (width -> setting; ``cpu_paper.WIDTH_SWEEP`` by default)."""
  out = []
  for width, setting in sorted((sweep or cpu_paper.WIDTH_SWEEP).items()):
    folder = os.path.join(results_root, setting)
    if not os.path.exists(os.path.join(folder, "run.json")):
      continue
    with open(os.path.join(folder, "run.json")) as f:
      run = json.load(f)
    with open(os.path.join(folder, "full", "results.json")) as f:
      out.append((width, setting, run, json.load(f)))
  return out


def _show(i: ss.Interval | None, digits: int) -> str:
  if i is None:
    return "n/a"
  return f"{i.estimate:.{digits}f} [{i.low:.{digits}f}, {i.high:.{digits}f}]"


def _header() -> list[str]:
  return ["| width (head dim) | seeds | " + " | ".join(
               f"{m}: loss barrier" for m in METHODS) + " | " +
           " | ".join(f"{m} (% of naive)" for m in METHODS[1:]) +
           " | training | wall time |",
           "|" + "---|" * (2 + 2 * len(METHODS) - 1 + 2)]


def width_table(results_root: str) -> str:
  """Markdown: the committed points of the width sweep, one row per width, then the slope of
  each method's barrier (nats, and % of naive) per doubling of the width; then the points rerun
  under the more patient rule (``cpu_paper.PATIENT_SWEEP``), where committed."""
  points = _committed(results_root)
  if not points:
    return "No point of the width sweep is committed yet."
  lines = _header()
  barriers = {m: [] for m in METHODS}
  ratios = {m: [] for m in METHODS[1:]}
  for width, _, run, res in points:
    line, b, r = _row(width, run, res)
    lines.append(line)
    for m in METHODS:
      barriers[m].append((width, b[m]))
    for m in METHODS[1:]:
      ratios[m].append((width, r[m]))
  lines += ["", "Slope per doubling of the width (least squares against log2 width over the "
                "committed widths; 95 % interval from the per-width seed-level standard errors):",
            "", "| statistic | slope per doubling | 95 % interval | widths |", "|---|---|---|---|"]
  for label, table, unit, digits in (("loss barrier", barriers, " nats", 4),
                                     ("% of naive", ratios, " points", 1)):
    for m, points_m in table.items():
      kept = [(w, i) for w, i in points_m if i is not None]
      s = slope([w for w, _ in kept], [i for _, i in kept]) if kept else None
      widths = ", ".join(str(w) for w, _ in kept)
      if s is None:
        lines.append(f"| {m}: {label} | n/a | n/a | {widths} |")
      else:
        lines.append(f"| {m}: {label} | {s.estimate:+.{digits}f}{unit} | "
                     f"[{s.low:+.{digits}f}, {s.high:+.{digits}f}] | {widths} |")
  patient = _committed(results_root, cpu_paper.PATIENT_SWEEP)
  if patient:
    lines += ["", "The same points under a rule with a 1,000-step window (patience 10):", "",
              *_header(), *(_row(width, run, res)[0] for width, _, run, res in patient)]
  return "\n".join(lines)


def _row(width: int, run: dict[str, Any], res: dict[str, Any]
         ) -> tuple[str, dict[str, ss.Interval | None], dict[str, ss.Interval | None]]:
  """(the table row of one point, each method's barrier and ratio intervals)."""
  b = {m: ss.jackknife(_pairs(res, m, ratio=False)) for m in METHODS}
  r = {m: ss.jackknife(_pairs(res, m, ratio=True)) for m in METHODS[1:]}
  seeds = b["naive"].num_seeds if b["naive"] else "n/a"
  row = [f"{width} ({width // cpu_paper.SWEEP_HEADS})", str(seeds),
         *(_show(b[m], 4) for m in METHODS), *(_show(r[m], 1) for m in METHODS[1:]),
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
  folder = os.path.join(results_root, CONTROL)
  if not os.path.exists(os.path.join(folder, "run.json")):
    return "The positive control is not committed yet."
  with open(os.path.join(folder, "run.json")) as f:
    run = json.load(f)
  with open(os.path.join(folder, "spawn", "results.json")) as f:
    res = json.load(f)
  lines = [f"| method | loss barrier | method − naive | verdict (margin {CONTROL_MARGIN:g} nats) "
           "| element against the identity |", "|---|---|---|---|---|"]
  naive = _pairs(res, "naive", ratio=False)
  for m in METHODS:
    b = ss.jackknife(_pairs(res, m, ratio=False))
    if m == "naive":
      lines.append(f"| naive | {_show(b, 4)} | | | |")
      continue
    d = ss.paired_difference(_pairs(res, m, ratio=False), naive)
    lines.append(f"| {m} | {_show(b, 4)} | {_show(d.interval, 4)} | {control_verdict(d)} | "
                 f"{_identity_cell(res, m)} |")
  lines += ["", f"Training: {report.training_cell(run.get('training', {}), 'spawn')}; "
                f"wall time {run['wall_seconds'] / 60:.0f} min."]
  return "\n".join(lines)


FIGURE = "width_sweep.png"  # under results/, written by ``python -m experiments.report.regime``


def plot_width(results_root: str, path: str) -> str | None:
  """PNG of each method's mean loss barrier against width (log scale), with its 95 % interval
  over seeds as a band, and of the same in % of naive; None when no point is committed."""
  points = _committed(results_root)
  if not points:
    return None
  widths = [w for w, *_ in points]
  fig = figure.Figure(figsize=(9, 3.6))
  axes = fig.subplots(1, 2)
  for ax, ratio, methods, ylabel in ((axes[0], False, METHODS, "loss barrier (nats)"),
                                     (axes[1], True, METHODS[1:], "loss barrier, % of naive")):
    for m in methods:
      cis = [ss.jackknife(_pairs(res, m, ratio)) for *_, res in points]
      kept = [(w, i) for w, i in zip(widths, cis) if i is not None]
      ax.plot([w for w, _ in kept], [i.estimate for _, i in kept], "o-", label=m,
              color=report.COLORS.get(m))
      ax.fill_between([w for w, _ in kept], [i.low for _, i in kept],
                      [i.high for _, i in kept], alpha=0.2, color=report.COLORS.get(m))
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel(f"width ({cpu_paper.SWEEP_HEADS} heads, head dim = width / "
                  f"{cpu_paper.SWEEP_HEADS})")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.suptitle("ViT on Fashion-MNIST, full model re-initialised: mean over pairs, "
               "95 % interval over seeds")
  fig.tight_layout()
  atomic_io.save_figure(fig, path, dpi=120)
  return path


if __name__ == "__main__":  # python -m experiments.report.regime: the figure of the committed sweep
  _results = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
      __file__)))), "results")
  print(plot_width(_results, os.path.join(_results, FIGURE)))
