"""Learned alignment on the REPAIRed path (option ``learn_repair``, ``repair.BatchRepair``): the
objective is the loss of ``repair.repair`` on the same path, batch and lambda; training lowers
it; the option is refused where it cannot work, before any work; equal settings share one
compiled step.

One small GPT-2 (a layer, width 16); the loss is a regression of the logits onto a third
model's (the teacher), on random tokens. The loss function, the model and its ``BatchRepair``
live at module level, so that the tests of one dtype share their compiled programs.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_symmetry import group_action as ga
from attn_symmetry import lmc
from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry import registry
from attn_symmetry import repair as repair_lib
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _learned

MODEL = models.build("gpt2", "tiny", depth=1, width=16, num_heads=2, num_kv_heads=None,
                     mlp_dim=24)
SPEC = MODEL.spec
NAMES = matching.active_names(SPEC, None)
REPAIR = repair_lib.BatchRepair(MODEL)
TRAIN, HOLDOUT, TEST = range(100, 104), range(200, 202), 300


def _params(seed, dtype):
  """An initialisation with every leaf perturbed (weights of order 0.3: a path with a
  barrier), in ``dtype``."""
  rng = np.random.default_rng(seed)
  flat = spec_lib.flatten(MODEL.init(jax.random.key(seed)))
  return spec_lib.unflatten({p: jnp.asarray(x + 0.3 * rng.normal(size=x.shape), dtype)
                             for p, x in sorted(flat.items())})


def _distil(params, batch):
  return jnp.mean((MODEL.apply(params, batch["tokens"])[0] - batch["target"]) ** 2)


def _batches(teacher, seeds):
  """Random tokens [4, 6] and the teacher's logits, one batch per seed."""
  out = []
  for s in seeds:
    tokens = jax.random.randint(jax.random.key(s), (4, 6), 0, MODEL.config.vocab_size)
    out.append({"tokens": tokens, "target": MODEL.apply(teacher, tokens)[0]})
  return out


def _repaired_loss(a, b, lam, batch):
  """The loss of ``repair.repair`` of the path from ``a`` to ``b`` at ``lam`` on ``batch``."""
  return float(_distil(repair_lib.repair(MODEL, a, b, lam, [batch])[0], batch))


def _learn(a, b, start, teacher, **options):
  return matching.learn_alignment(
      SPEC, a, b, (start, {"folded_norm_scales": False}), names=NAMES, loss_fn=_distil,
      batches=_batches(teacher, TRAIN), holdout_batches=_batches(teacher, HOLDOUT),
      **{"repair": REPAIR, "learning_rate": 1e-2, **options})


def test_the_objective_is_the_loss_of_repair_on_the_same_batch(x64):
  """At the start g0 (a random element of the group), the first step's loss is that of
  ``repair.repair`` of the path from A to g0 . B at lambda 1/2 on the first training batch, and
  the held-out loss the mean of it over the held-out batches, each repaired on its own, to
  float64 rounding; REPAIR moved it (the plain midpoint's loss differs)."""
  a, b, teacher = (_params(s, jnp.float64) for s in (0, 1, 2))
  start = ga.random_model_element(jax.random.key(5), SPEC)
  lines = []
  _, info = _learn(a, b, start, teacher, factors="ffn", steps=1, eval_every=1,
                   progress=lines.append)
  moved = ga.apply_model(SPEC, b, start)
  train, holdout = _batches(teacher, TRAIN)[0], _batches(teacher, HOLDOUT)
  expected = _repaired_loss(a, moved, 0.5, train)
  np.testing.assert_allclose(lines[0]["train_loss"], expected, rtol=1e-11)
  assert abs(float(_distil(lmc.interpolate(a, moved, 0.5), train)) - expected) > 1e-2 * expected
  initial = info["learned"]["holdout"]["initial"]
  np.testing.assert_allclose(initial["loss"], np.mean([_repaired_loss(a, moved, 0.5, h)
                                                       for h in holdout]), rtol=1e-11)
  ends = [np.mean([float(_distil(p, h)) for h in holdout]) for p in (a, moved)]
  np.testing.assert_allclose(initial["endpoints"], ends, rtol=1e-11)
  assert info["learned"]["repair"] == {"no_bias": "std", "points": ["attention", "mlp"]}


