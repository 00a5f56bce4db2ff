"""Several bases per Table 1 setting (experiments/report/bases.py): the two-stage interval over
bases, its coverage by simulation, the variance components, and the generated table on made-up
committed runs."""

import itertools
import json
import math

import numpy as np
import pytest

from experiments.configs import cpu_paper
from experiments.report import bases
from experiments.report import claims
from experiments.report import report
from experiments.report import seed_statistics as ss


def _pairs(values_by_seed_pair):
  return [(a, b, v) for (a, b), v in values_by_seed_pair.items()]


def _simulated_base(rng, mu, base_sd, seed_sd, noise_sd, seeds):
  """The pairs of one base: mu + u (the base's effect) + v_s + v_t (each seed's) + noise."""
  u = rng.normal(0.0, base_sd)
  v = {s: rng.normal(0.0, seed_sd) for s in seeds}
  return [(a, b, mu + u + v[a] + v[b] + rng.normal(0.0, noise_sd))
          for a, b in itertools.combinations(seeds, 2)]


def test_two_stage_is_the_t_interval_over_the_bases_estimates():
  per_base = [[("a", "b", x), ("a", "c", x + 1), ("b", "c", x + 2)] for x in (1.0, 4.0, 7.0)]
  level = bases.two_stage(per_base)
  theta = np.array([2.0, 5.0, 8.0])
  se = theta.std(ddof=1) / math.sqrt(3)
  assert level.estimate == pytest.approx(5.0) and level.se == pytest.approx(se)
  assert level.df == 2
  assert level.high - level.estimate == pytest.approx(ss.t_quantile(0.975, 2) * se)
  assert bases.two_stage(per_base[:1]) is None  # one base: no spread between bases


def test_variance_components_split_the_spread_between_and_within_bases():
  # s^2 of (2, 5, 8) = 9; within = mean(1, 4, 1) = 2: between = 7
  assert bases.components([2.0, 5.0, 8.0], [1.0, 2.0, 1.0]) == pytest.approx((7.0, 2.0))
  # seeds alone explain more than the spread: between is 0, not negative
  assert bases.components([1.0, 1.1, 0.9], [1.0, 1.0, 1.0])[0] == 0.0


def test_two_stage_interval_covers_the_settings_mean_by_simulation():
  """3 bases x 4 seeds with a base effect as large as the seeds': the two-stage interval covers
  the setting's mean in 95 % of 2,000 draws (Monte Carlo SE 0.5 %), and one base's seed-level
  interval does not (it is conditional on its base)."""
  rng = np.random.default_rng(0)
  mu, draws, covered, one_base = 10.0, 2000, 0, 0
  for k in range(draws):
    per_base = [_simulated_base(rng, mu, 2.0, 1.0, 0.5, [f"s{k}_{j}_{i}" for i in range(4)])
                for j in range(3)]
    level = bases.two_stage(per_base)
    covered += level.low <= mu <= level.high
    first = ss.jackknife(per_base[0])
    one_base += first.low <= mu <= first.high
  assert 0.93 <= covered / draws <= 0.97
  assert one_base / draws < 0.8


def test_a_bounded_statistic_stays_inside_its_bounds_over_bases():
  seeds = ("a", "b", "c", "d")
  per_base = [[(a, b, r) for (a, b), r in zip(itertools.combinations(seeds, 2), ranks)]
              for ranks in ([1, 1, 2, 1, 1, 3], [1, 4, 1, 1, 1, 1], [1, 1, 1, 9, 1, 1])]
  level = bases.two_stage(per_base, claims.RANK_BOUNDS)
  assert level.transformed and 1.0 <= level.low < level.estimate < level.high <= 24.0
  unbounded = bases.two_stage(per_base)
  assert unbounded.low < 1.0  # what the untransformed interval would print


def _write_run(root, setting, seeds, full, ortho, perm, ranks):
  """A committed run of ``setting`` with a first_attention results.json: naive barrier 1 in
  every pair, the methods' barriers at these % of it, the ablation's ranks and L-hats."""
  folder = root / setting / "first_attention"
  folder.mkdir(parents=True)
  combos = list(itertools.combinations(seeds, 2))
  pairs = [{"a": a, "b": b, "methods": {"naive": {"loss_barrier": 1.0},
                                        "full": {"loss_barrier": full[k] / 100},
                                        "ortho": {"loss_barrier": ortho[k] / 100},
                                        "perm": {"loss_barrier": perm[k] / 100}}}
           for k, (a, b) in enumerate(combos)]
  per_pair = [{"a": a, "b": b, "loss_rank": ranks[k], "loss_lhat": 2.0 * ranks[k]}
              for k, (a, b) in enumerate(combos)]
  (folder / "results.json").write_text(json.dumps(
      {"pairs": pairs, "ablation": {"permutations": {"per_pair": per_pair}}}))
  (root / setting / "config.json").write_text(json.dumps(
      {"reinit": {"scopes": ["first_attention"]}, "dataset": {"name": "mnist5k"}}))
  (root / setting / "run.json").write_text("{}")


