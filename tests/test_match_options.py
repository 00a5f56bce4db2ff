"""``matching.MatchOptions`` is the one table of the matching options: ``align_model``'s
keywords, the methods' options, the align command's flags and checks and the study's config
fields all derive from it, and a new option is one field of it plus the code that reads it.
"""

import argparse
import dataclasses
import inspect
import os
import re
import shutil
import subprocess
import sys

import pytest

from attn_symmetry import matching
from attn_symmetry.align import _check, _cli, _records
from experiments.setting import config_schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT_IN = ("naive", "perm", "ortho", "full", "learned")


def _flags() -> dict[str, argparse.Action]:
  parser = argparse.ArgumentParser()
  _cli.add_arguments(parser)
  return {action.dest: action for action in parser._actions}  # pylint: disable=protected-access


def test_every_place_that_names_an_option_reads_the_table():
  names = tuple(f.name for f in dataclasses.fields(matching.MatchOptions))
  assert tuple(o.name for o in matching.OPTIONS) == names == _records.MATCHING_OPTIONS
  assert matching.ALIGN_OPTIONS == tuple(o.name for o in matching.OPTIONS if not o.descent)
  for function in (matching.align_model, matching.align_model_streamed):
    parameters = inspect.signature(function).parameters
    assert {n: parameters[n].default for n in names} == dataclasses.asdict(
        matching.MatchOptions()), function
  flags = _flags()
  fields = config_schema.option_fields()
  for option in matching.OPTIONS:
    assert flags[option.name].type is option.range.parse
    assert flags[option.name].help.startswith(option.doc)
    if option.name in matching.ALIGN_OPTIONS:
      field = config_schema.BY_PATH[fields[option.name]]
      assert (field.doc, field.keys, field.option) == (option.doc, config_schema.Role.STUDY,
                                                       option.name)
  for method in BUILT_IN:
    assert matching.METHODS[method].options == tuple(
        o.name for o in matching.OPTIONS if method in o.methods)


@pytest.mark.parametrize("option", matching.OPTIONS, ids=lambda o: o.name)
def test_the_command_and_the_study_refuse_what_the_range_refuses(option):
  """A value outside the option's range (the schema rule's bad value) is refused by the
  command's check and the study's rule alike; the default lies inside."""
  bad = config_schema.option_rule(option.range).bad
  assert bad not in option.range
  with pytest.raises(_records.InputError, match=f"^{_check.flag(option.name)} must "):
    _check.check_options(_records.Options(
        method="learned", scope="full", merge=None, dtype="keep", function_tolerance=None,
        out=None, overwrite=False, eval_text="x.txt", eval_images=None, num_lambdas=11,
        batch_size=8, seq_len=128, eval_batches=8, matching={option.name: bad}))
  assert option.default is None or option.default in option.range


def test_what_a_method_reads_follows_the_table():
  """The descent's max_rounds for every built-in descent; learning_rate for "full" only with
  the Adam solver (its ``requires``), for "learned" always; residual for every method but
  "naive"."""
  reads = lambda method, **given: matching.METHODS[method].reads(given)
  assert reads("naive") == ()
  assert reads("perm") == reads("ortho") == ("distance", "max_rounds", "residual")
  assert reads("activation") == ("steps", "residual") and "residual" in reads("learned")
  assert "learning_rate" not in reads("full")
  assert "learning_rate" in reads("full", solver="adam")
  assert "learning_rate" in reads("learned") and "factors" in reads("learned")
  assert _check.options_used("full", {"steps": 3}) == {
      "distance": "frobenius", "steps": 3, "max_rounds": 10, "init": "procrustes",
      "refine": "every_round", "solver": "gauss_newton", "residual": "permutation"}


PAGE = os.path.join(ROOT, "docs", "extending.md")


def _page_diff() -> tuple[str, str]:
  """(the context line before, the added lines) of docs/extending.md's diff in 'A matching
  option': the new field, appended to MatchOptions."""
  section = open(PAGE, encoding="utf-8").read().split("## A matching option\n", 1)[1]
  (diff,) = re.findall(r"^```diff\n(.*?)^```", section.split("\n## ", 1)[0], re.M | re.S)
  lines = diff.splitlines()
  added = [line[1:] for line in lines if line.startswith("+")]
  before = [line[1:] for line in lines if line.startswith(" ")]
  assert added and before, diff
  return before[-1], "\n".join(added) + "\n"

# Every place sees it; only the method that reads it is written.
SCRIPT = r'''
import argparse
import jax
import numpy as np
from attn_symmetry import matching, models
from attn_symmetry.align import _check, _cli, _records
from experiments.setting import config_schema
from experiments.study import scope_study

seen = []
def align_soft(spec, params_a, params_b, *, scope, temperature):
  seen.append(temperature)
  return matching.align_model(spec, params_a, params_b, scope=scope, method="naive")

matching.register_method("soft", align_soft, options=("temperature",))
model = models.build("vit", "tiny")
a, b = model.init(jax.random.key(0)), model.init(jax.random.key(1))
matching.align_model(model.spec, a, b, method="soft")
matching.align_model(model.spec, a, b, method="soft", temperature=0.25)
assert seen == [1.0, 0.25], seen

parser = argparse.ArgumentParser()
_cli.add_arguments(parser)
args = parser.parse_args(["A", "B", "--out", "D", "--temperature", "0.5"])
assert args.temperature == 0.5 and "temperature" in _records.MATCHING_OPTIONS

def refusal(method, **given):
  options = _records.Options(
      method=method, scope="full", merge=None, dtype="keep", function_tolerance=None, out=None,
      overwrite=False, eval_text=None, eval_images=None, num_lambdas=11, batch_size=8,
      seq_len=128, eval_batches=8, matching=given)
  try:
    _check.check_options(options)
  except _records.InputError as e:
    return str(e)

assert refusal("soft", temperature=0.5) is None
assert refusal("soft", temperature=-1) == "--temperature must be a positive number, got -1"
assert refusal("full", temperature=0.5).startswith("--temperature is not read by --method full")
assert _check.options_used("soft", {}) == {"temperature": 1.0}

field = config_schema.BY_PATH["study.match_temperature"]
assert (field.default, field.doc, field.option) == (1.0, "softness of the assignment",
                                                    "temperature")
config = config_schema.default_config()
assert scope_study.matching_kwargs(config, "soft") == {"temperature": 1.0}
assert scope_study.method_keys("soft") == ("study.match_temperature",)
print("ok")
'''


@pytest.mark.slow
def test_a_new_option_is_one_field_plus_the_code_that_reads_it(tmp_path):
  """A copy of the package whose MatchOptions has one more field (docs/extending.md's diff,
  'A matching option'): align_model passes it to the
  registered method that names it (its default, or the value given), the command has its flag
  and checks its range and who reads it, the report records it, and the study has its config
  field, passes it on and keys by it. Nothing else was edited."""
  for package in ("attn_symmetry", "experiments"):
    shutil.copytree(os.path.join(ROOT, package), tmp_path / package,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  table = tmp_path / "attn_symmetry" / "matching" / "_options.py"
  source = table.read_text()
  context, field = _page_diff()
  end = source.index(context + "\n", source.index("class MatchOptions")) + len(context) + 1
  assert source[end:].startswith("\n\n"), "the diff's field is not appended to MatchOptions"
  table.write_text(source[:end] + field + source[end:])
  env = dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
