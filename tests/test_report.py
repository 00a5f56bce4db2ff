"""Study reports: summaries over pairs, ranks and L-hat, summary.md, the curves figure."""

import importlib
import math

import matplotlib.image
import numpy as np
import pytest

from experiments.report import report
from experiments.report import seed_statistics

NAN = float("nan")


def _pair(loss, accuracy):
  """A pair entry with the given {method: barrier} for loss and accuracy."""
  return {"methods": {m: {"loss_barrier": loss[m], "accuracy_barrier": accuracy[m]} for m in loss}}


# Three pairs; the full method's loss barrier of pair 3 is NaN (a diverged path).
PAIRS = [_pair({"naive": 0.4, "full": 0.1}, {"naive": 0.2, "full": 0.05}),
         _pair({"naive": 0.2, "full": 0.1}, {"naive": 0.1, "full": 0.0}),
         _pair({"naive": 0.3, "full": NAN}, {"naive": 0.3, "full": 0.03})]


def test_ratio_pct():
  assert report.ratio_pct(0.5, 2.0) == pytest.approx(25.0)
  assert report.ratio_pct(3.0, 3.0) == pytest.approx(100.0)
  assert report.ratio_pct(0.1, 0.0) is None  # a zero naive barrier: nothing to reduce
  assert report.ratio_pct(0.1, 1e-13) is None


def test_summarise_methods_means_stds_and_ratios():
  rows = report.summarise_methods(PAIRS[:2])
  naive, full = rows["naive"], rows["full"]
  assert naive["num_pairs"] == full["num_pairs"] == 2
  assert naive["loss_barrier_mean"] == pytest.approx(0.3)
  assert naive["loss_barrier_std"] == pytest.approx(0.1)  # population std of 0.4, 0.2
  assert naive["loss_barrier_ratio_pct"] == pytest.approx(100.0)
  assert naive["loss_barrier_ratio_pct_std"] == pytest.approx(0.0)
  # Ratios are taken per pair, then averaged: 25 % and 50 %, not 0.1 / 0.3.
  assert full["loss_barrier_ratio_pct"] == pytest.approx(37.5)
  assert full["loss_barrier_ratio_pct_std"] == pytest.approx(12.5)
  assert full["accuracy_barrier_mean"] == pytest.approx(0.025)
  assert full["accuracy_barrier_ratio_pct"] == pytest.approx(12.5)  # 25 % and 0 %
  assert full["loss_barrier_num_finite"] == full["accuracy_barrier_num_finite"] == 2


def test_a_nan_barrier_is_left_out_and_counted():
  full = report.summarise_methods(PAIRS)["full"]
  assert full["num_pairs"] == 3 and full["loss_barrier_num_finite"] == 2
  assert full["loss_barrier_mean"] == pytest.approx(0.1) and full["loss_barrier_std"] == 0.0
  assert full["loss_barrier_ratio_pct"] == pytest.approx(37.5)  # pairs 1 and 2 only
  assert full["accuracy_barrier_num_finite"] == 3  # its accuracy barriers are all finite
  assert full["accuracy_barrier_mean"] == pytest.approx(0.08 / 3)
  naive_nan = [_pair({"naive": NAN, "full": 0.1}, {"naive": NAN, "full": 0.0})]
  row = report.summarise_methods(naive_nan)["full"]
  assert row["loss_barrier_mean"] == pytest.approx(0.1)
  assert row["loss_barrier_ratio_pct"] is None and row["loss_barrier_ratio_pct_std"] is None
  assert report.summarise_methods(naive_nan)["naive"]["loss_barrier_num_finite"] == 0


def test_rank_and_lhat():
  barriers = [0.3, 0.1, 0.2, 0.1 + 1e-13, 0.5, 0.2]
  assert report.rank_and_lhat(0.2, barriers, naive=0.5) == (3, pytest.approx(25.0))  # ties share
  assert report.rank_and_lhat(0.1 + 1e-13, barriers, naive=0.5) == (1, pytest.approx(0, abs=1e-9))
  assert report.rank_and_lhat(0.5, barriers, naive=0.5) == (6, pytest.approx(100.0))
  assert report.rank_and_lhat(0.2, barriers, naive=0.1) == (3, None)  # naive is the best


