"""Symmetry specs: which group factor acts on which axis of which parameter.

A spec is plain data, separate from the code that applies or solves for a
group element (git-re-basin's ``PermutationSpec``, generalised):

* ``factors``: named factors that act on one axis of some leaves, each a
  permutation of ``size`` coordinates (FFN hidden units, the residual stream of
  a LayerNorm model), an orthogonal map (the residual stream of an RMSNorm
  model) or an orthogonal map Q that fixes the all-ones vector, Q 1 = 1
  ("mean_zero_orthogonal": the residual stream of a pre-LayerNorm model, which
  acts as O(d - 1) on the mean-zero subspace 1-perp; docs/symmetries.md, 'Whole models').
* ``axes``: for every leaf path ("layers_0/mlp/wi/kernel"), a tuple with one
  entry per array axis, the factor acting on that axis or None. Every leaf of
  the parameter tree is listed, so that a forgotten leaf is an error rather
  than a silent break of the symmetry.
* ``attention``: subtree paths ("layers_0/attention") of canonical attention
  layers (``attention.py``), each with the per-head group of
  docs/symmetries.md (head permutation, QK matrix in GL(H) or the RoPE commutant
  H(H), VO matrix in GL(H)). The head and head-dim axes of those leaves are
  tied together, which one-axis factors cannot express.
* ``norm_scales``: norm scale leaves and the leaves that read the normalised
  stream, so that ``fold_norm_scales`` can move the scales into the readers
  (needed before an orthogonal residual map, which does not commute with an
  elementwise scale).
* ``streams``: for a residual factor of a pre-LayerNorm model, the stream's
  ``LayerNormStream`` (its writers, and each LayerNorm's bias and readers), the
  data that ``with_residual`` turns a permutation factor into a
  "mean_zero_orthogonal" one with, and that ``group_action.canonical_form``
  reads to bring the two gauges of such a stream to one form.
* ``writers``: for each part of a layer that writes the residual stream (an
  attention site, an FFN factor), the (kernel, bias or None) leaves of the dense
  projection that writes it there (the attention's output projection, the FFN's
  down projection), into which REPAIR folds its corrections (``repair.py``).

Paths are "/"-joined keys of the nested parameter dict.

A model's activations (``matching.ACTIVATION_KEYS``) are keyed by the spec's
names: a factor or site ``name`` itself, or ``tap(name, tag)``, "name:tag";
an attention site's tags are ``SITE_TAPS``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attn_symmetry import attention

FACTOR_KINDS = ("permutation", "orthogonal", "mean_zero_orthogonal")
# The kinds whose elements are [size, size] orthogonal matrices acting by x -> x O.
MATRIX_KINDS = ("orthogonal", "mean_zero_orthogonal")
ATTENTION_GROUPS = ("gl", "rope")
TAP_SEPARATOR = ":"
SITE_TAPS = attention.HeadActivations._fields  # ("q", "k", "v", "heads")


def tap(name: str, tag: str) -> str:
  """The activation key of factor or attention site ``name`` at ``tag``: "name:tag"
  ("residual:layers_0", "layers_0/attention:q"); the one place the two are joined."""
  return f"{name}{TAP_SEPARATOR}{tag}"


def is_key_of(key: str, name: str) -> bool:
  """Whether activation key ``key`` belongs to factor or site ``name``: it is ``name`` itself
  or ``tap(name, tag)`` for some tag."""
  return key == name or key.startswith(tap(name, ""))


@dataclasses.dataclass(frozen=True)
class Factor:
  """A group factor acting on one axis of length ``size``."""
  size: int
  kind: str = "permutation"

  def __post_init__(self):
    if self.kind not in FACTOR_KINDS:
      raise ValueError(f"Factor kind must be one of {FACTOR_KINDS}, got {self.kind!r}")

  @property
  def is_matrix(self) -> bool:
    """Whether an element of this factor is a [size, size] orthogonal matrix (``MATRIX_KINDS``)."""
    return self.kind in MATRIX_KINDS


@dataclasses.dataclass(frozen=True)
class LayerNormStream:
  """A residual stream that is read through LayerNorms only (a pre-LayerNorm model with an
  untied head), which therefore has the symmetry O(d - 1) on 1-perp (docs/symmetries.md).

  Attributes:
    writers: the leaves that add to the stream (token, position and patch embeddings, a CLS
      token, attention output and FFN down projections and their biases); the gauge
      projects their stream axis onto 1-perp.
    norms: each LayerNorm scale path -> (its bias path, the leaves that read its output).
  """
  writers: tuple[str, ...]
  norms: Mapping[str, tuple[str, tuple[str, ...]]]

  def leaves(self) -> tuple[str, ...]:
    """Every leaf the stream's data names."""
    return (*self.writers, *(p for s, (b, r) in self.norms.items() for p in (s, b, *r)))

  def part(self, paths) -> "LayerNormStream":
    """The stream's data on the leaves ``paths`` alone."""
    return LayerNormStream(tuple(p for p in self.writers if p in paths),
                           {s: (b, tuple(r for r in readers if r in paths))
                            for s, (b, readers) in self.norms.items()
                            if s in paths and b in paths})


