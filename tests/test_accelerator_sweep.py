"""experiments/accelerator_sweep.py: its settings, its plan, what it carries, and every stage at
toy size on the CPU (so that it is ready when a GPU is lent; its figures there are the ones to
quote, not these)."""

import json
import os
import subprocess
import sys
import tarfile

import pytest

from experiments import accelerator_sweep
from experiments.configs import cpu_paper
from experiments.reproduction import carry
from experiments.reproduction import sweep_plan
from tests.test_reproduce import _leaves  # a config's fields as (dotted path, value)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATOR = list(cpu_paper.ACCELERATOR_ONLY)


def _differences(a: str, b: str) -> dict:
  x = dict(_leaves(cpu_paper.get_config(a).to_dict()))
  y = dict(_leaves(cpu_paper.get_config(b).to_dict()))
  return {k: (x.get(k), y.get(k)) for k in x.keys() | y.keys() if x.get(k) != y.get(k)}


def test_the_accelerator_points_are_the_gpt2_width_sweep_with_three_seeds():
  assert _differences("width_gpt2_wiki_128", "width_gpt2_wiki_512") == {
      ".model.overrides.width": (128, 512), ".model.overrides.mlp_dim": (512, 2048),
      ".reinit.seeds": ((1, 2, 3, 4, 5), (1, 2, 3))}
  assert _differences("width_gpt2_wiki_256", "theus_gpt2_wiki") == {
      ".model.overrides.depth": (2, 6), ".dataset.seq_len": (64, 256)}
  assert cpu_paper.ACCELERATOR_WIDTHS[512] == "width_gpt2_wiki_512"
  assert 512 not in cpu_paper.LM_WIDTH_SWEEP  # three seeds: reported apart from the sweep
  assert set(ACCELERATOR) <= set(cpu_paper.SETTINGS)


def test_the_plan_adds_up_the_stated_throughput():
  plans = {s: sweep_plan.predict(s, cpu_paper.get_config(s)) for s in ACCELERATOR}
  for p in plans.values():
    assert (p.seeds, p.steps, p.pairs) == (3, 3 * 6000, 3)
  flops = {s: p.gflop_per_step for s, p in plans.items()}
  assert flops["width_gpt2_wiki_256"] < flops["width_gpt2_wiki_512"] < flops["theus_gpt2_wiki"]
  # Only the host's share of a step: the prediction is steps x that.
  host_only = sweep_plan.Assumptions(startup_s=0, compile_s=0, host_s_per_step=1e-3,
                                     flops_per_s=float("inf"), validation_s=0,
                                     study_s_per_pair=0, sharing_slowdown=2.0)
  p = sweep_plan.predict("width_gpt2_wiki_256", cpu_paper.get_config("width_gpt2_wiki_256"),
                         host_only)
  assert p.predicted_s == pytest.approx(18.0)
  ordered = sweep_plan.longest_first(list(plans.values()))
  assert ordered[0].setting == "theus_gpt2_wiki"
  alone = sweep_plan.makespan(ordered, 1, host_only)
  assert alone[ordered[-1].setting] == pytest.approx(sum(q.predicted_s for q in ordered), abs=0.2)
  shared = sweep_plan.makespan(ordered, 3, host_only)
  assert shared == {q.setting: pytest.approx(2 * q.predicted_s, abs=0.1) for q in ordered}


def test_the_carried_wheels_are_what_the_image_lacks():
  assert not set(carry.WHEELS) & carry.IMAGE_PACKAGES
  assert {"jax", "flax", "optax", "orbax-checkpoint", "matplotlib"} <= carry.IMAGE_PACKAGES
  assert carry.outside(["flax", "Tensorflow_Datasets", "ml_collections", "ipython",
                        "attn_symmetry", "no-such-package"]) == ["no-such-package"]
  pins = carry.pinned()
  assert [pin.split("==")[0] for pin in pins] == list(carry.WHEELS)
  assert ".accelerator/wheels/*.whl" in carry.install_command()


def test_points_with_gpu_results_are_skipped_and_packed(tmp_path):
  results = tmp_path / "results"
  for setting in ACCELERATOR:
    (results / setting).mkdir(parents=True)
    (results / setting / "run.json").write_text(json.dumps({"accelerator": {"toy": False}}))
  summary = accelerator_sweep.sweep(ACCELERATOR, toy=False, budget_s=60, jobs=3,
                                    results_root=str(results),
                                    workdir_root=str(tmp_path / "work"), out=str(tmp_path),
                                    data_dir=str(tmp_path / "data"))
  assert summary["remaining"] == []
  assert {p["state"] for p in summary["points"].values()} == {"done before"}
  with tarfile.open(tmp_path / accelerator_sweep.BUNDLE) as tar:
    assert {f"results/{s}/run.json" for s in ACCELERATOR} <= set(tar.getnames())


def _toy(tmp_path, *flags):
  return subprocess.run([sys.executable, "experiments/accelerator_sweep.py", "--toy",
                         f"--out={tmp_path}", *flags], cwd=REPO, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=REPO), timeout=600)


@pytest.mark.slow
def test_the_toy_sweep_runs_every_stage(tmp_path):
  done = _toy(tmp_path, "--settings=theus_gpt2_wiki")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "sweep: 1 of 1 points finished" in done.stdout, done.stdout
  with open(tmp_path / accelerator_sweep.SUMMARY) as f:
    summary = json.load(f)
  assert summary["remaining"] == [] and summary["toy"]
  with open(tmp_path / "results" / "theus_gpt2_wiki" / "run.json") as f:
    run = json.load(f)
  assert run["device"]["platform"] == "cpu" and run["accelerator"]["toy"]
  assert run["accelerator"]["matmul_precision"] == "highest"
  assert run["command"] == "python experiments/accelerator_sweep.py --toy"
  with tarfile.open(tmp_path / accelerator_sweep.BUNDLE) as tar:
    names = set(tar.getnames())
    log = tar.extractfile("logs/theus_gpt2_wiki.log").read().decode()
  assert {"results/theus_gpt2_wiki/full/results.json", "results/theus_gpt2_wiki/summary.md",
          "results/theus_gpt2_wiki/config.json"} <= names
  assert "imports outside the GPU image and the carried wheels: none" in log


@pytest.mark.slow
def test_the_points_still_running_at_the_budget_are_stopped(tmp_path):
  done = _toy(tmp_path, "--settings=width_gpt2_wiki_256,width_gpt2_wiki_512", "--budget_s=1")
  assert done.returncode == 0, done.stderr[-3000:]
  with open(tmp_path / accelerator_sweep.SUMMARY) as f:
    summary = json.load(f)
  assert summary["remaining"] == ["width_gpt2_wiki_256", "width_gpt2_wiki_512"]
  assert {p["state"] for p in summary["points"].values()} == {"stopped at the budget"}
  assert "the same call again resumes them" in done.stdout