def test_summarise_permutation_ablation():
  per_pair = [{"loss_rank": 1, "loss_lhat": 0.0, "accuracy_rank": 2, "accuracy_lhat": None},
              {"loss_rank": 3, "loss_lhat": 20.0, "accuracy_rank": 4, "accuracy_lhat": 10.0}]
  s = report.summarise_permutation_ablation(per_pair)
  assert (s["loss_rank_mean"], s["loss_rank_std"]) == (2.0, 1.0)
  assert (s["loss_lhat_mean"], s["loss_lhat_std"]) == (10.0, 10.0)
  assert (s["accuracy_rank_mean"], s["accuracy_rank_std"]) == (3.0, 1.0)
  assert (s["accuracy_lhat_mean"], s["accuracy_lhat_std"]) == (10.0, 0.0)  # None left out


def _results():
  methods = report.summarise_methods(PAIRS)
  return {"lambdas": [0.0, 0.5, 1.0], "eval_split": "test", "pairs": PAIRS,
          "endpoints": {"seed_1": {"loss": 1.25, "accuracy": 0.5},
                        "seed_2": {"loss": 1.5, "accuracy": 0.625}},
          "methods": methods,
          "ablation": {"permutations": {"num_permutations": 24, "summary": {
              "loss_rank_mean": 1.5, "loss_rank_std": 0.5, "loss_lhat_mean": 2.25,
              "loss_lhat_std": 0.75, "accuracy_rank_mean": 3.0, "accuracy_rank_std": 0.0,
              "accuracy_lhat_mean": None, "accuracy_lhat_std": None}},
                       "distances": {"cosine": methods["full"]}},
          "robustness": {"noise_levels": [0.0, 0.5], "models": ["A", "B"],
                         "accuracy": {"A": [0.9, 0.5], "B": [0.8, 0.25]}}}


def test_ci95_is_the_t_interval_of_the_mean():
  values = [1.0, 2.0, 4.0, 7.0]
  t975_3 = 3.182446305284263  # Student's t quantile, 3 degrees of freedom
  assert report.ci95(values) == pytest.approx(t975_3 * np.std(values, ddof=1) / 2.0)
  assert report.ci95([1.0, NAN, 2.0, 4.0, 7.0, None]) == report.ci95(values)  # finite only
  assert report.ci95([3.0]) is None and report.ci95([]) is None
  assert report.ci95([5.0, 5.0, 5.0]) == 0.0
  rows = report.summarise_methods(PAIRS[:2])
  assert rows["full"]["loss_barrier_ci95"] == pytest.approx(12.706204736 * 0.0, abs=1e-12)
  assert rows["naive"]["loss_barrier_ci95"] == pytest.approx(12.706204736 * 0.1)
  assert rows["full"]["loss_barrier_ratio_pct_ci95"] == pytest.approx(12.706204736 * 12.5)


def test_markdown_summary_holds_the_numbers():
  text = report.markdown_summary("LMC study", {"first_attention": _results()})
  lines = text.splitlines()
  assert lines[0] == "# LMC study"
  assert "## Re-initialisation scope: first_attention" in lines
  assert ("3 checkpoint pair(s), 3 interpolation points on the test split. Endpoint metrics: "
          "seed_1 loss 1.2500 acc 0.5000, seed_2 loss 1.5000 acc 0.6250") in lines
  # The pairs name no seeds: no interval over seeds. Median and ratio of means of full: the
  # NaN pair left out, median(25, 50) = 37.5 and 100 * (0.1 + 0.1) / (0.4 + 0.2) = 33.3.
  assert ("| naive | 0.3000 ± 0.0816 | 0.2000 ± 0.0816 | 100.0 ± 0.0 | n/a | 100.0 | 100.0 | "
          "100.0 ± 0.0 | n/a |") in lines
  assert ("| full (+ gradient refinement) | 0.1000 ± 0.0000 (finite in 2 of 3 pairs) | "
          "0.0267 ± 0.0205 | 37.5 ± 12.5 | n/a | 37.5 | 33.3 | 11.7 ± 10.3 | n/a |") in lines
  assert report.INTERVALS_NOTE in lines
  assert "| Stage 1 | 1.50 ± 0.50 | 2.2 ± 0.8 | 3.00 ± 0.00 | n/a |" in lines
  assert "| cosine | 0.1000 ± 0.0000 (finite in 2 of 3 pairs) | 37.5 ± 12.5 |" in lines
  assert "| noise | A | B |" in lines
  assert "| 0.5 | 0.5000 | 0.2500 |" in lines


