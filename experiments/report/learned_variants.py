"""The learned method from another start or lambda scheme, set against its base on the same pairs.

A variant of ``cpu_paper.LEARN_VARIANTS`` is a committed setting (its base) with the base's
trained runs, studied by naive and the learned method alone, with one of the learned method's
fields changed: its start (``study.learn_init``: activation matching's element instead of the
full method's) or its lambda (``study.learn_lam_band``: drawn at every step from a band around
1/2 instead of fixed there). Base and variant measure the same pairs of the same endpoints, so
``table`` sets them side by side pair by pair. Per variant and scope, with r_p the learned
method's loss barrier of pair p in % of that pair's naive barrier (``report.ratio_pairs``):

* the base's mean r_p and the variant's, each with its 95 % seed-level interval
  (``seed_statistics.jackknife``);
* the paired difference d_p = r_p(variant) - r_p(base), matched by the pair's seeds, its mean
  and interval (``seed_statistics.paired_difference``; d < 0 where the variant leaves less)
  and the pairs on each side of 0;
* the largest |naive_p(variant) - naive_p(base)| over those pairs: 0 when the variant's
  endpoints are its base's runs (its workdir a copy of the base's), else how far apart the
  two studies' endpoints are.

A variant whose results, or whose base's, are not committed gives no row; a note names it.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from experiments.configs import cpu_paper
from experiments.report import committed
from experiments.report import regime
from experiments.report import report
from experiments.report import seed_statistics as ss

METHOD = "learned"


class Comparison(NamedTuple):
  """One variant against its base in one scope (module docstring).

  Attributes:
    variant, base, scope: the settings and the scope compared.
    change: the study fields the variant sets ("study.learn_init = "activation"").
    base_learned, variant_learned: the mean ratio in % of naive and its seed-level interval
      (None with too few seeds).
    difference: variant - base, pair by pair, in points of % of naive.
    naive_gap: the largest |naive barrier of the variant - of the base| over the pairs both
      have (None when they share no pair).
  """
  variant: str
  base: str
  scope: str
  change: str
  base_learned: ss.Interval | None
  variant_learned: ss.Interval | None
  difference: ss.Difference
  naive_gap: float | None


def _pairs(run: committed.Run, scope: str) -> list[dict[str, Any]] | None:
  return run.results(scope)["pairs"] if run.has(scope) else None


def _naive_gap(variant: list[dict[str, Any]], base: list[dict[str, Any]]) -> float | None:
  naive = lambda p: p["methods"]["naive"]["loss_barrier"]
  by_seeds = {(p["a"], p["b"]): naive(p) for p in base}
  gaps = [abs(naive(p) - by_seeds[p["a"], p["b"]]) for p in variant
          if (p["a"], p["b"]) in by_seeds]
  return max(gaps) if gaps else None


def change_of(variant: str) -> str:
  """The study fields ``variant`` sets, as "study.<field> = <value>" joined by commas."""
  return ", ".join(f"study.{k} = {json.dumps(v)}"
                   for k, v in cpu_paper.LEARN_VARIANTS[variant][1].items())


def comparisons(results_root: str) -> tuple[list[Comparison], list[str]]:
  """(each committed variant's ``Comparison`` per scope that it and its base both hold, each
  variant or scope left out as "<variant> (why)"), in ``cpu_paper.LEARN_VARIANTS``' order."""
  rows, left_out = [], []
  for variant, (base, _) in cpu_paper.LEARN_VARIANTS.items():
    run, base_run = committed.find(results_root, variant), committed.find(results_root, base)
    if run is None:
      left_out.append(f"{variant} (not committed)")
      continue
    if base_run is None:
      left_out.append(f"{variant} (its base {base} is not committed)")
      continue
    for scope in run.scopes():
      pairs = _pairs(run, scope), _pairs(base_run, scope)
      lacking = [s for s, held in zip((variant, base), pairs)
                 if not held or not all(METHOD in p["methods"] for p in held)]
      if lacking:
        left_out.append(f"{variant} ({' and '.join(lacking)} without the {METHOD} method in "
                        f"scope {scope})")
        continue
      learned = [report.ratio_pairs(p, METHOD) for p in pairs]
      rows.append(Comparison(variant, base, scope, change_of(variant), ss.jackknife(learned[1]),
                             ss.jackknife(learned[0]), ss.paired_difference(*learned),
                             _naive_gap(*pairs)))
  return rows, left_out


def table(results_root: str) -> str:
  """Markdown: one row per ``Comparison`` (module docstring), then the variants left out."""
  rows, left_out = comparisons(results_root)
  note = "Not in the table: " + "; ".join(left_out) + "." if left_out else ""
  if not rows:
    return f"No variant of the learned method is committed yet. {note}"
  lines = [f"| variant | base setting | scope | the variant sets | pairs | base: {METHOD} (% of "
           f"naive) | variant: {METHOD} (% of naive) | variant − base (points) | pairs below / "
           "above 0 | naive barrier: largest difference to the base's |", "|" + "---|" * 10]
  for r in rows:
    d = r.difference
    gap = "n/a" if r.naive_gap is None else f"{r.naive_gap:.2g}"
    lines.append(f"| {r.variant} | {r.base} | {r.scope} | `{r.change}` | "
                 f"{d.above + d.below + d.zero} | {regime.show_interval(r.base_learned, 1)} | "
                 f"{regime.show_interval(r.variant_learned, 1)} | "
                 f"{regime.show_interval(d.interval, 1)} | {d.below} / {d.above} | {gap} |")
  return "\n".join(lines + (["", note] if note else []))
