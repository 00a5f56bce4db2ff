"""The verdict table of the paper's claims (experiments/report/claims.py), on made-up results."""

import itertools
import json
import math

import pytest

from experiments.report import claims

SEEDS = ("seed_1", "seed_2", "seed_3", "seed_4", "seed_5")


def _write(root, setting, scope, barriers, seeds=SEEDS, ablation=None, dataset=None):
  """results/<setting>/<scope>/results.json whose pair k has loss barrier
  ``barriers[method][k]`` for each method, in a committed run of ``setting``: its run.json,
  and its config.json listing the scope (and naming ``dataset``, when given)."""
  pairs = [{"a": a, "b": b, "methods": {m: {"loss_barrier": v[k]} for m, v in barriers.items()}}
           for k, (a, b) in enumerate(itertools.combinations(seeds, 2))]
  res = {"pairs": pairs, "ablation": ablation or {}}
  folder = root / setting / scope
  folder.mkdir(parents=True)
  (folder / "results.json").write_text(json.dumps(res))
  config_path = root / setting / "config.json"
  config = json.loads(config_path.read_text()) if config_path.exists() else {
      "reinit": {"scopes": []}}
  config["reinit"]["scopes"].append(scope)
  if dataset is not None:
    config["dataset"] = {"name": dataset}
  config_path.write_text(json.dumps(config))
  (root / setting / "run.json").write_text("{}")


def _rows(root, claim_start, across=False):
  """The rows of the claims named ``claim_start...``: per setting, or (``across``) across the
  Table 1 settings."""
  return [r for r in claims.verdict_rows(str(root)) if r.claim.startswith(claim_start)
          and (r.setting == claims.ACROSS_SETTING) == across]


def _methods(naive, **ratios):
  """Barriers: naive's, and each method's at ``ratios[m][k]`` % of naive's pair k."""
  out = {"naive": naive}
  out.update({m: [n * r / 100 for n, r in zip(naive, rs)] for m, rs in ratios.items()})
  return out


def test_range_and_ordering_verdicts(tmp_path):
  naive = [1.0] * 10
  _write(tmp_path, "in_range", "first_attention",
         _methods(naive, full=[9, 10, 11, 9, 10, 11, 9, 10, 11, 10], ortho=[14] * 10,
                  perm=[90] * 10))
  _write(tmp_path, "far_above", "first_attention",
         _methods(naive, full=[55, 56, 57, 55, 56, 57, 55, 56, 57, 56], ortho=[50] * 10,
                  perm=[90] * 10))
  full = {r.setting: r.verdict for r in _rows(tmp_path, "full method at 7-12")}
  assert full == {"in_range": "agrees", "far_above": "differs"}
  ordering = {r.setting: r for r in _rows(tmp_path, "full below Variant 2")}
  assert ordering["in_range"].verdict == "agrees"  # every pair 3-5 points below
  assert "10 pairs below 0, 0 above" in ordering["in_range"].estimate
  assert ordering["far_above"].verdict == "differs"  # every pair 5-7 points above Variant 2


def test_an_interval_that_covers_the_claim_is_undetermined(tmp_path):
  spread = [2, 30, 5, 25, 8, 20, 3, 28, 6, 23]  # mean 15, wide over seeds
  _write(tmp_path, "wide", "first_attention",
         _methods([1.0] * 10, full=spread, ortho=spread[::-1], perm=[90] * 10))
  (row,) = _rows(tmp_path, "full method at 7-12")
  assert row.verdict == "undetermined" and "5 seeds" in row.estimate


def test_no_ratio_under_the_floor(tmp_path):
  naive = [0.001] * 10
  _write(tmp_path, "memorised", "first_attention",
         _methods(naive, full=[10] * 10, ortho=[12] * 10, perm=[90] * 10))
  for row in _rows(tmp_path, ""):
    assert row.verdict == row.corrected == "n/a"
    assert row.estimate.startswith("no ratio: mean naive barrier 0.0010 is under the floor")
    assert "%" not in row.estimate


