"""Benchmark: aligning a GPT-2-small-shaped pair, jitted matching against a numpy/scipy reference.

    .venv/bin/python benchmarks/bench_matching.py            # GPT-2 small: 12 layers, D=768
    .venv/bin/python benchmarks/bench_matching.py --quick    # a small model, for a smoke run
    .venv/bin/python benchmarks/bench_matching.py --lap_only # the LAP against scipy, 3072^2

The pair: the leaves and symmetry spec of the library's GPT-2 small
(``models.build("gpt2", "base")``: 12 layers, 12 heads of dim 64, D = 768, FFN
3072, vocabulary 50257, 1024 positions, LayerNorm, biases, tied embedding). A
draws every weight with std 0.02 (norm scales 1 + 0.1 noise); B = g . A + noise
with g a random element of its symmetry group (residual permutation, FFN
permutations, per-layer head permutation and GL(64) matrices) and noise of 10%
of each leaf's standard deviation.

The reference is ``reference_align`` below, a straightforward per-head Python
loop with numpy and scipy (D x D circuits for Stage 1, D x H matrices in every
one of 200 Adam steps, ``scipy.optimize.linear_sum_assignment``): the paper's
algorithm written plainly. ``matching.align_model(method="full")`` (one jit:
Grams, vmap over heads and layers, lax loops) runs with ``--solver``: its
default Gauss-Newton refinement (stopped on a tolerance; the iterations it
took are printed), or "adam", the reference's own 200 Adam steps. The
squared distances reached are printed side by side.
Both are timed in this process, one after the other. Then the jitted attention
matching alone is timed for a range of N, H and L. Last, ``linear_assignment``
(jitted: distinct row minima answer at once, else the auction of
``matching._auction``, or optax's Hungarian below 512 rows on CPU) and optax's
Hungarian algorithm forced on CPU are timed against
``scipy.optimize.linear_sum_assignment`` on random and on near-permutation
n x n costs (the kind Weight Matching meets between a model and a fine-tuned
or planted copy of it; their row minima are distinct, so linear_assignment
answers them without a solver, as it does every assignment of the GPT-2 pair
above). ``benchmarks/bench_assignment.py`` times the auction alone against
scipy.

On CPU, jaxlib's LAPACK kernels (the batched 64 x 64 solves and SVDs of Stage 2)
run on scipy's OpenBLAS. With its threads on, XLA's concurrent custom calls into
it crawl or deadlock (a known OpenBLAS hazard), so this script limits that one
library to a single thread (threadpoolctl); numpy's OpenBLAS, which the
reference uses, keeps its default threads unless --reference_blas_threads says
otherwise.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
import threadpoolctl

from attn_symmetry import group_action as ga
from attn_symmetry import matching
from attn_symmetry.matching import _assignment
from attn_symmetry import models
from attn_symmetry import spec as spec_lib

R = "residual"  # the residual-stream factor of the library's specs
# The library's GPT-2 at its "base" preset is GPT-2 small; QUICK is a 2-layer one for smoke runs.
GPT2_SMALL = dict(preset="base")
QUICK = dict(preset="tiny", width=64, mlp_dim=256, vocab_size=500, max_len=64)
ADAM = dict(b1=0.9, b2=0.999, eps=1e-8)  # optax.adam's defaults


# ----------------------------------------------------------------------------- the model pair


def gpt2(**sizes) -> models.Model:
  """``models.build("gpt2", ...)``: pre-LayerNorm, biases, tied embedding."""
  return models.build("gpt2", **sizes)


def leaf_shapes(model: models.Model) -> dict[str, tuple[int, ...]]:
  """Flat path -> shape of the model's parameters (nothing allocated)."""
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  return {p: x.shape for p, x in spec_lib.flatten(shapes).items()}


def attention_sizes(model: models.Model) -> dict[str, int]:
  """The sizes of its attention layers, for the layer-stack measurements."""
  c = model.config
  return dict(layers=c.depth, width=c.width, heads=c.num_heads, head_dim=c.head_dim)