def _commit_bases(root, setting, levels):
  for base, level in zip((1, *sorted(cpu_paper.TABLE1_BASES)), levels):
    seeds = [f"seed_{10 * (base - 1) + i}" for i in range(1, 5 if base > 1 else 6)]
    n = len(seeds) * (len(seeds) - 1) // 2
    wobble = [0.3 * ((k * 7) % 5 - 2) for k in range(n)]
    _write_run(root, cpu_paper.table1_base_setting(setting, base), seeds,
               [level + w for w in wobble], [level + 3 + w for w in wobble], [90.0] * n,
               [1 + (k % 3) for k in range(n)])


def test_the_table_says_so_in_one_line_with_base_1_alone(tmp_path):
  _commit_bases(tmp_path, "table1_vit_mnist_ape", [9.0])
  text = bases.table(str(tmp_path))
  assert "\n" not in text and text.startswith("No Table 1 setting has a second base model")
  assert "base 1 alone for 1 of the 6 settings" in text


def test_the_table_sets_base_level_verdicts_beside_the_one_base_ones(tmp_path):
  setting = "table1_vit_mnist_ape"
  _commit_bases(tmp_path, setting, [9.0, 10.0, 11.0])
  text = bases.table(str(tmp_path))
  lines = text.splitlines()
  assert lines[0].startswith("| setting | claim | base 1 | base 2 | base 3 | over bases")
  rows = {line.split(" | ")[1]: line for line in lines[2:]}
  assert set(rows) == {c.key for c in bases.BASE_CLAIMS}
  full = rows["full-range"]
  assert "(5 seeds)" in full and "(4 seeds)" in full and "(3 bases)" in full
  assert "% between)" in full
  assert "agrees → " in full  # base 1's own verdict, beside the base-level one
  cells = full.split(" | ")
  assert cells[-3] in claims.OUTCOMES and cells[-2] in claims.OUTCOMES
  # base 3 missing: its cell says so, the interval runs over two bases
  _commit_bases(tmp_path / "two", setting, [9.0, 10.0])
  two = bases.table(str(tmp_path / "two"))
  assert "not committed" in two and "(2 bases)" in two


def test_a_base_under_the_ratio_floor_gives_no_ratio_and_its_rank_still_counts(tmp_path):
  """A base whose mean naive barrier is under report.RATIO_FLOOR has no value for the claims
  that divide by it (a ratio of float32 noise, not 0 %): the interval runs over the other
  bases; the rank, which divides by nothing, keeps all three."""
  setting = "table1_vit_mnist_ape"
  _commit_bases(tmp_path, setting, [9.0, 10.0, 11.0])
  results = tmp_path / cpu_paper.table1_base_setting(setting, 2) / "first_attention" / "results.json"
  res = json.loads(results.read_text())
  res["methods"] = {"naive": {"loss_barrier_mean": report.RATIO_FLOOR / 4}}
  results.write_text(json.dumps(res))
  rows = {line.split(" | ")[1]: line.split(" | ") for line in bases.table(str(tmp_path)).splitlines()[2:]}
  for key in ("full-range", "variant2-range", "full-below-variant2", "variant1-high", "lhat-near-0"):
    assert rows[key][3] == f"no ratio: naive under {report.RATIO_FLOOR}", rows[key]
    assert rows[key][5].endswith("(2 bases)"), rows[key]
  assert rows["rank-low"][3].endswith("(4 seeds)") and rows["rank-low"][5].endswith("(3 bases)")


def test_the_readme_holds_the_generated_table():
  from experiments.report import committed
  from experiments.report import results_table
  with open(f"{committed.RESULTS_ROOT}/README.md", encoding="utf-8") as f:
    text = f.read()
  block = text.split(results_table.BASES_BEGIN, 1)[1].split(results_table.BASES_END, 1)[0]
  assert block.strip() == bases.table(committed.RESULTS_ROOT).strip()
