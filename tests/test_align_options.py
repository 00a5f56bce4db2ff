"""``attn_symmetry.align``'s parts that need no checkpoint: the option checks, the split of the
evaluation batches for method "learned", the stages' clock, the compilation cache default and
the function check on a tiny zoo model.

The option checks (``_check.check_options``) look at the options alone: they are run here with
paths that do not exist and with every way of reading a file made to fail.
"""

import argparse
import builtins
import dataclasses
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attn_symmetry import align
from attn_symmetry.align import _check, _cli, _clock, _function_check, _outputs, _records
from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry import runtime
from attn_symmetry import spec as spec_lib

NOWHERE = os.path.join(os.sep, "no", "such", "folder")
# align_checkpoints' defaults, with an output folder and an evaluation file that do not exist.
VALID = _records.Options(
    method="full", scope="full", merge=None, dtype="keep", function_tolerance=None,
    out=os.path.join(NOWHERE, "out"),
    overwrite=False, eval_text=os.path.join(NOWHERE, "valid.txt"), eval_images=None,
    num_lambdas=11, batch_size=8, seq_len=128, eval_batches=8, matching={})


def _options(**changes):
  return dataclasses.replace(VALID, **changes)


@pytest.fixture
def no_file_access(monkeypatch):
  """Every open, stat and listdir (the folder checks, the checkpoint and evaluation readers)
  raises for the duration of the test."""
  def refuse(*args, **kwargs):
    raise AssertionError(f"a file was looked at: {args}")

  for module, name in ((builtins, "open"), (os, "stat"), (os, "listdir"), (os, "scandir"),
                       (os, "access")):
    monkeypatch.setattr(module, name, refuse)


@pytest.mark.parametrize("changes", [
    {},
    dict(eval_text=None, out=None),
    dict(eval_text=None, eval_images=NOWHERE),
    dict(method="learned"),
    dict(method="naive", scope="first_attention"),
    dict(scope="layers_0/attention,layers_1"),
    dict(scope=("layers_0/attention", "layers_1")),
    dict(scope=("",)),  # the whole model, as scope "full" is
    dict(merge=0.0), dict(merge=1.0), dict(merge=0.5, dtype="float32"),
    dict(num_lambdas=3, batch_size=1, seq_len=1, eval_batches=1),
    dict(function_tolerance=1e-3), dict(function_tolerance=2),
    dict(matching=dict(distance="cosine", steps=0, init="best", max_rounds=2)),
    dict(method="learned", matching=dict(factors=("residual",))),
    dict(method="learned", matching=dict(factors=["attention", "heads", "ffn", "residual"])),
    dict(matching=dict(solver="adam", learning_rate=0.05, steps=np.int64(10), refine="final")),
    dict(method="learned", matching=dict(learning_rate=1e-3, steps=5, max_rounds=1)),
    dict(method="perm", matching=dict(distance="squared", max_rounds=1)),
    dict(method="activation", match_data=NOWHERE),
    dict(method="activation", match_data=NOWHERE, merge=0.5, repair=True, match_batches=1),
    dict(method="learned", match_data=NOWHERE, matching=dict(learn_init="activation")),
    dict(method="naive", eval_text=None, match_data=NOWHERE, merge=0.0, repair=True),
], ids=repr)
def test_good_options_pass_without_reading_a_file(changes, no_file_access):
  _check.check_options(_options(**changes))


