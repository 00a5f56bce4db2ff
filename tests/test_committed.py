"""The committed runs under results/ (experiments/report/committed.py): what counts as a run and
where its reruns lie."""

import json
import os
import pathlib
import re

import pytest

from experiments.configs import cpu_paper
from experiments.report import committed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(folder, scopes=("full",), wall_seconds=60.0):
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "run.json"), "w") as f:
    json.dump({"wall_seconds": wall_seconds}, f)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"reinit": {"scopes": list(scopes)}}, f)
  for scope in scopes:
    os.makedirs(os.path.join(folder, scope), exist_ok=True)
    with open(os.path.join(folder, scope, "results.json"), "w") as f:
      json.dump({"pairs": [], "scope": scope}, f)


def test_a_run_needs_its_record_and_its_config(tmp_path):
  """A folder with run.json and config.json is a committed run; one lacking either (a run that
  did not finish writing) is passed over, and so are stray files."""
  _write_run(str(tmp_path / "b"), scopes=("full", "first_layer"))
  _write_run(str(tmp_path / "a"))
  os.makedirs(tmp_path / "unfinished" / "full")
  (tmp_path / "unfinished" / "run.json").write_text("{}")
  (tmp_path / "README.md").write_text("")
  assert [r.setting for r in committed.runs(str(tmp_path))] == ["a", "b"]
  assert committed.find(str(tmp_path), "unfinished") is None
  b = committed.find(str(tmp_path), "b")
  assert b.scopes() == ["full", "first_layer"] and b.record() == {"wall_seconds": 60.0}
  assert b.has("first_layer") and not b.has("all_attention")
  assert b.results("first_layer")["scope"] == "first_layer"


def test_reruns_follow_their_setting_only_when_asked(tmp_path):
  _write_run(str(tmp_path / "a"))
  _write_run(str(tmp_path / "a" / "every_core"))
  _write_run(str(tmp_path / "a" / "reduced"))
  _write_run(str(tmp_path / "b"))
  assert [r.folder for r in committed.runs(str(tmp_path))] == [
      str(tmp_path / "a"), str(tmp_path / "b")]
  assert [r.folder for r in committed.runs(str(tmp_path), reruns=True)] == [
      str(tmp_path / s) for s in ("a", "a/reduced", "a/every_core", "b")]
  assert committed.find(str(tmp_path), "b", "every_core") is None
  assert committed.find(str(tmp_path), "a", "every_core").setting == "a"
  with pytest.raises(ValueError, match="'every_cores' is none of"):
    committed.find(str(tmp_path), "a", "every_cores")


def test_a_record_is_read_without_its_config_and_an_unreadable_one_is_none(tmp_path):
  """The scheduler's wall times read run.json alone; one that does not parse is None."""
  os.makedirs(tmp_path / "a")
  (tmp_path / "a" / "run.json").write_text('{"wall_seconds": 5}')
  os.makedirs(tmp_path / "b")
  (tmp_path / "b" / "run.json").write_text("{not json")
  assert committed.saved_record(str(tmp_path), "a") == {"wall_seconds": 5}
  assert committed.saved_record(str(tmp_path), "b") is None
  assert committed.saved_record(str(tmp_path), "c") is None


def test_every_committed_setting_is_a_run():
  """Each folder of the repository's results/ named for a setting of cpu_paper is a committed
  run (the quickstart's folder holds the main job's summary and figures, not a run)."""
  root = os.path.join(REPO, "results")
  folders = sorted(d for d in os.listdir(root) if d in cpu_paper.SETTINGS)
  assert [r.setting for r in committed.runs(root)] == folders


def _fake_stages(monkeypatch):
  """Training and the study replaced by stand-ins that write the study's reports at once."""
  from experiments.study import study  # pylint: disable=g-import-not-at-top
  from experiments.train import trainer  # pylint: disable=g-import-not-at-top

  def run_study(config, workdir):
    reports = study.reports_folder(workdir)
    for scope in config.reinit.scopes:
      os.makedirs(os.path.join(reports, scope), exist_ok=True)
      with open(os.path.join(reports, committed.scope_file(scope)), "w") as f:
        json.dump({"scope": scope}, f)
    with open(os.path.join(reports, committed.SUMMARY), "w") as f:
      f.write("# summary\n")

  monkeypatch.setattr(trainer, "train_and_evaluate", lambda config, workdir: {"s0": {"loss": 1}})
  monkeypatch.setattr(study, "run_study", run_study)


def test_the_runner_and_the_accelerator_sweep_write_one_record(tmp_path, monkeypatch):
  """reproduce.py's runner and the accelerator sweep record a run through committed.run_record
  and write it through committed.write_run: the same keys, the sweep's "device" and
  "accelerator" added, and the files each wrote named in its run.json."""
  from experiments import accelerator_sweep  # pylint: disable=g-import-not-at-top
  from experiments.reproduction import runner  # pylint: disable=g-import-not-at-top

  _fake_stages(monkeypatch)
  setting = "table1_vit_mnist_ape"
  cpu = runner.run_setting(setting, reduced=True, workdir=str(tmp_path / "w1"),
                           results_dir=committed.folder(str(tmp_path / "r"), setting,
                                                        reduced=True))
  gpu = accelerator_sweep.run_point(cpu_paper.THEUS, toy=True, workdir=str(tmp_path / "w2"),
                                    results_dir=committed.folder(str(tmp_path / "r"),
                                                                 cpu_paper.THEUS),
                                    budget_s=1.0, predicted_s=2.0, jobs=1)
  assert [k for k in gpu if k not in ("device", "accelerator")] == list(cpu)
  assert gpu["machine"].keys() == cpu["machine"].keys()
  for record in (cpu, gpu):
    run = committed.find(str(tmp_path / "r"), record["setting"],
                         committed.REDUCED if record["reduced"] else None)
    assert run.record() == record
    assert record["files"] == sorted(
        [committed.CONFIG, committed.RECORD, committed.SUMMARY,
         *(committed.scope_file(s) for s in run.scopes())])
    assert record["training"] == {"s0": {"loss": 1}}


def test_no_other_module_spells_the_layout():
  """The names of a run's files and rerun folders are spelled in committed.py alone: every
  other module of experiments/ and benchmarks/ names them through it."""
  spelled = re.compile(r"""(["'])([^"'\n]*/)?(run\.json|results\.json|summary\.md|curves\.png|"""
                       r"""ablation_permutations\.png|every_core)\1""")  # a string, or its end
  found = []
  for package in ("experiments", "benchmarks"):
    for path in sorted(pathlib.Path(REPO, package).rglob("*.py")):
      if path.name == "committed.py" and path.parent.name == "report":
        continue
      for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if spelled.search(line):
          found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
  assert not found, "the layout spelled outside committed.py:\n" + "\n".join(found)
