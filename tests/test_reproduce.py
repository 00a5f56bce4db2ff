"""results/ is what the committed code computes: the smallest setting's reduced form is rerun
and its numbers compared with the committed ones; every setting's config is valid."""

import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from experiments.configs import cpu_paper
from experiments.report import claims
from experiments.report import committed
from experiments.report import report
from experiments.report import results_table
from experiments.reproduction import runner
from experiments.reproduction import scheduler
from experiments.setting import config_checks
from tests.conftest import compile_options_removed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALLEST = "table1_vit_mnist_ape"
COMMITTED = os.path.join(REPO, "results", SMALLEST, "reduced")


@pytest.mark.parametrize("setting", sorted(cpu_paper.SETTINGS))
@pytest.mark.parametrize("variant", ["", ",reduced"])
def test_every_setting_is_a_valid_config(setting, variant):
  config_checks.validate(cpu_paper.get_config(setting + variant))


def test_a_setting_must_be_named():
  with pytest.raises(ValueError, match="name one setting"):
    cpu_paper.get_config("reduced")
  with pytest.raises(ValueError, match="unknown setting"):
    runner.run_setting("table9", reduced=True, workdir="/nonexistent", results_dir="/nonexistent")


def _load(directory):
  with open(os.path.join(directory, "first_attention", "results.json")) as f:
    return json.load(f)


# How far the reduced rerun may move from the committed run, per quantity. The committed run
# came from an AMD EPYC; the same commit rerun on an Intel Xeon (CPU family 6, model 207) with
# XLA's default kernels (AVX-512) and with --xla_cpu_max_isa=AVX2, AVX and SSE4_2 moved by at
# most (measured 2026-12-05):
#   the methods' loss curves and loss barriers      4.4e-5 nats  (learned, AVX2)
#   the matching's final weight distance            1.4e-3       (learned; 2.7e-4 the others)
#   the ablation's loss barriers and curves         4.1e-4 nats  (one head pair of one seed
#                                                                 pair, whose Stage 2 carries
#                                                                 rounding furthest)
#   the ablation's L-hat                            4.6e-3 points
#   accuracies                                      one example of the evaluation batch
#                                                   (the ablation's; the methods' none)
# Repeated runs on one machine are bit for bit equal. Each tolerance is about twice the
# largest move. What is decided (the config, the pairs and methods, each matching's steps and
# rounds, the chosen permutation and its loss rank) must be equal, so a changed option or seed
# fails there. Mutation runs: study.match_steps 50 -> 49 moves no value past its tolerance
# (the full method's loss barrier by 5.4e-5) and fails on the config and the matchings' steps
# alone; 50 -> 60 also moves the values (full's loss barrier by 3.9e-4, learned's distance
# by 0.98, L-hat by 0.04).
LOSS_ATOL = 1e-4
DISTANCE_ATOL = 3e-3
ABLATION_LOSS_ATOL = 1e-3
LHAT_ATOL = 1e-2
DECIDED_MATCHING = ("refinement_steps", "rounds", "folded_norm_scales")


