"""Whole-model alignment: Weight Matching and align_model on small ViT-like and Llama-like specs.

The specs are built here with ``spec.SymmetrySpec`` directly (independent of
``attn_symmetry.models``). Test data comes from numpy, so that the only
compiles are those of the code under test and of a few jitted helpers.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

from attn_symmetry import group_action as ga
from attn_symmetry import matching
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _model

D, N, H, F, LAYERS = 8, 4, 2, 12, 2
R = "residual"


def vit_like():
  """LayerNorm, GELU MLP with biases, learned positions, class token: a permutation residual."""
  shapes = {"embed/kernel": ((12, D), (None, R)), "embed/bias": ((D,), (R,)),
            "cls": ((1, D), (None, R)), "pos_embedding": ((5, D), (None, R)),
            "norm/scale": ((D,), (R,)), "norm/bias": ((D,), (R,)),
            "head/kernel": ((D, 3), (R, None)), "head/bias": ((3,), (None,))}
  factors, sites = {R: spec_lib.Factor(D)}, {}
  for i in range(LAYERS):
    layer, mlp = f"layers_{i}", f"layers_{i}/mlp"
    factors[mlp] = spec_lib.Factor(F)
    for norm in ("ln1", "ln2"):
      shapes |= {f"{layer}/{norm}/scale": ((D,), (R,)), f"{layer}/{norm}/bias": ((D,), (R,))}
    for proj in ("query", "key", "value"):
      shapes |= {f"{layer}/attention/{proj}/kernel": ((D, N, H), (R, None, None)),
                 f"{layer}/attention/{proj}/bias": ((N, H), (None, None))}
    shapes |= {f"{layer}/attention/out/kernel": ((N, H, D), (None, None, R)),
               f"{layer}/attention/out/bias": ((D,), (R,)),
               f"{mlp}/wi/kernel": ((D, F), (R, mlp)), f"{mlp}/wi/bias": ((F,), (mlp,)),
               f"{mlp}/wo/kernel": ((F, D), (mlp, R)), f"{mlp}/wo/bias": ((D,), (R,))}
    sites[f"{layer}/attention"] = spec_lib.AttentionSite(N, H)
  axes = {p: a for p, (_, a) in shapes.items()}
  return spec_lib.SymmetrySpec(factors, axes, sites), {p: s for p, (s, _) in shapes.items()}


def llama_like():
  """RMSNorm, SwiGLU, grouped-query RoPE attention, no biases: an orthogonal residual."""
  kv = N // 2
  shapes = {"embed": ((24, D), (None, R)), "norm/scale": ((D,), (R,)),
            "head/kernel": ((D, 24), (R, None))}
  factors, sites = {R: spec_lib.Factor(D, "orthogonal")}, {}
  norm_scales = {"norm/scale": ("head/kernel",)}
  for i in range(LAYERS):
    layer, mlp = f"layers_{i}", f"layers_{i}/mlp"
    factors[mlp] = spec_lib.Factor(F)
    shapes |= {f"{layer}/attention_norm/scale": ((D,), (R,)),
               f"{layer}/mlp_norm/scale": ((D,), (R,)),
               f"{layer}/attention/query/kernel": ((D, N, H), (R, None, None)),
               f"{layer}/attention/key/kernel": ((D, kv, H), (R, None, None)),
               f"{layer}/attention/value/kernel": ((D, kv, H), (R, None, None)),
               f"{layer}/attention/out/kernel": ((N, H, D), (None, None, R)),
               f"{mlp}/gate/kernel": ((D, F), (R, mlp)), f"{mlp}/up/kernel": ((D, F), (R, mlp)),
               f"{mlp}/down/kernel": ((F, D), (mlp, R))}
    norm_scales[f"{layer}/attention_norm/scale"] = tuple(
        f"{layer}/attention/{p}/kernel" for p in ("query", "key", "value"))
    norm_scales[f"{layer}/mlp_norm/scale"] = (f"{mlp}/gate/kernel", f"{mlp}/up/kernel")
    sites[f"{layer}/attention"] = spec_lib.AttentionSite(N, H, num_kv_heads=kv, group="rope")
  axes = {p: a for p, (_, a) in shapes.items()}
  return (spec_lib.SymmetrySpec(factors, axes, sites, norm_scales),
          {p: s for p, (s, _) in shapes.items()})


def mlp_like():
  """A three-layer MLP: two hidden permutations, no residual stream."""
  shapes = {"l0/kernel": ((6, F), (None, "h0")), "l0/bias": ((F,), ("h0",)),
            "l1/kernel": ((F, F), ("h0", "h1")), "l1/bias": ((F,), ("h1",)),
            "l2/kernel": ((F, 3), ("h1", None))}
  factors = {"h0": spec_lib.Factor(F), "h1": spec_lib.Factor(F)}
  return (spec_lib.SymmetrySpec(factors, {p: a for p, (_, a) in shapes.items()}),
          {p: s for p, (s, _) in shapes.items()})


def _init(shapes, seed):
  rng = np.random.default_rng(seed)
  flat = {p: (1 + 0.3 * rng.normal(size=s) if p.endswith("scale")
              else rng.normal(size=s) / np.sqrt(s[0] if len(s) > 1 else 4)) for p, s in shapes.items()}
  return spec_lib.unflatten(flat)


def _numpy(tree):
  """Arrays to numpy, integer ones to int32 (as matching returns them: one trace of apply)."""
  cast = lambda x: np.asarray(x, np.int32) if jnp.issubdtype(x.dtype, jnp.integer) else np.asarray(x)
  return jax.tree.map(cast, tree)


def _random_element(spec, rng):
  """A random element of the spec's group, from numpy (no compile): uniform permutations,
  Haar orthogonal maps, and per site a kv-preserving head permutation with well-conditioned
  GL(H) matrices (on the QK side with RoPE: one nonzero a + ib per frequency pair, in either
  sign convention the same set H(H))."""
  def orthogonal(n):
    q, r = np.linalg.qr(rng.normal(size=(n, n)))
    return q * np.sign(np.diag(r))

  def gl(k):
    return np.stack([orthogonal(H) * np.exp(rng.uniform(-0.5, 0.5, H)) @ orthogonal(H)
                     for _ in range(k)])

  out = {}
  for name, f in spec.factors.items():
    out[name] = (rng.permutation(f.size).astype(np.int32) if f.kind == "permutation"
                 else orthogonal(f.size))
  for name, site in spec.attention.items():
    k, g = site.kv_heads, site.num_heads // site.kv_heads
    perm = (rng.permutation(k)[:, None] * g + np.stack([rng.permutation(g) for _ in range(k)]))
    qk = gl(k)
    if site.group == "rope":
      qk = np.zeros((k, H, H))
      for i, j in site.rope_pairs():
        modulus, angle = np.exp(rng.uniform(-0.5, 0.5, k)), rng.uniform(-np.pi, np.pi, k)
        a, b = modulus * np.cos(angle), modulus * np.sin(angle)
        qk[:, i, i] = qk[:, j, j] = a
        qk[:, i, j], qk[:, j, i] = b, -b
    out[name] = ga.AttentionElement(perm.reshape(-1).astype(np.int32), qk, gl(k))
  return out


def _planted(spec, shapes, seed, part, apply_part):
  """(A, B = g A, g) with g random in the group of ``part`` (``spec`` or a restriction of it),
  applied by ``apply_part``. With norm scales, B = g fold(A)."""
  a = _init(shapes, seed)
  g = _random_element(part, np.random.default_rng(seed + 100))
  return a, _numpy(apply_part(ga.fold_norm_scales(spec, a), g)), g


def _jitted_apply(spec):
  return jax.jit(functools.partial(ga.apply_model, spec))


def _max_relative_error(apply, a, b, element):
  moved = spec_lib.flatten(apply(b, element))
  return max(np.linalg.norm(moved[p] - x) / np.linalg.norm(x) for p, x in spec_lib.flatten(a).items())


# ----------------------------------------------------------------------------- planted recovery


def _assert_permutations_recovered(spec, element, g):
  for i in range(LAYERS):
    np.testing.assert_array_equal(element[f"layers_{i}/mlp"], np.argsort(g[f"layers_{i}/mlp"]))
    np.testing.assert_array_equal(element[f"layers_{i}/attention"].perm,
                                  np.argsort(g[f"layers_{i}/attention"].perm))
  if spec.factors[R].kind == "permutation":
    np.testing.assert_array_equal(element[R], np.argsort(g[R]))


@pytest.mark.slow
@pytest.mark.parametrize("build", [vit_like, llama_like], ids=["vit_like", "llama_like"])
def test_planted_model_recovery(x64, build):
  """Exact recovery with the least-squares starts (init="best"), refined in every round."""
  spec, shapes = build()
  apply = _jitted_apply(spec)
  a, b, g = _planted(spec, shapes, 0, spec, apply)
  element, info = matching.align_model(spec, a, b, init="best")
  assert info["folded_norm_scales"] == bool(spec.norm_scales)
  folded_a = ga.fold_norm_scales(spec, a)
  assert _max_relative_error(apply, folded_a, b, element) <= 1e-5
  assert float(info["distance"]["final"]) <= 1e-10 * float(info["distance"]["initial"])
  _assert_permutations_recovered(spec, element, g)
  inverse = np.argsort(g[R]) if spec.factors[R].kind == "permutation" else g[R].T
  np.testing.assert_allclose(element[R], inverse, atol=1e-8)


@pytest.mark.slow
@pytest.mark.parametrize("build,bound", [(vit_like, 1e-10), (llama_like, 1e-4)],
                         ids=["vit_like", "llama_like"])
def test_refine_final_planted_recovery(x64, build, bound):
  """refine="final": the descent is Variant 2's ("ortho": same element and distance), then one
  refinement of the attention matrices lowers the distance. A permutation residual (ViT) is
  recovered exactly. An orthogonal one (Llama) stays where the descent fitted it to the
  orthogonal attention matrices: measured 1.5e-5 of the initial distance, 4.5e-3 off in the
  residual map, against 1.2e-2 for Variant 2."""
  spec, shapes = build()
  a, b, g = _planted(spec, shapes, 0, spec, _jitted_apply(spec))
  ortho, ortho_info = matching.align_model(spec, a, b, method="ortho")
  element, info = matching.align_model(spec, a, b, init="best", refine="final")
  distance = {k: float(v) for k, v in info["distance"].items()}
  np.testing.assert_allclose(distance["before_refinement"], float(ortho_info["distance"]["final"]),
                             rtol=1e-9)
  np.testing.assert_allclose(element[R], ortho[R], atol=1e-12)
  _assert_permutations_recovered(spec, element, g)
  _assert_permutations_recovered(spec, ortho, g)
  assert distance["final"] <= bound * distance["initial"]
  assert distance["final"] < 1e-2 * distance["before_refinement"]


@pytest.mark.slow
def test_scope_aligns_only_inside_it(x64):
  """B differs from A by the first layer's FFN and attention symmetries only; aligning the
  scope "layers_0" recovers them and leaves every other factor at identity."""
  spec, shapes = vit_like()
  part = spec.restrict(["layers_0/mlp", "layers_0/attention"])
  a, b, g = _planted(spec, shapes, 1, part, _jitted_apply(part))
  element, _ = matching.align_model(spec, a, b, scope=["layers_0"], init="best")
  assert _max_relative_error(_jitted_apply(spec), a, b, element) <= 1e-5
  np.testing.assert_array_equal(element[R], np.arange(D))
  np.testing.assert_array_equal(element["layers_1/mlp"], np.arange(F))
  perm, qk, vo = element["layers_1/attention"]
  np.testing.assert_array_equal(perm, np.arange(N))
  np.testing.assert_array_equal(qk, np.broadcast_to(np.eye(H), (N, H, H)))
  np.testing.assert_array_equal(vo, np.broadcast_to(np.eye(H), (N, H, H)))
  np.testing.assert_array_equal(element["layers_0/mlp"], np.argsort(g["layers_0/mlp"]))


@pytest.mark.parametrize("scope,expected", [
    (None, [R, "layers_0/mlp", "layers_1/mlp", "layers_0/attention", "layers_1/attention"]),
    ([""], [R, "layers_0/mlp", "layers_1/mlp", "layers_0/attention", "layers_1/attention"]),
    (["layers_0/attention"], ["layers_0/attention"]),
    (["layers_0/attention", "layers_1/attention"], ["layers_0/attention", "layers_1/attention"]),
    (["layers_1"], ["layers_1/mlp", "layers_1/attention"]),
    ("layers_1", ["layers_1/mlp", "layers_1/attention"]),  # a bare string is one prefix
    (["layers_0/attention/query"], []),  # a site is aligned only as a whole
])
def test_scope_selects_factors_and_sites(scope, expected):
  spec, _ = vit_like()
  assert sorted(_model.active_names(spec, scope)) == sorted(expected)


# ----------------------------------------------------------------------------- one site: the methods


def _planted_first_attention(seed, element):
  """(spec, A, B): B differs from A by ``element`` on layers_0/attention only."""
  spec, shapes = vit_like()
  part = spec.restrict(["layers_0/attention"])
  a = _init(shapes, seed)
  return spec, a, _numpy(_jitted_apply(part)(a, {"layers_0/attention": element}))


@pytest.mark.slow
def test_variant1_applies_the_stage1_permutation(x64):
  """B = (tau, -I, -I) . A on the first attention layer: Stage 1 finds tau^{-1} (circuits are
  invariant), but the permutation alone doubles the distance (every head weight is negated).
  "perm" applies it all the same, as the paper's Variant 1; "ortho" recovers A."""
  tau = np.array([2, 0, 3, 1], np.int32)
  minus = -np.broadcast_to(np.eye(H), (N, H, H))
  spec, a, b = _planted_first_attention(4, ga.AttentionElement(tau, minus, minus))
  site = "layers_0/attention"
  element, info = matching.align_model(spec, a, b, scope=site, method="perm")
  np.testing.assert_array_equal(element[site].perm, np.argsort(tau))
  np.testing.assert_array_equal(element[site].qk, np.broadcast_to(np.eye(H), (N, H, H)))
  initial, final = float(info["distance"]["initial"]), float(info["distance"]["final"])
  assert final > 1.5 * initial  # applied although it raises the distance
  moved = spec_lib.flatten(ga.apply_model(spec, b, _numpy(element)))
  np.testing.assert_allclose(final, sum(np.sum((x - moved[p]) ** 2)
                                        for p, x in spec_lib.flatten(a).items()), rtol=1e-9)
  element, info = matching.align_model(spec, a, b, scope=site, method="ortho")
  np.testing.assert_array_equal(element[site].perm, np.argsort(tau))
  np.testing.assert_allclose(element[site].qk, minus, atol=1e-12)
  assert float(info["distance"]["final"]) <= 1e-20 * initial


