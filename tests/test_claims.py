"""The verdict table of the paper's claims (experiments/claims.py), on made-up results."""

import itertools
import json
import math

import pytest

from experiments import claims

SEEDS = ("seed_1", "seed_2", "seed_3", "seed_4", "seed_5")


def _write(root, setting, scope, barriers, seeds=SEEDS, ablation=None):
  """results/<setting>/<scope>/results.json whose pair k has loss barrier
  ``barriers[method][k]`` for each method."""
  pairs = [{"a": a, "b": b, "methods": {m: {"loss_barrier": v[k]} for m, v in barriers.items()}}
           for k, (a, b) in enumerate(itertools.combinations(seeds, 2))]
  res = {"pairs": pairs, "ablation": ablation or {}}
  folder = root / setting / scope
  folder.mkdir(parents=True)
  (folder / "results.json").write_text(json.dumps(res))


def _rows(root, claim_start):
  return [r for r in claims.verdict_rows(str(root)) if r.claim.startswith(claim_start)]


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
  for row in claims.verdict_rows(str(tmp_path)):
    assert row.verdict == "undetermined"
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
  assert rows[0].verdict == "undetermined"


def test_ablation_and_full_model_claims_apply_only_where_they_were_measured(tmp_path):
  naive = [1.0] * 10
  per_pair = [{"loss_rank": r, "loss_lhat": 0.5 * r} for r in [1, 2, 1, 3, 2, 1, 2, 1, 1, 2]]
  _write(tmp_path, "table", "first_attention",
         _methods(naive, full=[10] * 10, ortho=[12] * 10, perm=[90] * 10),
         ablation={"permutations": {"per_pair": per_pair}})
  _write(tmp_path, "scratch", "full", _methods(naive, full=[60 + k for k in range(10)]))
  rank = _rows(tmp_path, "Stage 1's rank low")
  assert [(r.setting, r.verdict) for r in rank] == [("table", "agrees")]
  lmc = _rows(tmp_path, "full-model LMC")
  assert [(r.setting, r.scope, r.verdict) for r in lmc] == [("scratch", "full", "differs")]
  assert not _rows(tmp_path, "ours")  # no "learned" method in these results


def test_the_table_ends_each_row_with_its_verdict(tmp_path):
  _write(tmp_path, "s", "first_attention",
         _methods([1.0] * 10, full=[10] * 10, ortho=[12] * 10, perm=[90] * 10))
  table = claims.verdict_table(str(tmp_path))
  body = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
  assert body and all(line.rstrip(" |").rsplit("| ", 1)[1] in
                      ("agrees", "differs", "undetermined") for line in body)
