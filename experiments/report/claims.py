"""The paper's claims, each set against our results with a verdict (results/README.md).

``verdict_rows(results_root)`` reads every ``results/<setting>/<scope>/results.json``
and gives one row per claim and setting: the claim, the setting and scope, whether
the setting lies in the claim's domain, our estimate with its 95 % seed-level
interval (``seed_statistics``: leave-one-seed-out jackknife, t with n_seeds - 1
degrees of freedom), the p-value of the test the verdict rests on, the verdict,
the verdict after Holm's correction over the claim's rows, and whether it holds on a
second float32 trajectory where one was run. ``verdict_table`` writes them as
markdown and ``findings`` the summary that opens results/README.md. Nothing is
typed in: a test checks that results/README.md holds exactly what the generator makes.

The rules (docs/lmc.md, 'Verdicts'), on barrier ratios in % of naive, every test at
level ``Rules.alpha`` = 0.05. With theta-hat the estimate, SE its standard error and
T Student's t with n_seeds - 1 degrees of freedom, the p-value of "theta > c" is

    p_>(c) = min(1, 2 P(T >= (theta-hat - c) / SE)),

doubled so that p_>(c) <= alpha exactly when the printed 95 % interval lies above c
(p_<(c) likewise, below c). Then:

* a range claim [L, H] *agrees* when the interval lies inside [L - delta, H + delta]
  (two one-sided tests, TOST: p = max(p_>(L - delta), p_<(H + delta)) <= alpha); it
  *differs* when the interval lies wholly outside that same widened range
  (p = min(p_<(L - delta), p_>(H + delta)) <= alpha); it is *consistent* when the
  estimate lies in [L, H] without either; otherwise it is *undetermined*;
* an ordering claim ("full below Variant 2") is judged on the paired differences
  d = lower - higher: *no gap* when the interval lies inside [-delta_0, delta_0]
  (TOST), else *agrees* when it lies below 0 (p_<(0)), *differs* when above (p_>(0)),
  else *undetermined*;
* a threshold claim ("Variant 1 high", "Stage 1's rank low", "L-hat near 0",
  full-model LMC) *agrees* when the interval lies on the claimed side of its cut-off,
  *differs* when on the other, and is *undetermined* otherwise.

Holm's step-down correction runs over each claim's family (``Claim.family``: its rows,
the range's row across the Table 1 settings, the sweeps' trend rows for the full-model
claim), and every test a row ran counts in it: a row with k tests (``Decision.tests``)
enters k hypotheses. A verdict stands when the test it rests on (the smallest of its
tests when none decides) survives; a decided verdict that does not falls back to
*consistent* (a range's estimate in the range) or *undetermined*. Rank and L-hat are
bounded, so their intervals and tests run on a scale that keeps them inside their bounds
(``seed_statistics.bounded_jackknife``). The full-model claim classes each data set by
its size against the paper's sets (``size_class``); where size and kind disagree the row
is an extrapolation, which ``counts`` leaves out of the in-domain counts.

A ratio needs a barrier to divide by: where the mean naive loss barrier is under
``report.RATIO_FLOOR`` (nats, or bits per byte on text), no ratio claim is judged. That, a
scope with a method missing, a non-finite barrier, or fewer than
``seed_statistics.MIN_SEEDS`` seeds gives "n/a" and one line saying why.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from experiments.configs import cpu_paper
from experiments.report import committed
from experiments.report import regime
from experiments.report import report
from experiments.report import seed_statistics as ss

FLOOR = report.RATIO_FLOOR
AGREES, CONSISTENT, NO_GAP = "agrees", "consistent", "no gap"
DIFFERS, UNDETERMINED, NA = "differs", "undetermined", "n/a"
OUTCOMES = (AGREES, CONSISTENT, NO_GAP, DIFFERS, UNDETERMINED, NA)  # the order of the counts

# The paper's ranges (% of naive) and what this project derives from them (docs/lmc.md).
FULL_RANGE = (7.0, 12.0)
VARIANT2_RANGE = (10.0, 16.0)
# delta: half the width of the narrower range.
RANGE_MARGIN = (FULL_RANGE[1] - FULL_RANGE[0]) / 2
# The gap "full below Variant 2" implies: the distance between the ranges' midpoints.
PAPER_GAP = sum(VARIANT2_RANGE) / 2 - sum(FULL_RANGE) / 2
# delta_0: a third of that gap.
NO_GAP_MARGIN = PAPER_GAP / 3
# Cut-offs of the threshold claims, this project's choices.
RANDOM_RANK = 12.5                # the mean rank of a permutation drawn at random among 24
LHAT_NEAR_ZERO = 10.0             # a tenth of the way from the best permutation to naive
VARIANT1_HIGH = VARIANT2_RANGE[1]  # above all that Variant 2 leaves in the paper
LMC_MAX = FULL_RANGE[1]           # the most the paper's matched layers leave
RANK_BOUNDS = ss.Bounds(1.0, 24.0)  # a rank among the 4! = 24 head permutations
LHAT_BOUNDS = ss.Bounds(0.0, None)  # L-hat: Stage 1's barrier is never below the best one
# The full-model claim predicts LMC on small data and none on large (docs/lmc.md, 'Verdicts':
# data by size). Kind: the list the paper puts a data set's source in (wiki_bytes: enwik8's kind).
DATA_KIND = {"digits": "small", "mnist5k": "small", "fashion_mnist_deb": "small",
             "wiki_bytes": "large"}
# Size: (modality, training examples: images, or bytes of byte-level text) of each data set the
# settings train on (the re-initialised runs' data set), its whole training split.
DATA_SIZE = {"digits": ("images", 1_797), "mnist5k": ("images", 5_000),
             "fashion_mnist_deb": ("images", 60_000), "wiki_bytes": ("bytes", 5_480_771)}
# The paper's sets as this project reads them: scale -> name -> (modality, training examples).
PAPER_SETS = {
    "small": {"MNIST": ("images", 60_000), "CIFAR-10": ("images", 50_000),
              "CIFAR-100": ("images", 50_000)},
    "large": {"ImageNet": ("images", 1_281_167), "enwik8": ("bytes", 90_000_000),
              # about: both are word-level; only the smallest large set (enwik8) sets the bound
              "WikiText-103": ("bytes", 540_000_000),
              "One Billion Word": ("bytes", 4_000_000_000)},
}
SMALL, LARGE, UNCLASSIFIED = "small", "large", "unclassified"
TABLE1 = "table1_"  # the settings named so are this project's versions of the paper's Table 1


@dataclasses.dataclass(frozen=True)
class Rules:
  """The level of every test and the two margins (points of % of naive)."""
  alpha: float = 0.05
  range_margin: float = RANGE_MARGIN
  no_gap_margin: float = NO_GAP_MARGIN

  def __post_init__(self):
    if not 0.0 < self.alpha < 1.0:
      raise ValueError(f"alpha must lie in (0, 1), got {self.alpha}")
    for name in ("range_margin", "no_gap_margin"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


class Estimate(NamedTuple):
  """An estimate, its standard error and the degrees of freedom of its t interval."""
  value: float
  se: float
  df: int

  @classmethod
  def of(cls, interval: ss.Interval) -> Estimate:
    return cls(interval.estimate, interval.se, interval.num_seeds - 1)


def p_beyond(est: Estimate, bound: float, above: bool) -> float:
  """p-value of "the mean lies above ``bound``" (``above``) or below it: twice the
  one-sided t tail, min(1, 2 P(T_df >= +-(value - bound) / se)), so that p <= alpha
  exactly when the two-sided (1 - alpha) interval lies wholly on that side."""
  gap = (est.value - bound) if above else (bound - est.value)
  if est.se == 0.0:
    return 0.0 if gap > 0 else 1.0
  return min(1.0, 2.0 * ss.t_upper_tail(gap / est.se, est.df))


def p_inside(est: Estimate, low: float, high: float) -> float:
  """TOST p-value of "the mean lies inside [low, high]": the larger of the two one-sided
  tests' p-values, max(p_>(low), p_<(high)); <= alpha when the (1 - alpha) interval lies
  inside."""
  return max(p_beyond(est, low, above=True), p_beyond(est, high, above=False))


def p_outside(est: Estimate, low: float, high: float) -> float:
  """p-value of "the mean lies outside [low, high]": min(p_<(low), p_>(high))."""
  return min(p_beyond(est, low, above=False), p_beyond(est, high, above=True))


def holm(p_values: Sequence[float]) -> list[float]:
  """Holm's step-down adjusted p-values, in the input's order.

  With p_(1) <= ... <= p_(m) sorted, p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)).
  Rejecting where p~ <= alpha is Holm's procedure (reject while p_(i) <= alpha / (m - i + 1),
  stop at the first that fails), which controls the family-wise error rate at alpha.
  """
  m = len(p_values)
  adjusted, running = [0.0] * m, 0.0
  for rank, i in enumerate(sorted(range(m), key=lambda k: p_values[k])):
    running = max(running, min(1.0, (m - rank) * p_values[i]))
    adjusted[i] = running
  return adjusted


class Decision(NamedTuple):
  """A rule's outcome: the verdict, the p-value of the test it rests on (the smallest of
  ``tests`` when none decides), the verdict when that test does not survive the correction,
  and the p-values of every test the rule ran (each counts in the claim's family)."""
  verdict: str
  p: float
  fallback: str
  tests: tuple[float, ...]


class Judged(NamedTuple):
  """A row's estimate as printed, its verdict, the p-value that verdict rests on (None for
  n/a), the verdict when that p-value does not survive the correction, the figure
  (estimate, low, high, unit) the findings quote, and every test the rule ran."""
  estimate: str
  verdict: str
  p: float | None = None
  fallback: str = UNDETERMINED
  figure: tuple[float, float, float, str] | None = None
  tests: tuple[float, ...] = ()


def _judged(text: str, decision: Decision,
            figure: tuple[float, float, float, str] | None) -> Judged:
  return Judged(text, decision.verdict, decision.p, decision.fallback, figure, decision.tests)


def _na(why: str) -> Judged:
  return Judged(why, NA, None, NA)


def _decide(tests: Sequence[tuple[str, float]], weak: str, rules: Rules) -> Decision:
  """The first of ``tests`` ((outcome, p) in the rule's order) whose p is at most alpha decides;
  else ``weak`` with the smallest p. Every test's p is kept for the family."""
  ps = tuple(p for _, p in tests)
  for outcome, p in tests:
    if p <= rules.alpha:
      return Decision(outcome, p, weak, ps)
  return Decision(weak, min(ps), weak, ps)


def range_verdict(est: Estimate, low: float, high: float, rules: Rules) -> Decision:
  """"The mean lies in [low, high]" (module docstring): agrees inside the widened range
  [low - delta, high + delta], differs wholly outside it; two tests."""
  weak = CONSISTENT if low <= est.value <= high else UNDETERMINED
  wide = (low - rules.range_margin, high + rules.range_margin)
  return _decide(((AGREES, p_inside(est, *wide)), (DIFFERS, p_outside(est, *wide))), weak, rules)


def side_verdict(est: Estimate, threshold: float, below: bool, rules: Rules) -> Decision:
  """"The mean lies below (``below``) or above ``threshold``"; two tests."""
  return _decide(((AGREES, p_beyond(est, threshold, above=not below)),
                  (DIFFERS, p_beyond(est, threshold, above=below))), UNDETERMINED, rules)


def ordering_verdict(est: Estimate, rules: Rules) -> Decision:
  """"Lower below higher" on d = lower - higher: no gap inside [-delta_0, delta_0], else the
  side of 0; three tests."""
  return _decide(((NO_GAP, p_inside(est, -rules.no_gap_margin, rules.no_gap_margin)),
                  (AGREES, p_beyond(est, 0.0, above=False)),
                  (DIFFERS, p_beyond(est, 0.0, above=True))), UNDETERMINED, rules)


def _show(interval: ss.Interval, unit: str = " %") -> str:
  return (f"{interval.estimate:.1f}{unit} [{interval.low:.1f}, {interval.high:.1f}] "
          f"({interval.num_seeds} seeds)")


def _figure(interval: ss.Interval, unit: str) -> tuple[float, float, float, str]:
  return interval.estimate, interval.low, interval.high, unit


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
  """One scope's results.json (and its setting's data set), with the per-pair series the
  claims read."""

  def __init__(self, setting: str, scope: str, res: Mapping[str, Any],
               dataset: str | None = None):
    self.setting, self.scope, self.res, self.dataset = setting, scope, res, dataset
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

  def ablation(self, key: str, bounds: ss.Bounds) -> ss.Bounded | None:
    """The Stage 1 ablation's per-pair ``key`` (rank, L-hat), with an interval inside
    ``bounds``."""
    per_pair = self.res.get("ablation", {}).get("permutations", {}).get("per_pair")
    if not per_pair:
      return None
    # Each entry names its pair (runs before the seed subset of the ablation: in pair order).
    return ss.bounded_jackknife([(q.get("a", p["a"]), q.get("b", p["b"]), q.get(key))
                                 for p, q in zip(self.pairs, per_pair)], bounds)


Judge = Callable[[_Scope, Rules], Judged | None]  # None: the claim does not apply


def _ratio_claim(methods: Sequence[str], judge: Judge) -> Judge:
  """A claim on barrier ratios: n/a without the methods or seeds, or under the floor."""
  def run(scope: _Scope, rules: Rules) -> Judged | None:
    why = _missing(scope.res, ("naive", *methods)) or scope.below_floor()
    return _na(why) if why else judge(scope, rules)
  return run


def _in_range(method: str, bounds: tuple[float, float]) -> Judge:
  def judge(scope, rules):
    interval = scope.ratio(method)
    return _judged(_show(interval), range_verdict(Estimate.of(interval), *bounds, rules),
                   _figure(interval, " %"))
  return _ratio_claim((method,), judge)


def _ordered(lower: str, higher: str) -> Judge:
  """``lower``'s ratio below ``higher``'s, on the paired differences lower - higher."""
  def judge(scope, rules):
    d = scope.difference(lower, higher)
    text = f"{_show(d.interval, ' points')}; {d.below} pairs below 0, {d.above} above"
    return _judged(text, ordering_verdict(Estimate.of(d.interval), rules),
                   _figure(d.interval, " points"))
  return _ratio_claim((lower, higher), judge)


def _above(method: str, threshold: float) -> Judge:
  def judge(scope, rules):
    interval = scope.ratio(method)
    return _judged(_show(interval),
                   side_verdict(Estimate.of(interval), threshold, False, rules),
                   _figure(interval, " %"))
  return _ratio_claim((method,), judge)


def _ablation_claim(key: str, threshold: float, unit: str, bounds: ss.Bounds, *,
                    ratio: bool) -> Judge:
  """A claim on the Stage 1 ablation's per-pair ``key`` below ``threshold``; its interval and
  test on the scale that keeps it inside ``bounds`` (``seed_statistics.bounded_jackknife``);
  ``ratio``: it divides by the naive barrier (L-hat), so it is not judged under the floor."""
  def run(scope: _Scope, rules: Rules) -> Judged | None:
    if "permutations" not in scope.res.get("ablation", {}):
      return None
    why = _missing(scope.res, ("naive",)) or (scope.below_floor() if ratio else None)
    bounded = None if why else scope.ablation(key, bounds)
    if bounded is None:
      return _na(why or "n/a: too few seeds with a finite value")
    interval = bounded.interval
    est = Estimate(bounded.scaled(interval.estimate), interval.se, interval.num_seeds - 1)
    note = "" if bounded.transformed else "; clipped to its bounds"
    return _judged(_show(interval, unit) + note,
                   side_verdict(est, bounded.scaled(threshold), True, rules),
                   _figure(interval, unit))
  return run


def size_class(dataset: str | None) -> str:
  """``SMALL`` when ``dataset`` has at most as many training examples as the largest of the
  paper's small sets of its modality (``PAPER_SETS``), ``LARGE`` when at least as many as the
  smallest of its large sets, ``UNCLASSIFIED`` otherwise (between them, no paper set on that
  side in its modality, or a data set of unknown size)."""
  if dataset not in DATA_SIZE:
    return UNCLASSIFIED
  modality, size = DATA_SIZE[dataset]
  of = lambda scale: [n for m, n in PAPER_SETS[scale].values() if m == modality]
  if of(SMALL) and size <= max(of(SMALL)):
    return SMALL
  if of(LARGE) and size >= min(of(LARGE)):
    return LARGE
  return UNCLASSIFIED


def _full_model_lmc(scope: _Scope, rules: Rules) -> Judged | None:
  """LMC (full at most ``LMC_MAX``) on small data, none on large: judged by the data set's kind
  (``DATA_KIND``), its size class beside it (``size_class``; ``_lmc_domain`` marks a row whose
  two disagree an extrapolation)."""
  kind = DATA_KIND.get(scope.dataset or "")
  if kind is None:
    return _na(f"n/a: the paper gives no scale for data set {scope.dataset!r}")
  interval = scope.ratio("full")
  size = size_class(scope.dataset)
  modality, examples = DATA_SIZE.get(scope.dataset, ("examples", math.nan))
  return _judged(f"{_show(interval)}; {scope.dataset}: {kind} in kind, {size} by size "
                 f"({examples:,} training {modality}), so the paper expects "
                 f"{'LMC' if kind == SMALL else 'none'}",
                 side_verdict(Estimate.of(interval), LMC_MAX, kind == SMALL, rules),
                 _figure(interval, " %"))


def _only(scope_name: str, judge: Judge) -> Judge:
  """``judge`` on the scope named ``scope_name``; no row for the others."""
  return lambda scope, rules: judge(scope, rules) if scope.scope == scope_name else None


def _learned(judge: Judge) -> Judge:
  """``judge`` on the scopes whose every pair has the learned method; no row for the others."""
  return lambda scope, rules: (judge(scope, rules) if scope.pairs and all(
      "learned" in p["methods"] for p in scope.pairs) else None)


def _table1_domain(scope: _Scope) -> str:
  return "Table 1" if scope.setting.startswith(TABLE1) else "extrapolation"


def _lmc_domain(scope: _Scope) -> str:
  """"small data" or "large data" where the data set's kind and size class agree, else
  "extrapolation" (this project's Wikipedia bytes: large in kind, unclassified by size)."""
  kind = DATA_KIND.get(scope.dataset or "")
  return f"{kind} data" if kind is not None and kind == size_class(scope.dataset) else (
      "extrapolation")


class Claim(NamedTuple):
  key: str                           # the rows' anchors: <key>-<setting>-<scope>
  text: str                          # as the table prints it
  judge: Judge
  domain: Callable[[_Scope], str]    # whether a setting lies where the paper made the claim


FIRST = "first_attention"  # the scope of the paper's Table 1
_OURS = lambda scope: "ours"
CLAIMS: tuple[Claim, ...] = (
    Claim("full-range", "full method at 7-12 % of naive",
          _only(FIRST, _in_range("full", FULL_RANGE)), _table1_domain),
    Claim("variant2-range", "Variant 2 at 10-16 % of naive",
          _only(FIRST, _in_range("ortho", VARIANT2_RANGE)), _table1_domain),
    Claim("full-below-variant2", "full below Variant 2",
          _only(FIRST, _ordered("full", "ortho")), _table1_domain),
    Claim("variant1-high", f"Variant 1 high (above {VARIANT1_HIGH:g} %)",
          _only(FIRST, _above("perm", VARIANT1_HIGH)), _table1_domain),
    Claim("rank-low", f"Stage 1's rank low (below {RANDOM_RANK:g} of 24, a random choice's mean)",
          _ablation_claim("loss_rank", RANDOM_RANK, "", RANK_BOUNDS, ratio=False),
          _table1_domain),
    Claim("lhat-near-0", f"L̂ near 0 (below {LHAT_NEAR_ZERO:g} %)",
          _ablation_claim("loss_lhat", LHAT_NEAR_ZERO, " %", LHAT_BOUNDS, ratio=True),
          _table1_domain),
    Claim("full-model-lmc",
          f"full-model LMC on small data only (full at most {LMC_MAX:g} % of naive on small "
          "data, above it on large)",
          _only("full", _ratio_claim(("full",), _full_model_lmc)), _lmc_domain),
    Claim("learned-below-full", "ours: learned below full",
          _learned(_ordered("learned", "full")), _OURS),
)
# The paper's ranges as it states them: across its Table 1 configurations.
ACROSS: tuple[tuple[str, str, str, tuple[float, float]], ...] = (
    ("full-range-across", "full method at 7-12 % of naive, across the Table 1 settings",
     "full", FULL_RANGE),
    ("variant2-range-across", "Variant 2 at 10-16 % of naive, across the Table 1 settings",
     "ortho", VARIANT2_RANGE),
)


ACROSS_SETTING = "Table 1 settings"  # the setting cell of the rows across them
# The family each row joins, by its key where that is not the family's own (docs/lmc.md,
# 'Verdicts': family-wise correction): the ranges across settings join their ranges.
# The sweeps' trends join the full-model claim they restate.
FAMILY = {"full-range-across": "full-range", "variant2-range-across": "variant2-range",
          "scale-precludes-lmc": "full-model-lmc", "scale-raises-barrier": "full-model-lmc"}

# The paper's full-model claim as a trend: "as dataset scale and model capacity increase, the loss
# landscape becomes sufficiently complex to preclude LMC", judged on each sweep's slope
# (``regime.trends``: points of % of naive per doubling of the width or the data) of each
# aligned method: it agrees when the slope's interval lies above 0, differs when below, and
# is flat ("no gap") when inside [-delta_0, delta_0] per doubling.
TREND = ("scale-precludes-lmc", "capacity and data scale preclude full-model LMC (the aligned "
         "barrier, % of naive, rises per doubling of width or data)")
# The same on the aligned loss barrier itself (nats, or bits per byte), beside the ratio: flat
# ("no gap") inside +-``FLOOR`` per doubling, the floor under which a barrier is evaluation noise.
TREND_ABSOLUTE = ("scale-raises-barrier", "capacity and data scale preclude full-model LMC (the "
                  "aligned loss barrier itself, nats or bits, rises per doubling of width or "
                  "data)")


class Row(NamedTuple):
  claim: str
  setting: str
  scope: str
  domain: str
  estimate: str
  p: float | None
  verdict: str
  corrected: str     # after Holm over the claim's family
  other: str         # the verdict on a second trajectory: "holds", "-> <verdict>", or ""
  anchor: str
  figure: tuple[float, float, float, str] | None
  tests: int = 0     # how many tests the row counts for in its family
  family: str = ""   # the key of the claim whose family it joins


def _read_scope(run: committed.Run | None, scope: str) -> _Scope | None:
  if run is None or not run.has(scope):
    return None
  cfg = run.config()
  dataset = cfg.get("reinit", {}).get("dataset") or cfg.get("dataset", {}).get("name")
  return _Scope(run.setting, scope, run.results(scope), dataset)


def _scopes(results_root: str) -> Iterator[tuple[_Scope, _Scope | None]]:
  """Every committed setting's scopes under ``results_root`` (not its reduced rerun's), by
  setting and scope name, each with its run on every core where one exists. The variants of
  ``cpu_paper.STUDY_VARIANTS`` are left out: they repeat their base's pairs with other study
  fields, and ``variants.py`` sets them against their bases. So are the other bases of a
  Table 1 setting (``cpu_paper.TABLE1_BASE_VARIANTS``): ``bases.py`` judges each setting over
  its bases."""
  for run in committed.runs(results_root):
    if run.setting in cpu_paper.STUDY_VARIANTS or run.setting in cpu_paper.TABLE1_BASE_VARIANTS:
      continue
    every_core = committed.find(results_root, run.setting, committed.EVERY_CORE)
    for scope in sorted(run.scopes()):
      if (found := _read_scope(run, scope)) is not None:
        yield found, _read_scope(every_core, scope)


def _other(judged: Judged, other: Judged | None) -> str:
  if other is None:
    return ""
  return "holds" if other.verdict == judged.verdict else f"→ {other.verdict}"


def _across(scopes: Sequence[_Scope], method: str, bounds: tuple[float, float],
            rules: Rules) -> Judged:
  """The range as the paper states it, a spread over configurations: the mean of the Table 1
  settings' estimates, with the t interval over settings (k - 1 degrees of freedom: the
  settings as a sample of configurations), judged by the range rule; the text adds the
  settings' own spread."""
  values = []
  for scope in scopes:
    if scope.setting.startswith(TABLE1) and scope.scope == FIRST:
      if _missing(scope.res, ("naive", method)) is None and scope.below_floor() is None:
        values.append(scope.ratio(method).estimate)
  k = len(values)
  if k < ss.MIN_SEEDS:
    return _na(f"n/a: {k} Table 1 setting(s) with a ratio; a spread needs at least "
               f"{ss.MIN_SEEDS}")
  est = Estimate(float(np.mean(values)), float(np.std(values, ddof=1)) / math.sqrt(k), k - 1)
  half = ss.t_quantile(0.975, k - 1) * est.se
  inside = sum(bounds[0] <= v <= bounds[1] for v in values)
  text = (f"{est.value:.1f} % [{est.value - half:.1f}, {est.value + half:.1f}] (mean of {k} "
          f"settings); settings at {min(values):.1f}-{max(values):.1f} %, {inside} of {k} in "
          f"{bounds[0]:g}-{bounds[1]:g} %")
  return _judged(text, range_verdict(est, *bounds, rules),
                 (est.value, est.value - half, est.value + half, " %"))


class _Entry(NamedTuple):
  """A row before the correction: the claim's key and text, the family it joins, where it
  lies, and its judgement."""
  key: str
  text: str
  family: str
  setting: str
  scope: str
  domain: str
  judged: Judged
  other: str


def _row(entry: _Entry, after: str) -> Row:
  where = entry.setting if entry.scope == FIRST else f"{entry.setting}-{entry.scope}"
  anchor = re.sub(r"[^a-z0-9]+", "-", f"{entry.key}-{where}".lower()).strip("-")
  judged = entry.judged
  tests = len(judged.tests or (judged.p,)) if judged.p is not None else 0
  return Row(entry.text, entry.setting, entry.scope, entry.domain, judged.estimate, judged.p,
             judged.verdict, after, entry.other, anchor, judged.figure, tests, entry.family)


def corrected(judged: Sequence[Judged], rules: Rules) -> list[str]:
  """Each row's verdict after Holm over every test of ``judged`` (one claim's family; n/a rows
  stay n/a): a row with k tests enters k hypotheses, and its verdict stands when the test it
  rests on (``Judged.p``) survives."""
  flat, rests_on = [], {}
  for k, j in enumerate(judged):
    if j.p is not None:
      tests = j.tests or (j.p,)
      rests_on[k] = len(flat) + tests.index(j.p)
      flat.extend(tests)
  adjusted = holm(flat)
  return [j.verdict if k not in rests_on or adjusted[rests_on[k]] <= rules.alpha else j.fallback
          for k, j in enumerate(judged)]


def _entries(results_root: str, rules: Rules) -> list[_Entry]:
  """Every row before the correction: claim by claim, then the ranges across the Table 1
  settings, then the sweeps' trends."""
  scopes = list(_scopes(results_root))
  out = []
  for claim in CLAIMS:
    for scope, other in scopes:
      if (judged := claim.judge(scope, rules)) is not None:
        twin = None if other is None else claim.judge(other, rules)
        out.append(_Entry(claim.key, claim.text, claim.key, scope.setting, scope.scope,
                          claim.domain(scope), judged, _other(judged, twin)))
  for key, text, method, bounds in ACROSS:
    judged = _across([s for s, _ in scopes], method, bounds, rules)
    out.append(_Entry(key, text, FAMILY.get(key, key), ACROSS_SETTING, FIRST, "Table 1", judged,
                      ""))
  for sweep in regime.SWEEPS:
    ended = regime.endpoints(results_root, sweep)
    unit = regime.loss_unit(results_root, sweep)
    for (key, text), ratio in ((TREND, True), (TREND_ABSOLUTE, False)):
      for method, slope in regime.trends(results_root, sweep, ratio).items():
        judged = _trend(slope, rules, ratio, unit, ended)
        out.append(_Entry(key, text, FAMILY[key], f"sweep {sweep.key}", method, "extrapolation",
                          judged, ""))
  return out


def verdict_rows(results_root: str, rules: Rules = Rules()) -> list[Row]:
  """One row per claim and (setting, scope) that the claim applies to, claim by claim; then
  the ranges across the Table 1 settings and the sweeps' trends. Holm runs over each family
  (``FAMILY``: a row joins its claim's), counting every test of every row."""
  entries = _entries(results_root, rules)
  after: dict[int, str] = {}
  for family in dict.fromkeys(e.family for e in entries):
    members = [k for k, e in enumerate(entries) if e.family == family]
    after.update(zip(members, corrected([entries[k].judged for k in members], rules)))
  return [_row(e, after[k]) for k, e in enumerate(entries)]


def _trend(slope: regime.Slope | None, rules: Rules, ratio: bool = True, loss_unit: str = "nats",
           ended: str = "") -> Judged:
  """``TREND``'s verdict on one slope (``TREND_ABSOLUTE``'s unless ``ratio``): the ordering rule
  on its negation, so that a rise agrees, with the margin delta_0 points per doubling on the
  ratio and ``FLOOR`` on the barrier itself. The text adds the design (paired or not), the
  curvature with three or more points, and how each point's runs ended (``ended``)."""
  if slope is None:
    return _na("n/a: fewer than two points with a value")
  unit, digits = (" points/doubling", 1) if ratio else (f" {loss_unit}/doubling", 3)
  margin = rules if ratio else dataclasses.replace(rules, no_gap_margin=FLOOR)
  # -slope below 0 (the ordering rule's "agrees") is a rise
  decision = ordering_verdict(Estimate(-slope.estimate, slope.se, slope.df), margin)
  show = lambda v, lo, hi: f"{v:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"
  text = (f"{show(slope.estimate, slope.low, slope.high)}{unit} "
          f"({'paired' if slope.paired else 'unpaired'}, df {slope.df})")
  if slope.curvature is not None:
    c = slope.curvature
    text += f"; curvature {show(c.estimate, c.low, c.high)}"
  if ended:
    text += f"; runs ended: {ended}"
  return _judged(text, decision, (slope.estimate, slope.low, slope.high, unit))


def show_p(p: float | None) -> str:
  return "" if p is None else "<0.001" if p < 0.001 else f"{p:.3f}"


def counts(rows: Sequence[Row], field: str) -> str:
  """"n agrees, n consistent, ... of N rows in the claims' domains" for the verdicts in
  ``field``; the extrapolations are counted apart and left out of those counts."""
  inside = [getattr(r, field) for r in rows if r.domain != "extrapolation"]
  outside = [getattr(r, field) for r in rows if r.domain == "extrapolation"]
  show = lambda found: ", ".join(f"{found.count(v)} {v}" for v in OUTCOMES)
  return (f"{show(inside)} of {len(inside)} rows in the claims' domains (extrapolations, not "
          f"counted there: {show(outside)} of {len(outside)})")


def verdict_table(results_root: str, rules: Rules = Rules()) -> str:
  """The rows as a markdown table, then the count of each verdict before and after Holm."""
  lines = ["| claim | setting | scope | domain | our estimate [95 % seed-level interval] | p | "
           "tests | verdict | after Holm | on a second trajectory |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  rows = verdict_rows(results_root, rules)
  lines += [f"| <a id=\"{r.anchor}\"></a>{r.claim} | {r.setting} | {r.scope} | {r.domain} | "
            f"{r.estimate} | {show_p(r.p)} | {r.tests or ''} | {r.verdict} | {r.corrected} | "
            f"{r.other} |" for r in rows]
  lines += ["", f"Before the correction: {counts(rows, 'verdict')}. After Holm's correction "
                f"within each claim's family, every test counted: {counts(rows, 'corrected')}."]
  return "\n".join(lines) + "\n"


def _cite(row: Row) -> str:
  """A row as the findings quote it: its setting, linked to the row, and its figure."""
  where = ("the Table 1 settings" if row.setting == ACROSS_SETTING else
           f"`{row.setting}`" if row.scope == FIRST else f"`{row.setting}/{row.scope}`")
  link = f"[{where}](#{row.anchor})"
  if row.figure is None:
    return link
  value, low, high, unit = row.figure
  return f"{link} {value:.1f}{unit} [{low:.1f}, {high:.1f}]"


def _by_outcome(rows: Sequence[Row], outcomes: Sequence[str]) -> str:
  parts = []
  for outcome in outcomes:
    chosen = [r for r in rows if r.corrected == outcome]
    if chosen:
      parts.append(f"{outcome} on " + ", ".join(_cite(r) for r in chosen))
  return "; ".join(parts)


def findings(results_root: str, rules: Rules = Rules()) -> str:
  """What the data show and what they do not: per claim, the rows whose verdict after Holm
  is decided, then the rows it leaves open, each linked to its row of the verdict table."""
  rows = verdict_rows(results_root, rules)
  claims = list(dict.fromkeys(r.claim for r in rows))
  show, open_ = [], []
  for claim in claims:
    of = [r for r in rows if r.claim == claim]
    inside = [r for r in of if r.domain != "extrapolation"]
    decided = _by_outcome(inside, (AGREES, NO_GAP, DIFFERS))
    beyond = _by_outcome([r for r in of if r.domain == "extrapolation"], (AGREES, NO_GAP, DIFFERS))
    undecided = _by_outcome(of, (CONSISTENT, UNDETERMINED, NA))
    if decided:
      show.append(f"- **{claim}**: {decided}.")
    if beyond:
      show.append(f"- **{claim}**, extrapolations (outside the claim's domain): {beyond}.")
    if undecided:
      open_.append(f"- **{claim}**: {undecided}.")
  changed = [r for r in rows if r.other.startswith("→")]
  twins = [r for r in rows if r.other]
  lines = ["What the data show (verdicts after Holm's correction within each claim; the "
           "figures are estimates in % of naive, or points for differences, with their 95 % "
           "intervals over seeds):", "", *show, "",
           "What they do not show (consistent: the estimate in the range, the interval not "
           "inside the widened range; undetermined: the interval settles neither way):", "",
           *open_]
  if twins:
    lines += ["", f"On a second float32 trajectory, {len(twins) - len(changed)} of "
                  f"{len(twins)} verdicts hold"
                  + ("" if not changed else "; these do not: " + ", ".join(
                      f"{_cite(r)} ({r.claim}: {r.verdict} {r.other})" for r in changed))
                  + "."]
  extrapolated = sum(r.domain == "extrapolation" for r in rows)
  lines += ["", f"{extrapolated} rows set a claim against settings outside the domain the paper "
                "made it in (column 'domain': extrapolation); the paper's claims say nothing "
                "there, and a verdict there tests only whether the pattern carries over."]
  return "\n".join(lines) + "\n"
