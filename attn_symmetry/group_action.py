"""Pure, jittable group actions on attention layers and whole models.

Attention (docs/symmetries.md, 'The group of one layer'). An element g = (tau, (A_k, B_k)_k) of
G = S_N x| (GL(H) x GL(H))^K (QK part in the RoPE commutant H(H) when the layer
uses RoPE) acts on a canonical attention layer (``attention.py``, the one home of its layout) by

    W^Q_n <- W^Q_{tau(n)} A_{k(n)}          b^Q likewise
    W^K_k <- W^K_{sigma(k)} A_k^{-T}        b^K likewise
    W^V_k <- W^V_{sigma(k)} B_k             b^V likewise
    W^O_n <- B_{k(n)}^{-1} W^O_{tau(n)}     b^O unchanged

where k(n) = n // G is the kv head of query head n and sigma(k) = tau(k G) // G
the kv permutation that tau induces (tau must map kv groups onto kv groups).
For plain multi-head attention K = N and G = 1. Every output of the layer is
unchanged.

Elements are ``AttentionElement(perm [..., N], qk [..., K, H, H], vo [..., K,
H, H])``; leading axes [...] act on layer-stacked leaves [..., D, N, H], so one
element of shape [L, ...] acts on an [L, ...] stack, layer by layer.

Composition follows function application:
``apply(apply(p, b), a) == apply(p, compose(a, b))``.

Whole models (docs/symmetries.md, 'Whole models') act through a ``spec.SymmetrySpec``: a
``ModelElement`` is a dict from factor name to a permutation [size] or an
orthogonal matrix [size, size], and from attention-site path to an
``AttentionElement``. A permutation factor acts on an axis by ``take``; an
orthogonal factor O maps the axis by x -> x O, which is right for weights that
write the stream (columns) and, as O^{-1} = O^T, for weights that read it
(rows). A "mean_zero_orthogonal" factor (a pre-LayerNorm stream) is an
orthogonal O with O 1 = 1, O = U diag(1, R) U^T (``mean_zero_basis``: U's first
column is 1 / sqrt(d); R in O(d - 1)); it acts like any orthogonal factor, a
LayerNorm's bias as a writer (b -> b O). Since 1^T O = 1^T, O commutes with the
centring x -> x - mean(x) 1 and keeps the norm: LayerNorm(x O) = LayerNorm(x) O,
epsilon included, once the gains are folded (``canonical_form``).

This module imports jax and numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import attention
from attn_symmetry import spec as spec_lib

Params = dict[str, Any]
ModelElement = dict[str, Any]

GROUPS = ("permutation", "orthogonal", "gl", "rope")
# Largest condition number accepted in a concrete element (float64 inverse stays accurate).
MAX_CONDITION = 1e8


class AttentionElement(NamedTuple):
  """An element of the attention group of one layer (or a stack of layers).

  Attributes:
    perm: int [..., N]; new head n is old head perm[n].
    qk: [..., K, H, H]; A_k, acting on the QK circuit of kv group k.
    vo: [..., K, H, H]; B_k, acting on the VO circuit of kv group k.
  """
  perm: jax.Array
  qk: jax.Array
  vo: jax.Array

  @property
  def num_heads(self) -> int:
    return self.perm.shape[-1]

  @property
  def num_kv_heads(self) -> int:
    return self.qk.shape[-3]

  @property
  def head_dim(self) -> int:
    return self.qk.shape[-1]

  @property
  def batch_shape(self) -> tuple[int, ...]:
    return self.perm.shape[:-1]


def _batched(fn, num_batch_dims: int):
  for _ in range(num_batch_dims):
    fn = jax.vmap(fn)
  return fn


def kv_permutation(perm: jax.Array, num_kv_heads: int) -> jax.Array:
  """sigma(k) = perm[k G] // G, the kv-head permutation induced by ``perm``; [..., K]."""
  g = perm.shape[-1] // num_kv_heads
  return perm[..., ::g] // g


# ----------------------------------------------------------------------------- construction