@dataclasses.dataclass(frozen=True)
class AttentionSite:
  """The per-head symmetry of one canonical attention layer: its shape and RoPE layout.

  The one object that carries a layer's group through the library: the
  spec's ``attention`` entries, ``group_action.random_element`` and
  ``rope_commutant``, ``matching.match_attention`` and the matching stages
  all take it whole (docs/symmetries.md, 'The group of one layer').

  Attributes:
    num_heads: N query heads.
    head_dim: H.
    num_kv_heads: K kv heads (None: K = N, plain multi-head attention).
    group: "gl" (no or absolute position encoding: QK and VO in GL(H)) or
      "rope" (QK in the commutant H(H) of the rotations for this layout, VO
      in GL(H)).
    rope_pairing, rotary_fraction, rope_axes: the RoPE layout
      (``attention.rope_pairs``); read for group "rope" and checked then.
  """
  num_heads: int
  head_dim: int
  num_kv_heads: int | None = None
  group: str = "gl"
  rope_pairing: str = "half"
  rotary_fraction: float = 1.0
  rope_axes: int = 1

  def __post_init__(self):
    if self.group not in ATTENTION_GROUPS:
      raise ValueError(f"AttentionSite group must be one of {ATTENTION_GROUPS}, got {self.group!r}")
    if self.num_heads % self.kv_heads:
      raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}")
    if self.group == "rope":
      self.rope_pairs()  # the layout fits the head dim (ValueError naming the field otherwise)

  @property
  def kv_heads(self) -> int:
    return attention.kv_heads(self.num_heads, self.num_kv_heads)

  def rotary_dims(self) -> int:
    """r, the rotated coordinates of a head (``attention.rotary_dims``)."""
    return attention.rotary_dims(self.head_dim, self.rotary_fraction, self.rope_axes)

  def rope_pairs(self) -> Any:
    """[r / 2, 2] coordinate pairs RoPE rotates together (``attention.rope_pairs``)."""
    return attention.rope_pairs(self.head_dim, pairing=self.rope_pairing,
                                rotary_fraction=self.rotary_fraction, rope_axes=self.rope_axes)

  def unrotated_dims(self) -> Any:
    """[H - r] int32 coordinates RoPE leaves alone (``attention.unrotated_dims``)."""
    return attention.unrotated_dims(self.head_dim, self.rope_pairs())


def check_site(site: Any, name: str = "site") -> AttentionSite:
  """``site`` if it is an ``AttentionSite``; TypeError saying what to pass otherwise."""
  if not isinstance(site, AttentionSite):
    raise TypeError(f"{name} must be a spec.AttentionSite (the layer's heads, head dim, kv heads, "
                    f"group and RoPE layout), got {type(site).__name__}: e.g. "
                    f"AttentionSite(num_heads=4, head_dim=16, group='rope')")
  return site