def planted_pair(spec, shapes, *, seed=0, noise=0.1):
  """(A, B = g A + noise, g) as float32 numpy trees."""
  rng = np.random.default_rng(seed)
  flat = {}
  for path, shape in shapes.items():
    if path.endswith("scale"):
      flat[path] = 1 + 0.1 * rng.standard_normal(shape, np.float32)
    else:
      flat[path] = 0.02 * rng.standard_normal(shape, np.float32)
  a = spec_lib.unflatten(flat)

  def orthogonal(n):
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))

  g = {name: rng.permutation(f.size).astype(np.int32) for name, f in spec.factors.items()}
  for name, site in spec.attention.items():
    h = site.head_dim
    gl = lambda: np.stack([orthogonal(h) * np.exp(rng.uniform(-0.5, 0.5, h)) @ orthogonal(h)
                           for _ in range(site.num_heads)]).astype(np.float32)
    g[name] = ga.AttentionElement(rng.permutation(site.num_heads).astype(np.int32), gl(), gl())
  moved = _apply_model(spec, spec_lib.flatten(a), g)
  b = {p: x + noise * np.std(x) * rng.standard_normal(x.shape, np.float32) for p, x in moved.items()}
  return a, spec_lib.unflatten(b), g


# ----------------------------------------------------------------------------- the reference


def _take(x, perm, axis):
  return np.take(x, perm, axis=axis)


def _apply_attention(layer, element):
  """group_action.apply for one layer, head by head."""
  perm, qk, vo = element
  out = {name: dict(layer[name]) for name in layer}
  for name, mat, side in (("query", qk, "right"), ("key", qk, "inverse_t"), ("value", vo, "right")):
    kernel, bias = layer[name]["kernel"][:, perm], layer[name]["bias"][perm]
    new_k, new_b = np.empty_like(kernel), np.empty_like(bias)
    for n in range(len(perm)):
      m = mat[n] if side == "right" else np.linalg.inv(mat[n]).T
      new_k[:, n], new_b[n] = kernel[:, n] @ m, bias[n] @ m
    out[name] = {"kernel": new_k, "bias": new_b}
  kernel = layer["out"]["kernel"][perm]
  out["out"] = {"kernel": np.stack([np.linalg.inv(vo[n]) @ kernel[n] for n in range(len(perm))]),
                "bias": layer["out"]["bias"]}
  return out


def _transformed(spec, flat_b, element, path, skip_axis=None):
  leaf = flat_b[path]
  for axis, f in enumerate(spec.axes[path]):
    if f is not None and axis != skip_axis:
      leaf = _take(leaf, element[f], axis)
  return leaf


def _with_attention(spec, flat, element):
  """``flat`` with every site's attention element applied (the factors not yet)."""
  moved = dict(flat)
  for s in spec.attention:
    layer = spec_lib.unflatten({p[len(s) + 1:]: flat[p] for p in flat if p.startswith(s + "/")})
    moved.update({f"{s}/{p}": v for p, v in spec_lib.flatten(_apply_attention(layer, element[s])).items()})
  return moved


def _apply_model(spec, flat, element):
  """group_action.apply_model in numpy (flat trees)."""
  moved = _with_attention(spec, flat, element)
  return {p: _transformed(spec, moved, element, p) for p in moved}


def _permutation_step(spec, flat_a, flat_b, element, factor, paths):
  """Weight Matching: scipy's LAP on sum over leaves of A_(P) B_(P)^T."""
  n = spec.factors[factor].size
  m = np.zeros((n, n), np.float64)
  for path in paths:
    for axis in [i for i, f in enumerate(spec.axes[path]) if f == factor]:
      a = np.moveaxis(flat_a[path], axis, 0).reshape(n, -1)
      b = np.moveaxis(_transformed(spec, flat_b, element, path, axis), axis, 0).reshape(n, -1)
      m += a @ b.T
  return scipy.optimize.linear_sum_assignment(m, maximize=True)[1].astype(np.int32)


def _objective_and_grad(m, x1, y1, x2, y2):
  """||X1 M - Y1||^2 + ||X2 M^{-T} - Y2||^2 and its gradient, on the full D x H matrices."""
  m_inv_t = np.linalg.inv(m).T
  r1, r2 = x1 @ m - y1, x2 @ m_inv_t - y2
  g2 = 2 * x2.T @ r2  # gradient in M^{-T}
  grad = 2 * x1.T @ r1 - m_inv_t @ g2.T @ m_inv_t
  return np.sum(r1 * r1) + np.sum(r2 * r2), grad