def identity(num_heads: int, head_dim: int, num_kv_heads: int | None = None, *,
             batch_shape: tuple[int, ...] = (), dtype: Any = None) -> AttentionElement:
  """The identity element (int32 perm), optionally stacked to ``batch_shape``."""
  k = attention.kv_heads(num_heads, num_kv_heads)
  dtype = dtype or jnp.asarray(0.0).dtype
  eye = jnp.broadcast_to(jnp.eye(head_dim, dtype=dtype), (*batch_shape, k, head_dim, head_dim))
  perm = jnp.broadcast_to(jnp.arange(num_heads, dtype=jnp.int32), (*batch_shape, num_heads))
  return AttentionElement(perm, eye, eye)


def rope_commutant(ab: jax.Array, rest: jax.Array | None,
                   site: spec_lib.AttentionSite) -> jax.Array:
  """An element of H(H), the matrices that commute with every RoPE rotation R_k.

  On pair p = (i, j) of ``site.rope_pairs()`` the matrix is the 2x2 block
  [[a_p, b_p], [-b_p, a_p]] (rows i, j; columns i, j): acting on row vectors
  (x_i, x_j) -> (x_i, x_j) C, it is multiplication of x_i + i x_j by the
  complex number a_p + i b_p; on the unrotated dims (partial rotary) it is
  the free block ``rest``.

  Args:
    ab: [..., P, 2] the (a_p, b_p) of every pair.
    rest: [..., H - r, H - r] block on the unrotated dims, or None when r = H.
    site: the layer (its head dim H and RoPE layout).

  Returns:
    [..., H, H] matrix C with R_k C = C R_k for every k.
  """
  head_dim = spec_lib.check_site(site).head_dim
  lead = ab.shape[:-2]
  parts = [ab[..., 0], ab[..., 1], -ab[..., 1]]
  if head_dim > site.rotary_dims():
    if rest is None:
      raise ValueError(f"partial rotary leaves {head_dim - site.rotary_dims()} dims unrotated; "
                       "pass `rest`")
    parts.append(jnp.broadcast_to(rest, (*lead, *rest.shape[-2:])).reshape(*lead, -1))
  parts.append(jnp.zeros((*lead, 1), ab.dtype))
  return jnp.concatenate(parts, axis=-1)[..., _commutant_index(site)]


@functools.lru_cache(maxsize=None)
def _commutant_index(site: spec_lib.AttentionSite) -> np.ndarray:
  """[H, H] index into (a_0..a_P-1, b_0..b_P-1, -b_0..-b_P-1, rest row by row, 0) that
  ``rope_commutant`` reads each entry from: one gather, no scatter to compile."""
  pairs = site.rope_pairs()
  num_pairs, (i, j) = len(pairs), pairs.T
  unrotated = site.unrotated_dims()
  index = np.full((site.head_dim, site.head_dim), 3 * num_pairs + len(unrotated) ** 2, np.int32)
  p = np.arange(num_pairs)
  index[i, i] = index[j, j] = p
  index[i, j], index[j, i] = num_pairs + p, 2 * num_pairs + p
  index[unrotated[:, None], unrotated[None, :]] = (
      3 * num_pairs + np.arange(len(unrotated) ** 2).reshape(len(unrotated), len(unrotated)))
  return index


def _random_orthogonal(key, shape, n, dtype):
  q, r = jnp.linalg.qr(jax.random.normal(key, (*shape, n, n), dtype))
  return q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[..., None, :]


def mean_zero_basis(n: int, dtype: Any = None) -> jax.Array:
  """U [n, n]: an orthogonal matrix whose first column is 1 / sqrt(n), its other columns a
  basis of 1-perp (the Householder reflection that maps e_1 to 1 / sqrt(n); symmetric).

  An orthogonal O fixes 1 exactly when O = U diag(1, R) U^T with R in O(n - 1).
  """
  v = -np.full(n, 1 / np.sqrt(n))
  v[0] += 1.0
  norm = v @ v
  u = np.eye(n) - (2 / norm) * np.outer(v, v) if norm > 0 else np.eye(n)
  return jnp.asarray(u, dtype or jnp.asarray(0.0).dtype)