def test_markdown_summary_names_the_evaluation_split_and_what_learned_read():
  res = dict(_results(), eval_split="train[:90%]", eval_examples=144,
             learned_overlap={"dataset.train_split": "train[:90%]"})
  lines = report.markdown_summary("LMC study", {"first_attention": res}).splitlines()
  assert any(line.startswith("3 checkpoint pair(s), 3 interpolation points on 144 examples of "
                             "the train[:90%] split. ") for line in lines)
  assert ("The \"learned\" method trains on config.dataset.train_split 'train[:90%]', which "
          "shares records with this split: its barrier here is not held out (the other methods "
          "read no data).") in lines
  res["learned_overlap"] = {}
  assert "not held out" not in report.markdown_summary("LMC study", {"first_attention": res})


@pytest.mark.parametrize("with_nan", [False, True])
def test_plot_curves_writes_a_png(tmp_path, with_nan):
  lams = np.linspace(0, 1, 5)
  pairs = [{"methods": {m: {"loss": (1 + s * lams * (1 - lams)).tolist(),
                            "accuracy": (0.9 - 0.1 * s * lams * (1 - lams)).tolist()}
                        for m, s in (("naive", 4.0), ("full", 0.5))}} for _ in range(3)]
  if with_nan:
    pairs[2]["methods"]["full"]["loss"][2] = NAN
  path = tmp_path / "fig" / "curves.png"  # the folder does not exist yet
  assert report.plot_curves(str(path), "title", lams, pairs) == str(path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  image = matplotlib.image.imread(path)
  assert image.shape[:2] == (456, 1200)  # 10 x 3.8 inches at 120 dpi
  assert image[..., :3].std() > 0.05  # something is drawn
  assert not math.isnan(float(image.mean()))


def test_plot_permutation_curves_draws_every_pair(tmp_path):
  lams = np.linspace(0, 1, 5)
  bump = lams * (1 - lams)
  per_pair = [{"loss_curves": [(1 + k * bump).tolist() for k in range(24)],
               "loss_barriers": [k / 4 for k in range(24)], "chosen": c, "loss_rank": c + 1,
               "num_permutations": 24} for c in (0, 3, 7)]
  naive = [(1 + 30 * bump).tolist()] * 3
  path = tmp_path / "ablation_permutations.png"
  assert report.plot_permutation_curves(str(path), "title", lams, per_pair, naive) == str(path)
  image = matplotlib.image.imread(path)
  assert image.shape[:2] == (280, 960)  # 3 panels of 3.2 x 2.8 inches at 100 dpi
  assert image[..., :3].std() > 0.05


def test_drawing_a_report_leaves_the_callers_matplotlib_backend_alone(tmp_path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  previous = matplotlib.get_backend()
  matplotlib.use("pdf")
  try:
    importlib.reload(report)
    pairs = [{"methods": {"naive": {"loss": [1.0, 2.0, 1.0], "accuracy": [1.0, 0.5, 1.0]}}}]
    report.plot_curves(str(tmp_path / "c.png"), "t", [0.0, 0.5, 1.0], pairs)
    assert matplotlib.get_backend() == "pdf" and (tmp_path / "c.png").stat().st_size > 0
  finally:
    matplotlib.use(previous)


def _seeded_pairs(full_ratios, naive=0.5):
  """Pairs of 4 seeds (6 pairs) whose full barrier is ``full_ratios[k]`` % of naive's."""
  keys = [(f"seed_{i}", f"seed_{j}") for i in range(1, 5) for j in range(i + 1, 5)]
  return [{"a": a, "b": b, "methods": {
      "naive": {"loss_barrier": naive, "accuracy_barrier": naive},
      "ortho": {"loss_barrier": naive * (r + 2) / 100, "accuracy_barrier": 0.0},
      "full": {"loss_barrier": naive * r / 100, "accuracy_barrier": 0.0}}}
          for (a, b), r in zip(keys, full_ratios)]


def test_summaries_carry_seed_level_intervals_and_paired_differences():
  ratios = [10.0, 20.0, 12.0, 30.0, 11.0, 14.0]
  pairs = _seeded_pairs(ratios)
  full = report.summarise_methods(pairs)["full"]
  expected = seed_statistics.jackknife([(p["a"], p["b"], r) for p, r in zip(pairs, ratios)])
  assert full["loss_barrier_ratio_pct_seed_ci"] == pytest.approx([expected.low, expected.high])
  assert full["num_seeds"] == 4 and full["num_pairs"] == 6
  assert full["loss_barrier_ratio_pct_median"] == pytest.approx(13.0)
  assert full["loss_barrier_ratio_of_means_pct"] == pytest.approx(np.mean(ratios))
  differences = report.paired_differences(pairs)
  assert list(differences) == ["full - ortho"]  # the methods DIFFERENCES names that are here
  d = differences["full - ortho"]
  assert d["mean"] == pytest.approx(-2.0)
  assert (d["below"], d["above"], d["zero"], d["num_pairs"]) == (6, 0, 0, 6)
  assert d["seed_ci"][0] == pytest.approx(-2.0) and d["seed_ci"][1] == pytest.approx(-2.0)


def test_no_ratio_is_printed_under_the_floor():
  res = dict(_results(), pairs=_seeded_pairs([10.0, 20.0, 12.0, 30.0, 11.0, 14.0], naive=1e-4))
  res["methods"] = report.summarise_methods(res["pairs"])
  text = report.markdown_summary("LMC study", {"first_attention": res})
  assert "is under the floor of 0.02" in text
  assert "| full (+ gradient refinement) | 0.0000 ± 0.0000 | 0.0000 ± 0.0000 | no ratio |  |  |  |" in text
  assert "Paired differences" not in text


def test_headline_sets_each_scope_beside_each_method_in_percent_of_naive():
  """The lines main.py ends with: a row per scope, a column per method (naive left out), the
  ratio with its seed-level interval; a scope whose naive barrier is under the floor says so."""
  def methods(ratio, naive=1.0):
    return {"naive": {"loss_barrier_mean": naive, "loss_barrier_ratio_pct": 100.0},
            "full": {"loss_barrier_mean": naive * ratio / 100, "loss_barrier_ratio_pct": ratio,
                     "loss_barrier_ratio_pct_seed_ci": [ratio - 2, ratio + 2]}}
  lines = report.headline({"first_attention": {"methods": methods(9.75)},
                           "full": {"methods": methods(50.0, naive=report.RATIO_FLOOR / 2)}})
  assert lines[0].startswith("loss barrier as % of naive")
  assert lines[1].split() == ["scope", "full"]
  assert lines[2].split() == ["first_attention", "9.8", "[7.8,", "11.8]"]
  assert lines[3].startswith("full") and "under the floor" in lines[3]


def test_the_circuit_path_is_summarised_beside_each_method_against_the_ordinary_naive():
  """``study.circuit_path``: every method's "circuit" entry is summarised under "circuit_*"
  keys, its ratio to the ordinary naive barrier of the pair; summary.md adds its two columns
  and a note, and nothing without it."""
  pairs = PAIRS[:2]
  plain = report.pair_statistics(pairs)
  assert not any(k.startswith("circuit") for row in plain["methods"].values() for k in row)
  circuits = {"naive": [0.3, 0.1], "full": [0.02, 0.05]}
  with_circuit = [dict(p, methods={m: dict(v, circuit={"loss_barrier": circuits[m][i],
                                                       "accuracy_barrier": 0.0})
                                   for m, v in p["methods"].items()})
                  for i, p in enumerate(pairs)]
  stats = report.pair_statistics(with_circuit)
  naive, full = stats["methods"]["naive"], stats["methods"]["full"]
  assert full["circuit_loss_barrier_mean"] == pytest.approx(0.035)
  assert full["circuit_loss_barrier_ratio_pct"] == pytest.approx((5.0 + 25.0) / 2)  # of 0.4, 0.2
  assert naive["circuit_loss_barrier_ratio_pct"] == pytest.approx((75.0 + 50.0) / 2)
  assert {k: v for k, v in full.items() if not k.startswith("circuit_")} == plain["methods"]["full"]
  res = dict(_results(), pairs=with_circuit, methods=stats["methods"])
  lines = report.markdown_summary("LMC study", {"first_attention": res}).splitlines()
  assert any(line.endswith("| circuit path: loss barrier | circuit path: loss barrier / naive "
                           "(%) |") for line in lines)
  assert any(line.startswith("| full (+ gradient refinement) |")
             and line.endswith("| 0.0350 ± 0.0150 | 15.0 ± 10.0 |") for line in lines)
  assert report.CIRCUIT_COLUMNS_NOTE in lines
  assert "circuit" not in report.markdown_summary("LMC study", {"first_attention": _results()})