@pytest.mark.parametrize("changes, message", [
    (dict(method="best"),
     r"--method must be one of naive, perm, ortho, full, learned, activation, got 'best'"),
    (dict(method="learned", eval_text=None),
     r"--method learned trains on the task loss of a checkpoint with a task head, and is judged "
     r"on an evaluation file: give --eval-text or --eval-images"),
    (dict(matching=dict(steps=3, lr=0.1, temperature=1)),
     r"unknown matching options \['lr', 'temperature'\]; known: distance, steps, learning_rate, "
     r"max_rounds, init, refine, solver, residual, learn_init, learn_lam_band, learn_schedule, "
     r"learn_patience, factors, learn_steps, learn_learning_rate, learn_uniform_lambda, "
     r"learn_holdout_batches, learn_repair"),
    (dict(matching=dict(factors=("ffn",))),
     r"--factors chooses what --method learned trains; --method is 'full'"),
    (dict(method="learned", matching=dict(factors=("ffn", "norms"))),
     r"--factors must list some of attention, heads, ffn, residual, got \('ffn', 'norms'\)"),
    (dict(method="learned", matching=dict(factors=())),
     r"--factors must list some of attention, heads, ffn, residual, got \(\)"),
    (dict(method="learned", matching=dict(factors="ffn")),
     r"--factors must list some of attention, heads, ffn, residual, got 'ffn'"),
    (dict(matching=dict(distance="l1")), r"--distance must be one of frobenius, squared, "),
    (dict(matching=dict(steps=-5)), r"--steps must be a non-negative integer, got -5"),
    (dict(matching=dict(steps=2.5)), r"--steps must be a non-negative integer, got 2.5"),
    (dict(matching=dict(max_rounds=0)), r"--max-rounds must be a positive integer, got 0"),
    (dict(matching=dict(solver="lbfgs")),
     r"--solver must be one of gauss_newton, adam, got 'lbfgs'"),
    (dict(matching=dict(init="foo")), r"--init must be one of procrustes, best, got 'foo'"),
    (dict(matching=dict(refine="foo")),
     r"--refine must be one of every_round, final, got 'foo'"),
    (dict(matching=dict(solver="adam", learning_rate=-1)),
     r"--learning-rate must be a positive number, got -1"),
    (dict(matching=dict(learning_rate=0.1)),
     r"--learning-rate is the Adam solver's step size; --solver is 'gauss_newton' \(give "
     r"--solver adam, or no --learning-rate\)"),
    (dict(method="perm", matching=dict(steps=3)),
     r"--steps is not read by --method perm \(it reads --distance, --max-rounds, "
     r"--residual\)"),
    (dict(method="naive", matching=dict(distance="cosine")),
     r"--distance is not read by --method naive \(it reads no matching option\)"),
    (dict(scope=","), r"--scope  holds no whole attention site or factor to align"),
    (dict(scope=()), r"--scope  holds no whole attention site or factor to align"),
    (dict(scope=("layers_0", 3)),
     r"--scope: scope entries must be path prefixes \(str\), got 3 \(scopes: .*full, or path "
     r"prefixes\)"),
    (dict(merge=1.5), r"--merge must lie in \[0, 1\], got 1.5"),
    (dict(merge=-0.1), r"--merge must lie in \[0, 1\], got -0.1"),
    (dict(dtype="bfloat16"), r"--dtype must be one of keep, float32, got 'bfloat16'"),
    (dict(function_tolerance=0.0), r"--function-tolerance must be a positive number, got 0.0"),
    (dict(function_tolerance=-1e-3),
     r"--function-tolerance must be a positive number, got -0.001"),
    (dict(function_tolerance=float("nan")),
     r"--function-tolerance must be a positive number, got nan"),
    (dict(function_tolerance="1e-3"),
     r"--function-tolerance must be a positive number, got '1e-3'"),
    (dict(eval_images=NOWHERE), r"give --eval-text or --eval-images, not both"),
    (dict(num_lambdas=2), r"--lambdas must be an integer >= 3, got 2"),
    (dict(batch_size=0), r"--batch-size must be an integer >= 1, got 0"),
    (dict(seq_len=1.5), r"--seq-len must be an integer >= 1, got 1.5"),
    (dict(eval_batches=-1), r"--eval-batches must be an integer >= 1, got -1"),
    (dict(method="activation", match_data=NOWHERE, match_batches=0),
     r"--match-batches must be an integer >= 1, got 0"),
    (dict(method="activation"),
     r"--method activation reads the models' activations on data: give --match-data FILE"),
    (dict(method="learned", matching=dict(learn_init="activation")),
     r"--method learned with --learn-init activation reads the models' activations on data: "
     r"give --match-data FILE"),
    (dict(repair=True, match_data=NOWHERE), r"--repair repairs the merged model: give --merge "
                                            r"LAMBDA"),
    (dict(repair=True, merge=0.5), r"--repair resets the merged model's channel statistics "
                                   r"measured on data: give --match-data FILE"),
    (dict(match_data=NOWHERE), r"--match-data is read by --method learned, --method "
                               r"activation and --repair only; --method is 'full' without "
                               r"--repair"),
], ids=repr)
def test_bad_options_are_refused_without_reading_a_file(changes, message, no_file_access):
  with pytest.raises(align.InputError) as refusal:
    _check.check_options(_options(**changes))
  assert re.fullmatch(message + ".*", str(refusal.value)), str(refusal.value)
  assert "\n" not in str(refusal.value)


