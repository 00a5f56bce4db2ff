"""Symmetry specs: which group factor acts on which axis of which parameter.

A spec is plain data, separate from the code that applies or solves for a
group element (git-re-basin's ``PermutationSpec``, generalised):

* ``factors``: named factors that act on one axis of some leaves, each either a
  permutation of ``size`` coordinates (FFN hidden units, the residual stream of
  a LayerNorm model) or an orthogonal map (the residual stream of an RMSNorm
  model; docs/symmetries.md, 'Whole models').
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

FACTOR_KINDS = ("permutation", "orthogonal")
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
    return SymmetrySpec(factors, axes, sites, dict(self.norm_scales), writers)

  def part(self, paths) -> "SymmetrySpec":
    """The spec of the leaves ``paths`` alone: their axes, the factors that act on them, the
    attention sites with a leaf among them, the norm scales among them (with their readers
    among them) and the writers of the part's factors and sites whose leaves are among them."""
    paths = set(paths)
    axes = {p: a for p, a in self.axes.items() if p in paths}
    used = {f for a in axes.values() for f in a if f is not None}
    attention = {s: site for s, site in self.attention.items()
                 if any(p.startswith(s + "/") for p in paths)}
    norm_scales = {s: tuple(r for r in readers if r in paths)
                   for s, readers in self.norm_scales.items() if s in paths}
    writers = {n: leaves for n, leaves in self.writers.items()
               if (n in used or n in attention) and all(p is None or p in paths for p in leaves)}
    return SymmetrySpec({f: self.factors[f] for f in used}, axes, attention, norm_scales, writers)

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
