"""``build`` and ``Model``: the pure view of a family's NNX module.

The modules are Flax NNX modules (``vit.py``, ``bert.py``, ``decoder.py``).
Everything outside this package sees them through ``Model``:

* ``init(key)`` builds the module and returns its state as a
  plain nested dict (``nnx.to_pure_dict``);
* ``apply(params, inputs)`` rebuilds the module from that dict with
  ``nnx.merge`` and calls it. This is a pure function of (params, inputs), so
  it can be jitted, differentiated, vmapped, and fed parameters that symmetry
  code has transformed, with no NNX objects leaking out;
* ``apply_streamed(read, inputs)`` gives the same logits with the parameters
  read a layer at a time (a checkpoint too large to hold), the layers run in
  place of the module's own (``TransformerCore.encode``'s ``layers``);
* ``activations(params, inputs)`` gives the activations that the "activation"
  matching method reads (``matching.ACTIVATION_KEYS``), keyed by the spec's names;
  ``apply`` neither computes nor returns them.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from attn_symmetry import spec as spec_lib
from attn_symmetry.models import core
from attn_symmetry.models.config import Config, get_family, make_config

Params = dict[str, Any]
SCOPES = ("first_attention", "all_attention", "first_layer", "full")

class Model:
  """A model family at one config, in the pure view.

  Attributes:
    config: the frozen ``Config``.
    spec: the ``SymmetrySpec`` of the parameters (every leaf listed).
    task: ``attn_symmetry.tasks.CLASSIFICATION`` (ViT, BERT), ``LM`` (GPT-2,
      Llama, GPT-NeoX), ``MLM`` (BERT with ``head="mlm"`` or ``"pretraining"``) or
      ``FEATURES`` (BERT with ``head="encoder"`` or ``"encoder_no_pooler"``: no task head).
    input_key: the batch entry its inputs are read from ("image" for ViT,
      "tokens" for the text families), as ``data.DatasetInfo.input_key``.
  """

  def __init__(self, config: Config):
    self.config = config
    family = get_family(config.family)
    self._module_class, self.input_key = family.module, family.input_key
    self._head_activations = family.head_activations
    abstract = nnx.eval_shape(lambda: self._module_class(config, rngs=nnx.Rngs(0)))
    self._graphdef, state = nnx.split(abstract)
    self.param_shapes: dict[str, tuple[int, ...]] = {
        path: tuple(leaf.shape) for path, leaf in spec_lib.flatten(nnx.to_pure_dict(state)).items()}
    self.spec = family.symmetry_spec(config)

  def __repr__(self) -> str:
    return f"Model({self.config})"

  @property
  def task(self) -> str:
    return self.config.task

  def init(self, key: jax.Array) -> Params:
    """Random parameters, a plain nested dict of float32 arrays.

    Runs eagerly rather than under one ``jax.jit``: each random draw is then a
    small computation that JAX compiles once per shape and reuses across
    models, where a jitted init would compile the whole model's threefry
    graph again for every config (tens of seconds on a CPU).
    """
    return nnx.to_pure_dict(nnx.state(self._module_class(self.config, rngs=nnx.Rngs(params=key))))

  def check_params(self, params: Params) -> None:
    """Raises ValueError naming every missing, extra or misshapen parameter path."""
    flat = spec_lib.flatten(params)
    missing = sorted(set(self.param_shapes) - set(flat))
    extra = sorted(set(flat) - set(self.param_shapes))
    misshapen = [f"{p}: {tuple(np.shape(flat[p]))} instead of {s}"
                 for p, s in sorted(self.param_shapes.items())
                 if p in flat and tuple(np.shape(flat[p])) != s]
    if missing or extra or misshapen:
      raise ValueError(f"parameters do not fit {self.config.family} model: missing {missing}; "
                       f"extra {extra}; misshapen {misshapen}")

  def apply(self, params: Params, inputs: jax.Array, *, mask: jax.Array | None = None,
            segments: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The forward pass, pure and jittable.

    Args:
      params: parameters as returned by ``init`` (any float dtype; the
        computation runs in the parameters' dtype).
      inputs: images float [B, S, S, C] (ViT) or int tokens [B, T] (text).
      mask: optional bool [B, T] key mask, True = attend (text models).
      segments: optional int [B, T] segment ids (BERT with num_segments > 0).

    Returns:
      (logits, intermediates): logits [B, classes] for classification,
      [B, T, V] for "lm", "mlm" and "pretraining", the last hidden state
      [B, T, D] for a bare encoder ("encoder", "encoder_no_pooler"); intermediates
      maps names to activations ("embed", "layers_i/attention", "layers_i/mlp",
      "layers_i", "features"; "nsp_logits" [B, 2] for "pretraining"; "pooled"
      [B, D], the pooler's output, for "encoder").
    """
    self.check_params(params)
    module = nnx.merge(self._graphdef, params)
    return module(inputs, mask=mask, segments=segments)

  def apply_streamed(self, read: Callable[[Iterable[str]], Mapping[str, Any]], inputs: jax.Array,
                     *, mask: jax.Array | None = None, segments: jax.Array | None = None
                     ) -> jax.Array:
    """The logits of ``apply`` with the parameters read a layer at a time.

    ``read(paths)`` returns {path: array} for those parameter paths. The parameters outside
    the layers (embeddings, final norm, heads) are read first and held throughout; then each
    ``layers_i`` is read, run on the stream and released before the next is read: memory holds
    the outside and one layer, not the model, and none of it once the logits are returned. The
    outside runs eagerly, each layer as one program (compiled once for all layers of one
    shape).

    Args:
      read: the parameters, by path (any float dtype; computed in the arrays' dtype).
      inputs, mask, segments: as for ``apply``.

    Returns:
      logits as ``apply`` returns them (its intermediates are not kept).
    """
    depth = self.config.depth
    layers = [[p for p in self.param_shapes if p.split("/")[0] == f"layers_{i}"]
              for i in range(depth)]
    inside = {p for paths in layers for p in paths}
    outside = dict(read([p for p in self.param_shapes if p not in inside]))
    # The layers' places in the module hold empty arrays: ``encode`` runs ``stack`` instead.
    placeholders = {p: np.zeros((0,), np.float32) for p in inside}
    module = nnx.merge(self._graphdef, spec_lib.unflatten(outside | placeholders))

    def stack(x, *, positions, mask):
      for i, paths in enumerate(layers):
        params = spec_lib.unflatten(dict(read(paths)))[f"layers_{i}"]
        # The layer's program has run, and the layer is released, before the next is read:
        # dispatch is asynchronous, and the queued programs would hold their layers.
        x = jax.block_until_ready(_run_layer(self._layer_graphdef, params, x, positions, mask))
        del params
      return x

    logits = module(inputs, mask=mask, segments=segments, layers=stack)[0]
    # The module holds the outside in reference cycles (flax's object graph): collected now, it
    # is not still in memory when the next model is read (a 7B model's embeddings and head: 1 GB).
    del module, outside
    gc.collect()
    return logits

  def activations(self, params: Params, inputs: jax.Array, *, mask: jax.Array | None = None,
                  segments: jax.Array | None = None) -> dict[str, jax.Array]:
    """The activations that ``matching.align_model(method="activation")`` reads, keyed by the
    names of ``self.spec`` (the contract of ``matching.ACTIVATION_KEYS``); pure and jittable.

    Keys (r the residual factor, "residual", when the stream has one):

    * "layers_i/mlp": the FFN hidden units [B, T, F];
    * "r:embed", "r:layers_i/attention", "r:layers_i": the stream where the layers read and
      write it: the embedded input, each attention output and each layer's output [B, T, D];
    * "layers_i/attention:q", ":k" (after RoPE), ":v", ":heads" (the heads' outputs before
      the output projection): [B, T, N, H], [B, T, K, H], [B, T, K, H], [B, T, N, H];
    * a head's factors (``Family.head_activations``: BERT's "pooler" [B, D], "mlm").

    Args:
      params, inputs, mask, segments: as for ``apply``.
    """
    self.check_params(params)
    module = nnx.merge(self._graphdef, params)
    out: dict[str, jax.Array] = {}
    r = core.RESIDUAL if core.RESIDUAL in self.spec.factors else None
    stream = lambda name, x: out.update({f"{r}:{name}": x} if r else {})
    final = []

    def stack(x, *, positions, mask):
      stream("embed", x)
      for i in range(self.config.depth):
        x, parts = getattr(module, f"layers_{i}")(x, positions=positions, mask=mask, taps=True)
        out[f"layers_{i}/mlp"] = parts.pop("mlp")
        stream(f"layers_{i}/attention", parts.pop("attention"))
        out.update({f"layers_{i}/{k}": v for k, v in parts.items()})
        stream(f"layers_{i}", x)
      final.append(x)
      return x

    module(inputs, mask=mask, segments=segments, layers=stack)
    if self._head_activations is not None:
      x = final[0] if module.final_norm is None else module.final_norm(final[0])
      out.update(self._head_activations(module, x))
    return out

  def batch_activations(self, params: Params, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
    """``activations`` of a data batch: its ``input_key`` entry, with its "mask" where it has
    one. One function per model (a bound method), so that matching compiles it once."""
    return self.activations(params, batch[self.input_key], mask=batch.get("mask"))

  @functools.cached_property
  def _layer_graphdef(self) -> nnx.GraphDef:
    """The graph of one layer (``core.Block``), for ``apply_streamed``."""
    return nnx.split(nnx.eval_shape(lambda: core.Block(self.config, rngs=nnx.Rngs(0))))[0]

  def scope_paths(self, scope: str) -> list[str]:
    """Parameter path prefixes that re-initialisation ``scope`` covers.

    "first_attention": ["layers_0/attention"]; "all_attention": every
    "layers_i/attention"; "first_layer": ["layers_0"]; "full": [""] (all).
    """
    if scope == "first_attention":
      return ["layers_0/attention"]
    if scope == "all_attention":
      return [f"layers_{i}/attention" for i in range(self.config.depth)]
    if scope == "first_layer":
      return ["layers_0"]
    if scope == "full":
      return [""]
    raise ValueError(f"unknown scope {scope!r}; choose from {SCOPES}")


@functools.partial(jax.jit, static_argnums=0)
def _run_layer(graphdef: nnx.GraphDef, params: Params, x: jax.Array, positions: Any,
               mask: jax.Array | None) -> jax.Array:
  """One layer (``core.Block``) of ``Model.apply_streamed`` on the stream x [B, T, D]."""
  return nnx.merge(graphdef, params)(x, positions=positions, mask=mask)[0]


def build(family: str, preset: str = "tiny", **overrides: Any) -> Model:
  """The ``family`` model ("vit", "bert", "gpt2", "llama", "gpt_neox") at size ``preset``.

  Args:
    family: model family.
    preset: "tiny" (tests), "small" or "paper" (6 layers, 4 heads, D = 256),
      "base" (the 12-layer originals).
    **overrides: any ``Config`` field, e.g. ``pos_encoding="rope"``.

  Raises:
    ValueError: unknown family, preset or field, or an invalid config.
  """
  return Model(make_config(family, preset, **overrides))
