"""results/README.md's table of what REPAIR leaves (experiments/report/repair_gaps.py): read
from the committed pairs, each number recomputed here from the gaps they record."""

import json
import os

import numpy as np
import pytest

from experiments.report import committed
from experiments.report import repair_gaps
from experiments.report import results_table

ROOT = committed.RESULTS_ROOT


def _write_run(root, setting, pairs, lambdas):
  """A committed run of scope "full" whose ``pairs`` are given."""
  folder = os.path.join(root, setting)
  os.makedirs(os.path.join(folder, "full"))
  for name, body in (("run.json", {}), ("config.json", {"reinit": {"scopes": ["full"]}})):
    with open(os.path.join(folder, name), "w") as f:
      json.dump(body, f)
  with open(os.path.join(folder, "full", "results.json"), "w") as f:
    json.dump({"pairs": pairs, "lambdas": lambdas}, f)


def _pair(a, b, gaps_at_half, no_bias="std"):
  """A pair whose "naive+repair" records ``gaps_at_half`` {point: (mean, scale)} at lambda 1/2
  and something else at the other interior lambdas."""
  far = {"p": {"mean_gap": 9.0, "scale_gap": 9.0}}
  at_half = {k: {"mean_gap": m, "scale_gap": s} for k, (m, s) in gaps_at_half.items()}
  return {"a": a, "b": b, "methods": {
      "naive": {"loss_barrier": 1.0},
      "naive+repair": {"loss_barrier": 0.5, "repair": {
          "no_bias": no_bias, "per_lambda": [{"gaps": far}, {"gaps": at_half}, {"gaps": far}]}}}}


def test_the_gaps_read_are_those_repair_records():
  from attn_symmetry import repair  # pylint: disable=import-outside-toplevel
  assert repair_gaps.GAPS == repair.GAPS


def test_middle_index_is_the_interior_lambda_nearest_a_half():
  assert repair_gaps.middle_index([0.0, 0.25, 0.5, 0.75, 1.0]) == 1
  assert repair_gaps.middle_index(list(np.linspace(0, 1, 11))) == 4
  assert repair_gaps.middle_index([0.0, 0.3, 1.0]) == 0
  with pytest.raises(ValueError, match="no interior lambda"):
    repair_gaps.middle_index([0.0, 1.0])


def test_a_row_averages_points_then_pairs_at_a_half(tmp_path):
  """Three seeds, three pairs: each pair's gap is its points' mean at lambda 1/2 (the other
  lambdas' 9s are never read), the row's estimate the pairs' mean, the largest point named."""
  pairs = [_pair(1, 2, {"l0": (0.1, 0.2), "l1": (0.3, 0.0)}, "second_moment"),
           _pair(1, 3, {"l0": (0.5, 0.1), "l1": (0.7, 0.1)}, "second_moment"),
           _pair(2, 3, {"l0": (0.2, 0.0), "l1": (0.0, 0.4)}, "second_moment")]
  _write_run(str(tmp_path), "s", pairs, [0.0, 0.25, 0.5, 0.75, 1.0])
  (row,) = repair_gaps.rows(str(tmp_path))
  assert (row.setting, row.scope, row.method, row.no_bias, row.lam, row.pairs) == (
      "s", "full", "naive+repair", "second_moment", 0.5, 3)
  np.testing.assert_allclose(row.gaps["mean_gap"].estimate, np.mean([0.2, 0.6, 0.1]))
  np.testing.assert_allclose(row.gaps["scale_gap"].estimate, np.mean([0.1, 0.1, 0.2]))
  assert row.largest == {"mean_gap": (0.7, "l1"), "scale_gap": (0.4, "l1")}
  assert "0.300 [" in repair_gaps.table(str(tmp_path))


def test_a_run_without_recorded_gaps_gives_no_row(tmp_path):
  pair = _pair(1, 2, {"l0": (0.1, 0.1)})
  del pair["methods"]["naive+repair"]["repair"]["per_lambda"]
  _write_run(str(tmp_path), "s", [pair], [0.0, 0.25, 0.5, 0.75, 1.0])
  assert repair_gaps.rows(str(tmp_path)) == []
  assert repair_gaps.table(str(tmp_path)).startswith("No committed run")


def test_committed_rows_fold_the_shift_where_a_bias_reads_every_channel():
  """GPT-2 and ViT fold REPAIR's shift: no mean gap, a scale gap at rounding. Llama, without
  biases, is left a mean gap at every point of the naive path."""
  rows = repair_gaps.rows(ROOT)
  biased = [r for r in rows if r.setting.startswith(("residual_gpt2", "residual_vit"))]
  assert biased and all(r.largest["mean_gap"][0] == 0 and r.largest["scale_gap"][0] < 1e-12
                        for r in biased)
  llama = [r for r in rows if "llama" in r.setting and r.method == "naive+repair"]
  assert llama and all(r.gaps["mean_gap"].low > 0 for r in llama)


def test_the_readme_holds_the_generated_table():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  begin, end = results_table.REPAIR_GAPS_BEGIN, results_table.REPAIR_GAPS_END
  block = text.split(begin, 1)[1].split(end, 1)[0]
  assert block.strip() == repair_gaps.table(ROOT).strip()
  assert text.index(results_table.REPAIR_END) < text.index(begin)
