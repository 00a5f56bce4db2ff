"""The paper's claims, each set against our results with a verdict (results/README.md).

``verdict_rows(results_root)`` reads every ``results/<setting>/<scope>/results.json``
and gives one row per claim and setting: the claim, the setting and scope, our
estimate with its 95 % seed-level interval (``seed_statistics``: leave-one-seed-out
jackknife, t with n_seeds - 1 degrees of freedom), and a verdict. ``verdict_table``
writes them as markdown, the verdict in the last cell. Nothing is typed in: a
test checks that results/README.md holds exactly what the generator makes.

The rules (docs/lmc.md, 'Verdicts'), on barrier ratios in % of naive:

* a range claim ("full at 7-12 %") agrees when the estimate lies in the range,
  differs when the whole interval lies outside it, and is undetermined
  otherwise (an agreeing estimate may have an interval wider than the range);
* an ordering claim ("full below Variant 2") is decided on the paired
  differences, pair by pair: it agrees when the interval of their mean lies
  wholly on the claimed side of zero, differs when it lies wholly on the other,
  and is undetermined when it covers zero;
* a threshold claim ("Stage 1's rank low", "L-hat near 0", "Variant 1 high")
  agrees when the interval lies wholly on the claimed side of its threshold,
  differs when it lies wholly on the other side, and is undetermined otherwise.

A ratio needs a barrier to divide by: where the mean naive loss barrier is under
``report.RATIO_FLOOR`` (nats, or bits per byte on text), no ratio claim is judged (the row
says why). A scope with a method missing, a non-finite barrier, or fewer than
``seed_statistics.MIN_SEEDS`` seeds gets "n/a" and one line saying why.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from experiments import report
from experiments import seed_statistics as ss

FLOOR = report.RATIO_FLOOR
AGREES, DIFFERS, UNDETERMINED = "agrees", "differs", "undetermined"
# The mean rank of a head permutation drawn at random among the 24 of 4 heads.
RANDOM_RANK = 12.5
# "Near 0" for L-hat (% of the way from the best permutation's barrier to naive's).
LHAT_NEAR_ZERO = 10.0
# "High" for Variant 1: above the top of Variant 2's range.
VARIANT1_HIGH = 16.0
# Full-model LMC: a full-scope barrier within the paper's matched range (at most 12 %).
LMC_MAX = 12.0


class Row(NamedTuple):
  claim: str
  setting: str
  scope: str
  estimate: str
  verdict: str


def _show(interval: ss.Interval, unit: str = " %") -> str:
  return (f"{interval.estimate:.1f}{unit} [{interval.low:.1f}, {interval.high:.1f}] "
          f"({interval.num_seeds} seeds)")


def _range_verdict(interval: ss.Interval, low: float, high: float) -> str:
  if low <= interval.estimate <= high:
    return AGREES
  if interval.high < low or interval.low > high:
    return DIFFERS
  return UNDETERMINED


def _side_verdict(interval: ss.Interval, threshold: float, below: bool) -> str:
  """Agrees when the interval lies wholly below (``below``) or above the threshold."""
  if interval.high < threshold:
    return AGREES if below else DIFFERS
  if interval.low > threshold:
    return DIFFERS if below else AGREES
  return UNDETERMINED


def _missing(res: Mapping[str, Any], methods: Sequence[str]) -> str | None:
  """Why the scope's pairs cannot be judged, or None."""
  pairs = res.get("pairs") or []
  for method in methods:
    if not pairs or any(method not in p["methods"] for p in pairs):
      return f"n/a: method {method!r} missing"
    values = [p["methods"][method]["loss_barrier"] for p in pairs]
    if any(v is None or not math.isfinite(v) for v in values):
      return f"n/a: a non-finite {method} barrier"
  why = ss.why_no_interval([(p["a"], p["b"], 0.0) for p in pairs])
  return None if why is None else f"n/a: {why}"


class _Scope:
  """One scope's results.json, with the per-pair series the claims read."""

  def __init__(self, setting: str, scope: str, res: Mapping[str, Any]):
    self.setting, self.scope, self.res = setting, scope, res
    self.pairs = res.get("pairs") or []
    naive = [p["methods"]["naive"]["loss_barrier"] for p in self.pairs
             if "naive" in p["methods"]]
    self.naive_mean = float(np.mean(naive)) if naive else math.nan

  def below_floor(self) -> str | None:
    if self.naive_mean < FLOOR:
      return (f"no ratio: mean naive barrier {self.naive_mean:.4f} is under the "
              f"floor {FLOOR}")
    return None

  def ratio(self, method: str) -> ss.Interval | None:
    return ss.jackknife(report.ratio_pairs(self.pairs, method))

  def difference(self, x: str, y: str) -> ss.Difference | None:
    return ss.paired_difference(report.ratio_pairs(self.pairs, x),
                                report.ratio_pairs(self.pairs, y))

  def ablation(self, key: str) -> ss.Interval | None:
    per_pair = self.res.get("ablation", {}).get("permutations", {}).get("per_pair")
    if not per_pair:
      return None
    # Each entry names its pair (runs before the seed subset of the ablation: in pair order).
    return ss.jackknife([(q.get("a", p["a"]), q.get("b", p["b"]), q.get(key))
                         for p, q in zip(self.pairs, per_pair)])


Judge = Callable[[_Scope], tuple[str, str] | None]  # (estimate, verdict); None: not applicable