def rerun_differences(new_dir, old_dir) -> list[str]:
  """Every way the reduced run in ``new_dir`` differs from the committed one in ``old_dir``
  beyond the tolerances above: one line each (empty when they agree)."""
  out = []

  def close(what, new, old, atol):
    new, old = np.asarray(new, float), np.asarray(old, float)
    if new.shape != old.shape or not np.all(np.abs(new - old) <= atol):
      worst = np.max(np.abs(new - old)) if new.shape == old.shape else "shape"
      out.append(f"{what}: differs by {worst} (tolerance {atol})")

  def equal(what, new, old):
    if new != old:
      out.append(f"{what}: {new!r} != committed {old!r}")

  configs = []
  for directory in (new_dir, old_dir):
    with open(os.path.join(directory, "config.json")) as f:
      configs.append(dict(_leaves(json.load(f))))
  for field, value in configs[1].items():  # fields added since keep the committed behaviour
    equal(f"config {field[1:]}", configs[0].get(field, "<missing>"), value)
  new, old = _load(new_dir), _load(old_dir)
  decided = len(out)
  equal("pairs", [(p["a"], p["b"]) for p in new["pairs"]], [(p["a"], p["b"]) for p in old["pairs"]])
  equal("methods", list(new["methods"]), list(old["methods"]))
  if len(out) > decided:  # no values to set side by side
    return out
  one_example = 1 / old["eval_examples"] + 1e-9
  ablations = [r["ablation"]["permutations"]["per_pair"] for r in (new, old)]
  equal("ablated pairs", len(ablations[0]), len(ablations[1]))
  for p_new, p_old, abl_new, abl_old in zip(new["pairs"], old["pairs"], *ablations):
    pair = f"{p_old['a']}-{p_old['b']}"
    for method, old_m in p_old["methods"].items():
      new_m, where = p_new["methods"][method], f"{pair} {method}"
      for key in ("loss", "loss_barrier"):
        close(f"{where} {key}", new_m[key], old_m[key], LOSS_ATOL)
      for key in ("accuracy", "accuracy_barrier"):
        close(f"{where} {key}", new_m[key], old_m[key], one_example)
      if "matching" in old_m:
        for key in DECIDED_MATCHING:
          equal(f"{where} matching {key}", new_m["matching"].get(key), old_m["matching"].get(key))
        if "distance" in old_m["matching"]:
          close(f"{where} distance", new_m["matching"]["distance"]["final"],
                old_m["matching"]["distance"]["final"], DISTANCE_ATOL)
    for key in ("perms", "chosen", "loss_rank"):
      equal(f"{pair} ablation {key}", abl_new[key], abl_old[key])
    for key in ("loss_barriers", "loss_curves"):
      close(f"{pair} ablation {key}", abl_new[key], abl_old[key], ABLATION_LOSS_ATOL)
    close(f"{pair} ablation loss_lhat", abl_new["loss_lhat"], abl_old["loss_lhat"], LHAT_ATOL)
    for key in ("accuracy_barriers", "accuracy_curves"):
      close(f"{pair} ablation {key}", abl_new[key], abl_old[key], one_example)
  return out


@pytest.mark.slow
def test_reduced_rerun_gives_the_committed_numbers(tmp_path):
  """The committed reduced run, recomputed by the committed command in a process of its own,
  as a user runs it: the same decisions, and the same numbers to the rounding that differs
  between CPUs (the tolerances above). The process runs on one core (reproduce.py pins it),
  so what shares the machine, here the other test worker, does not change its numbers; nor
  the test run's compile options, which it runs without."""
  results = tmp_path / "results"
  subprocess.run([sys.executable, "experiments/reproduce.py", f"--setting={SMALLEST}",
                  "--reduced", f"--workdir_root={tmp_path / 'work'}", f"--results={results}",
                  "--compilation_cache="], cwd=REPO, check=True,
                 env=dict(compile_options_removed(os.environ), PYTHONPATH=REPO))
  rerun = results / SMALLEST / "reduced"
  with open(rerun / "run.json") as f:
    record = json.load(f)
  with open(os.path.join(COMMITTED, "run.json")) as f:
    assert json.load(f)["command"] == record["command"]
  differences = rerun_differences(rerun, COMMITTED)
  assert not differences, "\n".join(differences)
  with open(os.path.join(COMMITTED, "summary.md")) as f:
    committed_summary = f.read()
  assert "## Re-initialisation scope: first_attention" in committed_summary


