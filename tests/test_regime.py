"""The width sweep's report: the slope against log2 width, its interval, the table's rows, and
the training cell that says how each row's runs ended."""

import itertools
import json
import math
import os

import numpy as np
import pytest

from experiments.configs import cpu_paper
from experiments.report import regime
from experiments.report import report
from experiments.report import seed_statistics as ss


def _interval(estimate, se, seeds=5):
  half = ss.t_quantile(0.975, seeds - 1) * se
  return ss.Interval(estimate, estimate - half, estimate + half, seeds, seeds * (seeds - 1) // 2,
                     se)


def test_slope_is_least_squares_against_log2_width_with_propagated_error():
  widths, means, ses = (32, 64, 128, 256), (1.0, 0.7, 0.5, 0.2), (0.1, 0.2, 0.05, 0.3)
  s = regime.slope(widths, [_interval(m, e) for m, e in zip(means, ses)])
  x = np.log2(widths)
  assert s.estimate == pytest.approx(np.polyfit(x, means, 1)[0])
  # the slope is linear in the means: its variance is the sum of squared weights x variances
  c = (x - x.mean()) / np.sum((x - x.mean()) ** 2)
  assert s.se == pytest.approx(math.sqrt(np.sum(c ** 2 * np.square(ses))))
  assert s.df == 4 and s.high - s.estimate == pytest.approx(ss.t_quantile(0.975, 4) * s.se)


def test_slope_of_two_widths_is_half_their_difference_per_doubling_and_needs_two_widths():
  s = regime.slope((32, 128), [_interval(1.0, 0.3, seeds=4), _interval(0.4, 0.4)])
  assert s.estimate == pytest.approx(-0.3) and s.se == pytest.approx(0.25) and s.df == 3
  assert regime.slope((64, 64), [_interval(1.0, 0.1), _interval(0.5, 0.1)]) is None


def _results(naive, full, learned, seeds=5):
  """A results.json whose every pair has these loss barriers, times a seed-dependent wobble
  (1 + (a + b) / 100, whose mean over the pairs of seeds 1-5 is 1.06)."""
  pairs = []
  for a, b in itertools.combinations(range(1, seeds + 1), 2):
    wobble = 1 + 0.01 * (a + b)
    pairs.append({"a": f"seed_{a}", "b": f"seed_{b}", "methods": {
        m: {"loss_barrier": v * wobble, "accuracy_barrier": 0.0}
        for m, v in (("naive", naive), ("full", full), ("learned", learned))}})
  return {"pairs": pairs}


def _commit_point(root, width, res, training, sweep=None):
  folder = os.path.join(root, (sweep or cpu_paper.WIDTH_SWEEP)[width])
  os.makedirs(os.path.join(folder, "full"))
  with open(os.path.join(folder, "run.json"), "w") as f:
    json.dump({"wall_seconds": 600, "training": training}, f)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"reinit": {"scopes": ["full"]}}, f)
  with open(os.path.join(folder, "full", "results.json"), "w") as f:
    json.dump(res, f)


