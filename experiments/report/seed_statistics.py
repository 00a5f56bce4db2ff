"""Statistics over seeds for a study's pairs (docs/lmc.md, 'Intervals over seeds').

n re-initialised seeds give n (n - 1) / 2 pairs, and every seed sits in n - 1
of them, so the pairs are not independent draws: an interval that treats them
as such is too narrow. The unit of replication is the seed. Every interval
here is a leave-one-seed-out jackknife: with theta_(s) the statistic over the
pairs that do not contain seed s, and theta_(.) their mean,

    SE^2 = (n - 1) / n * sum_s (theta_(s) - theta_(.))^2,
    interval = theta_hat +- t_{0.975, n - 1} * SE,

where theta_hat is the statistic over every pair. The jackknife is used rather
than a cluster bootstrap because it is deterministic and defined for any
statistic of the pairs, and because with 5 seeds a bootstrap over seeds has
only 5^5 distinct draws and its percentile interval is narrower still; t with
n - 1 degrees of freedom accounts for the few seeds.

Ratios of small barriers are heavy-tailed, so beside the mean of per-pair
ratios (the paper's statistic) the reports give the ratio of mean barriers and
the median ratio (``report.summarise_methods``), and ``paired_difference``
compares two methods pair by pair. A statistic needs at least ``MIN_SEEDS`` seeds with a finite
value; below that the functions return None and say why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import scipy.special

MIN_SEEDS = 3


def t_quantile(p: float, df: int) -> float:
  """The ``p``-quantile of Student's t distribution with ``df`` degrees of freedom
  (``scipy.special.stdtrit``: scipy.stats.t.ppf's value, without importing scipy.stats, which
  costs every command that reports a second)."""
  return float(scipy.special.stdtrit(df, p))


def t_upper_tail(x: float, df: int) -> float:
  """P(T >= x) for Student's t with ``df`` degrees of freedom (``scipy.special.stdtr``)."""
  return float(scipy.special.stdtr(df, -x))


# A pair: (seed a, seed b, value); the value may be None or not finite (left out).
Pair = tuple[str, str, float | None]
Statistic = Callable[[np.ndarray], float]


class Interval(NamedTuple):
  """A statistic over pairs, its 95 % leave-one-seed-out jackknife interval and its standard
  error ``se`` (the interval is estimate +- t_{0.975, num_seeds - 1} * se)."""
  estimate: float
  low: float
  high: float
  num_seeds: int
  num_pairs: int
  se: float


def _finite_pairs(pairs: Sequence[Pair]) -> list[tuple[str, str, float]]:
  return [(a, b, float(v)) for a, b, v in pairs if v is not None and math.isfinite(v)]


def _seeds(pairs: Sequence[tuple[str, str, Any]]) -> list[str]:
  return sorted({s for a, b, _ in pairs for s in (a, b)})


def why_no_interval(pairs: Sequence[Pair]) -> str | None:
  """None when ``jackknife`` can compute an interval from ``pairs``, else the reason (one
  line): fewer than ``MIN_SEEDS`` seeds among the pairs with a finite value."""
  finite = _finite_pairs(pairs)
  seeds = _seeds(finite)
  if len(seeds) < MIN_SEEDS:
    left_out = len(pairs) - len(finite)
    return (f"{len(seeds)} seed(s) in {len(finite)} pair(s) with a finite value "
            f"({left_out} left out); an interval over seeds needs at least {MIN_SEEDS}")
  for s in seeds:
    if all(s in (a, b) for a, b, _ in finite):
      return f"every pair with a finite value contains seed {s}; leaving it out leaves none"
  return None


def _leave_one_out(pairs: Sequence[Pair], statistic: Statistic
                   ) -> tuple[float, np.ndarray, int] | None:
  """(the statistic over every finite pair, the statistics without each seed in turn, the
  number of finite pairs), or None when ``why_no_interval(pairs)`` gives a reason."""
  if why_no_interval(pairs) is not None:
    return None
  finite = _finite_pairs(pairs)
  over = lambda kept: float(statistic(np.asarray([v for _, _, v in kept], np.float64)))
  left_out = np.asarray([over([p for p in finite if s not in p[:2]]) for s in _seeds(finite)])
  return over(finite), left_out, len(finite)


def _jackknife_se(left_out: np.ndarray) -> float:
  """sqrt((n - 1) / n * sum_s (theta_(s) - theta_(.))^2)."""
  n = len(left_out)
  return math.sqrt((n - 1) / n * float(np.sum((left_out - left_out.mean()) ** 2)))


def jackknife(pairs: Sequence[Pair], statistic: Statistic = np.mean) -> Interval | None:
  """The statistic of the pairs' finite values and its leave-one-seed-out interval.

  Args:
    pairs: (seed a, seed b, value) for every pair; a value that is None or not
      finite is left out (with every other pair kept).
    statistic: maps a [k] array of values to a number (mean, median, ...).

  Returns:
    ``Interval``, or None when ``why_no_interval(pairs)`` gives a reason.
  """
  found = _leave_one_out(pairs, statistic)
  if found is None:
    return None
  estimate, left_out, num_pairs = found
  n = len(left_out)
  se = _jackknife_se(left_out)
  half = t_quantile(0.975, n - 1) * se
  return Interval(estimate, estimate - half, estimate + half, n, num_pairs, se)