@pytest.mark.slow
def test_init_reaches_align_model(x64):
  """With no Adam steps "full" is its start: Variant 2's element for init="procrustes", the
  planted element (exact least squares) for init="best"."""
  g = _random_element(vit_like()[0], np.random.default_rng(5))["layers_0/attention"]
  spec, a, b = _planted_first_attention(5, g)
  site = ["layers_0/attention"]
  ortho, _ = matching.align_model(spec, a, b, scope=site, method="ortho")
  start, _ = matching.align_model(spec, a, b, scope=site, steps=0)
  jax.tree.map(np.testing.assert_array_equal, start, ortho)
  _, info = matching.align_model(spec, a, b, scope=site, steps=0, init="best")
  assert float(info["distance"]["final"]) <= 1e-10 * float(info["distance"]["initial"])


# ----------------------------------------------------------------------------- half precision


@pytest.mark.slow
@pytest.mark.parametrize("build", [vit_like, llama_like], ids=["vit_like", "llama_like"])
def test_bfloat16_planted_recovery(build):
  """bfloat16 models: aligned in float32, the element in float32, applied by apply_model to
  the bfloat16 B without changing its dtype. Every permutation is recovered exactly, and the
  aligned B is as close to A as the planted element's exact inverse brings it (the bfloat16
  noise floor; measured ratio 0.97 ViT-like, 1.02 Llama-like)."""
  spec, shapes = build()
  a = jax.tree.map(lambda x: x.astype(jnp.bfloat16), ga.fold_norm_scales(spec, _init(shapes, 0)))
  g = _random_element(spec, np.random.default_rng(100))
  g = jax.tree.map(lambda x: x.astype(np.float32) if x.dtype == np.float64 else x, g)
  upcast = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float32), t)
  b = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), ga.apply_model(spec, upcast(a), g))
  element, info = matching.align_model(spec, a, b)
  assert {x.dtype for x in jax.tree.leaves(element)} == {np.dtype(np.int32), np.dtype(np.float32)}
  moved = ga.apply_model(spec, b, element)
  assert {x.dtype for x in jax.tree.leaves(moved)} == {jnp.dtype(jnp.bfloat16)}
  _assert_permutations_recovered(spec, element, g)
  distance = lambda t: sum(np.sum((x - y) ** 2) for x, y in zip(jax.tree.leaves(upcast(a)),
                                                                  jax.tree.leaves(upcast(t))))
  floor = distance(ga.apply_model(spec, b, ga.inverse_model(spec, g)))
  assert distance(moved) <= 1.5 * floor
  assert floor <= 1e-5 * float(info["distance"]["initial"])  # the floor is bfloat16's rounding