def test_the_first_bad_option_is_named():
  """Method, then matching options, scope, merge, dtype, function tolerance, the evaluation
  flags, the sizes."""
  bad = dict(method="best", matching=dict(lr=1), scope=",", merge=2.0, dtype="x",
             function_tolerance=0, eval_images=NOWHERE, num_lambdas=1)
  named = []
  while bad:
    with pytest.raises(align.InputError) as refusal:
      _check.check_options(_options(**bad))
    named.append(re.match(r"(--[\w-]+|unknown matching options|give)", str(refusal.value))[0])
    bad.pop(next(iter(bad)))
  assert named == ["--method", "unknown matching options", "--scope", "--merge", "--dtype",
                   "--function-tolerance", "give", "--lambdas"]


def test_missing_evaluation_packages_are_named(monkeypatch):
  """An evaluation needs the [align] extra's packages: those missing are named, and none is
  looked for without an evaluation."""
  looked_for, real_find_spec = [], importlib.util.find_spec

  def find_spec(name, *args):
    looked_for.append(name)
    return None if name in ("PIL", "matplotlib") else real_find_spec(name, *args)

  monkeypatch.setattr(importlib.util, "find_spec", find_spec)
  _check.check_extras(_options(eval_text=None))
  assert looked_for == []
  _check.check_extras(_options(out=None))  # text without an output folder: no plot
  with pytest.raises(align.InputError, match=r"^the evaluation needs matplotlib, which is not "
                                             r"installed: pip install 'attn_symmetry\[align\]'$"):
    _check.check_extras(VALID)
  with pytest.raises(align.InputError, match=r"^the evaluation needs PIL, matplotlib, which"):
    _check.check_extras(_options(eval_text=None, eval_images=NOWHERE))


@pytest.mark.parametrize("count", range(3, 21))
def test_learned_method_splits_the_batches_in_order(count):
  """Training on the first half, held out on the next quarter, the curve on the rest: each part
  non-empty, together every batch once, in order."""
  curve, train, holdout = _check.split_for_learning(list(range(count)), "learned")
  assert train + holdout + curve == list(range(count))
  assert len(train) == count // 2 and len(holdout) == (count - count // 2) // 2
  assert min(len(curve), len(train), len(holdout)) >= 1


def test_learned_method_needs_three_batches():
  with pytest.raises(align.InputError, match=r"^--method learned needs at least 3 evaluation "
                                             r"batches \(training, held out, curve\); the data "
                                             r"gives 2$"):
    _check.split_for_learning([0, 1], "learned")


def test_clock_says_and_times_each_stage(monkeypatch):
  """One line per stage that ends, its seconds in order (a part before its stage; a part in two
  blocks named once, with their sum), the heap released after every stage and part; a stage
  that raises says and records nothing."""
  now = iter(range(0, 100, 2))
  monkeypatch.setattr(_clock.time, "perf_counter", lambda: float(next(now)))
  releases = []
  monkeypatch.setattr(runtime, "release_free_memory", lambda: releases.append(1) or True)
  lines = []
  clock = _clock.Clock(lines.append)
  with clock.stage("load") as stage:            # starts at 0
    stage.summary = "both models"
  with clock.stage("align") as stage:           # 4 ... 18
    with stage.part("align_model", "matching"):  # 6 ... 8
      stage.say("learned: step 1/1")
    for _ in range(2):                          # 10 ... 12, 14 ... 16
      with stage.part("function_check", "function check"):
        pass
    stage.summary = "distance 1 -> 0"
  with clock.stage("save") as stage:            # 20: stopped at 22, not at its end
    stage.stop()
    stage.stop()
    stage.summary = "out/report.json"
  with pytest.raises(align.InputError):
    with clock.stage("evaluate") as stage:
      raise align.InputError("no")
  assert lines == ["load: both models (2.0 s)", "learned: step 1/1",
                   "align: distance 1 -> 0 (14.0 s, matching 2.0 s, function check 4.0 s)",
                   "save: out/report.json (2.0 s)"]
  assert clock.seconds == {"load": 2.0, "align_model": 2.0, "function_check": 4.0, "align": 14.0,
                           "save": 2.0}
  assert list(clock.seconds) == ["load", "align_model", "function_check", "align", "save"]
  assert len(releases) == 6


