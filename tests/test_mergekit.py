"""A real client reads the command's outputs: mergekit's linear merge, at 0.5/0.5, of the two
folders that report.json's "compare" names is the command's own merged/ (tiny GPT-2 and
Llama-GQA pairs saved by transformers).

Runs where mergekit's ``mergekit-yaml`` is installed (``pip install 'attn_symmetry[mergekit]'``:
next to this Python, or on the PATH), and is skipped elsewhere."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

from attn_symmetry import align
from tests.test_align_checkpoints import CONFIGS

torch = pytest.importorskip("torch")

MERGEKIT = (shutil.which("mergekit-yaml", path=os.path.dirname(sys.executable))
            or shutil.which("mergekit-yaml"))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MERGEKIT is None, reason="mergekit is not installed")]


def _independent(family, folder, seed):
  """A tiny random HF model of ``family`` (``CONFIGS``) initialised from ``seed``, saved."""
  torch.manual_seed(seed)
  CONFIGS[family]().save_pretrained(folder)
  return folder


def _tensors(folder):
  out = {}
  for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
    with safe_open(os.path.join(folder, file), framework="numpy") as f:
      out |= {k: f.get_tensor(k) for k in f.keys()}
  return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_mergekit_linear_merge_of_the_compared_folders_is_merged(family, tmp_path):
  a, b = (_independent(family, str(tmp_path / name), seed) for name, seed in (("a", 0), ("b", 1)))
  out = tmp_path / "out"
  result = align.align_checkpoints(a, b, out=out, merge=0.5, dtype="float32")
  compare = [a if name == "MODEL_A" else str(out / name) for name in result.report["compare"]]
  config = tmp_path / "linear.yml"
  config.write_text(json.dumps({  # YAML is a superset of JSON
      "merge_method": "linear", "dtype": "float32",
      "models": [{"model": path, "parameters": {"weight": 0.5}} for path in compare]}))
  subprocess.run([MERGEKIT, str(config), str(tmp_path / "mergekit")], check=True,
                 capture_output=True)
  ours, theirs = _tensors(out / "merged"), _tensors(tmp_path / "mergekit")
  assert set(theirs) <= set(ours) and len(theirs) > 10
  for name, value in theirs.items():
    np.testing.assert_array_equal(value, ours[name], err_msg=name)
