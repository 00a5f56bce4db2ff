"""experiments/report/learned_curves.py: the learned method's held-out barrier against its steps,
one pair per committed setting and scope, on a planted results tree; and the block of
results/README.md that it writes."""

import json

import pytest

from experiments.report import committed
from experiments.report import learned_curves
from experiments.report import results_table

# The first pair's curve of a reduced residual_gpt2_wiki_full run (20 steps, evaluated every 2).
CURVE = [[0, 0.02851080894470215], [2, 0.018890857696533203], [4, 0.017355918884277344],
         [6, 0.014075756072998047], [8, 0.014909744262695312], [10, 0.02004528045654297],
         [12, 0.01170969009399414], [14, 0.011455059051513672], [16, 0.012798309326171875],
         [18, 0.01311802864074707], [20, 0.010545730590820312]]
# A run stopped by patience 2 after 40 of 100 steps, its best at step 20.
PATIENT = [[0, 0.5], [10, 0.3], [20, 0.2], [30, 0.25], [40, 0.22]]


def _info(curve=None, **fields):
  """A pair's info["learned"]: the keys of runs before the curve was saved, and ``curve`` with
  ``fields`` (stopped, patience, schedule, ...) for the newer ones."""
  info = {"steps": 20, "skipped": 0, "best_step": 20, "lambda": 0.5,
          "holdout": {"best": {"barrier": 0.0105}}}
  return info | ({"curve": curve} if curve else {}) | fields


def _pair(a, b, info=None):
  methods = {"naive": {"loss_barrier": 0.1}}
  if info is not None:
    methods["learned"] = {"loss_barrier": 0.05, "matching": {"learned": info}}
  return {"a": f"seed_{a}", "b": f"seed_{b}", "methods": methods}


def _commit(folder, scopes, learn_steps=20):
  """A committed run in ``folder``: run.json, config.json (scopes in order, study.learn_steps)
  and each scope's results.json with its pairs."""
  folder.mkdir(parents=True)
  (folder / committed.RECORD).write_text(json.dumps({"command": "planted"}))
  (folder / committed.CONFIG).write_text(json.dumps(
      {"reinit": {"scopes": list(scopes)}, "study": {"learn_steps": learn_steps}}))
  for scope, pairs in scopes.items():
    (folder / scope).mkdir()
    (folder / scope / committed.RESULTS).write_text(json.dumps({"pairs": pairs}))


@pytest.fixture
def planted(tmp_path):
  """with_curves (budget 20): "full", its first pair stored before the curve was saved, its
  second with the reduced run's curve, and "first_attention", stored before; its reduced
  rerun (no committed run of its own here); patient (budget 100): stopped by patience;
  without_curves: learned pairs without a curve; no_learned: no learned method."""
  root = tmp_path / "results"
  full = [_pair(1, 2, _info()), _pair(1, 3, _info(CURVE, stopped=False, patience=0,
                                                   schedule="constant")),
          _pair(2, 3, _info(PATIENT, steps=40, stopped=True, patience=2))]
  _commit(root / "with_curves", {"full": full, "first_attention": [_pair(1, 2, _info())]})
  _commit(root / "with_curves" / committed.REDUCED, {"full": full})
  _commit(root / "patient", {"first_attention": [_pair(1, 2, _info(
      PATIENT, steps=40, stopped=True, patience=2, schedule="warmup_cosine"))]}, learn_steps=100)
  _commit(root / "without_curves", {"full": [_pair(1, 2, _info()), _pair(1, 3, _info())]})
  _commit(root / "no_learned", {"full": [_pair(1, 2)]})
  return str(root)


def test_last_quarter_change():
  """100 (b_end - b_q) / b_q, b_q the last evaluation at or before 3/4 of the steps."""
  b_q, b_end = CURVE[7][1], CURVE[-1][1]  # step 14, the last at or before 15
  assert learned_curves.last_quarter_change(CURVE) == pytest.approx(100 * (b_end - b_q) / b_q)
  assert learned_curves.last_quarter_change(PATIENT) == pytest.approx(-12.0)  # 0.25 -> 0.22
  assert learned_curves.last_quarter_change([[0, 1.0], [10, 0.5]]) == pytest.approx(-50.0)
  assert learned_curves.last_quarter_change([[0, 0.0], [10, 0.5]]) is None  # b_q = 0
  assert learned_curves.last_quarter_change([[0, 1.0]]) is None