def test_rerun_comparison_tells_a_changed_option_or_value_from_rounding(tmp_path):
  """The comparison of the test above passes the committed run against itself moved by
  rounding (each quantity by half its tolerance), and names each change that is not rounding:
  an option, a matching's steps, a value moved past its tolerance, another chosen
  permutation."""
  shutil.copytree(COMMITTED, tmp_path / "same", ignore=shutil.ignore_patterns("*.png"))
  res = _load(COMMITTED)
  for pair in res["pairs"]:
    pair["methods"]["full"]["loss_barrier"] += LOSS_ATOL / 2
  for ablation in res["ablation"]["permutations"]["per_pair"]:
    ablation["loss_barriers"] = [b - ABLATION_LOSS_ATOL / 2 for b in ablation["loss_barriers"]]
  (tmp_path / "same" / "first_attention" / "results.json").write_text(json.dumps(res))
  assert rerun_differences(tmp_path / "same", COMMITTED) == []

  def changed(edit_results=None, edit_config=None):
    directory = tmp_path / f"changed_{len(list(tmp_path.iterdir()))}"
    shutil.copytree(tmp_path / "same", directory)
    for name, edit in (("first_attention/results.json", edit_results),
                       ("config.json", edit_config)):
      if edit:
        tree = json.loads((directory / name).read_text())
        edit(tree)
        (directory / name).write_text(json.dumps(tree))
    return rerun_differences(directory, COMMITTED)

  def steps(config):
    config["study"]["match_steps"] = 60
  assert changed(edit_config=steps) == ["config study.match_steps: 60 != committed 50"]
  def refinement(res):
    res["pairs"][0]["methods"]["full"]["matching"]["refinement_steps"] = 60
  assert changed(refinement) == ["seed_1-seed_2 full matching refinement_steps: 60 != committed 50"]
  def barrier(res):
    res["pairs"][1]["methods"]["learned"]["loss_barrier"] += 2 * LOSS_ATOL
  assert [d.split(":")[0] for d in changed(barrier)] == ["seed_1-seed_3 learned loss_barrier"]
  def chosen(res):
    res["ablation"]["permutations"]["per_pair"][2]["chosen"] = 0
  assert changed(chosen) == ["seed_2-seed_3 ablation chosen: 0 != committed 3"]


def test_committed_reports_are_restated_by_the_current_code(tmp_path):
  """Every committed run's results.json statistics (seed-level intervals included) and
  summary.md are what the current code derives from its stored pairs: restating a copy
  changes no byte."""
  root = tmp_path / "results"
  shutil.copytree(os.path.join(REPO, "results"), root, ignore=shutil.ignore_patterns("*.png"))
  runs = committed.runs(str(root), reruns=True)
  assert len(runs) > 1 and str(root / SMALLEST / "reduced") in [r.folder for r in runs]
  changed = [p for run in runs for p in results_table.restate(run)]
  assert not changed, f"run reproduce.py --table: {changed}"
  for run in runs:
    for scope in run.scopes():
      methods = run.results(scope)["methods"]
      assert all("loss_barrier_ratio_pct_seed_ci" in row and
                 "accuracy_barrier_ratio_pct_seed_ci" in row for row in methods.values())


def test_summary_title_names_the_data_set_the_study_evaluates_on():
  """A transfer setting's study evaluates on the data set its re-initialised runs fine-tune on,
  and its summary says so (restate writes the title the study wrote)."""
  with open(os.path.join(REPO, "results", "scopes_vit_mnist_to_fashion_attention",
                         "config.json")) as f:
    config = json.load(f)
  assert config["dataset"]["name"] == "mnist5k"
  assert report.study_title(config) == "LMC study: vit on fashion_mnist_deb"
  assert report.study_title(cpu_paper.get_config("table1_vit_mnist_ape")) == (
      "LMC study: vit on mnist5k")


def test_restate_derives_the_statistics_from_the_pairs(tmp_path):
  """A results.json stored with stale statistics gets the current ones, from its pairs."""
  setting = tmp_path / SMALLEST
  shutil.copytree(COMMITTED, setting, ignore=shutil.ignore_patterns("*.png"))
  path = setting / "first_attention" / "results.json"
  res = json.loads(path.read_text())
  res["methods"] = {m: {"loss_barrier_mean": 0.0} for m in res["methods"]}
  del res["differences"]
  path.write_text(json.dumps(res, indent=1))
  run = committed.find(str(tmp_path), SMALLEST)
  assert results_table.restate(run) == [str(path)]  # summary.md: from the pairs too
  restated = json.loads(path.read_text())
  assert restated["methods"] == report.summarise_methods(res["pairs"])
  assert restated["differences"] == report.paired_differences(res["pairs"])
  assert list(restated) == list(_load(COMMITTED))  # the study's order of keys
  assert results_table.restate(run) == []