def _reference_solve(x1, y1, x2, y2, *, steps, learning_rate):
  """Procrustes and one-sided least-squares starts, then Adam, keeping the best iterate."""
  u, _, vt = np.linalg.svd(x1.T @ y1 + x2.T @ y2)
  starts = [u @ vt, np.linalg.lstsq(x1, y1, rcond=None)[0],
            np.linalg.inv(np.linalg.lstsq(x2, y2, rcond=None)[0].T)]
  m = min(starts, key=lambda s: _objective_and_grad(s, x1, y1, x2, y2)[0])
  mu, nu = np.zeros_like(m), np.zeros_like(m)
  best, best_value = m, np.inf
  for t in range(1, steps + 2):
    value, grad = _objective_and_grad(m, x1, y1, x2, y2)
    if value < best_value:
      best, best_value = m, value
    mu = ADAM["b1"] * mu + (1 - ADAM["b1"]) * grad
    nu = ADAM["b2"] * nu + (1 - ADAM["b2"]) * grad * grad
    m = m - learning_rate * (mu / (1 - ADAM["b1"] ** t)) / (
        np.sqrt(nu / (1 - ADAM["b2"] ** t)) + ADAM["eps"])
  return best


def _reference_attention(layer_a, layer_b, *, steps, learning_rate):
  """Both stages for one layer, head by head."""
  aug = lambda layer, name, n: np.concatenate([layer[name]["kernel"][:, n],
                                               layer[name]["bias"][None, n]])
  heads = layer_a["query"]["kernel"].shape[1]
  circuits = lambda layer: [(aug(layer, "query", n) @ aug(layer, "key", n).T,
                             aug(layer, "value", n) @ layer["out"]["kernel"][n]) for n in range(heads)]
  ca, cb = circuits(layer_a), circuits(layer_b)
  cost = np.array([[np.linalg.norm(qa - qb) + np.linalg.norm(va - vb) for qb, vb in cb]
                   for qa, va in ca])
  perm = scipy.optimize.linear_sum_assignment(cost)[1].astype(np.int32)
  qk, vo = [], []
  for n, m in enumerate(perm):
    qk.append(_reference_solve(aug(layer_b, "query", m), aug(layer_a, "query", n),
                               aug(layer_b, "key", m), aug(layer_a, "key", n), steps=steps,
                               learning_rate=learning_rate))
    vo.append(_reference_solve(aug(layer_b, "value", m), aug(layer_a, "value", n),
                               layer_b["out"]["kernel"][m].T, layer_a["out"]["kernel"][n].T,
                               steps=steps, learning_rate=learning_rate))
  return ga.AttentionElement(perm, np.stack(qk), np.stack(vo))


def reference_align(spec, params_a, params_b, *, steps, learning_rate):
  """The same schedule as ``align_model`` on this spec, written plainly.

  Round one: the residual permutation from the leaves nothing else acts on
  (embeddings, LayerNorms), then every FFN permutation, then every attention
  layer; afterwards the residual permutation from all leaves, and the FFNs and
  attention layers again whenever it changed.
  """
  flat_a, flat_b = spec_lib.flatten(params_a), spec_lib.flatten(params_b)
  element = {name: np.arange(f.size, dtype=np.int32) for name, f in spec.factors.items()}
  site_of = {p: s for s in spec.attention for p in flat_a if p.startswith(s + "/")}
  residual_paths = [p for p, axes in spec.axes.items() if R in axes]
  anchors = [p for p in residual_paths if set(spec.axes[p]) <= {R, None} and p not in site_of]

  def others():
    for f in spec.factors:
      if f != R:
        paths = [p for p, axes in spec.axes.items() if f in axes]
        element[f] = _permutation_step(spec, flat_a, flat_b, element, f, paths)
    for s in spec.attention:
      leaves = [p for p in flat_b if p.startswith(s + "/")]
      layer_b = spec_lib.unflatten({p[len(s) + 1:]: _transformed(spec, flat_b, element, p)
                                    for p in leaves})
      layer_a = spec_lib.unflatten({p[len(s) + 1:]: flat_a[p] for p in leaves})
      element[s] = _reference_attention(layer_a, layer_b, steps=steps, learning_rate=learning_rate)

  element.update({s: ga.AttentionElement(np.arange(site.num_heads), *[np.broadcast_to(
      np.eye(site.head_dim), (site.num_heads, site.head_dim, site.head_dim))] * 2)
                  for s, site in spec.attention.items()})
  element[R] = _permutation_step(spec, flat_a, flat_b, element, R, anchors)
  others()
  while True:
    residual = _permutation_step(spec, flat_a, _with_attention(spec, flat_b, element), element, R,
                                 residual_paths)
    if np.array_equal(residual, element[R]):
      return element
    element[R] = residual
    others()