def mean_zero_orthogonal(r: jax.Array) -> jax.Array:
  """U diag(1, R) U^T [..., n, n] (``mean_zero_basis``), the orthogonal map that fixes 1 and
  acts as R [..., n - 1, n - 1] on 1-perp in U's basis (batched over the leading axes).

  Computed as I + U_perp (R - I) U_perp^T (U_perp = U[:, 1:]; equal, as U U^T = I), so that
  R = I gives I exactly."""
  n = r.shape[-1] + 1
  perp = mean_zero_basis(n, r.dtype)[:, 1:]
  matmul = lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST)
  eye = jnp.eye(n - 1, dtype=r.dtype)
  return jnp.eye(n, dtype=r.dtype) + matmul(matmul(perp, r - eye), perp.T)


def _random_gl(key, shape, n, dtype):
  """U diag(s) V^T with s in [e^-0.5, e^0.5]: random and condition number <= e."""
  ku, kv, ks = jax.random.split(key, 3)
  s = jnp.exp(jax.random.uniform(ks, (*shape, n), dtype, -0.5, 0.5))
  return (_random_orthogonal(ku, shape, n, dtype) * s[..., None, :]) @ jnp.swapaxes(
      _random_orthogonal(kv, shape, n, dtype), -1, -2)


def _random_rope(key, shape, site, dtype):
  head_dim, r = site.head_dim, site.rotary_dims()
  k_mod, k_ang, k_rest = jax.random.split(key, 3)
  modulus = jnp.exp(jax.random.uniform(k_mod, (*shape, r // 2), dtype, -0.5, 0.5))
  angle = jax.random.uniform(k_ang, (*shape, r // 2), dtype, -np.pi, np.pi)
  ab = jnp.stack([modulus * jnp.cos(angle), modulus * jnp.sin(angle)], axis=-1)
  rest = _random_gl(k_rest, shape, head_dim - r, dtype) if r < head_dim else None
  return rope_commutant(ab, rest, site)


def random_element(key: jax.Array, site: spec_lib.AttentionSite, *, group: str | None = None,
                   batch_shape: tuple[int, ...] = (), dtype: Any = None) -> AttentionElement:
  """A random group element.

  Args:
    key: PRNG key.
    site: the layer (``spec.AttentionSite``: heads, head dim, kv heads, group
      and RoPE layout).
    group: the subgroup drawn from, ``site.group`` by default: "permutation"
      (A = B = I), "orthogonal" (A, B orthogonal), "gl" (A, B in GL(H),
      condition number <= e) or "rope" (A in H(H) for the site's RoPE layout,
      moduli in [e^-0.5, e^0.5]; B in GL(H)).
    batch_shape: leading shape, e.g. (L,) for a layer stack.
    dtype: float dtype of the matrices (default: JAX's default float).

  Returns:
    An ``AttentionElement``; the head permutation is uniform over those that
    map kv groups onto kv groups.

  Raises:
    TypeError: ``site`` is not an ``AttentionSite``.
    ValueError: an unknown group, or group "rope" with a layout that does not
      fit the head dim.
  """
  spec_lib.check_site(site)
  group = site.group if group is None else group
  if group not in GROUPS:
    raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
  if group == "rope":  # validate the layout before drawing anything
    site.rotary_dims()
  num_heads, head_dim, k = site.num_heads, site.head_dim, site.kv_heads
  dtype = dtype or jnp.asarray(0.0).dtype
  g = num_heads // k
  k_kv, k_in, k_qk, k_vo = jax.random.split(key, 4)
  kv = jnp.argsort(jax.random.uniform(k_kv, (*batch_shape, k)), axis=-1)
  inner = jnp.argsort(jax.random.uniform(k_in, (*batch_shape, k, g)), axis=-1)
  perm = (kv[..., :, None] * g + inner).reshape(*batch_shape, num_heads)
  shape = (*batch_shape, k)
  if group == "permutation":
    eye = jnp.broadcast_to(jnp.eye(head_dim, dtype=dtype), (*shape, head_dim, head_dim))
    return AttentionElement(perm, eye, eye)
  if group == "orthogonal":
    return AttentionElement(perm, _random_orthogonal(k_qk, shape, head_dim, dtype),
                            _random_orthogonal(k_vo, shape, head_dim, dtype))
  vo = _random_gl(k_vo, shape, head_dim, dtype)
  if group == "gl":
    return AttentionElement(perm, _random_gl(k_qk, shape, head_dim, dtype), vo)
  return AttentionElement(perm, _random_rope(k_qk, shape, site, dtype), vo)


# ----------------------------------------------------------------------------- validation


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_element(element: AttentionElement, *, name: str = "element") -> None:
  """Raises ValueError naming the field if ``element`` is malformed.

  Shapes are always checked. Values (``perm`` a permutation that maps kv
  groups onto kv groups; ``qk`` and ``vo`` finite and invertible, condition
  number <= MAX_CONDITION) are checked when they are concrete, i.e. outside jit.
  """
  perm, qk, vo = element
  if perm.ndim < 1 or qk.ndim != perm.ndim + 2 or vo.shape != qk.shape:
    raise ValueError(f"{name}: inconsistent shapes perm {perm.shape}, qk {qk.shape}, vo {vo.shape}; "
                     "expected perm [..., N], qk and vo [..., K, H, H]")
  if qk.shape[:-3] != perm.shape[:-1] or qk.shape[-1] != qk.shape[-2]:
    raise ValueError(f"{name}: qk {qk.shape} does not match perm {perm.shape}")
  n, k = perm.shape[-1], qk.shape[-3]
  if n % k:
    raise ValueError(f"{name}.perm: {n} heads cannot be split into {k} kv groups")
  if _is_concrete(perm):
    p = np.asarray(perm).reshape(-1, n)
    if not np.issubdtype(p.dtype, np.integer):
      raise ValueError(f"{name}.perm must be an integer array, got dtype {p.dtype}")
    if not (np.sort(p, axis=-1) == np.arange(n)).all():
      raise ValueError(f"{name}.perm is not a permutation of 0..{n - 1}: {p.tolist()}")
    g = n // k
    groups = (p // g).reshape(-1, k, g)
    if not (groups == groups[..., :1]).all():
      raise ValueError(f"{name}.perm breaks kv groups (query heads sharing a kv head, "
                       f"G = {g}, must move together): {p.tolist()}")
  for field, m in (("qk", qk), ("vo", vo)):
    if _is_concrete(m):
      m = np.asarray(m, np.float64)
      if not np.isfinite(m).all():
        raise ValueError(f"{name}.{field} has non-finite entries")
      cond = np.linalg.cond(m.reshape(-1, *m.shape[-2:]))
      if not (cond <= MAX_CONDITION).all():
        raise ValueError(f"{name}.{field} is singular or near-singular (largest condition number "
                         f"{np.max(cond):.3g} > {MAX_CONDITION:.0e})")


def _check_layer(params: Params, element: AttentionElement) -> None:
  lead, d, n, k, h = attention.layer_shapes(params)
  want = (element.batch_shape, element.num_heads, element.num_kv_heads, element.head_dim)
  if (lead, n, k, h) != want:
    expected = attention.leaf_shapes(d, *want[1:], lead=want[0])
    path = next(p for p in ("query/kernel", "key/kernel", "value/kernel")
                if tuple(spec_lib.subtree(params, p).shape) != expected[p])
    raise ValueError(f"attention params: {path} has shape {tuple(spec_lib.subtree(params, path).shape)}"
                     f", expected {expected[path]} for element with batch {want[0]}, N={want[1]}, "
                     f"K={want[2]}, H={want[3]}")


# ----------------------------------------------------------------------------- attention action


def _apply_one(params: Params, e: AttentionElement) -> Params:
  k = e.qk.shape[0]
  g = e.perm.shape[0] // k
  sigma = kv_permutation(e.perm, k)
  a, b = e.qk, e.vo
  # One batched inverse: two independent LAPACK calls that XLA runs side by side can deadlock
  # jaxlib 0.10 on a CPU with few cores (its kernels wait on the pool they run on).
  a_inv, b_inv = jnp.linalg.inv(jnp.stack([a, b]))
  a_q, b_inv_q = jnp.repeat(a, g, axis=0), jnp.repeat(b_inv, g, axis=0)  # per query head
  maps = {  # leaf -> (head permutation, head axis, einsum applying the matrix)
      "query/kernel": (e.perm, 1, "dnh,nhi->dni", a_q),
      "query/bias": (e.perm, 0, "nh,nhi->ni", a_q),
      "key/kernel": (sigma, 1, "dkh,kih->dki", a_inv),  # W A^{-T}
      "key/bias": (sigma, 0, "kh,kih->ki", a_inv),
      "value/kernel": (sigma, 1, "dkh,khi->dki", b),
      "value/bias": (sigma, 0, "kh,khi->ki", b),
      "out/kernel": (e.perm, 0, "nhd,nih->nid", b_inv_q),  # B^{-1} W^O
  }
  out = {}
  for path, leaf in spec_lib.flatten(params).items():
    if path in maps:
      perm, axis, eq, mat = maps[path]
      # In the wider of the two dtypes, rounded once: a float32 element on bfloat16 leaves.
      leaf = jnp.einsum(eq, jnp.take(leaf, perm, axis=axis), mat).astype(leaf.dtype)
    out[path] = leaf
  return spec_lib.unflatten(out)


def apply(params: Params, element: AttentionElement) -> Params:
  """g . params for one canonical attention layer or a stack of them.

  Args:
    params: canonical attention parameters (biases optional); leaves carry the
      element's batch shape in front, e.g. query/kernel [L, D, N, H].
    element: an ``AttentionElement`` with perm [..., N].

  Returns:
    Transformed parameters, same structure, shapes and dtypes (each leaf is
    computed in the wider of its dtype and the element's, then cast back, so
    a float32 element acts on bfloat16 leaves with one rounding).

  Raises:
    ValueError: naming the leaf or field, on mismatched shapes, a ``perm``
      that is not a permutation or breaks kv groups, or a singular matrix.
  """
  check_element(element)
  _check_layer(params, element)
  return _batched(_apply_one, len(element.batch_shape))(params, element)


def _compose_one(a: AttentionElement, b: AttentionElement) -> AttentionElement:
  sigma_a = kv_permutation(a.perm, a.qk.shape[0])
  return AttentionElement(b.perm[a.perm], b.qk[sigma_a] @ a.qk, b.vo[sigma_a] @ a.vo)


def compose(a: AttentionElement, b: AttentionElement) -> AttentionElement:
  """a o b: ``apply(apply(p, b), a) == apply(p, compose(a, b))``."""
  check_element(a, name="a")
  check_element(b, name="b")
  if a.qk.shape != b.qk.shape or a.perm.shape != b.perm.shape:
    raise ValueError(f"cannot compose elements of shapes {a.qk.shape} and {b.qk.shape}")
  return _batched(_compose_one, len(a.batch_shape))(a, b)


def _inverse_one(e: AttentionElement) -> AttentionElement:
  sigma_inv = jnp.argsort(kv_permutation(e.perm, e.qk.shape[0]))
  return AttentionElement(jnp.argsort(e.perm), jnp.linalg.inv(e.qk[sigma_inv]),
                          jnp.linalg.inv(e.vo[sigma_inv]))


def inverse(element: AttentionElement) -> AttentionElement:
  """g^{-1}, with ``apply(apply(p, g), inverse(g)) == p``."""
  check_element(element)
  return _batched(_inverse_one, len(element.batch_shape))(element)


# ----------------------------------------------------------------------------- whole models


def _act_on_axis(leaf: jax.Array, axis: int, value: jax.Array, kind: str) -> jax.Array:
  if kind == "permutation":
    return jnp.take(leaf, value, axis=axis)
  return jnp.moveaxis(jnp.tensordot(leaf, value, axes=(axis, 0)), -1, axis).astype(leaf.dtype)


def apply_leaf(spec: spec_lib.SymmetrySpec, path: str, leaf: jax.Array, element: ModelElement, *,
               skip_axis: int | None = None) -> jax.Array:
  """One leaf of a model under the factors of ``element`` (attention sites act through ``apply``).

  Every axis of ``leaf`` that ``spec.axes[path]`` maps with a factor is mapped
  by it (a permutation by ``take``, an orthogonal O by x -> x O), except
  ``skip_axis``. An orthogonal factor leaves a norm scale of
  ``spec.norm_scales`` as it is, which is right for folded (all-ones) scales
  only; a concrete scale that is not all ones raises (``fold_norm_scales``).
  No checks of shapes or of the element (``apply_model`` makes them); jittable.

  Args:
    spec: the model's spec.
    path: the leaf's path, a key of ``spec.axes``.
    leaf: its value, [...] with one axis per entry of ``spec.axes[path]``.
    element: a model element (its factors are read).
    skip_axis: an axis left unmapped (matching scores one factor with the
      others applied).

  Returns:
    The mapped leaf, same shape; an orthogonal map keeps the leaf's dtype.
  """
  for axis, f in enumerate(spec.axes[path]):
    if f is None or axis == skip_axis:
      continue
    factor = spec.factors[f]
    if factor.is_matrix and path in spec.norm_scales:
      _check_folded(path, leaf)  # ones commute with O: left as they are
      continue
    leaf = _act_on_axis(leaf, axis, element[f], factor.kind)
  return leaf


def check_model_element(spec: spec_lib.SymmetrySpec, element: Mapping[str, Any]) -> None:
  """Raises ValueError, naming the factor or site, unless ``element`` is an element of the
  group that ``spec`` describes: one entry per factor and attention site, of their shapes;
  outside jit, permutations that are permutations, orthogonal factors that are orthogonal
  and mean-zero orthogonal ones that also map 1 to 1 (to 1e-5)."""
  expected = set(spec.factors) | set(spec.attention)
  if set(element) != expected:
    raise ValueError(f"model element keys {sorted(element)} differ from the spec's factors and "
                     f"attention sites {sorted(expected)}")
  for name, factor in spec.factors.items():
    v = element[name]
    want = (factor.size,) if factor.kind == "permutation" else (factor.size, factor.size)
    if tuple(v.shape) != want:
      raise ValueError(f"element[{name!r}] has shape {tuple(v.shape)}, expected {want} "
                       f"for a {factor.kind} factor")
    if _is_concrete(v):
      v = np.asarray(v)
      if factor.kind == "permutation" and not (np.sort(v) == np.arange(factor.size)).all():
        raise ValueError(f"element[{name!r}] is not a permutation of 0..{factor.size - 1}")
      if factor.is_matrix and not np.allclose(v.T @ v, np.eye(factor.size), atol=1e-5):
        raise ValueError(f"element[{name!r}] is not orthogonal")
      if factor.kind == "mean_zero_orthogonal" and not np.allclose(v.sum(-1), 1, atol=1e-5):
        raise ValueError(f"element[{name!r}] does not map the all-ones vector to itself "
                         "(a mean_zero_orthogonal factor is U diag(1, R) U^T)")
  for name, site in spec.attention.items():
    e = element[name]
    check_element(e, name=f"element[{name!r}]")
    if (e.num_heads, e.num_kv_heads, e.head_dim) != (site.num_heads, site.kv_heads, site.head_dim):
      raise ValueError(f"element[{name!r}] has N={e.num_heads}, K={e.num_kv_heads}, H={e.head_dim}; "
                       f"the spec's site has N={site.num_heads}, K={site.kv_heads}, H={site.head_dim}")


def _check_folded(path: str, scale: jax.Array) -> None:
  if _is_concrete(scale) and not np.all(np.asarray(scale) == 1):
    raise ValueError(f"{path} is a norm scale on an orthogonally mapped axis; an elementwise "
                     "scale does not commute with an orthogonal map: call fold_norm_scales first")


def apply_model(spec: spec_lib.SymmetrySpec, params: Params, element: ModelElement, *,
                check_element: bool = True) -> Params:
  """g . params for a whole model described by ``spec``.

  Every leaf keeps its dtype. bfloat16 and float16 leaves are transformed in
  float32 (the dtype of the elements that matching returns for them) and
  rounded once at the end, whatever number of factors act on them.

  Raises:
    ValueError: if params or element do not fit the spec (naming the leaf or
      factor), or if an orthogonal factor meets a norm scale that is not all
      ones (fold the scales first with ``fold_norm_scales``; folded scales are
      left as they are, which is only checked outside jit). ``check_element=False`` skips
      ``check_model_element``, for a caller that applies one element part by part and checked
      it once (a d x d orthogonal factor's check costs O(d^3)).
  """
  spec.check(params)
  if check_element:
    check_model_element(spec, element)
  dtypes = {p: x.dtype for p, x in spec_lib.flatten(params).items()}
  wide = lambda d: jnp.promote_types(d, jnp.float32) if jnp.issubdtype(d, jnp.floating) else d
  flat = {p: apply_leaf(spec, p, x.astype(wide(x.dtype)), element)
          for p, x in spec_lib.flatten(params).items()}
  out = spec_lib.unflatten(flat)
  for site in spec.attention:
    node = out
    *parents, last = site.split("/")
    for p in parents:
      node = node[p]
    node[last] = apply(node[last], element[site])
  return jax.tree.map(lambda x, d: x.astype(d), out, spec_lib.unflatten(dtypes))


def identity_model(spec: spec_lib.SymmetrySpec, dtype: Any = None) -> ModelElement:
  """The identity element of a model's group: int32 permutations (as matching returns),
  matrices in ``dtype`` (default: JAX's default float)."""
  dtype = dtype or jnp.asarray(0.0).dtype
  out: ModelElement = {}
  for name, f in spec.factors.items():
    out[name] = (jnp.arange(f.size, dtype=jnp.int32) if f.kind == "permutation"
                 else jnp.eye(f.size, dtype=dtype))
  for name, site in spec.attention.items():
    out[name] = identity(site.num_heads, site.head_dim, site.num_kv_heads, dtype=dtype)
  return out


def random_model_element(key: jax.Array, spec: spec_lib.SymmetrySpec, *,
                         attention_group: str | None = None, dtype: Any = None) -> ModelElement:
  """A random element of a model's group.

  Permutation factors get a uniform permutation, orthogonal factors a Haar
  orthogonal matrix, mean-zero orthogonal factors U diag(1, R) U^T with R Haar
  in O(size - 1) (``mean_zero_orthogonal``), each attention site an element of its own group
  (``site.group``), or of ``attention_group`` when given (e.g. "gl" on a RoPE
  model, to see that it is not a symmetry).
  """
  dtype = dtype or jnp.asarray(0.0).dtype
  out: ModelElement = {}
  for i, (name, f) in enumerate(sorted(spec.factors.items())):
    k = jax.random.fold_in(key, i)
    if f.kind == "permutation":
      out[name] = jax.random.permutation(k, f.size)
    elif f.kind == "orthogonal":
      out[name] = _random_orthogonal(k, (), f.size, dtype)
    else:
      out[name] = mean_zero_orthogonal(_random_orthogonal(k, (), f.size - 1, dtype))
  for i, (name, site) in enumerate(sorted(spec.attention.items())):
    k = jax.random.fold_in(key, len(spec.factors) + i)
    out[name] = random_element(k, site, group=attention_group, dtype=dtype)
  return out


def compose_model(spec: spec_lib.SymmetrySpec, a: ModelElement, b: ModelElement) -> ModelElement:
  """a o b for whole-model elements: ``apply_model(s, apply_model(s, p, b), a)`` equals
  ``apply_model(s, p, compose_model(s, a, b))``."""
  check_model_element(spec, a)
  check_model_element(spec, b)
  out: ModelElement = {}
  for name, f in spec.factors.items():
    out[name] = b[name][a[name]] if f.kind == "permutation" else b[name] @ a[name]
  for name in spec.attention:
    out[name] = compose(a[name], b[name])
  return out


def inverse_model(spec: spec_lib.SymmetrySpec, element: ModelElement) -> ModelElement:
  """g^{-1} for a whole-model element."""
  check_model_element(spec, element)
  out: ModelElement = {}
  for name, f in spec.factors.items():
    v = element[name]
    out[name] = jnp.argsort(v) if f.kind == "permutation" else v.T
  for name in spec.attention:
    out[name] = inverse(element[name])
  return out


def fold_norm_scales(spec: spec_lib.SymmetrySpec, params: Params) -> Params:
  """Moves every norm scale of ``spec.norm_scales`` into the leaves that read it.

  A norm y = n(x) * s followed by a reader W (acting on y's axis) equals
  n(x) (diag(s) W): the reader's residual axis is multiplied by s and s is set
  to ones. The function is unchanged, and afterwards an orthogonal residual
  map is a symmetry of an RMSNorm model (Theus et al. 2025). Each reader's
  scaled axis is the one the spec maps with the scale's factor.
  """
  spec.check(params)
  flat = spec_lib.flatten(params)
  for scale_path, readers in spec.norm_scales.items():
    (factor,) = spec.axes[scale_path]
    s = flat[scale_path]
    for reader in readers:
      axes = spec.axes[reader]
      if axes.count(factor) != 1:
        raise ValueError(f"norm reader {reader} must have exactly one axis mapped by {factor!r}, "
                         f"has axes {axes}")
      axis = axes.index(factor)
      shape = [1] * len(axes)
      shape[axis] = s.shape[0]
      flat[reader] = flat[reader] * s.reshape(shape)
    flat[scale_path] = jnp.ones_like(s)
  return spec_lib.unflatten(flat)


def _check_gains(path: str, scale: jax.Array) -> None:
  if _is_concrete(scale) and np.any(np.asarray(scale) == 0):
    raise ValueError(f"{path} has a zero gain: a LayerNorm coordinate with gain 0 outputs its "
                     "bias alone, which no bias of a gain-1 norm reproduces; canonical_form "
                     "cannot fold it")


def canonical_form(spec: spec_lib.SymmetrySpec, params: Params) -> Params:
  """``params`` with the gauges of every matrix factor brought to one form ("one gauge").

  The function is unchanged, and afterwards every orthogonal and mean-zero orthogonal factor of
  ``spec`` is an exact symmetry (``apply_model``), so two models in this form can be compared
  and matched:

  * every norm scale of ``spec.norm_scales`` is folded into its readers
    (``fold_norm_scales``; an RMSNorm model's whole gauge);
  * for each "mean_zero_orthogonal" factor, with its ``spec.LayerNormStream``:
    - writers' means: each vector a writer adds to the stream is replaced by its projection
      onto 1-perp, v -> v - mean(v) 1 along the factor's axis. LayerNorm drops the stream's
      component along 1 and nothing reads the stream but LayerNorms, so no value read
      changes, and the stream is mean-zero everywhere;
    - gains: gamma * xhat + beta = (xhat + beta / gamma) * gamma; the bias becomes
      beta / gamma and gamma moves into the readers (W -> diag(gamma) W), gain 1.

  Idempotent; jittable (a zero gain, which cannot be folded, raises outside jit and gives
  non-finite biases under it).

  Args:
    spec: the model's spec (``SymmetrySpec.with_residual`` for a LayerNorm stream).
    params: parameters that fit it.

  Returns:
    The parameters in canonical form, same structure, shapes and dtypes.

  Raises:
    ValueError: if params do not fit the spec, or (concrete) a LayerNorm gain is zero.
  """
  spec.check(params)
  flat = spec_lib.flatten(params)
  for name, stream in spec.streams.items():
    if spec.factors[name].kind != "mean_zero_orthogonal":
      continue
    for path in stream.writers:
      axis = spec.axes[path].index(name)
      flat[path] = flat[path] - jnp.mean(flat[path], axis=axis, keepdims=True)
    for scale, (bias, _) in stream.norms.items():
      _check_gains(scale, flat[scale])
      flat[bias] = flat[bias] / flat[scale]
  return fold_norm_scales(spec, spec_lib.unflatten(flat))