def test_commit_column_marks_edited_code_but_not_reports_of_other_settings():
  sha = "0123456789abcdef"
  commit = results_table._commit
  assert commit({"commit": sha, "uncommitted": []}) == "0123456"
  assert commit({"commit": sha, "uncommitted": ["results/other/run.json"]}) == "0123456"
  assert commit({"commit": sha, "uncommitted": ["results/other/run.json",
                                                "experiments/train.py"]}) == "0123456 (with edits)"
  assert commit({"commit": sha + "+dirty"}) == "0123456 (with edits)"


def test_readme_table_is_generated_from_the_committed_runs():
  """results/README.md's table is exactly what --table makes of results/*/run.json and the
  results beside them, one row per setting and scope, with the commit each run started from."""
  root = os.path.join(REPO, "results")
  with open(os.path.join(root, "README.md")) as f:
    text = f.read()
  marks = results_table.MARK_BEGIN, results_table.MARK_END
  table = text.split(marks[0], 1)[1].split(marks[1], 1)[0].strip()
  assert table == results_table.markdown(root)
  runs = [d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "run.json"))]
  for setting in runs:
    with open(os.path.join(root, setting, "run.json")) as f:
      commit = json.load(f)["commit"][:7]
    assert f"| {setting} |" in table and f"| {commit}" in table


def _between(text, begin, end):
  return text.split(begin, 1)[1].split(end, 1)[0].strip()


def test_readme_verdicts_and_findings_are_generated_from_the_committed_runs():
  """results/README.md's verdict table and the findings that open it are exactly what
  claims.py makes of results/*/results.json, and the findings come first."""
  root = os.path.join(REPO, "results")
  with open(os.path.join(root, "README.md")) as f:
    text = f.read()
  assert _between(text, results_table.VERDICTS_BEGIN, results_table.VERDICTS_END) == (
      claims.verdict_table(root).strip())
  assert _between(text, results_table.FINDINGS_BEGIN, results_table.FINDINGS_END) == (
      claims.findings(root).strip())
  assert text.index(results_table.FINDINGS_BEGIN) < text.index(results_table.VERDICTS_BEGIN) < (
      text.index(results_table.MARK_BEGIN))


def test_seed_level_against_pair_level_width_is_what_the_docs_say():
  """docs/lmc.md gives the range of (seed-level width) / (pair-level width) of the committed
  runs' ratios; it is that range, to the printed digit."""
  widths = []
  for path in glob.glob(os.path.join(REPO, "results", "*", "*", "results.json")):
    with open(path) as f:
      methods = json.load(f)["methods"]
    for method, row in methods.items():
      ci, half = row.get("loss_barrier_ratio_pct_seed_ci"), row.get("loss_barrier_ratio_pct_ci95")
      if method != "naive" and ci and half:
        widths.append((ci[1] - ci[0]) / 2 / half)
  with open(os.path.join(REPO, "docs", "lmc.md")) as f:
    docs = " ".join(f.read().split())
  assert f"{min(widths):.1f} to {max(widths):.1f} times as wide" in docs


def test_scope_prose_quotes_the_committed_paired_differences():
  """The paired differences that results/README.md quotes for scopes_vit_fashion are those of
  its results.json, to the printed digit."""
  with open(os.path.join(REPO, "results", "README.md")) as f:
    text = " ".join(f.read().replace("−", "-").split())
  quoted = [(scope, "activation - full", 2) for scope in ("first_layer", "all_attention", "full")]
  quoted += [(scope, "learned - full", 1) for scope in ("first_layer", "all_attention", "full")]
  for scope, key, digits in quoted:
    with open(os.path.join(REPO, "results", "scopes_vit_fashion", scope, "results.json")) as f:
      d = json.load(f)["differences"][key]
    low, high = d["seed_ci"]
    assert f"{d['mean']:.{digits}f}" in text and f"[{low:.{digits}f}, {high:.{digits}f}]" in text