def test_the_flags_are_the_fields_of_options():
  """One table: every field of Options has one flag, whose default is the field's, and the
  command turns its flags into one Options (``_cli.options_of``); --memory-budget is in GB,
  the field in bytes."""
  parser = argparse.ArgumentParser()
  _cli.add_arguments(parser)
  assert _cli.options_of(parser.parse_args(["A", "B", "--out", "D"])) == _records.Options(out="D")
  given = parser.parse_args(["A", "B", "--out", "D", "--lambdas", "5", "--eval-text", "t.txt",
                             "--overwrite", "--memory-budget", "2", "--max-rounds", "3"])
  assert _cli.options_of(given) == _records.Options(
      out="D", num_lambdas=5, eval_text="t.txt", overwrite=True, memory_budget=2e9,
      matching={"max_rounds": 3})
  actions = parser._actions  # pylint: disable=protected-access
  flags = {action.dest: action.option_strings for action in actions}
  for field in dataclasses.fields(_records.Options):
    if field.name != "matching":
      assert flags[field.name] == [_records.Options.flag(field.name)], field.name


def test_one_compilation_cache_default():
  """The align command and the experiments default to one cache folder (runtime's)."""
  from experiments import main  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser()
  _cli.add_arguments(parser)
  assert parser.get_default("compilation_cache") == runtime.COMPILATION_CACHE
  assert main.FLAGS["compilation_cache"].default == runtime.COMPILATION_CACHE
  assert runtime.default_compilation_cache({}).endswith(os.path.join("attn_symmetry", "jax_cache"))
  assert runtime.default_compilation_cache({runtime.COMPILATION_CACHE_ENV: "/x"}) == "/x"


def test_the_test_run_keeps_its_programs_out_of_the_users_cache(request):
  """The commands that tests run (here and in the processes they start) default to the test
  run's own cache (tests/conftest.py), never to the user's."""
  assert runtime.COMPILATION_CACHE == os.path.join(request.config.run_cache, "jax_cache")
  assert os.environ[runtime.COMPILATION_CACHE_ENV] == runtime.COMPILATION_CACHE


# ----------------------------------------------------------------------------- the function check


def test_default_tolerance_is_the_square_root_of_the_least_precise_epsilon():
  """float32 (and float64, computed in float32) 2^-11.5; float16 2^-5; bfloat16 2^-3.5."""
  f32, f16, bf16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
  assert _function_check.default_tolerance([f32]) == pytest.approx(2 ** -11.5)
  assert _function_check.default_tolerance([np.dtype(np.float64)]) == pytest.approx(2 ** -11.5)
  assert _function_check.default_tolerance([f32, f16]) == pytest.approx(2 ** -5)
  assert _function_check.default_tolerance([f16, bf16, f32]) == pytest.approx(2 ** -3.5)


def test_check_inputs_follow_the_model_and_the_key():
  """Token ids in the vocabulary, at most max_len of them; images of the model's size; the same
  draw every time."""
  text = models.build("gpt2", "tiny", vocab_size=50, max_len=8)
  tokens = _function_check.check_inputs(text)
  assert tokens.shape == (align.CHECK_BATCH, 8) and tokens.dtype == jnp.int32
  assert 0 <= int(tokens.min()) and int(tokens.max()) < 50
  np.testing.assert_array_equal(tokens, _function_check.check_inputs(text))
  images = _function_check.check_inputs(models.build("vit", "tiny"))
  assert images.shape == (align.CHECK_BATCH, 8, 8, 3) and images.dtype == jnp.float32