@dataclasses.dataclass(frozen=True)
class SymmetrySpec:
  """Where every group factor of a model acts (module docstring)."""
  factors: Mapping[str, Factor]
  axes: Mapping[str, tuple[str | None, ...]]
  attention: Mapping[str, AttentionSite] = dataclasses.field(default_factory=dict)
  norm_scales: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  writers: Mapping[str, tuple[str, str | None]] = dataclasses.field(default_factory=dict)
  streams: Mapping[str, LayerNormStream] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    for path, axes in self.axes.items():
      for f in axes:
        if f is not None and f not in self.factors:
          raise ValueError(f"spec axes of {path!r} name unknown factor {f!r}")
    for name in self.attention:
      if name in self.factors:
        raise ValueError(f"{name!r} is both a factor and an attention site")
    for scale, readers in self.norm_scales.items():
      for p in (scale, *readers):
        if p not in self.axes:
          raise ValueError(f"norm_scales entry {scale!r} names {p!r}, which is not in the spec's axes")
    for name, leaves in self.writers.items():
      if name not in self.factors and name not in self.attention:
        raise ValueError(f"writers entry {name!r} is neither a factor nor an attention site")
      for p in leaves:
        if p is not None and p not in self.axes:
          raise ValueError(f"writers entry {name!r} names {p!r}, which is not in the spec's axes")
    for name, stream in self.streams.items():
      if name not in self.factors:
        raise ValueError(f"streams entry {name!r} is not a factor")
      for p in stream.leaves():
        if p not in self.axes:
          raise ValueError(f"streams entry {name!r} names {p!r}, which is not in the spec's axes")
    for name, factor in self.factors.items():
      if factor.kind == "mean_zero_orthogonal" and name not in self.streams:
        raise ValueError(f"factor {name!r} is mean_zero_orthogonal but the spec has no "
                         "LayerNormStream for it (streams)")

  def with_residual(self, name: str, kind: str) -> "SymmetrySpec":
    """The same spec with factor ``name`` of ``kind``, "permutation" or "mean_zero_orthogonal".

    A "mean_zero_orthogonal" factor needs the stream's ``LayerNormStream`` in ``streams``
    (a pre-LayerNorm model with an untied head: ``models.untie_head`` unties a tied one);
    its LayerNorm scales are listed in ``norm_scales`` with their readers, to be folded
    (``group_action.canonical_form``). "permutation" drops them again.

    Raises:
      ValueError: naming the factor, if it is unknown or has no ``LayerNormStream``, or the
        kind is neither of the two.
    """
    if name not in self.factors:
      raise ValueError(f"unknown factor {name!r}")
    if kind not in ("permutation", "mean_zero_orthogonal"):
      raise ValueError(f"with_residual takes kind 'permutation' or 'mean_zero_orthogonal', "
                       f"got {kind!r}")
    if name not in self.streams:
      raise ValueError(f"factor {name!r} is no stream read through LayerNorms only (no "
                       "LayerNormStream: an RMSNorm or post-LayerNorm model, or a head tied to "
                       "the embedding, which must be untied first)")
    norms = self.streams[name].norms
    scales = {s: v for s, v in self.norm_scales.items() if s not in norms}
    if kind == "mean_zero_orthogonal":
      scales |= {s: readers for s, (_, readers) in norms.items()}
    factors = dict(self.factors, **{name: Factor(self.factors[name].size, kind)})
    return dataclasses.replace(self, factors=factors, norm_scales=scales)

  def restrict(self, names) -> "SymmetrySpec":
    """The same spec with only the named factors and attention sites acting."""
    names = set(names)
    unknown = names - set(self.factors) - set(self.attention)
    if unknown:
      raise ValueError(f"unknown factors or attention sites: {sorted(unknown)}")
    factors = {k: v for k, v in self.factors.items() if k in names}
    axes = {p: tuple(f if f in factors else None for f in a) for p, a in self.axes.items()}
    sites = {k: v for k, v in self.attention.items() if k in names}
    writers = {k: v for k, v in self.writers.items() if k in factors or k in sites}
    streams = {k: v for k, v in self.streams.items() if k in factors}
    return SymmetrySpec(factors, axes, sites, dict(self.norm_scales), writers, streams)

  def part(self, paths) -> "SymmetrySpec":
    """The spec of the leaves ``paths`` alone: their axes, the factors that act on them, the
    attention sites with a leaf among them, the norm scales among them (with their readers
    among them), the writers of the part's factors and sites whose leaves are among them, and
    the streams of the part's factors on the leaves among them."""
    paths = set(paths)
    axes = {p: a for p, a in self.axes.items() if p in paths}
    used = {f for a in axes.values() for f in a if f is not None}
    attention = {s: site for s, site in self.attention.items()
                 if any(p.startswith(s + "/") for p in paths)}
    norm_scales = {s: tuple(r for r in readers if r in paths)
                   for s, readers in self.norm_scales.items() if s in paths}
    writers = {n: leaves for n, leaves in self.writers.items()
               if (n in used or n in attention) and all(p is None or p in paths for p in leaves)}
    streams = {f: s.part(paths) for f, s in self.streams.items() if f in used}
    return SymmetrySpec({f: self.factors[f] for f in used}, axes, attention, norm_scales, writers,
                        streams)

  def check(self, params: Mapping[str, Any]) -> None:
    """Raises ValueError, naming the leaf, if ``params`` does not fit this spec."""
    leaves = flatten(params)
    missing = sorted(set(leaves) - set(self.axes))
    extra = sorted(set(self.axes) - set(leaves))
    if missing or extra:
      raise ValueError(f"parameters do not match the symmetry spec: leaves not in the spec "
                       f"{missing}; spec paths not in the parameters {extra}")
    for path, axes in self.axes.items():
      shape = leaves[path].shape
      if len(shape) != len(axes):
        raise ValueError(f"{path}: leaf has shape {shape} but the spec lists {len(axes)} axes {axes}")
      for i, f in enumerate(axes):
        if f is not None and shape[i] != self.factors[f].size:
          raise ValueError(f"{path}: axis {i} has size {shape[i]} but factor {f!r} has size "
                           f"{self.factors[f].size}")
    for site_path in self.attention:
      if not any(p.startswith(site_path + "/") for p in leaves):
        raise ValueError(f"attention site {site_path!r} has no parameters")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"a": {"b": x}} -> {"a/b": x}, in the tree's insertion order.

  ``flax.traverse_util.flatten_dict(tree, sep="/")`` does the same, but this
  module is part of the pure core (``group_action`` and ``matching`` import it
  and import jax, numpy and optax only), so it cannot import Flax. JAX's own
  ``tree_flatten_with_path`` is no substitute: it sorts dict keys, and the
  order of the leaves fixes the order of the sums in matching's objectives.
  """
  out = {}
  for k, v in tree.items():
    path = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(flatten(v, path + "/"))
    else:
      out[path] = v
  return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  """{"a/b": x} -> {"a": {"b": x}}; the inverse of ``flatten`` (``flatten``: why not Flax's)."""
  out: dict[str, Any] = {}
  for path, v in flat.items():
    node = out
    *parents, last = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = v
  return out


def subtree(tree: Mapping[str, Any], path: str) -> Any:
  """The node at a "/"-joined path; KeyError naming the path if absent."""
  node = tree
  for p in path.split("/"):
    if not isinstance(node, Mapping) or p not in node:
      raise KeyError(f"no parameter subtree at {path!r}")
    node = node[p]
  return node