@pytest.mark.slow
def test_table_command_rewrites_the_committed_readme_byte_for_byte(tmp_path):
  """``reproduce.py --table`` on a copy of results/ leaves its README as committed, and puts
  the generated table and the learned curves' block back between their markers after their
  text was changed: every other block and the hand-written text stay byte for byte."""
  root = tmp_path / "results"
  shutil.copytree(os.path.join(REPO, "results"), root, ignore=shutil.ignore_patterns("*.png"))
  committed = (root / "README.md").read_bytes()
  begin, end = (m.encode() for m in (results_table.LEARNED_CURVES_BEGIN,
                                     results_table.LEARNED_CURVES_END))
  head, rest = committed.replace(b"| table1_vit_mnist_ape |", b"| x |").split(begin, 1)
  (root / "README.md").write_bytes(head + begin + b"\nx\n" + end + rest.split(end, 1)[1])
  done = subprocess.run([sys.executable, "experiments/reproduce.py", "--table",
                         f"--results={root}"], cwd=REPO, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=REPO))
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == str(root / "README.md")
  assert (root / "README.md").read_bytes() == committed


def _leaves(tree, prefix=""):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _leaves(v, f"{prefix}.{k}")
  else:
    yield prefix, tree


@pytest.mark.parametrize("setting", sorted(
    d for d in os.listdir(os.path.join(REPO, "results"))
    if os.path.exists(os.path.join(REPO, "results", d, "run.json"))))
def test_committed_runs_are_the_settings_of_the_committed_config(setting):
  """Each committed run is a setting of cpu_paper, and every config field it recorded has
  the value the setting has now (fields added to the config since are not in its record), so
  that a setting's definition cannot change under its committed numbers."""
  assert setting in cpu_paper.SETTINGS, f"results/{setting} is no setting of cpu_paper"
  with open(os.path.join(REPO, "results", setting, "config.json")) as f:
    recorded = dict(_leaves(json.load(f)))
  now = dict(_leaves(json.loads(cpu_paper.get_config(setting).to_json())))
  changed = {k: (v, now.get(k)) for k, v in recorded.items() if now.get(k) != v}
  assert not changed, f"{setting}: fields changed since its run (recorded, now): {changed}"


def test_a_run_on_every_core_reports_beside_the_one_core_run():
  """--noone_core follows another float32 trajectory: its reports go to every_core/, never over
  the committed one-core run's, and its command says how it ran."""
  assert committed.folder("r", "s", reduced=False, one_core=True) == os.path.join("r", "s")
  assert committed.folder("r", "s", reduced=False, one_core=False) == os.path.join(
      "r", "s", "every_core")
  assert committed.folder("r", "s", reduced=True, one_core=True) == os.path.join(
      "r", "s", "reduced")
  assert runner.command("s", False, one_core=False) == (
      "python experiments/reproduce.py --setting=s --noone_core")


def test_trajectory_table_says_where_each_mean_of_the_every_core_run_falls(tmp_path):
  """Each method's every-core mean is set against the one-core run's interval over seeds:
  unchanged pairs fall inside it; full's barriers made ten times larger, above it. The
  every-core run is restated with the others and judged by no claim."""
  setting = tmp_path / "s"
  shutil.copytree(COMMITTED, setting, ignore=shutil.ignore_patterns("*.png"))
  shutil.copytree(COMMITTED, setting / "every_core", ignore=shutil.ignore_patterns("*.png"))
  path = setting / "every_core" / "first_attention" / "results.json"
  res = json.loads(path.read_text())
  for pair in res["pairs"]:
    pair["methods"]["full"]["loss_barrier"] *= 10
  path.write_text(json.dumps(res))
  run = json.loads((setting / "every_core" / "run.json").read_text())
  run["machine"]["cores_used"], run["command"] = 2, runner.command("s", True, one_core=False)
  (setting / "every_core" / "run.json").write_text(json.dumps(run))
  table = results_table.trajectory_table(str(tmp_path))
  rows = {line.split(" | ")[2].split(" (")[0]: line for line in table.splitlines()
          if line.startswith("| s |")}
  assert list(rows) == ["naive", "Variant 1", "Variant 2", "full", "learned"]
  full = report.summarise_methods(res["pairs"])["full"]["loss_barrier_ratio_pct"]
  low, high = json.loads((setting / "first_attention" / "results.json").read_text())[
      "methods"]["full"]["loss_barrier_ratio_pct_seed_ci"]
  assert full > high and rows["full"].endswith("| above |")
  assert all(rows[m].endswith("| inside |") for m in ("naive", "Variant 1", "Variant 2",
                                                      "learned"))
  assert "on 2 cores" in table and "--noone_core" in table
  every_core = committed.find(str(tmp_path), "s", "every_core")
  assert every_core in committed.runs(str(tmp_path), reruns=True)
  assert results_table.restate(every_core) == [  # its stale statistics
      str(path), str(setting / "every_core" / "summary.md")]
  assert {(r.setting, r.scope) for r in claims.verdict_rows(str(tmp_path))
          if r.setting != claims.ACROSS_SETTING} == {("s", "first_attention")}