def test_round_to_rounds_narrow_leaves_in_place():
  """bfloat16 and float16 leaves take their dtype's values (in float32); float32 leaves stay
  the very same arrays."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)
  params = {"a": {"w": x, "b": x}, "c": x}
  dtypes = {"a/w": np.dtype(ml_dtypes.bfloat16), "a/b": np.dtype(np.float16),
            "c": np.dtype(np.float32)}
  _function_check.round_to(params, dtypes)
  assert params["c"] is x and all(v.dtype == jnp.float32 for v in params["a"].values())
  np.testing.assert_array_equal(params["a"]["w"], np.asarray(x).astype(ml_dtypes.bfloat16)
                                .astype(np.float32))
  np.testing.assert_array_equal(params["a"]["b"], np.asarray(x).astype(np.float16)
                                .astype(np.float32))
  assert not np.array_equal(params["a"]["w"], x)


def _tiny_check(model, params, broken, **changes):
  """``_function_check`` of ``broken`` (as aligned_a and aligned_b) against ``params``'s logits,
  written in float32 (no checkpoint is read)."""
  inputs = _function_check.check_inputs(model)
  reference = _function_check.logits(model, params, inputs)
  written = {"aligned_b": (None, params), "aligned_a": (None, broken)}
  return _function_check.function_check(model, _options(dtype="float32", **changes), inputs,
                               {"aligned_b": reference, "aligned_a": reference}, written)


def test_function_check_measures_and_refuses():
  """The same parameters pass with a difference of 0; a changed leaf is refused with one line
  that names the folder and the measured difference, unless the tolerance allows it; NaN
  logits are refused whatever the tolerance."""
  model = models.build("gpt2", "tiny")
  params = model.init(jax.random.key(0))
  flat = spec_lib.flatten(params)
  path = "layers_0/attention/out/kernel"
  broken = spec_lib.unflatten({**flat, path: flat[path] * 1.5})
  passed = _tiny_check(model, params, params)
  assert passed["inputs"] == {"seed": align.CHECK_SEED, "shape": [align.CHECK_BATCH, 16]}
  assert passed["aligned_b"]["max_abs"] == 0 and passed["aligned_b"]["relative"] == 0
  assert passed["aligned_b"]["tolerance"] == pytest.approx(2 ** -11.5)
  assert passed["aligned_a"]["scale"] == passed["aligned_b"]["scale"] > 0

  allowed = _tiny_check(model, params, broken, function_tolerance=10.0)
  difference = allowed["aligned_a"]
  assert difference["tolerance"] == 10.0 and 1e-3 < difference["relative"] < 10
  assert difference["relative"] == pytest.approx(difference["max_abs"] / difference["scale"])
  with pytest.raises(align.FunctionCheckError) as refusal:
    _tiny_check(model, params, broken)
  message = str(refusal.value)
  assert "\n" not in message and isinstance(refusal.value, align.InputError)
  assert re.fullmatch(
      r"aligned A \(A with its norm scales folded\) does not compute A's function: on 2 random "
      r"inputs its logits differ from A's by up to (\S+) \((\S+) of their scale \S+\), "
      r"above --function-tolerance 0.000345; nothing is written", message), message
  assert float(re.search(r"by up to (\S+)", message)[1]) == pytest.approx(difference["max_abs"],
                                                                         rel=1e-3)
  nan = spec_lib.unflatten({**flat, path: flat[path].at[0, 0, 0].set(jnp.nan)})
  with pytest.raises(align.FunctionCheckError, match=r"up to nan \(nan of their scale"):
    _tiny_check(model, params, nan, function_tolerance=1e30)


@pytest.mark.parametrize("family, prefixes, factors", [
    ("gpt2", [""], ("attention", "heads", "ffn", "residual")),
    ("llama", [""], ("residual",)),  # RMSNorm: the orthogonal residual factor
    ("gpt2", ["layers_0"], ("heads", "ffn")),
])
def test_factors_the_scope_has_pass(family, prefixes, factors):
  _check.factors_in_scope(models.build(family, "tiny"), prefixes, factors)


@pytest.mark.parametrize("family, prefixes, factors, missing", [
    ("gpt2", ["layers_0/attention"], ("ffn",), "ffn"),
    ("llama", ["layers_0"], ("attention", "residual"), "residual"),
    ("vit", ["layers_0/attention"], ("residual",), "residual"),
])
def test_a_factor_without_a_symmetry_is_refused_naming_it_and_the_model(family, prefixes, factors,
                                                                        missing):
  with pytest.raises(align.InputError) as refusal:
    _check.factors_in_scope(models.build(family, "tiny"), prefixes, factors)
  message = str(refusal.value)
  assert message.startswith(f"--factors: the model has no {missing!r} symmetry in this scope")
  assert message.endswith(f"({family} model, scope {','.join(prefixes)})"), message
  assert "\n" not in message


def _tree(folder):
  """{relative path: file text} of every file under ``folder``."""
  out = {}
  for root, _, files in os.walk(folder):
    for name in files:
      with open(os.path.join(root, name), encoding="utf-8") as f:
        out[os.path.relpath(os.path.join(root, name), folder)] = f.read()
  return out


def _fill(folder, files):
  for name, text in files.items():
    os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
      f.write(text)


@pytest.mark.parametrize("overwrite", [False, True])
def test_staging_error_keeps_what_the_user_had(tmp_path, overwrite):
  """An error while the outputs are written, or while they are moved into place, leaves a
  pre-existing --out folder exactly as it was: the user's own files and, with --overwrite,
  the earlier outputs."""
  out = str(tmp_path / "out")
  before = {"notes.txt": "mine", "aligned_b/model.safetensors": "old", "report.json": "{}"}
  _fill(out, before)
  with pytest.raises(RuntimeError, match="while writing"):
    with _outputs.staging(out, overwrite) as tmp:
      _fill(tmp, {"aligned_b/model.safetensors": "new"})
      raise RuntimeError("while writing")
  assert _tree(out) == before
  assert sorted(os.listdir(out)) == ["aligned_b", "notes.txt", "report.json"]
  # A move that fails half way (report.json is a folder in the way of a file) is undone.
  os.remove(os.path.join(out, "report.json"))
  _fill(out, {"report.json/keep.txt": "in the way"})
  before = _tree(out)
  if not overwrite:
    with pytest.raises(OSError):
      with _outputs.staging(out, overwrite) as tmp:
        _fill(tmp, {"aligned_a/x": "new", "report.json": "new"})
    assert _tree(out) == before


def test_staging_removes_only_a_folder_it_made(tmp_path):
  out = str(tmp_path / "new" / "out")
  with pytest.raises(RuntimeError):
    with _outputs.staging(out, False):
      raise RuntimeError("stop")
  assert not os.path.exists(out)
  with _outputs.staging(out, False) as tmp:
    _fill(tmp, {"report.json": "{}"})
  assert _tree(out) == {"report.json": "{}"}
  with _outputs.staging(out, True) as tmp:
    _fill(tmp, {"report.json": "{\"new\": 1}"})
  assert _tree(out) == {"report.json": "{\"new\": 1}"}


def _non_default(option: matching.Option):
  """A value of ``option``'s range other than its default, and its command-line text."""
  r, default = option.range, option.default
  if isinstance(r, matching.AtLeast):
    value = (default or r.minimum) + 1
  elif isinstance(r, matching.Positive):
    value = default * 2
  elif isinstance(r, matching.OneOf):
    value = next(v for v in r.values if v != default)
  elif isinstance(r, matching.SomeOf):
    value = (r.values[0],) if default != (r.values[0],) else (r.values[1],)
  else:  # Flag
    value = not default
  text = ",".join(value) if isinstance(value, tuple) else str(value).lower() \
      if isinstance(value, bool) else str(value)
  return value, text