def test_width_table_has_a_row_per_committed_width_and_the_slopes(tmp_path):
  assert regime.width_table(str(tmp_path)) == "No point of the width sweep is committed yet."
  training = {f"reinit/full/seed_{s}": {"steps": 1000 * s, "stopped": "plateau", "loss": 0.4}
              for s in range(1, 6)}
  widths = sorted(cpu_paper.WIDTH_SWEEP)[:2]
  for width, naive in zip(widths, (2.0, 1.0)):
    _commit_point(str(tmp_path), width, _results(naive, naive / 2, naive / 10), training)
  table = regime.width_table(str(tmp_path))
  rows = [line for line in table.splitlines() if line[2:3].isdigit()]
  assert len(rows) == 2
  heads = cpu_paper.SWEEP_HEADS
  assert rows[0].startswith(f"| {widths[0]} ({widths[0] // heads}) | 5 | ")
  assert "seeds: 5 plateau; 1,000–5,000 steps; test loss 0.400 | 10 min |" in rows[0]
  # naive halves from one width to the next (2 x 1.06 to 1.06 nats): a slope of -1.06 nats per
  # doubling; full stays at 50 % of naive in every pair: a ratio slope of 0
  cells = {line.split(" | ")[0]: line.split(" | ")[1:] for line in table.splitlines()}
  assert cells["| naive: loss barrier"][0] == "-1.0600 nats"
  assert cells["| full: % of naive"][0] in ("+0.0 points", "-0.0 points")
  assert cells["| full: % of naive"][2] == "paired"  # two widths: no curvature
  assert cells["| full: % of naive"][3] == ""
  assert "How the runs ended, per point: " in table and ": 5 plateau" in table
  assert cells["| learned: loss barrier"][0] == "-0.1060 nats"
  assert "patience 10" not in table
  # a point rerun under the more patient rule gets a row of its own, outside the slopes
  width = sorted(cpu_paper.PATIENT_SWEEP)[0]
  _commit_point(str(tmp_path), width, _results(3.0, 1.5, 0.3), training, cpu_paper.PATIENT_SWEEP)
  patient = regime.width_table(str(tmp_path)).split("patience 10")
  assert len(patient) == 2 and patient[0].startswith(table)
  assert f"| {width} ({width // heads}) | 5 | 3.1800 [" in patient[1]


def test_training_cell_counts_stops_and_spans_steps_and_losses():
  training = {"base": {"steps": 1500, "stopped": "budget", "loss": 0.404},
              "reinit/first_layer/seed_1": {"steps": 3000, "stopped": "budget", "loss": 0.38},
              "reinit/first_layer/seed_2": {"steps": 2200, "stopped": "plateau", "loss": 0.36},
              "reinit/full/seed_1": {"steps": 1500, "stopped": "budget", "loss": 0.41}}
  assert report.training_cell(training, "first_layer") == (
      "seeds: 1 plateau, 1 budget; 2,200–3,000 steps; test loss 0.360–0.380; "
      "base: budget; 1,500 steps; test loss 0.404")
  # the "full" scope starts from no base model: its cell leaves it out
  assert report.training_cell(training, "full") == (
      "seeds: 1 budget; 1,500 steps; test loss 0.410")
  assert report.training_cell({}, "full") == "n/a"
  assert report.training_cell({"reinit/full/seed_1": {"loss": 0.4}}, "full") == "n/a"


def test_identity_closeness_is_one_and_zero_at_the_identity_and_measures_a_move():
  from experiments.study import scope_study
  identity = {"residual": np.arange(4, dtype=np.int32), "rot": np.eye(2),
              "site": {"perm": np.arange(2, dtype=np.int32), "qk": np.stack([np.eye(2)] * 2)}}
  same = scope_study.identity_closeness(identity, identity)
  assert same == {"fixed_points": {"['residual']": 1.0, "['site']['perm']": 1.0},
                  "relative_distance": {"['rot']": 0.0, "['site']['qk']": 0.0}}
  c, s = math.cos(0.1), math.sin(0.1)
  moved = {"residual": np.array([1, 0, 2, 3], np.int32), "rot": np.array([[c, -s], [s, c]]),
           "site": {"perm": np.array([1, 0], np.int32), "qk": np.stack([np.eye(2)] * 2)}}
  out = scope_study.identity_closeness(moved, identity)
  assert out["fixed_points"] == {"['residual']": 0.5, "['site']['perm']": 0.0}
  # ||R(t) - I||_F = 2 sqrt(2) sin(t / 2), ||I||_F = sqrt(2)
  assert out["relative_distance"]["['rot']"] == pytest.approx(2 * math.sin(0.05))


@pytest.mark.parametrize("low, high, verdict", [
    (-0.01, 0.01, "no worse"), (-0.01, 0.03, "undetermined"), (0.025, 0.04, "worse")])