def test_table_says_when_a_ratio_leaves_out_pairs(tmp_path):
  """A pair whose naive barrier is zero has no ratio to naive; the row says over how many
  pairs its ratios are taken."""
  setting = SMALLEST
  shutil.copytree(os.path.join(REPO, "results", setting), tmp_path / setting,
                  ignore=shutil.ignore_patterns("reduced", "*.png"))
  path = tmp_path / setting / "first_attention" / "results.json"
  res = json.loads(path.read_text())
  pairs = len(res["pairs"])
  assert f"| {setting} | first_attention | {pairs} |" in results_table.markdown(str(tmp_path))
  for pair in res["pairs"][:3]:
    pair["methods"]["naive"]["loss_barrier"] = 0.0
  path.write_text(json.dumps(res))
  assert (f"| {setting} | first_attention | {pairs} (ratios over {pairs - 3}) |"
          in results_table.markdown(str(tmp_path)))


@pytest.mark.slow
def test_run_concurrently_keeps_at_most_jobs_running_and_reports_each_exit(tmp_path):
  """Four commands, two at a time, in the order given: at no moment do three run, two that
  run at once hold different slots, each one's output lands in its log, and a failure leaves
  the others running."""
  script = ("import sys, time; print('out', sys.argv[1]); open(sys.argv[2], 'a').write("
            "f'{sys.argv[3]} {time.time()} '); time.sleep(0.4); open(sys.argv[2], 'a').write("
            "f'{time.time()}\\n'); sys.exit(3 if sys.argv[1] == 'c' else 0)")
  names = ["a", "b", "c", "d"]
  commands = [(n, [sys.executable, "-c", script, n, str(tmp_path / f"{n}.times")]) for n in names]
  status = scheduler.run_concurrently(commands, jobs=2, log_dir=str(tmp_path / "logs"),
                                      slot_args=lambda slot: [f"slot{slot}"], poll_seconds=0.05)
  assert status == {"a": 0, "b": 0, "c": 3, "d": 0} and set(status) == set(names)
  runs = [(tmp_path / f"{n}.times").read_text().split() for n in names]
  spans = [(float(start), float(end)) for _, start, end in runs]
  for slot, (start, end) in zip([r[0] for r in runs], spans):
    beside = [r[0] for r, (s, e) in zip(runs, spans) if s < end and start < e]
    assert beside.count(slot) == 1, f"{slot} held twice at once: {runs}"
  for t in [start for start, _ in spans]:
    assert sum(start <= t < end for start, end in spans) <= 2
  assert spans[0][0] < spans[2][0] and spans[1][0] < spans[3][0]  # in order
  assert (tmp_path / "logs" / "c.log").read_text().strip() == "out c"