@pytest.mark.parametrize("case, why", [
    ("missing", "n/a: method 'full' missing"),
    ("nan", "n/a: a non-finite full barrier"),
    ("two_seeds", "n/a: 2 seed(s) in 1 pair(s)"),
])
def test_bad_results_give_na_with_the_reason(tmp_path, case, why):
  naive = [1.0] * 10
  barriers = _methods(naive, full=[10] * 10, ortho=[12] * 10, perm=[90] * 10)
  seeds = SEEDS
  if case == "missing":
    del barriers["full"]
  elif case == "nan":
    barriers["full"][3] = math.nan
  else:
    seeds = SEEDS[:2]
    barriers = {m: v[:1] for m, v in barriers.items()}
  _write(tmp_path, case, "first_attention", barriers, seeds=seeds)
  rows = _rows(tmp_path, "full method at 7-12")
  assert len(rows) == 1 and rows[0].estimate.startswith(why), rows
  assert "\n" not in rows[0].estimate and rows[0].verdict == "n/a" and rows[0].p is None


def test_ablation_and_full_model_claims_apply_only_where_they_were_measured(tmp_path):
  naive = [1.0] * 10
  per_pair = [{"loss_rank": r, "loss_lhat": 0.5 * r} for r in [1, 2, 1, 3, 2, 1, 2, 1, 1, 2]]
  _write(tmp_path, "table", "first_attention",
         _methods(naive, full=[10] * 10, ortho=[12] * 10, perm=[90] * 10),
         ablation={"permutations": {"per_pair": per_pair}})
  _write(tmp_path, "scratch", "full", _methods(naive, full=[60 + k for k in range(10)]),
         dataset="fashion_mnist_deb")
  _write(tmp_path, "text", "full", _methods(naive, full=[60 + k for k in range(10)]),
         dataset="wiki_bytes")
  _write(tmp_path, "unknown", "full", _methods(naive, full=[60 + k for k in range(10)]))
  rank = _rows(tmp_path, "Stage 1's rank low")
  assert [(r.setting, r.verdict) for r in rank] == [("table", "agrees")]
  lmc = _rows(tmp_path, "full-model LMC")
  assert [(r.setting, r.verdict, r.domain) for r in lmc] == [  # LMC expected on small data only
      ("scratch", "differs", "small data"), ("text", "agrees", "extrapolation"),
      ("unknown", "n/a", "extrapolation")]
  assert lmc[2].estimate == "n/a: the paper gives no scale for data set None"
  assert "wiki_bytes: large in kind, unclassified by size (5,480,771 training bytes)" in (
      lmc[1].estimate)
  assert not _rows(tmp_path, "ours")  # no "learned" method in these results


def test_the_table_ends_each_row_with_its_verdict(tmp_path):
  _write(tmp_path, "s", "first_attention",
         _methods([1.0] * 10, full=[10] * 10, ortho=[12] * 10, perm=[90] * 10))
  table = claims.verdict_table(str(tmp_path))
  body = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
  assert body and all(line.split(" | ")[-3:-1][0] in claims.OUTCOMES for line in body)
  assert "Before the correction: " in table and "After Holm's correction" in table


# Hand-computed examples: with 9 degrees of freedom t_{0.975, 9} = 2.2622, so an estimate with
# SE 1 has the 95 % interval estimate +- 2.2622.
T = claims.ss.t_quantile(0.975, 9)


def test_p_beyond_is_alpha_where_the_interval_touches_the_bound():
  est = claims.Estimate(10.0, 1.0, 9)
  assert claims.p_beyond(est, 10.0 - T, above=True) == pytest.approx(0.05)
  assert claims.p_beyond(est, 10.0 + T, above=False) == pytest.approx(0.05)
  assert claims.p_beyond(est, 10.0, above=True) == 1.0  # twice a half, capped at 1
  assert claims.p_beyond(claims.Estimate(3.0, 0.0, 9), 2.0, above=True) == 0.0


