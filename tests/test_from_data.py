"""The table of the full-model studies from data (experiments/report/from_data.py), on a tiny
results tree written here: what it reads from the pairs, which studies it leaves out, and a
REPAIRed path that the pairs lack."""

import itertools
import json
import os

import pytest

from experiments.report import from_data
from experiments.report import report
from experiments.report import results_table
from experiments.report import seed_statistics as ss

SEEDS = ("seed_1", "seed_2", "seed_3", "seed_4")
LAMBDAS = [0.0, 0.3, 0.45, 0.8, 1.0]  # nearest 1/2: 0.45, index 2


def _path(offset, barrier):
  """A method's entry: its loss and accuracy per lambda, both barriers, and its time."""
  loss = [1.0, 1.5, 2.0 + offset, 1.5, 1.0]
  return {"loss": loss, "accuracy": [0.9, 0.7, 0.5 - offset / 10, 0.7, 0.9],
          "loss_barrier": barrier, "accuracy_barrier": barrier / 10}


def _results(methods, repair):
  """results.json of 6 pairs of 4 seeds; each method's barrier differs from pair to pair, and
  its alignment takes (pair index + 1) * its rank seconds."""
  pairs = []
  for k, (a, b) in enumerate(itertools.combinations(SEEDS, 2)):
    entries = {}
    for rank, m in enumerate(methods):
      for name in (m, m + report.REPAIRED) if repair else (m,):
        shift = 0.1 * rank + (0.05 if name.endswith(report.REPAIRED) else 0.0)
        entries[name] = _path(shift + 0.01 * k, 2.0 - 0.4 * rank + 0.1 * k - shift)
        if m != "naive" and not name.endswith(report.REPAIRED):
          entries[name]["matching"] = {"seconds": float((k + 1) * rank)}
    pairs.append({"a": a, "b": b, "methods": entries})
  return {"lambdas": LAMBDAS, "loss_unit": "cross-entropy (nats)",
          "endpoints": {s: {"loss": 0.5 + 0.1 * i, "accuracy": 0.8 + 0.01 * i}
                        for i, s in enumerate(SEEDS)},
          "pairs": pairs}


def _commit(root, setting, scope, res):
  folder = root / setting
  (folder / scope).mkdir(parents=True)
  (folder / "run.json").write_text("{}")
  (folder / "config.json").write_text(json.dumps({"reinit": {"scopes": [scope]}}))
  (folder / scope / "results.json").write_text(json.dumps(res))


@pytest.fixture
def tree(tmp_path):
  _commit(tmp_path, "data_a", "full", _results(("naive", "full", "activation", "learned"), True))
  _commit(tmp_path, "data_b", "full", _results(("naive", "full", "activation"), False))
  _commit(tmp_path, "width_c", "full", _results(("naive", "full", "learned"), True))
  return str(tmp_path)


def test_a_study_without_the_activation_method_is_left_out(tree):
  assert [(s.setting, s.scope) for s in from_data.studies(tree)] == [("data_a", "full"),
                                                                     ("data_b", "full")]
  assert "width_c" not in from_data.table(tree)


def test_the_columns_are_read_from_the_pairs(tree):
  res = _results(("naive", "full", "activation", "learned"), True)
  s = from_data.studies(tree)[0]
  assert from_data.midpoint_index(LAMBDAS) == 2 and s.lam == 0.45
  assert [r.method for r in s.rows] == ["naive", "full", "activation", "learned"]
  full = s.rows[1]
  # the merged model at the lambda nearest 1/2: the mean over the 6 pairs of loss[2]
  assert full.midpoint[0] == pytest.approx(2.0 + 0.1 + 0.01 * 2.5)
  assert full.midpoint[1] == pytest.approx(0.5 - (0.1 + 0.01 * 2.5) / 10)
  assert full.midpoint_repaired[0] == pytest.approx(2.0 + 0.15 + 0.01 * 2.5)
  # the alignment's seconds: (k + 1) * 1 for full; median 3.5 of 1..6; naive aligns nothing
  assert full.seconds == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
  assert s.rows[0].seconds == []
  pairs = res["pairs"]
  assert full.ratio == ss.jackknife(report.ratio_pairs(pairs, "full"))
  stored = report.paired_differences(pairs)  # what results.json's "differences" hold
  assert full.repair_gain.mean == pytest.approx(stored["full+repair - full"]["mean"])
  assert list(full.repair_gain.interval[1:3]) == pytest.approx(
      stored["full+repair - full"]["seed_ci"])
  assert s.differences["activation − full"].mean == pytest.approx(
      stored["activation - full"]["mean"])
  assert s.endpoints == pytest.approx((0.65, 0.815))
  line = next(l for l in from_data.table(tree).splitlines() if "| full |" in l)
  assert "| 3.5 s (1.0–6.0) |" in line
  assert f"| {full.midpoint[0]:.3f} / {full.midpoint[1]:.3f} |" in line


def test_a_missing_repaired_path_and_method_read_n_a(tree):
  s = from_data.studies(tree)[1]
  assert [r.method for r in s.rows] == ["naive", "full", "activation"]
  assert all(r.repaired is None and r.repair_gain is None and r.midpoint_repaired is None
             for r in s.rows)
  assert s.differences["learned − activation"] is None
  rows = [l for l in from_data.table(tree).splitlines() if l.startswith("| `data_b`")]
  assert rows and rows[0].split(" | ")[3:5] == ["n/a", "n/a"]
  note = next(l for l in from_data.table(tree).splitlines() if l.startswith("- `data_b`"))
  assert "learned − activation: n/a" in note


def test_no_study_from_data(tmp_path):
  assert "No committed study" in from_data.table(str(tmp_path))


def test_the_readme_block_is_the_table_of_the_committed_runs():
  """results/README.md holds ``table`` of the committed results between its markers, in the
  subsection before the one on every factor learned in the language models."""
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
  with open(os.path.join(root, "README.md")) as f:
    text = f.read()
  block = text.split(results_table.FROM_DATA_BEGIN, 1)[1].split(results_table.FROM_DATA_END)[0]
  assert block.strip() == from_data.table(root)
  assert ("### Full-model alignment from data" in text[:text.index(results_table.FROM_DATA_BEGIN)]
          and text.index(results_table.FROM_DATA_END)
          < text.index("### Every factor learned in the full-model language models"))
