"""REPAIR: endpoints, targets met, a numpy reference, every family, degenerate channels, refusals."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_symmetry import lmc
from attn_symmetry import models
from attn_symmetry import repair as repair_lib
from attn_symmetry import spec as spec_lib


def _params64(model, seed):
  """Float64 params with every leaf perturbed (non-zero biases, non-unit norm scales)."""
  rng = np.random.default_rng(seed)
  flat = spec_lib.flatten(model.init(jax.random.key(seed)))
  return spec_lib.unflatten({p: jnp.asarray(leaf, jnp.float64) + 0.1 * rng.normal(size=leaf.shape)
                             for p, leaf in sorted(flat.items())})


def _batches(model, num=3, seed=0):
  """``num`` float64 input batches of 4 examples (6 tokens or one image each)."""
  keys = jax.random.split(jax.random.key(seed), num)
  if model.input_key == "tokens":
    return [jax.random.randint(k, (4, 6), 0, model.config.vocab_size) for k in keys]
  cfg = model.config
  return [jax.random.normal(k, (4, cfg.image_size, cfg.image_size, cfg.num_channels), jnp.float64)
          for k in keys]


def _pair(family, **overrides):
  model = models.build(family, "tiny", **overrides)
  return model, _params64(model, 0), _params64(model, 1), _batches(model)


def _targets(model, params_a, params_b, lam, batches, names):
  sa, sb = (repair_lib.statistics(model, p, batches, names) for p in (params_a, params_b))
  return {n: ((1 - lam) * sa[n].mean + lam * sb[n].mean, (1 - lam) * sa[n].std + lam * sb[n].std)
          for n in names}


@pytest.mark.parametrize("family", models.FAMILIES)
def test_endpoints_compute_the_endpoints_functions(x64, family):
  """lam = 0 is A's function and lam = 1 B's; the result is a checkpoint of the architecture."""
  model, params_a, params_b, batches = _pair(family)
  for lam, params in ((0.0, params_a), (1.0, params_b)):
    repaired, info = repair_lib.repair(model, params_a, params_b, lam, batches)
    assert jax.tree.structure(repaired) == jax.tree.structure(params_a)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), repaired) == jax.tree.map(
        lambda x: (x.shape, x.dtype), params_a)
    for batch in batches:
      np.testing.assert_allclose(model.apply(repaired, batch)[0], model.apply(params, batch)[0],
                                 atol=1e-9, rtol=0)
    assert set(info) == {f"layers_{i}/{k}" for i in range(model.config.depth)
                         for k in ("attention", "mlp")}
    assert all(v["degenerate"] == 0 and v["corrected"] == v["channels"] for v in info.values())


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_repaired_statistics_meet_the_targets(x64, family):
  """Every point of the repaired model meets its target: the attention output as measured, the
  FFN hidden units as the down projection reads them (a h + c). Llama folds the scales alone:
  its standard deviations meet the targets and its means sit at a mu_lam, as mean_gap says."""
  model, params_a, params_b, batches = _pair(family)
  lam = 0.3
  repaired, info = repair_lib.repair(model, params_a, params_b, lam, batches)
  targets = _targets(model, params_a, params_b, lam, batches, list(info))
  after = repair_lib.statistics(model, repaired, batches, list(info))
  naive = repair_lib.statistics(model, lmc.interpolate(params_a, params_b, lam), batches,
                                list(info))
  shift = family != "llama"
  for name, point in info.items():
    mu_t, sigma_t = targets[name]
    a, c = (point["scale"], point["offset"]) if name.endswith("mlp") else (1.0, 0.0)
    np.testing.assert_allclose(a * after[name].std, sigma_t, atol=1e-9, rtol=0)
    mean = a * after[name].mean + c
    assert point["shift_folded"] == shift
    if shift:
      np.testing.assert_allclose(mean, mu_t, atol=1e-9, rtol=0)
      assert point["mean_gap"] == 0.0
    else:
      gap = np.sqrt(np.mean(((mean - mu_t) / sigma_t) ** 2))
      np.testing.assert_allclose(point["mean_gap"], gap, rtol=1e-9)
      assert gap > 0 and not np.any(c)
    assert point["scale_gap"] <= 1e-12 and point["no_bias"] == "std"
  # The repair moved something: the first layer's attention output differs from naive's.
  assert not np.allclose(after["layers_0/attention"].std, naive["layers_0/attention"].std)


def test_second_moment_rule_meets_the_uncentred_second_moment(x64):
  """Llama (no bias) with no_bias="second_moment": every point's E[x^2] as the next reader sees
  it meets the interpolated endpoints' (1 - lam) m2_A + lam m2_B, and the gaps left to mu_t and
  sigma_t are the ones reported (measured on the repaired model). A family with biases ignores
  the rule (bit-identical to "std")."""
  model, params_a, params_b, batches = _pair("llama")
  lam = 0.3
  repaired, info = repair_lib.repair(model, params_a, params_b, lam, batches,
                                     no_bias="second_moment")
  names = list(info)
  sa, sb, after = (repair_lib.statistics(model, p, batches, names)
                   for p in (params_a, params_b, repaired))
  second = lambda m: m.var + m.mean ** 2
  targets = _targets(model, params_a, params_b, lam, batches, names)
  for name, point in info.items():
    a = point["scale"] if name.endswith("mlp") else 1.0
    mean, std = a * after[name].mean, a * after[name].std
    np.testing.assert_allclose(std ** 2 + mean ** 2,
                               (1 - lam) * second(sa[name]) + lam * second(sb[name]),
                               rtol=1e-9)
    mu_t, sigma_t = targets[name]
    rms = lambda x: np.sqrt(np.mean(x ** 2))
    np.testing.assert_allclose(point["mean_gap"], rms((mean - mu_t) / sigma_t), rtol=1e-8)
    np.testing.assert_allclose(point["scale_gap"], rms((std - sigma_t) / sigma_t), rtol=1e-8)
    assert point["no_bias"] == "second_moment" and point["scale_gap"] > 0
  model, params_a, params_b, batches = _pair("gpt2")
  runs = [repair_lib.repair(model, params_a, params_b, lam, batches, no_bias=rule)[0]
          for rule in repair_lib.NO_BIAS_RULES]
  for x, y in zip(*map(jax.tree.leaves, runs)):
    np.testing.assert_array_equal(x, y)
  with pytest.raises(ValueError, match="no_bias must be one of std, second_moment, got 'rms'"):
    repair_lib.repair(model, params_a, params_b, lam, batches, no_bias="rms")


def _numpy_repair(model, params_a, params_b, lam, batches):
  """The same procedure, straightforwardly: all activations at once, np.mean and np.std, the
  fold written out per row and column in numpy."""
  def acts(params, name):
    return np.concatenate([np.asarray(model.apply(params, b)[1][name]).reshape(
        -1, np.shape(model.apply(params, b)[1][name])[-1]) for b in batches])

  flat = {p: (1 - lam) * np.asarray(x) + lam * np.asarray(spec_lib.flatten(params_b)[p])
          for p, x in spec_lib.flatten(params_a).items()}
  for i in range(model.config.depth):
    for kind in ("attention", "mlp"):
      name = f"layers_{i}/{kind}"
      ha, hb = acts(params_a, name), acts(params_b, name)
      hl = acts(spec_lib.unflatten(flat), name)
      sigma_t = (1 - lam) * ha.std(0) + lam * hb.std(0)
      mu_t = (1 - lam) * ha.mean(0) + lam * hb.mean(0)
      a = sigma_t / hl.std(0)
      c = mu_t - a * hl.mean(0)
      if kind == "attention":
        kernel, bias = f"{name}/out/kernel", f"{name}/out/bias"
        new_kernel = flat[kernel].copy()
        for d in range(a.size):
          new_kernel[:, :, d] *= a[d]
        if bias in flat:
          flat[bias] = a * flat[bias] + c
      else:
        down = "down" if model.config.gated_mlp else "wo"
        kernel, bias = f"{name}/{down}/kernel", f"{name}/{down}/bias"
        new_kernel = flat[kernel].copy()
        for j in range(a.size):
          new_kernel[j, :] *= a[j]
        if bias in flat:
          flat[bias] = flat[bias] + sum(c[j] * flat[kernel][j, :] for j in range(c.size))
      flat[kernel] = new_kernel
  return flat


@pytest.mark.parametrize("family, depth, use_bias", [
    ("gpt2", 1, True), ("gpt2", 2, True), ("gpt2", 2, False), ("llama", 1, False)])
def test_matches_a_numpy_reference(x64, family, depth, use_bias):
  model = models.build(family, "tiny", depth=depth, width=16, num_heads=2, num_kv_heads=None,
                       mlp_dim=24, use_bias=use_bias)
  params_a, params_b = _params64(model, 0), _params64(model, 1)
  batches = _batches(model, num=2)
  repaired, _ = repair_lib.repair(model, params_a, params_b, 0.6, batches)
  expected = _numpy_repair(model, params_a, params_b, 0.6, batches)
  got = spec_lib.flatten(repaired)
  assert set(got) == set(expected)
  for path, value in expected.items():
    np.testing.assert_allclose(got[path], value, atol=1e-9, rtol=1e-9, err_msg=path)


def test_float32_checkpoint_keeps_its_dtypes():
  model = models.build("gpt_neox", "tiny")
  params_a, params_b = model.init(jax.random.key(0)), model.init(jax.random.key(1))
  repaired, info = repair_lib.repair(model, params_a, params_b, 0.5,
                                     [b.astype(jnp.int32) for b in _batches(model)])
  assert jax.tree.map(lambda x: (x.shape, x.dtype), repaired) == jax.tree.map(
      lambda x: (x.shape, x.dtype), params_a)
  assert all(v["corrected"] == v["channels"] for v in info.values())
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(repaired))


def test_statistics_stream_and_count_only_masked_in_positions(x64):
  """Batch by batch equals all at once, over the positions with mask True."""
  model = models.build("bert", "tiny")
  params = _params64(model, 0)
  tokens = jax.random.randint(jax.random.key(3), (6, 7), 0, model.config.vocab_size)
  mask = np.arange(7)[None, :] < np.array([7, 5, 3, 7, 1, 6])[:, None]
  batches = [{"tokens": tokens[i:i + 2], "mask": mask[i:i + 2]} for i in range(0, 6, 2)]
  stats = repair_lib.statistics(model, params, batches, ["layers_1/mlp"])["layers_1/mlp"]
  h = np.asarray(model.apply(params, tokens, mask=jnp.asarray(mask))[1]["layers_1/mlp"])[mask]
  assert stats.count == mask.sum()
  np.testing.assert_allclose(stats.mean, h.mean(0), atol=1e-12)
  np.testing.assert_allclose(stats.var, h.var(0), atol=1e-12)


def test_degenerate_channels_are_left_and_counted(x64):
  """A channel constant in A (an FFN unit with a zero input column) or in B (an attention output
  channel with a zero W_O column) keeps a = 1, c = 0 and is counted."""
  model = models.build("gpt2", "tiny")
  flat_a = spec_lib.flatten(_params64(model, 0))
  flat_b = spec_lib.flatten(_params64(model, 1))
  flat_a["layers_0/mlp/wi/kernel"] = flat_a["layers_0/mlp/wi/kernel"].at[:, 3].set(0.0)
  flat_b["layers_1/attention/out/kernel"] = flat_b["layers_1/attention/out/kernel"].at[..., 5].set(0.0)
  params_a, params_b = spec_lib.unflatten(flat_a), spec_lib.unflatten(flat_b)
  batches = _batches(model)
  repaired, info = repair_lib.repair(model, params_a, params_b, 0.5, batches)
  assert {n: v["degenerate"] for n, v in info.items()} == {
      "layers_0/attention": 0, "layers_0/mlp": 1, "layers_1/attention": 1, "layers_1/mlp": 0}
  for name, channel in (("layers_0/mlp", 3), ("layers_1/attention", 5)):
    assert info[name]["scale"][channel] == 1.0 and info[name]["offset"][channel] == 0.0
    assert info[name]["corrected"] == info[name]["channels"] - 1
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(repaired))


class _Counting:
  """A stand-in for ``model`` that counts the traces of its ``apply`` (hashable, as a Model is)."""

  def __init__(self, model):
    self.model, self.traces = model, []
    self.config, self.spec = model.config, model.spec
    self.input_key, self.check_params = model.input_key, model.check_params

  def apply(self, params, inputs, **kwargs):
    self.traces.append(1)
    return self.model.apply(params, inputs, **kwargs)


def test_statistics_compile_once(x64):
  """One compiled pass serves A, B, every repaired point and every lambda of a path."""
  model = models.build("llama", "tiny")
  counting = _Counting(model)
  params_a, params_b, batches = _params64(model, 0), _params64(model, 1), _batches(model)
  repair_lib.repair(counting, params_a, params_b, 0.5, batches)
  endpoints = repair_lib.endpoint_statistics(counting, params_a, params_b, batches)
  repair_lib.repair(counting, params_a, params_b, 0.25, batches, endpoints=endpoints)
  assert len(counting.traces) == 1


def test_endpoint_statistics_measured_once_serve_every_lambda(x64, monkeypatch):
  """``endpoints`` measured once give every lambda the repair it computes alone, and the
  batches then run through the interpolated model only: 2 x depth passes over them per
  lambda instead of 2 + 2 x depth."""
  model, params_a, params_b, batches = _pair("gpt2")
  endpoints = repair_lib.endpoint_statistics(model, params_a, params_b, batches)
  accumulate, passes = repair_lib._accumulate, []
  monkeypatch.setattr(repair_lib, "_accumulate",
                      lambda *args: (passes.append(1), accumulate(*args))[1])
  depth = model.config.depth
  for lam in (0.25, 0.5):
    passes.clear()
    alone, _ = repair_lib.repair(model, params_a, params_b, lam, batches)
    assert len(passes) == 2 + 2 * depth
    passes.clear()
    shared, _ = repair_lib.repair(model, params_a, params_b, lam, batches, endpoints=endpoints)
    assert len(passes) == 2 * depth
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), alone, shared)
  with pytest.raises(ValueError, match=r"measured at points \('attention', 'mlp'\), not at the "
                                       r"repaired \('mlp',\)"):
    repair_lib.repair(model, params_a, params_b, 0.5, batches, points=("mlp",), endpoints=endpoints)
  other = spec_lib.flatten(params_b)
  other.pop("layers_1/mlp/wo/kernel")  # parameters that do not fit the model are still refused
  with pytest.raises(ValueError, match=r"do not fit gpt2 model: missing \['layers_1/mlp/wo/kernel'\]"):
    repair_lib.repair(model, params_a, spec_lib.unflatten(other), 0.5, batches, endpoints=endpoints)


def test_refusals(x64):
  model, params_a, params_b, batches = _pair("gpt2")
  for lam in (-0.1, 1.5, float("nan")):
    with pytest.raises(ValueError, match=r"lam must lie in \[0, 1\]"):
      repair_lib.repair(model, params_a, params_b, lam, batches)
  with pytest.raises(ValueError, match="repair points must be"):
    repair_lib.repair(model, params_a, params_b, 0.5, batches, points=("residual",))
  with pytest.raises(ValueError, match="no batches"):
    repair_lib.repair(model, params_a, params_b, 0.5, [])
  broken = spec_lib.flatten(params_b)
  broken["layers_1/mlp/wi/kernel"] = broken["layers_1/mlp/wi/kernel"].at[0, 0].set(jnp.nan)
  with pytest.raises(ValueError, match="activations at layers_1/mlp of model B are not finite"):
    repair_lib.repair(model, params_a, spec_lib.unflatten(broken), 0.5, batches)
  # A family whose layers have no output projection to fold into.
  ffn = spec_lib.SymmetrySpec({"layers_0/mlp": spec_lib.Factor(4)},
                             {"layers_0/mlp/wo/kernel": ("layers_0/mlp", None)},
                             writers={"layers_0/mlp": ("layers_0/mlp/wo/kernel", None)})
  bare = types.SimpleNamespace(config=types.SimpleNamespace(family="meanpool", depth=1), spec=ffn)
  with pytest.raises(ValueError, match="REPAIR cannot fold into family 'meanpool'.*attention"):
    repair_lib.repair(bare, params_a, params_b, 0.5, batches)


@pytest.mark.parametrize("family, rule", [("gpt2", "std"), ("llama", "second_moment")])
def test_one_batch_inside_a_trace_is_repair_of_that_batch(x64, family, rule):
  """``repair_batch``, jitted, on one batch: ``repair``'s parameters on that batch to float64
  rounding (both run ``_solve``), a constant FFN unit (degenerate) included; its gradient is
  finite there and agrees with a central difference along a direction that keeps the unit
  constant (the gradient flows through the statistics)."""
  model = models.build(family, "tiny", depth=1, width=16, num_heads=2, num_kv_heads=None,
                       mlp_dim=24)
  params_a, params_b = _params64(model, 0), _params64(model, 1)
  flat = spec_lib.flatten(params_b)
  up = "layers_0/mlp/" + ("up" if model.config.gated_mlp else "wi") + "/kernel"
  flat[up] = flat[up].at[:, 3].set(0.0)  # unit 3 of B: constant
  params_b = spec_lib.unflatten(flat)
  (batch,) = _batches(model, num=1)
  lam = 0.4
  expected, info = repair_lib.repair(model, params_a, params_b, lam, [batch], no_bias=rule)
  assert info["layers_0/mlp"]["degenerate"] == 1

  def repaired(b):
    return repair_lib.repair_batch(model, params_a, b, lmc.interpolate(params_a, b, lam), lam,
                                   batch, no_bias=rule)

  got = jax.jit(repaired)(params_b)
  for path, value in spec_lib.flatten(expected).items():
    np.testing.assert_allclose(spec_lib.flatten(got)[path], value, rtol=1e-12, atol=1e-14,
                               err_msg=path)
  loss = jax.jit(lambda b: jnp.sum(jnp.tanh(model.apply(repaired(b), batch)[0])))
  grad = jax.grad(loss)(params_b)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grad))
  rng = np.random.default_rng(2)
  direction = {p: rng.normal(size=x.shape) for p, x in flat.items()}
  direction[up][:, 3] = 0.0  # unit 3 stays constant: its a = 1 is not moved off by the step
  direction = spec_lib.unflatten(direction)
  step = lambda t: jax.tree.map(lambda x, d: x + t * d, params_b, direction)
  difference = (loss(step(1e-6)) - loss(step(-1e-6))) / 2e-6
  analytic = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(direction)))
  np.testing.assert_allclose(analytic, difference, rtol=1e-6)


def test_a_batch_repair_is_checked_when_made_and_hashable():
  """``BatchRepair`` refuses a bad rule or point and a family with nothing to fold into when
  made; equal settings give equal (hashable) objects, a compiled step's static argument."""
  model = models.build("gpt2", "tiny")
  points = ["attention", "mlp"]  # a list: kept as a tuple, equal to the default
  assert repair_lib.BatchRepair(model) == repair_lib.BatchRepair(model, None, "std", points)
  assert len({repair_lib.BatchRepair(model), repair_lib.BatchRepair(model)}) == 1
  assert repair_lib.BatchRepair(model) != repair_lib.BatchRepair(model, no_bias="second_moment")
  with pytest.raises(ValueError, match="no_bias must be one of std, second_moment, got 'rms'"):
    repair_lib.BatchRepair(model, no_bias="rms")
  with pytest.raises(ValueError, match="repair points must be"):
    repair_lib.BatchRepair(model, points=("residual",))
  with pytest.raises(ValueError, match="model_inputs must be callable"):
    repair_lib.BatchRepair(model, model_inputs="tokens")
  ffn = spec_lib.SymmetrySpec({"layers_0/mlp": spec_lib.Factor(4)},
                             {"layers_0/mlp/wo/kernel": ("layers_0/mlp", None)},
                             writers={"layers_0/mlp": ("layers_0/mlp/wo/kernel", None)})
  bare = types.SimpleNamespace(config=types.SimpleNamespace(family="meanpool", depth=1), spec=ffn)
  with pytest.raises(ValueError, match="REPAIR cannot fold into family 'meanpool'.*attention"):
    repair_lib.BatchRepair(bare)