@pytest.mark.parametrize("value, se, margin, verdict", [
    (10.0, 1.0, 2.5, "agrees"),        # [7.74, 12.26] inside [4.5, 14.5]
    (10.0, 1.0, 0.0, "consistent"),    # estimate in 7-12, interval past 12
    (13.5, 0.4, 2.5, "agrees"),        # [12.60, 14.40]: outside 7-12, inside the margin
    (13.0, 1.0, 2.5, "undetermined"),  # [10.74, 15.26]: past 14.5, touches 7-12
    (16.0, 1.0, 2.5, "undetermined"),  # [13.74, 18.26] misses 7-12 but reaches 14.5
    (18.0, 1.0, 2.5, "differs"),       # [15.74, 20.26] leaves the widened range
    (2.1, 1.15, 2.5, "undetermined"),  # [-0.5, 4.7]: below 7-12, reaches 4.5
    (10.0, 3.0, 2.5, "consistent"),    # [3.21, 16.79]
])
def test_range_rule_on_hand_computed_intervals(value, se, margin, verdict):
  rules = claims.Rules(range_margin=margin)
  assert claims.range_verdict(claims.Estimate(value, se, 9), 7.0, 12.0, rules)[0] == verdict


@pytest.mark.parametrize("value, verdict", [
    (0.1, "no gap"),        # [-0.16, 0.36] inside +-1.17
    (-0.2, "no gap"),       # below 0 too, but by less than the margin
    (-3.0, "agrees"),       # [-5.26, -0.74]
    (3.0, "differs"),
    (-1.0, "undetermined"),  # [-3.26, 1.26]
])
def test_ordering_rule_on_hand_computed_intervals(value, verdict):
  se = 0.1 if abs(value) < 0.5 else 1.0
  est = claims.Estimate(value, se, 9)
  assert claims.ordering_verdict(est, claims.Rules())[0] == verdict


def test_margins_come_from_the_papers_ranges():
  assert claims.RANGE_MARGIN == 2.5 and claims.PAPER_GAP == 3.5
  assert claims.NO_GAP_MARGIN == pytest.approx(3.5 / 3)


def test_holm_on_a_hand_computed_family():
  # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (monotone)
  assert claims.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
  assert claims.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
  assert claims.holm([]) == []


def test_a_verdict_that_does_not_survive_holm_falls_back():
  judged = [claims.Judged("", "agrees", 0.01, "consistent"),
            claims.Judged("", "agrees", 0.04, "consistent"),
            claims.Judged("", "differs", 0.03, "undetermined"),
            claims.Judged("", "agrees", 0.005, "undetermined"),
            claims.Judged("n/a: why", "n/a", None, "n/a")]
  assert claims.corrected(judged, claims.Rules()) == [
      "agrees", "consistent", "undetermined", "agrees", "n/a"]


@pytest.mark.parametrize("kwargs, message", [
    ({"alpha": 0.0}, "alpha must lie in (0, 1), got 0.0"),
    ({"alpha": 1.5}, "alpha must lie in (0, 1), got 1.5"),
    ({"range_margin": -1.0}, "range_margin must be a finite number >= 0, got -1.0"),
    ({"no_gap_margin": math.nan}, "no_gap_margin must be a finite number >= 0, got nan"),
])
def test_bad_level_or_margin_is_refused_in_one_line(tmp_path, kwargs, message):
  with pytest.raises(ValueError) as err:
    claims.verdict_rows(str(tmp_path), claims.Rules(**kwargs))
  assert str(err.value) == message


def test_ranges_are_also_judged_across_the_table1_settings(tmp_path):
  for k, level in enumerate((8, 10, 11)):
    _write(tmp_path, f"table1_{k}", "first_attention",
           _methods([1.0] * 10, full=[level + 0.1 * j for j in range(10)], ortho=[14] * 10,
                    perm=[90] * 10))
  _write(tmp_path, "lm_x", "first_attention",
         _methods([1.0] * 10, full=[40 + j for j in range(10)], ortho=[40] * 10, perm=[90] * 10))
  rows = _rows(tmp_path, "full method at 7-12")
  assert {r.setting: r.domain for r in rows} == {
      "table1_0": "Table 1", "table1_1": "Table 1", "table1_2": "Table 1",
      "lm_x": "extrapolation"}
  (across,) = _rows(tmp_path, "full method at 7-12", across=True)
  # the mean of 8.45, 10.45 and 11.45 (lm_x left out): 10.12, 3 of 3 in 7-12
  assert across.estimate.startswith("10.1 % [") and "3 of 3 in 7-12 %" in across.estimate


