"""benchmarks/device_check.py runs end to end: at toy sizes on the CPU, so that the script is
ready when an accelerator is lent (its figures there are the ones to quote, not these)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_device_check_runs_every_stage_at_toy_sizes(tmp_path):
  done = subprocess.run([sys.executable, "benchmarks/device_check.py", "--small",
                         f"--out={tmp_path}"], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stdout.splitlines()
  for stage in ("device:", "matmul:", "train step:", "streamed alignment:", "LAP n=256 random:",
                "LAP n=256 near-permutation:"):
    assert any(line.startswith(stage) for line in lines), (stage, done.stdout)
  with open(tmp_path / "device_check.json", encoding="utf-8") as f:
    result = json.load(f)
  assert result["matmul"]["flops_per_s"] > 0 and result["train_step"]["flops_per_s"] > 0
  assert result["streamed_alignment"]["planted_recovered"]
  for kind in ("random", "near-permutation"):
    assert 0 <= result["assignment"][kind]["gap"] < 1e-3, result["assignment"]