# ----------------------------------------------------------------------------- timing


def _timed(fn):
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def _distance(spec, a, b, element):
  flat_a = spec_lib.flatten(a)
  element = jax.tree.map(np.asarray, element)
  moved = _apply_model(spec, spec_lib.flatten(b), element)
  return sum(float(np.sum((flat_a[p] - x) ** 2, dtype=np.float64)) for p, x in moved.items())


def whole_model(model, *, steps, learning_rate, solver, with_reference=True):
  spec, shapes = model.spec, leaf_shapes(model)
  a, b, _ = planted_pair(spec, shapes)
  params = sum(int(np.prod(s)) for s in shapes.values())
  c = model.config
  print(f"model: GPT-2, {c.depth} layers, {c.num_heads} heads of {c.head_dim}, D = {c.width}, "
        f"FFN {c.mlp_dim}, vocabulary {c.vocab_size}, {c.max_len} positions: "
        f"{params / 1e6:.1f}M parameters per model; reference: {steps} Adam steps, "
        f"learning rate {learning_rate}")
  a_dev, b_dev = jax.device_put(a), jax.device_put(b)
  run = lambda: matching.align_model(spec, a_dev, b_dev, steps=steps, learning_rate=learning_rate,
                                     init="best", solver=solver)  # the reference's starts
  (element, info), first = _timed(run)
  times = [_timed(run)[1] for _ in range(2)]
  ours = min(times)
  print(f"  jitted align_model: {ours:.2f} s after compile (best of {len(times)}: "
        f"{', '.join(f'{t:.2f}' for t in times)}), first call {first:.2f} s, so compile ~ "
        f"{first - ours:.2f} s; {int(info['rounds'])} rounds; {solver}: at most "
        f"{int(info['refinement_steps'])} refinement iterations")
  print(f"  squared distance to A: before {float(info['distance']['initial']):.4g}, after "
        f"{float(info['distance']['final']):.4g}")
  if not with_reference:
    return
  reference, ref_time = _timed(lambda: reference_align(spec, a, b, steps=steps,
                                                       learning_rate=learning_rate))
  print(f"  numpy/scipy reference: {ref_time:.2f} s")
  print(f"  speed-up: {ref_time / ours:.1f}x")
  print(f"  squared distance to A after the reference: {_distance(spec, a, b, reference):.4g}")
  same = [np.array_equal(np.asarray(element[f]), reference[f]) for f in spec.factors]
  same += [np.array_equal(np.asarray(element[s].perm), reference[s].perm) for s in spec.attention]
  print(f"  identical permutations (residual, FFNs, heads): {sum(same)} of {len(same)}")


def planted_attention(*, layers, width, heads, head_dim, seed=1, noise=0.1):
  """(A, B = g A + noise): stacks of canonical attention layers [L, ...], float32 numpy."""
  rng = np.random.default_rng(seed)
  shapes = {"query": (width, heads, head_dim), "key": (width, heads, head_dim),
            "value": (width, heads, head_dim), "out": (heads, head_dim, width)}
  layer = lambda: {k: {"kernel": 0.02 * rng.standard_normal(s, np.float32),
                       "bias": 0.02 * rng.standard_normal(s[1:] if k != "out" else (width,),
                                                          np.float32)}
                   for k, s in shapes.items()}

  def gl():
    q = lambda: np.linalg.qr(rng.standard_normal((head_dim, head_dim)))[0]
    return np.stack([q() * np.exp(rng.uniform(-0.5, 0.5, head_dim)) @ q() for _ in range(heads)])

  a = [layer() for _ in range(layers)]
  b = []
  for x in a:
    moved = _apply_attention(x, ga.AttentionElement(rng.permutation(heads), gl(), gl()))
    b.append(jax.tree.map(lambda y: (y + noise * np.std(y) * rng.standard_normal(y.shape)).astype(
        np.float32), moved))
  stack = lambda ls: jax.tree.map(lambda *x: np.stack(x), *ls)
  return stack(a), stack(b)