def test_a_second_trajectory_says_whether_each_verdict_holds(tmp_path):
  naive = [1.0] * 10
  _write(tmp_path, "s", "first_attention",
         _methods(naive, full=[9, 10, 11, 9, 10, 11, 9, 10, 11, 10], ortho=[14] * 10,
                  perm=[90] * 10))
  _write(tmp_path / "s", "every_core", "first_attention",
         _methods(naive, full=[55, 56, 57, 55, 56, 57, 55, 56, 57, 56], ortho=[14] * 10,
                  perm=[90] * 10))
  other = {r.claim: r.other for r in claims.verdict_rows(str(tmp_path)) if r.setting == "s"}
  assert other["full method at 7-12 % of naive"] == "→ differs"
  assert other["Variant 1 high (above 16 %)"] == "holds"


@pytest.mark.parametrize("estimate, verdict", [(6.0, claims.AGREES), (-6.0, claims.DIFFERS),
                                               (0.1, claims.NO_GAP), (1.5, claims.UNDETERMINED)])
def test_the_scale_trend_agrees_on_a_rise_differs_on_a_fall_and_is_flat_inside_the_margin(
    estimate, verdict):
  se = {claims.NO_GAP: 0.2, claims.UNDETERMINED: 1.0}.get(verdict, 0.5)
  t = claims.ss.t_quantile(0.975, 4) * se
  slope = claims.regime.Slope(estimate, estimate - t, estimate + t, se, 4)
  judged = claims._trend(slope, claims.Rules())
  assert judged.verdict == verdict
  assert judged.figure == (estimate, estimate - t, estimate + t, " points/doubling")
  assert claims._trend(None, claims.Rules()).verdict == claims.NA


def test_differs_only_where_the_interval_leaves_the_widened_range(tmp_path):
  """A planted row whose interval misses 7-12 % but reaches the widened range's edge (4.5 %)
  does not differ; one that leaves it does."""
  naive = [1.0] * 10
  _write(tmp_path, "edge", "first_attention",
         _methods(naive, full=[0, 4, 0, 4, 2, 2, 1, 5, 2, 5], ortho=[14] * 10, perm=[90] * 10))
  _write(tmp_path, "far", "first_attention",
         _methods(naive, full=[30 + 0.1 * k for k in range(10)], ortho=[14] * 10,
                  perm=[90] * 10))
  rows = {r.setting: r for r in _rows(tmp_path, "full method at 7-12")}
  low, high = rows["edge"].figure[1:3]
  assert low < 0.0 and 4.5 < high < 7.0  # 2.5 % [-0.3, 5.3]: it reaches the widened edge
  assert rows["edge"].verdict == "undetermined" and rows["far"].verdict == "differs"
  assert rows["far"].tests == 2


def test_a_row_across_the_settings_joins_its_claims_family(tmp_path):
  """The across-settings row is tested in the range's family: alone it would agree (p < 0.05),
  among the settings' rows (eight tests) it falls back to consistent."""
  for k, level in enumerate((8, 10, 11)):
    _write(tmp_path, f"table1_{k}", "first_attention",
           _methods([1.0] * 10, full=[level + 0.1 * j for j in range(10)], ortho=[14] * 10,
                    perm=[90] * 10))
  (across,) = _rows(tmp_path, "full method at 7-12", across=True)
  assert across.family == "full-range" and across.tests == 2
  assert across.verdict == "agrees" and across.p > 0.05 / 5
  assert across.corrected == "consistent"
  # as a family of one, with its deciding test alone (the rule before), it stood
  (alone,) = claims.corrected([claims.Judged("", "agrees", across.p, "consistent", None,
                                              (across.p,))], claims.Rules())
  assert alone == "agrees"


def test_every_test_of_a_row_counts_in_its_family():
  """A row decided by the smaller of two tests counts twice: p = 0.03 alone stands with one
  test, not with two (Holm: 2 x 0.03 > 0.05)."""
  one = claims.Judged("", "agrees", 0.03, "undetermined", None, (0.03,))
  two = claims.Judged("", "agrees", 0.03, "undetermined", None, (0.03, 0.9))
  assert claims.corrected([one], claims.Rules()) == ["agrees"]
  assert claims.corrected([two], claims.Rules()) == ["undetermined"]
  decision = claims.range_verdict(claims.Estimate(10.0, 1.0, 9), 7.0, 12.0, claims.Rules())
  assert len(decision.tests) == 2 and decision.p == min(decision.tests)
  assert len(claims.ordering_verdict(claims.Estimate(-3.0, 1.0, 9), claims.Rules()).tests) == 3