def test_half_precision_match_ffn(x64):
  """float16 parameters (x64 on: the element is float32 whatever JAX's default)."""
  spec, shapes = mlp_like()
  a, b, g = _planted(spec, shapes, 2, spec, _jitted_apply(spec))
  half = lambda t: jax.tree.map(lambda x: np.asarray(x).astype(np.float16), t)
  element, info = matching.match_ffn(spec, half(a), half(b))
  for f in spec.factors:
    np.testing.assert_array_equal(element[f], np.argsort(g[f]))
  assert info["distance"]["final"].dtype == np.float32 and float(info["distance"]["final"]) == 0.0


# ----------------------------------------------------------------------------- Weight Matching


def _lap_score(spec, a, b, element, factor):
  """sum_j M[j, perm_j] for the factor's current value and scipy's optimum, M from numpy."""
  others = dict(element, **{factor: np.arange(spec.factors[factor].size)})
  moved = spec_lib.flatten(ga.apply_model(spec, b, others))
  m = 0
  for path, axes in spec.axes.items():
    for axis in [i for i, f in enumerate(axes) if f == factor]:
      x = np.moveaxis(spec_lib.flatten(a)[path], axis, 0).reshape(len(element[factor]), -1)
      y = np.moveaxis(np.asarray(moved[path]), axis, 0).reshape(len(element[factor]), -1)
      m = m + x @ y.T
  rows, cols = scipy.optimize.linear_sum_assignment(m, maximize=True)
  return m[np.arange(len(m)), element[factor]].sum(), m[rows, cols].sum()


