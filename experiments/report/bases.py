"""Several bases per Table 1 setting: the base model as the top unit (docs/lmc.md, 'Verdicts').

Every seed of a Table 1 setting re-initialises one trained base model, so an interval over
its seeds is conditional on that base. ``cpu_paper.TABLE1_BASES`` adds bases 2 and 3 (other
``config.seed``, four re-initialisation seeds each, nested in their base); base 1 is the
committed setting. Pairs are formed within a base only.

**Two-stage estimate** (``two_stage``). With b bases and theta_j the statistic over base j's
pairs (its seed-level standard error SE_j from the leave-one-seed-out jackknife within the
base, ``seed_statistics``),

    theta-bar = (1 / b) sum_j theta_j,    SE^2 = s^2 / b,    s^2 = sum_j (theta_j - theta-bar)^2 / (b - 1),
    interval = theta-bar +- t_{0.975, b - 1} SE.

The bases are independent draws of the setting, so theta_j are independent with a common
mean (the setting's), whatever their seeds' spread: the interval needs no model of the
components. With a ``Bounds`` (rank, L-hat) the same runs on g(theta_j) and is mapped back
(``seed_statistics.Bounds``); a theta_j on a bound leaves the untransformed interval, clipped.

**Variance components** (``components``), a one-way random-effects split by the method of
moments: theta_j = mu + u_j + e_j with u_j the base's effect (variance sigma_B^2) and e_j
its seeds' sampling error (variance tau_j^2, estimated by SE_j^2). Then
E[s^2] = sigma_B^2 + mean_j tau_j^2, so

    within  = mean_j SE_j^2,             (between seeds within a base, on a base's estimate)
    between = max(0, s^2 - within),      (between bases)

and the share between bases is between / (between + within).

``table`` sets these beside the one-base verdicts for each Table 1 setting whose other
bases are committed (``committed.find`` of ``cpu_paper.table1_base_setting``), each
claim judged at base level by the rules of ``claims`` on (theta-bar, SE, b - 1), with Holm
over each claim's base-level rows (every test counted).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from experiments.configs import cpu_paper
from experiments.report import claims
from experiments.report import committed
from experiments.report import report
from experiments.report import seed_statistics as ss

MIN_BASES = 2  # a t interval over bases needs two; the issue asks for three


class BaseLevel(NamedTuple):
  """A statistic over bases: the two-stage estimate, its 95 % interval, standard error and
  degrees of freedom (on the bounds' scale where ``transformed``), each base's own seed-level
  interval, and the variance components (``between``, ``within``; on the untransformed scale)."""
  estimate: float
  low: float
  high: float
  se: float
  df: int
  per_base: tuple[ss.Interval, ...]
  between: float
  within: float
  transformed: bool = False

  def share_between(self) -> float:
    """between / (between + within); nan when both are 0."""
    total = self.between + self.within
    return self.between / total if total > 0 else math.nan


def components(estimates: Sequence[float], ses: Sequence[float]) -> tuple[float, float]:
  """(between, within): the method-of-moments variance between bases, max(0, s^2 - within),
  and the mean squared seed-level standard error of a base's estimate (module docstring)."""
  within = float(np.mean(np.square(ses)))
  spread = float(np.var(estimates, ddof=1))
  return max(0.0, spread - within), within


def two_stage(per_base: Sequence[Sequence[ss.Pair]], bounds: ss.Bounds | None = None
              ) -> BaseLevel | None:
  """The two-stage estimate over bases and its interval (module docstring).

  Args:
    per_base: each base's pairs (seed a, seed b, value), pairs formed within the base.
    bounds: where the statistic can lie (rank, L-hat), or None for an unbounded one.

  Returns:
    ``BaseLevel``, or None with fewer than ``MIN_BASES`` bases with a seed-level interval.
  """
  intervals = [i for pairs in per_base if (i := ss.jackknife(pairs)) is not None]
  b = len(intervals)
  if b < MIN_BASES:
    return None
  values = np.asarray([i.estimate for i in intervals])
  between, within = components(values, [i.se for i in intervals])
  scale = (lambda x: x) if bounds is None else bounds.to_scale
  scaled = np.asarray([scale(v) for v in values])
  transformed = bounds is not None and bool(np.all(np.isfinite(scaled)))
  if not transformed:
    scaled = values
  mean, se = float(scaled.mean()), float(scaled.std(ddof=1)) / math.sqrt(b)
  half = ss.t_quantile(0.975, b - 1) * se
  low, high = mean - half, mean + half
  if transformed:
    low, high = bounds.from_scale(low), bounds.from_scale(high)
  elif bounds is not None:
    low, high = bounds.clip(low), bounds.clip(high)
  return BaseLevel(float(values.mean()), low, high, se, b - 1, tuple(intervals), between, within,
                   transformed)


# --- the claims at base level ----------------------------------------------------------------

PairsOf = Callable[[dict], list[ss.Pair] | None]  # a first_attention results.json -> its pairs


def _ratio(method: str) -> PairsOf:
  return lambda res: report.ratio_pairs(res["pairs"], method)


def _difference(lower: str, higher: str) -> PairsOf:
  def pairs(res):
    x, y = report.ratio_pairs(res["pairs"], lower), report.ratio_pairs(res["pairs"], higher)
    ys = {(a, b): v for a, b, v in y or ()}
    return [(a, b, None if v is None or ys.get((a, b)) is None else v - ys[(a, b)])
            for a, b, v in x or ()]
  return pairs


def _ablation(key: str) -> PairsOf:
  def pairs(res):
    per_pair = res.get("ablation", {}).get("permutations", {}).get("per_pair") or []
    return [(q.get("a", p["a"]), q.get("b", p["b"]), q.get(key))
            for p, q in zip(res["pairs"], per_pair)]
  return pairs


# (estimate on the test scale, rules, the map of a cut-off onto that scale) -> the decision
Decide = Callable[[claims.Estimate, claims.Rules, Callable[[float], float]], claims.Decision]


class BaseClaim(NamedTuple):
  """A Table 1 claim judged at base level: its key (the claims' row anchors), what it reads
  from each base, its bounds, its rule, and its unit."""
  key: str
  pairs: PairsOf
  bounds: ss.Bounds | None
  decide: Decide
  unit: str
  over_naive: bool = True  # divides by the naive barrier: no value under report.RATIO_FLOOR


BASE_CLAIMS: tuple[BaseClaim, ...] = (
    BaseClaim("full-range", _ratio("full"), None,
              lambda e, r, g: claims.range_verdict(e, *claims.FULL_RANGE, r), " %"),
    BaseClaim("variant2-range", _ratio("ortho"), None,
              lambda e, r, g: claims.range_verdict(e, *claims.VARIANT2_RANGE, r), " %"),
    BaseClaim("full-below-variant2", _difference("full", "ortho"), None,
              lambda e, r, g: claims.ordering_verdict(e, r), " points"),
    BaseClaim("variant1-high", _ratio("perm"), None,
              lambda e, r, g: claims.side_verdict(e, claims.VARIANT1_HIGH, False, r), " %"),
    BaseClaim("rank-low", _ablation("loss_rank"), claims.RANK_BOUNDS,
              lambda e, r, g: claims.side_verdict(e, g(claims.RANDOM_RANK), True, r), "",
              over_naive=False),
    BaseClaim("lhat-near-0", _ablation("loss_lhat"), claims.LHAT_BOUNDS,
              lambda e, r, g: claims.side_verdict(e, g(claims.LHAT_NEAR_ZERO), True, r), " %"),
)


def committed_bases(results_root: str, setting: str) -> list[tuple[int, committed.Run]]:
  """(base, run) of each committed base of Table 1 ``setting``: base 1 (the setting itself)
  and every ``cpu_paper.TABLE1_BASES`` base whose run is committed."""
  out = []
  for base in (1, *sorted(cpu_paper.TABLE1_BASES)):
    run = committed.find(results_root, cpu_paper.table1_base_setting(setting, base))
    if run is not None and run.has(claims.FIRST):
      out.append((base, run))
  return out


def judge(claim: BaseClaim, level: BaseLevel, rules: claims.Rules) -> claims.Decision:
  """``claim``'s rule on the two-stage estimate: (theta-bar, SE, b - 1), on the bounds' scale
  where the interval was computed there."""
  if level.transformed:
    g = claim.bounds.to_scale
    value = float(np.mean([g(i.estimate) for i in level.per_base]))
    return claim.decide(claims.Estimate(value, level.se, level.df), rules, g)
  return claim.decide(claims.Estimate(level.estimate, level.se, level.df), rules, lambda x: x)


class BaseRow(NamedTuple):
  """One claim on one setting at base level, beside its one-base verdict."""
  setting: str
  key: str
  level: BaseLevel | None
  judged: claims.Judged
  one_base: claims.Row | None
  per_base: dict[int, ss.Interval | None]  # base -> its seed-level interval (inside the bounds)
  floored: set[int]  # the bases under the ratio floor (``under_the_floor``)


def under_the_floor(claim: BaseClaim, res: dict) -> bool:
  """Whether ``claim`` divides by a base's naive barrier whose mean is under
  ``report.RATIO_FLOOR``: the base then has no value for it (a ratio of float32 noise)."""
  return claim.over_naive and report.below_floor(res.get("methods", {})) is not None


def _base_pairs(claim: BaseClaim, res: dict) -> list[ss.Pair]:
  """What ``claim`` reads from one base's results; none under the floor."""
  return [] if under_the_floor(claim, res) else claim.pairs(res) or []


def _base_interval(claim: BaseClaim, res: dict) -> ss.Interval | None:
  """One base's estimate with its seed-level interval, inside ``claim.bounds`` where it has
  them."""
  pairs = _base_pairs(claim, res)
  if claim.bounds is None:
    return ss.jackknife(pairs)
  bounded = ss.bounded_jackknife(pairs, claim.bounds)
  return None if bounded is None else bounded.interval


def _show(i: ss.Interval, unit: str) -> str:
  return f"{i.estimate:.1f}{unit} [{i.low:.1f}, {i.high:.1f}] ({i.num_seeds} seeds)"


def _base_rows(results_root: str, rules: claims.Rules) -> list[BaseRow]:
  """Every claim of ``BASE_CLAIMS`` on every Table 1 setting with at least ``MIN_BASES``
  committed bases."""
  one_base = {r.anchor: r for r in claims.verdict_rows(results_root, rules)}
  rows = []
  for setting in cpu_paper.TABLE1:
    found = committed_bases(results_root, setting)
    if len(found) < MIN_BASES:
      continue
    results = [run.results(claims.FIRST) for _, run in found]
    for claim in BASE_CLAIMS:
      level = two_stage([_base_pairs(claim, res) for res in results], claim.bounds)
      if level is None:
        judged = claims.Judged(f"n/a: fewer than {MIN_BASES} bases with an interval", claims.NA,
                               None, claims.NA)
      else:
        decision = judge(claim, level, rules)
        judged = claims.Judged("", decision.verdict, decision.p, decision.fallback, None,
                               decision.tests)
      rows.append(BaseRow(setting, claim.key, level, judged,
                          one_base.get(f"{claim.key}-{setting}".replace("_", "-")),
                          {base: _base_interval(claim, res) for (base, _), res in
                           zip(found, results)},
                          {base for (base, _), res in zip(found, results)
                           if under_the_floor(claim, res)}))
  return rows


def _corrected_rows(rows: Sequence[BaseRow], rules: claims.Rules) -> list[str]:
  """Each row's base-level verdict after Holm over its claim's base-level rows."""
  after = {}
  for key in dict.fromkeys(r.key for r in rows):
    members = [k for k, r in enumerate(rows) if r.key == key]
    after.update(zip(members, claims.corrected([rows[k].judged for k in members], rules)))
  return [after[k] for k in range(len(rows))]


def _one_base(row: claims.Row | None) -> str:
  return "n/a" if row is None else f"{row.verdict} → {row.corrected} ({row.estimate.split(';')[0]})"


def _cells(row: BaseRow, unit: str, bases: Sequence[int]) -> list[str]:
  """Each base's estimate (by ``bases``), the two-stage interval and the components."""
  level = row.level
  per_base = ["not committed" if b not in row.per_base
              else f"no ratio: naive under {report.RATIO_FLOOR}" if b in row.floored
              else "n/a" if row.per_base[b] is None else _show(row.per_base[b], unit)
              for b in bases]
  if level is None:
    return [*per_base, row.judged.estimate, "", ""]
  over = (f"{level.estimate:.1f}{unit} [{level.low:.1f}, {level.high:.1f}] "
          f"({len(level.per_base)} bases)")
  share = level.share_between()
  parts = (f"{math.sqrt(level.between):.2f} / {math.sqrt(level.within):.2f}"
           + ("" if math.isnan(share) else f" ({100 * share:.0f} % between)"))
  return [*per_base, over, parts, claims.show_p(row.judged.p)]


def table(results_root: str, rules: claims.Rules = claims.Rules()) -> str:
  """Markdown: per Table 1 setting with at least ``MIN_BASES`` committed bases and claim, each
  base's estimate with its seed-level interval, the two-stage estimate with its interval over
  bases, the variance components (SD between bases / SE of a base's estimate from its seeds,
  and the share between bases), the p-value and tests, the base-level verdict before and after
  Holm (over the claim's base-level rows), and the one-base verdict (base 1, before → after
  Holm) it replaces. One line when no setting has a second base committed."""
  rows = _base_rows(results_root, rules)
  if not rows:
    with_one = sum(bool(committed_bases(results_root, s)) for s in cpu_paper.TABLE1)
    return (f"No Table 1 setting has a second base model committed: base 1 alone for "
            f"{with_one} of the {len(cpu_paper.TABLE1)} settings, none for the rest, so every "
            "verdict above is conditional on one base model.")
  bases = (1, *sorted(cpu_paper.TABLE1_BASES))
  unit = {c.key: c.unit for c in BASE_CLAIMS}
  lines = ["| setting | claim | " + " | ".join(f"base {b}" for b in bases) + " | over bases "
           "[95 % interval, t over bases] | SD between bases / SE within a base (seeds) | p | "
           "tests | verdict over bases | after Holm | one base (base 1): verdict → after Holm "
           "(estimate) |", "|" + "---|" * (len(bases) + 9)]
  for row, after in zip(rows, _corrected_rows(rows, rules)):
    tests = len(row.judged.tests) if row.judged.p is not None else ""
    lines.append(f"| {row.setting} | {row.key} | "
                 + " | ".join(_cells(row, unit[row.key], bases))
                 + f" | {tests} | {row.judged.verdict} | {after} | {_one_base(row.one_base)} |")
  return "\n".join(lines)