def _reader(option: matching.Option) -> tuple[str, dict]:
  """A built-in method that reads ``option`` and the options it reads it under."""
  if option.descent:
    return "full", {}
  need = option.requires
  given = {need.option: need.value} if need else {}
  return (need.method if need else option.methods[0]), given


@pytest.mark.parametrize("option", matching.OPTIONS, ids=lambda o: o.name)
def test_every_matching_option_reaches_the_command_at_a_non_default_value(option, tmp_path):
  """Each row of ``MatchOptions``: its flag parses a value other than its default, the check
  stage passes it, and the report would record it (``_check.options_used``)."""
  value, text = _non_default(option)
  method, given = _reader(option)
  parser = argparse.ArgumentParser()
  _cli.add_arguments(parser)
  flags = ["a", "b", "--out", str(tmp_path / "out"), "--method", method,
           "--eval-text", str(tmp_path / "t.txt"), _check.flag(option.name), text]
  for name, v in given.items():
    flags += [_check.flag(name), str(v)]
  if option.name == "learn_init":  # the activation start reads the match data
    flags += ["--match-data", str(tmp_path / "m.txt")]
  options = _cli.options_of(parser.parse_args(flags))
  assert options.matching[option.name] == value
  _check.check_options(options)
  assert _check.options_used(method, dict(options.matching))[option.name] == value
