"""Seed-level intervals of the study's pairs (experiments/report/seed_statistics.py)."""

import itertools
import math

import numpy as np
import pytest

from experiments.report import seed_statistics as ss


def _pairs(values, seeds=("s1", "s2", "s3")):
  return [(a, b, v) for (a, b), v in zip(itertools.combinations(seeds, 2), values)]


def test_jackknife_of_three_seeds_by_hand():
  """Pairs (1,2) = 1, (1,3) = 2, (2,3) = 3. Leaving out seed 1 leaves the pair (2,3): 3;
  seed 2 leaves 2, seed 3 leaves 1. Their mean is 2, so SE^2 = 2/3 * (1 + 0 + 1) = 4/3, and
  t_{0.975, 2} = 4.302653 gives the half-width 4.302653 * sqrt(4/3) = 4.968275."""
  interval = ss.jackknife(_pairs([1.0, 2.0, 3.0]))
  assert interval.estimate == pytest.approx(2.0)
  assert interval.low == pytest.approx(2.0 - 4.968275, abs=1e-6)
  assert interval.high == pytest.approx(2.0 + 4.968275, abs=1e-6)
  assert (interval.num_seeds, interval.num_pairs) == (3, 3)


def test_seed_interval_is_wider_than_the_pair_interval_when_a_seed_is_an_outlier():
  """One seed that makes every pair it is in large: a pair-level t interval sees 10 pairs,
  the seed-level one sees that the spread comes from one seed of five."""
  seeds = [f"s{i}" for i in range(5)]
  pairs = [(a, b, 10.0 if "s0" in (a, b) else 1.0 + 0.1 * i)
           for i, (a, b) in enumerate(itertools.combinations(seeds, 2))]
  values = np.asarray([v for _, _, v in pairs])
  pair_half = 2.262157 * values.std(ddof=1) / math.sqrt(len(values))
  interval = ss.jackknife(pairs)
  assert interval.estimate == pytest.approx(values.mean())
  assert (interval.high - interval.low) / 2 > 1.5 * pair_half


def test_non_finite_values_are_left_out_and_too_few_seeds_give_no_interval():
  pairs = _pairs([1.0, float("nan"), 3.0])
  assert ss.jackknife(pairs) is None
  assert "every pair with a finite value contains seed s2" in ss.why_no_interval(pairs)
  two = [("s1", "s2", 1.0)]
  assert ss.jackknife(two) is None
  assert "needs at least 3" in ss.why_no_interval(two)
  four = _pairs([1.0, None, 2.0, 3.0, 4.0, 5.0], seeds=("s1", "s2", "s3", "s4"))
  assert ss.jackknife(four).num_pairs == 5


def test_paired_difference_matches_a_numpy_reference():
  rng = np.random.default_rng(0)
  seeds = [f"s{i}" for i in range(6)]
  keys = list(itertools.combinations(seeds, 2))
  x, y = rng.normal(10, 3, len(keys)), rng.normal(9, 3, len(keys))
  got = ss.paired_difference([(a, b, v) for (a, b), v in zip(keys, x)],
                             [(a, b, v) for (a, b), v in zip(reversed(keys), y[::-1])])
  d = x - y
  left_out = np.asarray([d[[s not in k for k in keys]].mean() for s in seeds])
  se = np.sqrt(5 / 6 * np.sum((left_out - left_out.mean()) ** 2))
  half = 2.570582 * se  # t_{0.975, 5}
  assert got.interval.estimate == pytest.approx(d.mean())
  assert got.interval.low == pytest.approx(d.mean() - half, rel=1e-6)
  assert got.interval.high == pytest.approx(d.mean() + half, rel=1e-6)
  assert (got.above, got.below, got.zero) == (int((d > 0).sum()), int((d < 0).sum()), 0)