@pytest.mark.slow
@pytest.mark.parametrize("one_core", [True, False])
def test_run_settings_runs_longest_first_each_on_a_core_of_its_own(tmp_path, one_core):
  """Every setting's command runs, the longest committed run first, with this checkout on
  its PYTHONPATH; with one_core, two that run at once get different cores this process may
  use (``--core``), and without it no core is named."""
  for setting, seconds in (("short", 60.0), ("long", 3000.0)):
    (tmp_path / setting).mkdir()
    (tmp_path / setting / "run.json").write_text(json.dumps({"wall_seconds": seconds}))
  script = ("import json, os, sys, time; print(json.dumps([time.time(), sys.argv[1:], "
            "os.environ['PYTHONPATH'].split(os.pathsep)[0]])); sys.stdout.flush(); "
            "time.sleep(0.4)")
  argv = lambda setting: [sys.executable, "-c", script, setting]
  status = scheduler.run_settings(["short", "long", "new"], argv, jobs=2, one_core=one_core,
                                  results_root=str(tmp_path), log_dir=str(tmp_path / "logs"))
  assert sorted(status) == ["long", "new", "short"] and set(status.values()) == {0}
  runs = {s: json.loads((tmp_path / "logs" / f"{s}.log").read_text()) for s in status}
  assert sorted(runs, key=lambda s: runs[s][0])[-1] == "short"  # the shortest last
  assert {path for _, _, path in runs.values()} == {REPO}
  cores = {s: [a for a in args if a.startswith("--core=")] for s, (_, args, _) in runs.items()}
  if not one_core or not hasattr(os, "sched_getaffinity"):
    assert all(not c for c in cores.values())
    return
  allowed = {f"--core={c}" for c in os.sched_getaffinity(0)}
  assert all(len(c) == 1 and c[0] in allowed for c in cores.values())
  if len(allowed) > 1:  # "new" and "long" start together, on two cores
    assert cores["new"] != cores["long"]


def test_longest_first_orders_by_the_committed_wall_time(tmp_path):
  for setting, seconds in (("short", 60.0), ("long", 3000.0)):
    (tmp_path / setting).mkdir()
    (tmp_path / setting / "run.json").write_text(json.dumps({"wall_seconds": seconds}))
  assert scheduler.longest_first(["short", "new", "long"], str(tmp_path)) == [
      "new", "long", "short"]


def test_busy_seconds_is_the_length_of_the_union_of_runs():
  assert results_table.busy_seconds([]) == 0
  assert results_table.busy_seconds([(0, 10), (20, 25)]) == 15  # one after another: the sum
  assert results_table.busy_seconds([(0, 10), (5, 12), (6, 8), (30, 31)]) == 13


def test_table_says_how_long_overlapping_runs_kept_the_machine(tmp_path):
  """Two settings run at the same time: the footer adds up their wall times and says how
  long the machine was busy; run one after another, it says only the sum."""
  for setting in (SMALLEST, "table1_vit_mnist_rope"):
    shutil.copytree(os.path.join(REPO, "results", setting), tmp_path / setting,
                    ignore=shutil.ignore_patterns("reduced", "*.png"))
    record = json.loads((tmp_path / setting / "run.json").read_text())
    record.update(started="2026-12-01T10:00:00+00:00", wall_seconds=1800.0)
    (tmp_path / setting / "run.json").write_text(json.dumps(record))
  table = results_table.markdown(str(tmp_path))
  assert "added up: 1 h 00 min" in table and "took 0 h 30 min of the machines' time" in table
  record.update(started="2026-12-01T11:00:00+00:00")
  (tmp_path / "table1_vit_mnist_rope" / "run.json").write_text(json.dumps(record))
  table = results_table.markdown(str(tmp_path))
  assert "added up: 1 h 00 min" in table and "machines' time" not in table


@pytest.mark.slow
def test_jobs_must_be_positive():
  done = subprocess.run([sys.executable, "experiments/reproduce.py", "--all", "--jobs=0"],
                        cwd=REPO, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=REPO))
  assert done.returncode != 0 and "--jobs must be at least 1" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_use_one_core_pins_this_process_and_refuses_a_core_it_may_not_use():
  """In a child process (pinning is for the process's life): the lowest core by default, a
  named core if allowed, a clear error otherwise."""
  script = ("import os; from experiments.reproduction import runner\n"
            "low = min(os.sched_getaffinity(0)); high = max(os.sched_getaffinity(0))\n"
            "assert runner.use_one_core() == low and os.sched_getaffinity(0) == {low}\n"
            "try:\n  runner.use_one_core(high + 1)\nexcept ValueError as e:\n  print(e)\n")
  done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                        text=True, env=dict(os.environ, PYTHONPATH=REPO), check=True)
  assert "this process may use cores" in done.stdout