def test_match_ffn_planted_and_coordinatewise_optimal(x64):
  spec, shapes = mlp_like()
  a, b, g = _planted(spec, shapes, 2, spec, _jitted_apply(spec))
  element, info = matching.match_ffn(spec, a, b)
  for f in spec.factors:
    np.testing.assert_array_equal(element[f], np.argsort(g[f]))
  assert float(info["distance"]["final"]) <= 1e-20
  # Two unrelated networks: no factor's LAP (scipy, given the others) can improve the result.
  b = _init(shapes, seed=3)
  element, info = matching.match_ffn(spec, a, b)
  assert float(info["distance"]["final"]) < float(info["distance"]["initial"])
  for f in spec.factors:
    ours, optimum = _lap_score(spec, a, b, _numpy(element), f)
    np.testing.assert_allclose(ours, optimum, rtol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("build,fixed", [(vit_like, ["embed/kernel"]),
                                         (llama_like, ["embed", "head/kernel"])],
                         ids=["vit_like", "llama_like"])
def test_fixed_leaves_scored_once_keep_every_factor_optimal(x64, build, fixed):
  """Leaves only the residual acts on, with at least D columns (embeddings, an untied head),
  are scored once before the descent, as sum_leaf A_(R) B_(R)^T; with them scaled to dominate
  the residual's scores, the result is still coordinatewise optimal."""
  spec, shapes = build()
  a, b = _init(shapes, 0), _init(shapes, 1)
  flat_a, flat_b = spec_lib.flatten(a), spec_lib.flatten(b)
  assert {f: _model._fixed_leaves(spec, f, flat_a) for f in spec.factors} == {  # pylint: disable=protected-access
      f: fixed if f == R else [] for f in spec.factors}
  on = {n: jnp.bool_(True) for n in (*spec.factors, *spec.attention)}
  m, norm_a, norm_b = _model._fixed_scores(spec, flat_a, flat_b, on)[R]  # pylint: disable=protected-access
  view = lambda x, p: np.moveaxis(x, spec.axes[p].index(R), 0).reshape(D, -1)
  np.testing.assert_allclose(m, sum(view(flat_a[p], p) @ view(flat_b[p], p).T for p in fixed),
                             rtol=1e-12)
  np.testing.assert_allclose(norm_b, sum(np.sum(flat_b[p] ** 2) for p in fixed), rtol=1e-12)
  off = _model._fixed_scores(spec, flat_a, flat_b, dict(on, **{R: jnp.bool_(False)}))[R]  # pylint: disable=protected-access
  assert not np.any(off[0])
  if spec.factors[R].kind == "orthogonal":
    a, b = ga.fold_norm_scales(spec, a), ga.fold_norm_scales(spec, b)
  a, b = ({p: 10 * x if p in fixed else x for p, x in spec_lib.flatten(t).items()}
          for t in (a, b))
  a, b = spec_lib.unflatten(a), spec_lib.unflatten(b)
  element, info = matching.match_ffn(spec, a, b)
  assert float(info["distance"]["final"]) < float(info["distance"]["initial"])
  for f in (f for f in spec.factors if spec.factors[f].kind == "permutation"):
    ours, optimum = _lap_score(spec, a, b, _numpy(element), f)
    np.testing.assert_allclose(ours, optimum, rtol=1e-9)


def test_one_trace_for_equal_specs(x64, monkeypatch):
  counted = jax.jit(chex.assert_max_traces(_model._align_core, n=1),
                    static_argnames=_model._STATIC)  # pylint: disable=protected-access
  monkeypatch.setattr(_model, "_align_jit", counted)
  for seed in range(3):  # a new but equal spec object each time
    spec, shapes = mlp_like()
    matching.match_ffn(spec, _init(shapes, seed), _init(shapes, seed + 10))
  spec, shapes = mlp_like()
  matching.match_ffn(spec, _init(shapes, 0), _init(shapes, 1), scope=["l0", "l1"])  # a mask
  _, info = matching.match_ffn(spec, _init(shapes, 0), _init(shapes, 1), max_rounds=1)  # traced
  assert int(info["rounds"]) == 1
  with pytest.raises(AssertionError, match="traced > 1"):  # another spec: a new one
    matching.match_ffn(spec.restrict(["h0"]), _init(shapes, 0), _init(shapes, 1))


@pytest.mark.slow
@pytest.mark.parametrize("scope", [["layers_0"], ["layers_1/attention"],
                                   ["layers_0/attention", "layers_1/attention"]])
def test_scope_equals_the_descent_over_its_names_alone(x64, scope):
  """A scope is a traced mask over the whole model's descent; it reaches the element of a
  descent over the spec restricted to its names: bit for bit for perm and ortho, to rounding
  for full (its refinement runs batched with the sites out of scope). Out of scope: identity."""
  spec, shapes = vit_like()
  a, b = _init(shapes, 0), _init(shapes, 1)
  names = _model.active_names(spec, scope)
  identity = ga.identity_model(spec, jnp.float64)
  for method in ("perm", "ortho", "full"):
    masked, _ = matching.align_model(spec, a, b, scope=scope, method=method)
    alone, _ = matching.align_model(spec.restrict(names), a, b, method=method)
    for name in (*spec.factors, *spec.attention):
      want = alone[name] if name in names else identity[name]
      for x, y in zip(jax.tree.leaves(masked[name]), jax.tree.leaves(want)):
        if method == "full":
          np.testing.assert_allclose(x, y, rtol=0, atol=1e-10, err_msg=f"{method} {name}")
        else:
          np.testing.assert_array_equal(x, y, err_msg=f"{method} {name}")


@pytest.mark.slow
def test_one_program_for_every_scope_and_distance(x64, monkeypatch):
  """Scopes are a traced mask and the Stage 1 distance a traced index: every scope and
  distance of a model shares one compiled program."""
  counted = jax.jit(chex.assert_max_traces(_model._align_core, n=1),
                    static_argnames=_model._STATIC)  # pylint: disable=protected-access
  monkeypatch.setattr(_model, "_align_jit", counted)
  spec, shapes = vit_like()
  a, b = _init(shapes, 0), _init(shapes, 1)
  for scope in (None, ["layers_0/attention"], ["layers_1"], ["layers_0/attention",
                                                            "layers_1/attention"]):
    for method in ("perm", "full"):
      matching.align_model(spec, a, b, scope=scope, method=method)
  site = "layers_0/attention"
  for distance in ("frobenius", "squared", "normalised", "cosine"):  # each as match_attention's
    element, _ = matching.align_model(spec, a, b, scope=[site], method="ortho", distance=distance)
    alone, _ = matching.match_attention(spec_lib.subtree(a, site), spec_lib.subtree(b, site),
                                        spec.attention[site], method="ortho", distance=distance)
    np.testing.assert_array_equal(element[site].perm, alone.perm, err_msg=distance)
    np.testing.assert_allclose(element[site].qk, alone.qk, atol=1e-12, err_msg=distance)


@pytest.mark.slow
def test_one_program_for_perm_ortho_and_full(x64, monkeypatch):
  """The method is a traced index into the stages (perm, ortho, full): with equal options the
  three share one trace and one compiled program, and each still gives its own element:
  identity matrices for perm, orthogonal ones for ortho, refined ones (iterations reported)
  for full. So do the refinement's steps and start and the most rounds: a step count of 0
  refines nothing, one round stops after one."""
  counted = jax.jit(chex.assert_max_traces(_model._align_core, n=1),
                    static_argnames=_model._STATIC)  # pylint: disable=protected-access
  monkeypatch.setattr(_model, "_align_jit", counted)
  spec, shapes = vit_like()
  a, b = _init(shapes, 0), _init(shapes, 1)
  out = {m: matching.align_model(spec, a, b, method=m) for m in ("perm", "ortho", "full")}
  eye = np.broadcast_to(np.eye(H), (N, H, H))
  for i in range(LAYERS):
    perm, ortho, full = (out[m][0][f"layers_{i}/attention"] for m in ("perm", "ortho", "full"))
    np.testing.assert_array_equal(perm.qk, eye)
    np.testing.assert_array_equal(perm.vo, eye)
    for m in (ortho.qk, ortho.vo):
      np.testing.assert_allclose(np.swapaxes(m, 1, 2) @ m, eye, atol=1e-12)
    assert np.abs(np.swapaxes(full.vo, 1, 2) @ full.vo - eye).max() > 1e-3
  assert int(out["full"][1]["refinement_steps"]) > 0
  assert "refinement_steps" not in out["perm"][1] and "refinement_steps" not in out["ortho"][1]
  # The step and round counts and the refinement's start are traced too: the same program.
  _, info = matching.align_model(spec, a, b, method="full", steps=0, max_rounds=1)
  assert int(info["refinement_steps"]) == 0 and int(info["rounds"]) == 1
  best, info = matching.align_model(spec, a, b, method="full", init="best")
  assert float(info["distance"]["final"]) <= float(out["full"][1]["distance"]["final"]) * (1 + 1e-9)
  with pytest.raises(AssertionError, match="traced > 1"):  # another solver: a new one
    matching.align_model(spec, a, b, method="perm", solver="adam")


# ----------------------------------------------------------------------------- bad input


def _bad(case):
  spec, shapes = vit_like()
  a = _init(shapes, 0)
  b = jax.tree.map(np.copy, a)
  if case == "shape":
    b["head"]["bias"] = np.zeros(4)
    return spec, a, b, None, "head/bias: params_a has float64\\[3\\] but params_b has float64\\[4\\]"
  if case == "not in spec":
    b["extra"] = np.zeros(3)
    return spec, a, b, None, "params_b: .*leaves not in the spec \\['extra'\\]"
  if case == "nan":
    b["layers_1"]["mlp"]["wo"]["kernel"][2, 3] = np.nan
    return spec, a, b, None, "params_b: layers_1/mlp/wo/kernel has NaN or Inf"
  if case == "heads":
    sites = {s: spec_lib.AttentionSite(2, 4) for s in spec.attention}
    return (spec_lib.SymmetrySpec(spec.factors, spec.axes, sites), a, b, None,
            "layers_0/attention/query/kernel and layers_0/attention/key/kernel have N=4")
  return spec, a, b, ["layers_9"], "scope prefix 'layers_9' matches no parameter"


@pytest.mark.parametrize("case", ["shape", "not in spec", "nan", "heads", "scope"])
def test_bad_model_input_names_the_leaf(x64, case):
  spec, a, b, scope, message = _bad(case)
  with pytest.raises(ValueError, match=message):
    matching.align_model(spec, a, b, scope=scope)


@pytest.mark.parametrize("kwargs,message", [(dict(refine="once"), "refine must be one of"),
                                            (dict(init="lstsq"), "init must be one of")])
def test_bad_model_options(kwargs, message):
  spec, shapes = vit_like()
  a = _init(shapes, 0)
  with pytest.raises(ValueError, match=message):
    matching.align_model(spec, a, a, **kwargs)