def _ratio_claim(methods: Sequence[str], judge: Callable[[_Scope], tuple[str, str]]) -> Judge:
  """A claim on barrier ratios: n/a without the methods or seeds, no ratio under the floor."""
  def run(scope: _Scope) -> tuple[str, str]:
    why = _missing(scope.res, ("naive", *methods)) or scope.below_floor()
    return (why, UNDETERMINED) if why else judge(scope)
  return run


def _in_range(method: str, low: float, high: float) -> Judge:
  def judge(scope):
    interval = scope.ratio(method)
    return _show(interval), _range_verdict(interval, low, high)
  return _ratio_claim((method,), judge)


def _ordered(lower: str, higher: str) -> Judge:
  """``lower``'s ratio below ``higher``'s, on the paired differences lower - higher."""
  def judge(scope):
    d = scope.difference(lower, higher)
    text = (f"{_show(d.interval, ' points')}; {d.below} pairs below 0, {d.above} above")
    return text, _side_verdict(d.interval, 0.0, below=True)
  return _ratio_claim((lower, higher), judge)


def _variant1_high(scope: _Scope) -> tuple[str, str]:
  interval = scope.ratio("perm")
  return _show(interval), _side_verdict(interval, VARIANT1_HIGH, below=False)


def _ablation_claim(key: str, threshold: float, unit: str, *, ratio: bool) -> Judge:
  """A claim on the Stage 1 ablation's per-pair ``key``; ``ratio``: it divides by the naive
  barrier (L-hat), so it is not judged under the floor."""
  def run(scope: _Scope) -> tuple[str, str] | None:
    if "permutations" not in scope.res.get("ablation", {}):
      return None
    why = _missing(scope.res, ("naive",)) or (scope.below_floor() if ratio else None)
    interval = None if why else scope.ablation(key)
    if interval is None:
      return why or "n/a: too few seeds with a finite value", UNDETERMINED
    return _show(interval, unit), _side_verdict(interval, threshold, below=True)
  return run


def _full_model_lmc(scope: _Scope) -> tuple[str, str]:
  interval = scope.ratio("full")
  return _show(interval), _side_verdict(interval, LMC_MAX, below=True)


def _only(scope_name: str, judge: Judge) -> Judge:
  """``judge`` on the scope named ``scope_name``; no row for the others."""
  return lambda scope: judge(scope) if scope.scope == scope_name else None


FIRST = "first_attention"  # the scope of the paper's Table 1
# (claim as the table prints it, how it is judged).
CLAIMS: tuple[tuple[str, Judge], ...] = (
    ("full method at 7-12 % of naive", _only(FIRST, _in_range("full", 7.0, 12.0))),
    ("Variant 2 at 10-16 % of naive", _only(FIRST, _in_range("ortho", 10.0, 16.0))),
    ("full below Variant 2", _only(FIRST, _ordered("full", "ortho"))),
    (f"Variant 1 high (above {VARIANT1_HIGH:g} %)",
     _only(FIRST, _ratio_claim(("perm",), _variant1_high))),
    (f"Stage 1's rank low (below {RANDOM_RANK:g} of 24, a random choice's mean)",
     _ablation_claim("loss_rank", RANDOM_RANK, "", ratio=False)),
    (f"L̂ near 0 (below {LHAT_NEAR_ZERO:g} %)",
     _ablation_claim("loss_lhat", LHAT_NEAR_ZERO, " %", ratio=True)),
    (f"full-model LMC on small data (full at most {LMC_MAX:g} % of naive)",
     _only("full", _ratio_claim(("full",), _full_model_lmc))),
    ("ours: learned below full", _ordered("learned", "full")),
)


def _scopes(results_root: str) -> Iterator[_Scope]:
  """Every setting's scopes under ``results_root`` (not its reduced rerun's nor its run on every
  core: ``report.RERUN_FOLDERS``), sorted."""
  for setting in sorted(os.listdir(results_root)):
    folder = os.path.join(results_root, setting)
    if not os.path.isdir(folder):
      continue
    for scope in sorted(os.listdir(folder)):
      path = os.path.join(folder, scope, "results.json")
      if scope not in report.RERUN_FOLDERS and os.path.isfile(path):
        with open(path) as f:
          yield _Scope(setting, scope, json.load(f))


def verdict_rows(results_root: str) -> list[Row]:
  """One row per claim and (setting, scope) that the claim applies to, claim by claim."""
  scopes = list(_scopes(results_root))
  rows = []
  for claim, judge in CLAIMS:
    for scope in scopes:
      if claim.startswith("ours") and not all("learned" in p["methods"] for p in scope.pairs):
        continue
      judged = judge(scope)
      if judged is not None:
        rows.append(Row(claim, scope.setting, scope.scope, *judged))
  return rows


def verdict_table(results_root: str) -> str:
  """The rows as a markdown table (the verdict last), then the count of each verdict."""
  lines = ["| claim | setting | scope | our estimate [95 % seed-level interval] | verdict |",
           "|---|---|---|---|---|"]
  rows = verdict_rows(results_root)
  lines += [f"| {r.claim} | {r.setting} | {r.scope} | {r.estimate} | {r.verdict} |"
            for r in rows]
  counts = {v: sum(r.verdict == v for r in rows) for v in (AGREES, DIFFERS, UNDETERMINED)}
  lines += ["", ", ".join(f"{n} {v}" for v, n in counts.items()) + f" of {len(rows)} rows."]
  return "\n".join(lines) + "\n"