def attention_only(sizes, *, steps, learning_rate, solver, with_reference=True):
  """Both stages on a stack of L attention layers: jitted against the per-head reference."""
  a, b = planted_attention(**sizes)
  layers = a["query"]["kernel"].shape[0]
  a_dev, b_dev = jax.device_put(a), jax.device_put(b)
  site = spec_lib.AttentionSite(*a["query"]["kernel"].shape[-2:])  # N heads, head dim H; GL(H)
  run = lambda: matching.match_attention(a_dev, b_dev, site, steps=steps, learning_rate=learning_rate,
                                         init="best", solver=solver)  # the reference's starts
  (element, info), first = _timed(run)
  ours = min(_timed(run)[1] for _ in range(2))
  print(f"attention matching alone ({layers} layers, both stages; {solver}: at most "
        f"{int(np.max(info['refinement_steps']))} of {steps} iterations per layer):")
  print(f"  jitted match_attention: {ours:.2f} s after compile (compile ~ {first - ours:.2f} s)")
  if not with_reference:
    return
  one = lambda tree, i: jax.tree.map(lambda x: x[i], tree)
  reference, ref_time = _timed(lambda: [
      _reference_attention(one(a, i), one(b, i), steps=steps, learning_rate=learning_rate)
      for i in range(layers)])
  ref_objective = 0.0
  for i, e in enumerate(reference):
    moved = spec_lib.flatten(_apply_attention(one(b, i), e))
    ref_objective += sum(float(np.sum((x - moved[p]) ** 2, dtype=np.float64))
                         for p, x in spec_lib.flatten(one(a, i)).items() if p != "out/bias")
  print(f"  reference: {ref_time:.2f} s; speed-up {ref_time / ours:.1f}x")
  print(f"  squared distance to A: naive {float(info['objective']['naive'].sum()):.4g}, jitted "
        f"{float(info['objective']['full'].sum()):.4g}, reference {ref_objective:.4g}; same head "
        f"permutations in {sum(np.array_equal(element.perm[i], e.perm) for i, e in enumerate(reference))}"
        f" of {layers} layers")