def test_one_row_per_setting_and_scope_with_a_curve(planted):
  rows, left_out = learned_curves.rows(planted)
  assert [(r.setting, r.scope, r.pair) for r in rows] == [
      ("patient", "first_attention", "seed_1-seed_2"),
      ("with_curves", "full", "seed_1-seed_3")]  # the first pair with a curve
  # no_learned has no learned pair: not named; the reduced rerun is not a committed run
  assert left_out == ["with_curves/first_attention", "without_curves/full"]
  patient, full = rows
  assert full.curve == [tuple(c) for c in CURVE]
  assert (full.steps, full.budget, full.best_step, full.stopped, full.schedule) == (
      20, 20, 20, "budget", "constant")
  assert (full.start, full.best, full.end) == (CURVE[0][1], CURVE[-1][1], CURVE[-1][1])
  assert full.last_quarter == pytest.approx(-7.938, abs=1e-3)
  assert (patient.steps, patient.budget, patient.best_step, patient.stopped) == (
      40, 100, 20, "patience (2)")
  assert (patient.start, patient.best, patient.end) == (0.5, 0.2, 0.22)
  assert patient.schedule == "warmup_cosine"


def test_stopped_when_not_recorded_or_the_batches_ran_out(tmp_path):
  root = tmp_path / "results"
  _commit(root / "old", {"full": [_pair(1, 2, _info(CURVE))]})
  _commit(root / "ran_out", {"full": [_pair(1, 2, _info(CURVE, steps=12, stopped=False))]},
          learn_steps=20)
  rows, _ = learned_curves.rows(str(root))
  assert [(r.setting, r.stopped, r.schedule) for r in rows] == [
      ("old", "not recorded", "not recorded"), ("ran_out", "batches ran out", "not recorded")]


def test_table_rows_and_the_note_of_those_left_out(planted):
  text = learned_curves.table(planted)
  lines = text.splitlines()
  assert "| with_curves | full | seed_1-seed_3 | 20 | 20 | constant | 20 | budget | 0.0285 | " \
         "0.0105 | 0.0105 | -7.9 % |" in lines
  assert "| patient | first_attention | seed_1-seed_2 | 40 | 100 | warmup_cosine | 20 | " \
         "patience (2) | 0.5000 | 0.2000 | 0.2200 | -12.0 % |" in lines
  assert lines[-1] == ("Left out (no curve recorded: runs before the curve was saved): "
                       "with_curves/first_attention, without_curves/full.")
  assert "no_learned" not in text and f"]({learned_curves.FIGURE})" in text
  assert sum(line.startswith("| with_curves |") for line in lines) == 1  # not the reduced rerun


def test_table_without_curves_says_so_in_one_note(tmp_path):
  root = tmp_path / "results"
  _commit(root / "old", {"full": [_pair(1, 2, _info())]})
  assert learned_curves.table(str(root)) == (
      "No committed run of the learned method holds a curve yet. Left out (no curve recorded: "
      "runs before the curve was saved): old/full.")


def test_figure_is_written_with_a_panel_per_row(planted, tmp_path):
  path = tmp_path / learned_curves.FIGURE
  assert learned_curves.plot(planted, str(path)) == str(path)
  data = path.read_bytes()
  assert data.startswith(b"\x89PNG") and 1_000 < len(data) < 300_000
  empty = tmp_path / "empty"
  _commit(empty / "old", {"full": [_pair(1, 2, _info())]})
  assert learned_curves.plot(str(empty), str(tmp_path / "none.png")) is None
  assert not (tmp_path / "none.png").exists()


def test_the_readme_holds_the_generated_block_after_the_learned_variants():
  with open(f"{committed.RESULTS_ROOT}/README.md", encoding="utf-8") as f:
    text = f.read()
  begin, end = results_table.LEARNED_CURVES_BEGIN, results_table.LEARNED_CURVES_END
  block = text.split(begin, 1)[1].split(end, 1)[0]
  assert block.strip() == learned_curves.table(committed.RESULTS_ROOT).strip()
  assert (text.index(results_table.LEARNED_END) < text.index(begin)
          < text.index(results_table.RESIDUAL_BEGIN))