class Bounds(NamedTuple):
  """Where a statistic can lie: [low, high], either end open (None). ``to_scale`` maps the open
  interval (low, high) onto the real line (logit with both ends, log with one); ``from_scale``
  maps back."""
  low: float | None = None
  high: float | None = None

  def to_scale(self, x: float) -> float:
    """g(x): log((x - low) / (high - x)), log(x - low) or -log(high - x); +-inf on a bound."""
    with np.errstate(divide="ignore"):
      up = np.log(x - self.low) if self.low is not None else 0.0
      down = np.log(self.high - x) if self.high is not None else 0.0
    return float(up - down)

  def from_scale(self, y: float) -> float:
    """g^{-1}(y)."""
    if self.low is not None and self.high is not None:
      return self.low + (self.high - self.low) * float(scipy.special.expit(y))
    if self.low is not None:
      return self.low + math.exp(y)
    return self.high - math.exp(-y)

  def clip(self, x: float) -> float:
    return min(max(x, -math.inf if self.low is None else self.low),
               math.inf if self.high is None else self.high)


class Bounded(NamedTuple):
  """A bounded statistic's interval (``Interval``: the estimate, the endpoints mapped back from
  the transformed scale, and ``se`` on that scale), and the estimate and threshold's scale for
  its tests: ``transformed`` True when the interval was computed on g's scale, False when a value
  lay on a bound and the untransformed interval was clipped to the bounds (``se`` is then the
  untransformed one)."""
  interval: Interval
  bounds: Bounds
  transformed: bool

  def scaled(self, x: float) -> float:
    """x on the scale the tests run on: g(x) when transformed, else x."""
    return self.bounds.to_scale(x) if self.transformed else x


def bounded_jackknife(pairs: Sequence[Pair], bounds: Bounds, statistic: Statistic = np.mean
                      ) -> Bounded | None:
  """A statistic that lies in ``bounds`` (a mean rank in [1, 24], L-hat >= 0), with an interval
  whose endpoints lie in them too (docs/lmc.md, 'Verdicts': bounded quantities).

  With g = ``bounds.to_scale``: the leave-one-seed-out jackknife of g(theta), SE_g^2 =
  (n - 1) / n sum_s (g(theta_(s)) - mean_s g(theta_(s)))^2, gives the interval
  g^{-1}(g(theta-hat) +- t_{0.975, n - 1} SE_g), which g^{-1} keeps inside the bounds. Where
  theta-hat or a theta_(s) lies on a bound (g infinite), the untransformed jackknife interval is
  clipped to the bounds instead: it covers the mean whenever the unclipped one does.

  Returns:
    ``Bounded``, or None when ``why_no_interval(pairs)`` gives a reason.
  """
  found = _leave_one_out(pairs, statistic)
  if found is None:
    return None
  estimate, left_out, num_pairs = found
  n = len(left_out)
  t = t_quantile(0.975, n - 1)
  scaled = np.asarray([bounds.to_scale(v) for v in (estimate, *left_out)])
  if np.all(np.isfinite(scaled)):
    se = _jackknife_se(scaled[1:])
    low, high = (bounds.from_scale(scaled[0] + sign * t * se) for sign in (-1, 1))
    return Bounded(Interval(estimate, low, high, n, num_pairs, se), bounds, True)
  se = _jackknife_se(left_out)
  low, high = bounds.clip(estimate - t * se), bounds.clip(estimate + t * se)
  return Bounded(Interval(estimate, low, high, n, num_pairs, se), bounds, False)


class Difference(NamedTuple):
  """The mean of the finite per-pair differences x - y (None without one), its seed-level
  interval (None when ``why_no_interval`` gives a reason), and how many pairs lie above,
  below and at zero."""
  mean: float | None
  interval: Interval | None
  above: int
  below: int
  zero: int


def paired_difference(x: Sequence[Pair], y: Sequence[Pair]) -> Difference:
  """Pair by pair x - y (e.g. full's ratio minus Variant 2's), summarised by ``jackknife``.

  Args:
    x, y: (seed a, seed b, value) of the same pairs (matched by their seeds).
  """
  ys = {(a, b): v for a, b, v in y}
  diffs: list[Pair] = []
  for a, b, v in x:
    w = ys.get((a, b))
    ok = v is not None and w is not None and math.isfinite(v) and math.isfinite(w)
    diffs.append((a, b, v - w if ok else None))
  values = np.asarray([d for _, _, d in _finite_pairs(diffs)])
  return Difference(float(values.mean()) if len(values) else None, jackknife(diffs),
                    int(np.sum(values > 0)), int(np.sum(values < 0)), int(np.sum(values == 0)))


def interval_record(interval: Interval | None) -> list[float] | None:
  """[low, high] for results.json, None without an interval."""
  return None if interval is None else [interval.low, interval.high]
