"""What REPAIR leaves of its targets, per committed run: the table of results/README.md.

REPAIR (``attn_symmetry.repair``) rescales and shifts each channel of an interior point
theta_lam towards target statistics interpolated from the endpoints' (mu_t, sigma_t); what it
can fold depends on the family: a scale into a norm's gain, a shift only where a bias reads
the channel. A study records, per pair, REPAIRed method ("<method>+repair"), interior lambda
and point (an attention or MLP output of a layer), what was left
(``scope_study._repaired_path``; results.json: "repair" -> "per_lambda" -> "gaps"):

* "mean_gap": the RMS over the point's corrected channels of (repaired mean - mu_t) / sigma_t,
  0 where the shift folds;
* "scale_gap": that of (repaired std - sigma_t) / sigma_t.

Per run, scope and REPAIRed method, at the interior lambda nearest 1/2, with g_p a pair's gap
averaged over its points:

* the mean of g_p over the pairs and its 95 % seed-level interval
  (``seed_statistics.jackknife``), for each gap;
* the largest single point's gap over all pairs, and which point it is (none named where it
  is 0).

These are descriptive: they say how far each REPAIRed path's channels end from their targets,
not what the misses cost in loss.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from experiments.report import committed
from experiments.report import regime
from experiments.report import report
from experiments.report import seed_statistics as ss

GAPS = ("mean_gap", "scale_gap")  # attn_symmetry.repair.GAPS, without importing JAX here


class Row(NamedTuple):
  """One REPAIRed method of one committed run's scope.

  Attributes:
    setting, scope, method: where it was measured ("naive+repair", ...).
    no_bias: REPAIR's rule where no bias reads a channel ("std", "second_moment").
    lam: the interior lambda the gaps are read at.
    pairs: how many pairs.
    gaps: gap name -> mean over pairs of the pair's mean over points, with its seed-level
      interval (None with too few seeds).
    largest: gap name -> (the largest point's gap over every pair, that point's name).
  """
  setting: str
  scope: str
  method: str
  no_bias: str
  lam: float
  pairs: int
  gaps: dict[str, ss.Interval | None]
  largest: dict[str, tuple[float, str]]


def middle_index(lambdas: Sequence[float]) -> int:
  """The index into the interior lambdas (``lambdas[1:-1]``, the points REPAIR changes) of the
  one nearest 1/2."""
  interior = list(lambdas[1:-1])
  if not interior:
    raise ValueError(f"no interior lambda in {list(lambdas)}")
  return min(range(len(interior)), key=lambda i: abs(interior[i] - 0.5))


def _row(setting: str, scope: str, method: str, results: dict[str, Any]) -> Row | None:
  """``method``'s Row in one scope's results, or None where a pair records no gaps."""
  pairs = results["pairs"]
  if not all(method in p["methods"] for p in pairs):
    return None
  repairs = [p["methods"][method].get("repair", {}) for p in pairs]
  index = middle_index(results["lambdas"])
  try:
    points = [r["per_lambda"][index]["gaps"] for r in repairs]
  except (KeyError, IndexError):
    return None
  gaps, largest = {}, {}
  for gap in GAPS:
    means = [sum(p[gap] for p in at.values()) / len(at) if at else None for at in points]
    seeded = report.seed_pairs(pairs, means)
    gaps[gap] = None if seeded is None else ss.jackknife(seeded)
    largest[gap] = max(((p[gap], name) for at in points for name, p in at.items()),
                       default=(float("nan"), "none"))
  return Row(setting, scope, method, repairs[0].get("no_bias", "std"),
             float(results["lambdas"][1:-1][index]), len(pairs), gaps, largest)


def rows(results_root: str) -> list[Row]:
  """Every committed run's Rows (not the reruns), by setting, scope and the methods' order."""
  out = []
  for run in committed.runs(results_root):
    for scope in run.scopes():
      if not run.has(scope):
        continue
      results = run.results(scope)
      if not results.get("pairs"):
        continue
      for method in results["pairs"][0]["methods"]:
        if method.endswith(report.REPAIRED) and (row := _row(run.setting, scope, method, results)):
          out.append(row)
  return out


def table(results_root: str) -> str:
  """Markdown: one line per ``Row`` (module docstring)."""
  found = rows(results_root)
  if not found:
    return "No committed run records what REPAIR leaves yet."
  lines = ["| setting | scope | method | rule without a bias | λ | pairs | mean gap (σ_t), mean "
           "over points | scale gap (σ_t), mean over points | largest point's mean gap | "
           "largest point's scale gap |", "|" + "---|" * 10]
  for r in found:
    big = {g: f"{r.largest[g][0]:.3g}" + (f" ({r.largest[g][1]})" if r.largest[g][0] else "")
           for g in GAPS}
    lines.append(f"| {r.setting} | {r.scope} | {r.method} | {r.no_bias} | {r.lam:.2g} | "
                 f"{r.pairs} | {regime.show_interval(r.gaps['mean_gap'], 3)} | "
                 f"{regime.show_interval(r.gaps['scale_gap'], 3)} | {big['mean_gap']} | "
                 f"{big['scale_gap']} |")
  return "\n".join(lines)