def test_control_verdict_against_the_margin(low, high, verdict):
  interval = ss.Interval((low + high) / 2, low, high, 5, 10, 0.0)
  assert regime.control_verdict(ss.Difference(interval.estimate, interval, 0, 0, 0)) == verdict
  assert regime.CONTROL_MARGIN == 0.02


def test_a_sweep_table_shows_every_method_its_points_have_and_judges_each_trend(tmp_path):
  sweep = regime.GPT2_DATA
  for x, naive in ((0.25, 2.0), (0.5, 1.6), (1.0, 1.2)):
    res = _results(naive, 0.5 * naive, 0.2 * naive)
    for p in res["pairs"]:
      p["methods"]["activation"] = {"loss_barrier": 0.3 * p["methods"]["naive"]["loss_barrier"],
                                    "accuracy_barrier": 0.0}
    _commit_point(str(tmp_path), x, res, {}, sweep=sweep.points)
  table = regime.sweep_table(str(tmp_path), sweep)
  header = table.splitlines()[0]
  assert header.index("full: loss") < header.index("activation: loss") < header.index(
      "learned: loss")
  assert "| 0.25 | 5 | " in table
  assert ("| activation: % of naive | +0.0 points |" in table
          or "| activation: % of naive | -0.0 points |" in table)
  assert "| paired |" in table and "How the runs ended, per point: 0.25: n/a;" in table
  slopes = regime.trends(str(tmp_path), sweep)
  assert set(slopes) == {"full", "activation", "learned"}
  assert slopes["activation"].estimate == pytest.approx(0.0, abs=1e-9)
  assert "No point of the sweep" in regime.sweep_table(str(tmp_path), regime.VIT_DATA)


def _seed_effect_pairs(xs, slope_per_doubling, curvature=0.0, seeds=5):
  """Each point's pairs: value = slope * log2 x + curvature * (log2 x - mean)^2 + a + b (seed
  effects shared across the points, as a shared data order would make them)."""
  x = [math.log2(v) for v in xs]
  mean = sum(x) / len(x)
  out = []
  for xi in x:
    out.append([(f"seed_{a}", f"seed_{b}",
                 slope_per_doubling * xi + curvature * (xi - mean) ** 2 + 3.0 * (a + b))
                for a, b in itertools.combinations(range(1, seeds + 1), 2)])
  return out


def test_paired_slope_is_the_mean_of_per_pair_slopes_and_removes_shared_seed_effects():
  xs = (32, 64, 128)
  per_point = _seed_effect_pairs(xs, 2.0)
  s = regime.paired_slope(xs, per_point)
  assert s.paired and s.estimate == pytest.approx(2.0) and s.se == pytest.approx(0.0, abs=1e-9)
  # the unpaired slope sees the seeds' spread at each point as noise
  unpaired = regime.slope(xs, [ss.jackknife(p) for p in per_point])
  assert unpaired.estimate == pytest.approx(2.0) and unpaired.se > 1.0
  assert s.curvature.estimate == pytest.approx(0.0, abs=1e-9)


def test_curvature_finds_points_off_the_line_and_needs_three_points():
  xs = (32, 64, 128, 256)
  s = regime.paired_slope(xs, _seed_effect_pairs(xs, 1.0, curvature=0.5))
  assert s.curvature.estimate == pytest.approx(0.5)
  two = regime.paired_slope((32, 128), _seed_effect_pairs((32, 128), 1.0))
  assert two.curvature is None and two.estimate == pytest.approx(1.0)


def test_endpoints_say_how_each_point_ended(tmp_path):
  training = {f"reinit/full/seed_{s}": {"steps": 6000, "stopped": "budget" if s < 4 else
                                        "plateau", "loss": 0.4} for s in range(1, 6)}
  width = sorted(cpu_paper.WIDTH_SWEEP)[0]
  _commit_point(str(tmp_path), width, _results(2.0, 1.0, 0.2), training)
  assert regime.endpoints(str(tmp_path), regime.VIT_WIDTH) == (
      f"{width} ({width // cpu_paper.SWEEP_HEADS}): 2 plateau, 3 budget")