def attention_scaling(base, *, steps, learning_rate):
  """Jitted match_attention on layer stacks, one of N, H, L varied at a time."""
  print(f"jitted match_attention (full, {steps} steps), D = {base['width']}: time after compile "
        "(first call minus that: the compile, or ~0 where the shape was compiled before)")
  rng = np.random.default_rng(1)
  n0, h0, l0 = base["heads"], base["head_dim"], base["layers"]
  grid = [(n, h0, l0) for n in (n0 // 2, n0, 2 * n0)] + [(n0, h, l0) for h in (h0 // 2, 2 * h0)]
  grid += [(n0, h0, l) for l in (max(l0 // 4, 1), l0 // 2)]
  for n, h, layers in dict.fromkeys(grid):
    d = base["width"]
    shapes = {"query": (d, n, h), "key": (d, n, h), "value": (d, n, h), "out": (n, h, d)}
    make = lambda: {k: {"kernel": 0.02 * rng.standard_normal((layers, *s), np.float32),
                        "bias": 0.02 * rng.standard_normal((layers, *s[1:]) if k != "out"
                                                           else (layers, d), np.float32)}
                    for k, s in shapes.items()}
    a, b = jax.device_put(make()), jax.device_put(make())
    site = spec_lib.AttentionSite(n, h)
    run = lambda: matching.match_attention(a, b, site, steps=steps, learning_rate=learning_rate)
    _, first = _timed(run)
    t = min(_timed(run)[1] for _ in range(2))
    print(f"  N={n:3d} H={h:3d} L={layers:3d}: {t:6.3f} s ({first - t:5.1f} s)")


def _lap_costs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Random N(0, 1) costs, and near-permutation ones: -(P + 0.1 N(0, 1)) for a random P."""
  rng = np.random.default_rng(seed)
  near = np.zeros((n, n))
  near[np.arange(n), rng.permutation(n)] = 1.0
  return {"random": rng.normal(size=(n, n)), "near-permutation": -(near + 0.1 * rng.normal(size=(n, n)))}


def _best_time(fn, *, min_seconds: float) -> float:
  """The best of timed calls repeated until ``min_seconds`` have passed (at least one, at most
  50): a 60-ms solve timed once is at the mercy of one scheduler hiccup."""
  times = []
  while not times or (sum(times) < min_seconds and len(times) < 50):
    times.append(_timed(fn)[1])
  return min(times)


def assignment_vs_scipy(n: int, *, rounds: int = 3, min_seconds: float = 2.0):
  """linear_assignment and optax's device solver against scipy, side by side, per cost type;
  the solvers' timings interleaved over ``rounds``, so that drift hits each alike."""
  ours = jax.jit(matching.linear_assignment)
  device = jax.jit(_assignment._hungarian)  # pylint: disable=protected-access
  print(f"LAP on {n} x {n} costs (best of {rounds} interleaved rounds, each of one call or of "
        f"{min_seconds / rounds:.2g} s of calls; scipy = linear_sum_assignment on numpy):")
  for kind, cost in _lap_costs(n).items():
    cost32 = jnp.asarray(cost, jnp.float32)
    jax.block_until_ready((ours(cost32), device(cost32)))  # compiled before
    solvers = {"scipy": lambda: scipy.optimize.linear_sum_assignment(np.asarray(cost32)),
               "ours": lambda: ours(cost32), "device": lambda: device(cost32)}
    best = {name: float("inf") for name in solvers}
    for _ in range(rounds):
      for name, fn in solvers.items():
        best[name] = min(best[name], _best_time(fn, min_seconds=min_seconds / rounds))
    t_scipy, t_ours, t_device = (best[k] for k in ("scipy", "ours", "device"))
    same = np.array_equal(np.asarray(ours(cost32)),
                          scipy.optimize.linear_sum_assignment(np.asarray(cost32))[1])
    # pylint: disable-next=protected-access
    distinct = bool(_assignment._is_permutation(jnp.argmin(cost32, axis=-1)))  # then no solver
    print(f"  {kind:>16}: scipy {t_scipy:.3f} s | linear_assignment {t_ours:.3f} s "
          f"({t_ours / t_scipy:.2f}x scipy, same permutation: {same}, row minima distinct: "
          f"{distinct}) | optax Hungarian "
          f"{t_device:.3f} s ({t_device / t_scipy:.2f}x scipy)")


def _blas(library: str) -> threadpoolctl.ThreadpoolController:
  """The OpenBLAS bundled with ``library`` ("scipy" for jaxlib's LAPACK, or "numpy")."""
  controller = threadpoolctl.ThreadpoolController()
  paths = [c.filepath for c in controller.lib_controllers if f"/{library}.libs/" in c.filepath]
  return controller.select(filepath=paths)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="a small model instead of GPT-2 small")
  parser.add_argument("--steps", type=int, default=matching.DEFAULT_STEPS)
  parser.add_argument("--learning_rate", type=float, default=matching.DEFAULT_LEARNING_RATE)
  parser.add_argument("--solver", default=matching.SOLVERS[0], choices=matching.SOLVERS,
                      help="the jitted side's refinement (the reference always runs Adam)")
  parser.add_argument("--skip_scaling", action="store_true")
  parser.add_argument("--lap_only", action="store_true", help="only the LAP against scipy")
  parser.add_argument("--lap_size", type=int, default=3072)
  parser.add_argument("--skip_reference", action="store_true",
                      help="time the jitted matching alone (on an accelerator, say)")
  parser.add_argument("--reference_blas_threads", type=int, default=None,
                      help="threads of numpy's OpenBLAS for the reference (default: its own)")
  args = parser.parse_args()
  model = gpt2(**(QUICK if args.quick else GPT2_SMALL))
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {jax.device_count()} device(s)")
  _blas("scipy").limit(limits=1)
  if args.reference_blas_threads:
    _blas("numpy").limit(limits=args.reference_blas_threads)
  threads = [(i["filepath"].split("/")[-2], i["num_threads"]) for i in threadpoolctl.threadpool_info()]
  print(f"OpenBLAS threads: {threads}")
  if args.lap_only:
    assignment_vs_scipy(args.lap_size)
    return
  options = dict(steps=args.steps, learning_rate=args.learning_rate, solver=args.solver,
                 with_reference=not args.skip_reference)
  whole_model(model, **options)
  attention_only(attention_sizes(model), **options)
  if not args.skip_scaling:
    attention_scaling(attention_sizes(model), steps=args.steps, learning_rate=args.learning_rate)
  assignment_vs_scipy(args.lap_size)


if __name__ == "__main__":
  main()