def test_rank_and_lhat_intervals_respect_their_bounds(tmp_path):
  """A planted ablation whose untransformed intervals would reach below rank 1 and L-hat 0."""
  naive = [1.0] * 10
  ranks = [1, 1, 1, 1, 9, 1, 1, 1, 1, 2]
  per_pair = [{"loss_rank": r, "loss_lhat": 4.0 * (r - 1) + 0.1} for r in ranks]
  _write(tmp_path, "table1_x", "first_attention",
         _methods(naive, full=[10] * 10, ortho=[12] * 10, perm=[90] * 10),
         ablation={"permutations": {"per_pair": per_pair}})
  pairs = [(a, b, r) for (a, b), r in zip(itertools.combinations(SEEDS, 2), ranks)]
  raw = claims.ss.jackknife(pairs)
  assert raw.low < 1.0  # what the untransformed interval would print
  (rank,) = _rows(tmp_path, "Stage 1's rank low")
  (lhat,) = _rows(tmp_path, "L̂ near 0")
  assert 1.0 <= rank.figure[1] < rank.figure[0] < rank.figure[2] <= 24.0
  assert 0.0 <= lhat.figure[1] < lhat.figure[0] < lhat.figure[2]
  assert "clipped" not in rank.estimate
  # a leave-one-seed-out mean on the bound (every pair without seed_5 at rank 1): clipped
  on_bound = [(a, b, 3.0 if "seed_5" in (a, b) else 1.0)
              for a, b in itertools.combinations(SEEDS, 2)]
  bounded = claims.ss.bounded_jackknife(on_bound, claims.RANK_BOUNDS)
  assert not bounded.transformed and bounded.interval.low == 1.0


def test_data_are_classed_by_size_and_a_kind_that_disagrees_is_an_extrapolation(tmp_path):
  assert claims.size_class("fashion_mnist_deb") == claims.SMALL
  assert claims.size_class("mnist5k") == claims.SMALL
  assert claims.size_class("wiki_bytes") == claims.UNCLASSIFIED  # 16 x smaller than enwik8
  assert claims.size_class("unknown") == claims.UNCLASSIFIED
  naive = [1.0] * 10
  _write(tmp_path, "text", "full", _methods(naive, full=[60 + k for k in range(10)]),
         dataset="wiki_bytes")
  _write(tmp_path, "images", "full", _methods(naive, full=[60 + k for k in range(10)]),
         dataset="fashion_mnist_deb")
  rows = {r.setting: r for r in _rows(tmp_path, "full-model LMC")}
  assert rows["text"].domain == "extrapolation" and rows["text"].verdict == "agrees"
  assert rows["images"].domain == "small data" and rows["images"].verdict == "differs"
  counted = claims.counts(list(rows.values()), "verdict")
  assert counted.startswith("0 agrees, 0 consistent, 0 no gap, 1 differs, 0 undetermined, "
                            "0 n/a of 1 rows in the claims' domains")
  assert "extrapolations, not counted there: 1 agrees" in counted


def test_trend_rows_on_the_barrier_itself_use_the_floor_as_their_margin():
  slope = claims.regime.Slope(0.01, 0.005, 0.015, 0.002, 4, True)
  assert claims._trend(slope, claims.Rules(), ratio=False).verdict == claims.NO_GAP
  assert claims._trend(slope, claims.Rules(), ratio=True).verdict == claims.NO_GAP
  rising = claims.regime.Slope(0.45, 0.3, 0.6, 0.056, 4, True)
  judged = claims._trend(rising, claims.Rules(), ratio=False, loss_unit="bits",
                         ended="32 (8): 5 budget")
  assert judged.verdict == claims.AGREES and len(judged.tests) == 3
  assert judged.estimate.startswith("+0.450 [+0.300, +0.600] bits/doubling (paired, df 4)")
  assert judged.estimate.endswith("; runs ended: 32 (8): 5 budget")
  assert claims.FAMILY["scale-precludes-lmc"] == claims.FAMILY["scale-raises-barrier"] == (
      "full-model-lmc")
