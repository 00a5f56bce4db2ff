"""A study variant set against its base on the same pairs.

A variant of ``cpu_paper.STUDY_VARIANTS`` is a committed setting (its base) with the base's
trained runs, studied again with some study fields changed. Base and variant measure the same
pairs of the same endpoints, so ``table`` sets them side by side pair by pair. Three families:

* ``LEARNED`` (``cpu_paper.LEARN_VARIANTS``): naive and the learned method alone, with the
  learned method's start (``study.learn_init``) or its lambda (``study.learn_lam_band``)
  changed; the learned method is compared.
* ``RESIDUAL`` (``cpu_paper.RESIDUAL_VARIANTS``): the full-model scope with the O(d-1)
  residual of the LayerNorm stream (``study.match_residual = "orthogonal"``) instead of the
  base's permutation, every method of the base; each method both runs hold but naive is
  compared.
* ``REPAIR`` (``cpu_paper.REPAIR_VARIANTS``): the full-model scope with REPAIR's rule for a
  family without biases changed (``study.repair_no_bias``); compared as ``RESIDUAL``, so that
  each method's REPAIRed path ("naive+repair", ...) is set against the base's.

Per variant, scope and compared method, with r_p the method's loss barrier of pair p in % of
that pair's naive barrier (``report.ratio_pairs``):

* the base's mean r_p and the variant's, each with its 95 % seed-level interval
  (``seed_statistics.jackknife``);
* the paired difference d_p = r_p(variant) - r_p(base), matched by the pair's seeds, its mean
  and interval (``seed_statistics.paired_difference``; d < 0 where the variant leaves less)
  and the pairs on each side of 0;
* where the variant's study evaluated the circuit path too (``study.circuit_path``), the
  method's circuit barrier in % of the pair's ordinary naive barrier, mean and interval: a
  comparison measure only (docs/lmc.md, 'The circuit path');
* the largest |naive_p(variant) - naive_p(base)| over those pairs: 0 when the variant's
  endpoints are its base's runs (its workdir a copy of the base's, or the same runs trained
  again bit for bit), else how far apart the two studies' endpoints are.

A variant whose results, or whose base's, are not committed gives no row; a note names it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, NamedTuple

from experiments.configs import cpu_paper
from experiments.report import committed
from experiments.report import regime
from experiments.report import report
from experiments.report import seed_statistics as ss


class Family(NamedTuple):
  """A kind of variant.

  Attributes:
    what: what its variants change, for the table's first line ("the learned method").
    variants: variant -> (its base setting, the study fields it sets).
    methods: the methods compared; None for every method both runs hold but naive.
  """
  what: str
  variants: Mapping[str, tuple[str, Mapping[str, Any]]]
  methods: tuple[str, ...] | None


LEARNED = Family("the learned method", cpu_paper.LEARN_VARIANTS, ("learned",))
RESIDUAL = Family("the O(d-1) residual", cpu_paper.RESIDUAL_VARIANTS, None)
REPAIR = Family("REPAIR's rule without biases", cpu_paper.REPAIR_VARIANTS, None)


class Comparison(NamedTuple):
  """One variant against its base in one scope, for one method (module docstring).

  Attributes:
    variant, base, scope, method: the settings, the scope and the method compared.
    change: the study fields the variant sets ("study.learn_init = "activation"").
    base_ratio, variant_ratio: the method's mean ratio in % of naive and its seed-level
      interval (None with too few seeds).
    difference: variant - base, pair by pair, in points of % of naive.
    variant_circuit: the variant's circuit barrier in % of the ordinary naive barrier, with
      its seed-level interval; None where its pairs hold no circuit path.
    naive_gap: the largest |naive barrier of the variant - of the base| over the pairs both
      have (None when they share no pair).
  """
  variant: str
  base: str
  scope: str
  method: str
  change: str
  base_ratio: ss.Interval | None
  variant_ratio: ss.Interval | None
  difference: ss.Difference
  variant_circuit: ss.Interval | None
  naive_gap: float | None


def _pairs(run: committed.Run, scope: str) -> list[dict[str, Any]] | None:
  return run.results(scope)["pairs"] if run.has(scope) else None


def _naive_gap(variant: list[dict[str, Any]], base: list[dict[str, Any]]) -> float | None:
  naive = lambda p: p["methods"]["naive"]["loss_barrier"]
  by_seeds = {(p["a"], p["b"]): naive(p) for p in base}
  gaps = [abs(naive(p) - by_seeds[p["a"], p["b"]]) for p in variant
          if (p["a"], p["b"]) in by_seeds]
  return max(gaps) if gaps else None


def _circuit_ratios(pairs: list[dict[str, Any]], method: str) -> ss.Interval | None:
  """The seed-level interval of ``method``'s circuit barrier in % of naive's (ordinary)
  barrier; None unless every pair holds its circuit path."""
  circuit = report.circuit_pairs(pairs, method)
  return None if circuit is None else ss.jackknife(report.ratio_pairs(circuit, report.CIRCUIT))


def change_of(variant: str) -> str:
  """The study fields ``variant`` sets, as "study.<field> = <value>" joined by commas."""
  return ", ".join(f"study.{k} = {json.dumps(v)}"
                   for k, v in cpu_paper.STUDY_VARIANTS[variant][1].items())


def _methods(family: Family, variant: list[dict[str, Any]], base: list[dict[str, Any]]
             ) -> list[str]:
  """The methods ``family`` compares that every pair of both runs holds, in the variant's
  order."""
  held = [m for m in variant[0]["methods"] if m != "naive"]
  wanted = held if family.methods is None else family.methods
  return [m for m in wanted if all(m in p["methods"] for p in (*variant, *base))]


def comparisons(results_root: str, family: Family = LEARNED
                ) -> tuple[list[Comparison], list[str]]:
  """(each committed variant of ``family``: a ``Comparison`` per scope that it and its base
  both hold and per method compared there; each variant or scope left out as
  "<variant> (why)"), in the order of ``family.variants``."""
  rows, left_out = [], []
  for variant, (base, _) in family.variants.items():
    run, base_run = committed.find(results_root, variant), committed.find(results_root, base)
    if run is None:
      left_out.append(f"{variant} (not committed)")
      continue
    if base_run is None:
      left_out.append(f"{variant} (its base {base} is not committed)")
      continue
    for scope in run.scopes():
      pairs = _pairs(run, scope), _pairs(base_run, scope)
      methods = _methods(family, *pairs) if all(pairs) else []
      if not methods:
        lacking = " and ".join(family.methods or ("a method but naive",))
        left_out.append(f"{variant} ({variant} or {base} without {lacking} in scope {scope})")
        continue
      for method in methods:
        ratios = [report.ratio_pairs(p, method) for p in pairs]
        rows.append(Comparison(variant, base, scope, method, change_of(variant),
                               ss.jackknife(ratios[1]), ss.jackknife(ratios[0]),
                               ss.paired_difference(*ratios), _circuit_ratios(pairs[0], method),
                               _naive_gap(*pairs)))
  return rows, left_out


def table(results_root: str, family: Family = LEARNED) -> str:
  """Markdown: one row per ``Comparison`` of ``family`` (module docstring), then the variants
  left out."""
  rows, left_out = comparisons(results_root, family)
  note = "Not in the table: " + "; ".join(left_out) + "." if left_out else ""
  if not rows:
    return f"No variant of {family.what} is committed yet. {note}"
  lines = ["| variant | base setting | scope | method | the variant sets | pairs | base (% of "
           "naive) | variant (% of naive) | variant − base (points) | pairs below / above 0 | "
           "variant on the circuit path (% of naive) | naive barrier: largest difference to the "
           "base's |", "|" + "---|" * 12]
  for r in rows:
    d = r.difference
    gap = "n/a" if r.naive_gap is None else f"{r.naive_gap:.2g}"
    lines.append(f"| {r.variant} | {r.base} | {r.scope} | {r.method} | `{r.change}` | "
                 f"{d.above + d.below + d.zero} | {regime.show_interval(r.base_ratio, 1)} | "
                 f"{regime.show_interval(r.variant_ratio, 1)} | "
                 f"{regime.show_interval(d.interval, 1)} | {d.below} / {d.above} | "
                 f"{regime.show_interval(r.variant_circuit, 1)} | {gap} |")
  return "\n".join(lines + (["", note] if note else []))