def test_training_lowers_the_repaired_midpoint_loss_and_compiles_once():
  """float32, the attention matrices trained at lambda 1/2 on the REPAIRed path from the
  identity: the held-out REPAIRed barrier falls, and so does the loss of ``repair.repair`` at
  1/2 on a batch that neither training nor selection read. Another ``BatchRepair`` of the same
  settings reuses the compiled step."""
  a, b, teacher = (_params(s, jnp.float32) for s in (0, 1, 0))  # the teacher is A
  start = ga.identity_model(SPEC, jnp.float32)
  element, info = _learn(a, b, start, teacher, factors="attention", steps=12, eval_every=4)
  learned = info["learned"]
  assert learned["best_step"] > 0 and learned["skipped"] == 0
  assert learned["holdout"]["best"]["barrier"] < 0.9 * learned["holdout"]["initial"]["barrier"]
  (test,) = _batches(teacher, [TEST])
  before = _repaired_loss(a, b, 0.5, test)
  after = _repaired_loss(a, ga.apply_model(SPEC, b, element), 0.5, test)
  assert after < 0.99 * before
  compiled = _learned._step_jit._cache_size()  # pylint: disable=protected-access
  _learn(a, b, start, teacher, factors="attention", steps=1, repair=repair_lib.BatchRepair(MODEL))
  assert _learned._step_jit._cache_size() == compiled  # pylint: disable=protected-access


class _Bare:
  """A model whose spec has no projection to fold the attention point into."""
  config = types.SimpleNamespace(family="meanpool", depth=1)
  spec = spec_lib.SymmetrySpec({"layers_0/mlp": spec_lib.Factor(4)},
                               {"layers_0/mlp/wo/kernel": ("layers_0/mlp", None)},
                               writers={"layers_0/mlp": ("layers_0/mlp/wo/kernel", None)})

  @staticmethod
  def check_params(params):
    del params


@pytest.mark.parametrize("options, message", [
    (dict(method="full", learn_repair=True),
     r"\['learn_repair'\] are options of method 'learned' only, not of 'full'"),
    (dict(learn_repair=True), r"learn_repair=True fits the element on the REPAIRed path: pass "
                              r"model"),
    (dict(model=MODEL), r"model are read by 'learned' with learn_repair=True only, not by "
                        r"'learned' with learn_repair=False"),
    (dict(learn_repair=True, model=MODEL, repair_no_bias="rms"),
     r"no_bias must be one of std, second_moment, got 'rms'"),
    (dict(learn_repair=True, model=_Bare()), r"REPAIR cannot fold into family 'meanpool'"),
    (dict(learn_repair=True, model=models.build("llama", "tiny")),
     r"parameters do not fit llama model"),
    (dict(learn_repair="yes", model=MODEL), r"learn_repair must be true or false, got 'yes'"),
])
def test_refused_before_any_work(options, message):
  """Another method, no model, a model without learn_repair, a bad rule, a family with nothing
  to fold REPAIR into, parameters of another model, a value that is no flag: each is refused
  in one line before any work (the start method, here one that fails the test, never runs)."""
  a, b = (_params(s, jnp.float32) for s in (0, 1))
  if options.get("method") != "full":
    options = dict(method="learned", loss_fn=_distil, batches=[{}], holdout_batches=[{}],
                   learn_steps=1, **options)

  def ran(*args, **kwargs):
    raise AssertionError("the start method ran")

  with registry.scoped(), pytest.raises(ValueError, match=message):
    matching.METHODS["full"] = dataclasses.replace(matching.METHODS["full"], align=ran)
    matching.align_model(SPEC, a, b, **options)


def test_learn_alignment_takes_a_batch_repair_or_none():
  a, b = (_params(s, jnp.float32) for s in (0, 1))
  with pytest.raises(ValueError, match=r"repair must be a repair.BatchRepair .* got 'std'"):
    _learn(a, b, ga.identity_model(SPEC, jnp.float32), a, steps=1, repair="std")
