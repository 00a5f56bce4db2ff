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

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from attn_symmetry import circuit_path
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
    module runs in front of the layers (``_front``) and behind them (``_back``) as one program
    each, and each layer as one program (``_run_layer``, compiled once for all layers of one
    shape).

    Args:
      read: the parameters, by path (any float dtype; computed in the arrays' dtype).
      inputs, mask, segments: as for ``apply``.

    Returns:
      logits as ``apply`` returns them (its intermediates are not kept).
    """
    outside = dict(read(self._outside_paths))
    x, positions, layer_mask = _front(self, outside, inputs, mask, segments)
    for i, paths in enumerate(self._layer_paths):
      params = self._layer(read(paths), i)
      # The layer's program has run, and the layer is released, before the next is read:
      # dispatch is asynchronous, and the queued programs would hold their layers.
      x = jax.block_until_ready(_run_layer(self._layer_graphdef, params, x, positions,
                                           layer_mask, taps=False))
      del params
    return _back(self, outside, inputs, mask, segments, x)

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
    final = []

    def stack(x, *, positions, mask):
      out.update(self._embed_entries(x))
      for i in range(self.config.depth):
        x, parts = getattr(module, f"layers_{i}")(x, positions=positions, mask=mask, taps=True)
        out.update(self._layer_entries(i, x, parts))
      final.append(x)
      return x

    module(inputs, mask=mask, segments=segments, layers=stack)
    if self._head_activations is not None:
      out.update(_head_entries(self, module, final[0]))
    return out

  def activations_streamed(self, read: Callable[[Iterable[str]], Sequence[Mapping[str, Any]]],
                           batches: Sequence[Mapping[str, Any]]
                           ) -> Iterator[tuple[tuple[dict[str, Any], ...],
                                               Iterator[tuple[dict[str, jax.Array], ...]]]]:
    """``activations`` of several models (of this config) on ``batches``, computed a group of
    parameters at a time, as ``apply_streamed`` runs the layers.

    ``read(paths)`` returns each model's {path: array} at those paths (a tuple, one per
    model). Yields one step at a time: the embeddings (the parameters outside the layers,
    read, run on every batch in front of the layers and released), each ``layers_i`` (read,
    every batch's stream advanced through it, released), and, for a family with head
    activations, the head (the outside read again, run behind the layers). Each step is
    (the leaves read for it, one {path: array} per model; an iterator over the batches of
    the step's activations, one {key: array} per model, keyed as ``activations`` keys them).
    The step's iterator advances the streams as it is consumed; whatever is left unconsumed
    is run before the next step. Memory holds each model's hidden states on every batch
    [B, T, D], the step's leaves and one batch's activations of the step.

    Args:
      read: the parameters of every model, by path (computed in the arrays' dtype).
      batches: data batches, as ``batch_activations`` reads them.
    """
    inputs = [(b[self.input_key], b.get("mask")) for b in batches]
    outside = tuple(dict(x) for x in read(self._outside_paths))
    streams = [[None] * len(batches) for _ in outside]  # (x, positions, mask) per model, batch

    def front():
      for j, (x, mask) in enumerate(inputs):
        for m, params in enumerate(outside):
          streams[m][j] = _front(self, params, x, mask, None)
        yield tuple(self._embed_entries(s[j][0]) for s in streams)

    def layer(i, params):
      for j in range(len(batches)):
        out = []
        for m, p in enumerate(params):
          x, positions, mask = streams[m][j]
          x, parts = _run_layer(self._layer_graphdef, p, x, positions, mask, taps=True)
          streams[m][j] = (jax.block_until_ready(x), positions, mask)
          out.append(self._layer_entries(i, x, parts))
        yield tuple(out)

    yield from _drained(outside, front())
    del outside
    for i, paths in enumerate(self._layer_paths):
      leaves = tuple(dict(x) for x in read(paths))
      yield from _drained(leaves, layer(i, [self._layer(x, i) for x in leaves]))
      del leaves
    if self._head_activations is not None:
      outside = tuple(dict(x) for x in read(self._outside_paths))
      yield from _drained(outside, (tuple(_heads(self, p, s[j][0])
                                          for p, s in zip(outside, streams))
                                    for j in range(len(batches))))

  def hidden_shape(self, batch: Mapping[str, Any]) -> tuple[int, ...]:
    """The shape of the stream [B, T, D] that the layers run on for ``batch`` (arrays or
    ``jax.ShapeDtypeStruct``s); nothing is computed."""
    outside = {p: jax.ShapeDtypeStruct(self.param_shapes[p], np.float32)
               for p in self._outside_paths}
    x = jax.eval_shape(lambda o, b: _front(self, o, b[self.input_key], b.get("mask"), None)[0],
                       outside, dict(batch))
    return tuple(x.shape)

  def _embed_entries(self, x: jax.Array) -> dict[str, jax.Array]:
    """The activations of the stream x entering the layers (``activations``' keys)."""
    r = self._residual
    return {spec_lib.tap(r, core.EMBED): x} if r else {}

  def _layer_entries(self, i: int, x: jax.Array, parts: Mapping[str, jax.Array]
                     ) -> dict[str, jax.Array]:
    """The activations of layer i (``activations``' keys) from its output x and its
    ``core.Block`` parts (with taps)."""
    parts, r, layer = dict(parts), self._residual, f"layers_{i}"
    out = {f"{layer}/{core.MLP}": parts.pop(core.MLP)}
    attention = parts.pop(core.ATTENTION)
    out |= {f"{layer}/{k}": v for k, v in parts.items()}
    if r:
      out |= {spec_lib.tap(r, f"{layer}/{core.ATTENTION}"): attention, spec_lib.tap(r, layer): x}
    return out

  @functools.cached_property
  def _residual(self) -> str | None:
    return core.RESIDUAL if core.RESIDUAL in self.spec.factors else None

  @functools.cached_property
  def _layer_paths(self) -> list[list[str]]:
    """The parameter paths of each ``layers_i``, in order."""
    return [[p for p in self.param_shapes if p.split("/")[0] == f"layers_{i}"]
            for i in range(self.config.depth)]

  @functools.cached_property
  def _outside_paths(self) -> list[str]:
    """The parameter paths outside the layers (embeddings, final norm, heads)."""
    inside = {p for paths in self._layer_paths for p in paths}
    return [p for p in self.param_shapes if p not in inside]

  def _layer(self, flat: Mapping[str, Any], i: int) -> Params:
    """Layer i's nested parameters from its leaves {path: array}."""
    return spec_lib.unflatten(dict(flat))[f"layers_{i}"]

  def _outside_module(self, outside: Mapping[str, Any]) -> nnx.Module:
    """The module with the parameters ``outside`` the layers; the layers' places hold empty
    arrays (``encode`` runs a ``layers`` callable instead)."""
    placeholders = {p: np.zeros((0,), np.float32) for paths in self._layer_paths for p in paths}
    return nnx.merge(self._graphdef, spec_lib.unflatten(dict(outside) | placeholders))

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


@functools.partial(jax.jit, static_argnames=("taps",))
def _run_layer(graphdef: nnx.GraphDef, params: Params, x: jax.Array, positions: Any,
               mask: jax.Array | None, *, taps: bool) -> Any:
  """One layer (``core.Block``) on the stream x [B, T, D]: its output, and with ``taps``
  (output, the block's parts with the attention's taps)."""
  x, parts = nnx.merge(graphdef, params)(x, positions=positions, mask=mask, taps=taps)
  return (x, parts) if taps else x


@functools.partial(jax.jit, static_argnums=0)
def _front(model: Model, outside: Params, inputs: jax.Array, mask: jax.Array | None,
           segments: jax.Array | None) -> tuple[jax.Array, Any, Any]:
  """The module in front of its layers: (the stream x [B, T, D] entering ``layers_0``, the
  positions and the mask the layers are called with). The module runs whole with its layers
  replaced by a capture; what follows them is not returned, so the program drops it."""
  held = {}

  def capture(x, *, positions, mask):
    held.update(x=x, positions=positions, mask=mask)
    return x

  model._outside_module(outside)(inputs, mask=mask, segments=segments, layers=capture)
  return held["x"], held["positions"], held["mask"]


@functools.partial(jax.jit, static_argnums=0)
def _back(model: Model, outside: Params, inputs: jax.Array, mask: jax.Array | None,
          segments: jax.Array | None, x: jax.Array) -> jax.Array:
  """The module behind its layers: the logits from the stream x [B, T, D] leaving the last
  layer (the layers replaced by x; what precedes them is not used, so the program drops it)."""
  module = model._outside_module(outside)
  return module(inputs, mask=mask, segments=segments, layers=lambda *_, **__: x)[0]


def _head_entries(model: Model, module: nnx.Module, x: jax.Array) -> dict[str, jax.Array]:
  """The head's activations (``Family.head_activations``) from the stream x leaving the last
  layer (``final_norm`` applied where the module has one)."""
  return model._head_activations(module, x if module.final_norm is None else module.final_norm(x))


@functools.partial(jax.jit, static_argnums=0)
def _heads(model: Model, outside: Params, x: jax.Array) -> dict[str, jax.Array]:
  """``_head_entries`` with the parameters outside the layers."""
  return _head_entries(model, model._outside_module(outside), x)


def _drained(leaves: Any, entries: Iterator[Any]) -> Iterator[tuple[Any, Iterator[Any]]]:
  """Yields the step (``leaves``, ``entries``) of ``Model.activations_streamed``, then runs
  what the consumer left of ``entries``."""
  yield leaves, entries
  for _ in entries:
    pass


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


def untie_head(model: Model, params: Params | None = None) -> tuple[Model, Params | None]:
  """``model`` with its tied output head untied, and ``params`` (if given) in it: the same
  function, the head ``head/kernel`` [D, V] a copy of the token embedding (transposed), which
  the embedding no longer ties. A pre-LayerNorm decoder with a tied head (GPT-2) so gets the
  residual stream read through LayerNorms only (``SymmetrySpec.streams``) that its O(d - 1)
  factor needs (``SymmetrySpec.with_residual``); a model without a tied head is returned as
  it is.

  Raises:
    ValueError: a family whose tied head is not a plain ``head/kernel`` once untied (BERT's
      masked-LM decoder), named.
  """
  if not model.config.tied_embeddings:
    return model, params
  untied = Model(dataclasses.replace(model.config, tied_embeddings=False))
  added = set(untied.param_shapes) - set(model.param_shapes)
  if added != {"head/kernel"} or "embed/embedding" not in model.param_shapes:
    raise ValueError(f"{model.config.family}: its tied head cannot be untied into a plain "
                     "head/kernel")
  if params is None:
    return untied, None
  flat = spec_lib.flatten(params)
  flat["head/kernel"] = flat["embed/embedding"].T
  return untied, spec_lib.unflatten(flat)



def circuit_model(model: Model) -> Model:
  """The model that evaluates the circuit path's points (``circuit_path.interpolate`` of
  ``model``'s parameters): ``model``'s config with every attention head of width
  ``circuit_path.head_width(model.spec)`` = 2H (``Config.head_width``), all else as it is.
  Its parameters are ``model``'s but for the attention layers' q, k, v kernels and biases
  [D, N|K, 2H], [N|K, 2H] and output kernels [N, 2H, D] (docs/lmc.md, 'The circuit path').

  Raises:
    ValueError: a model that the circuit path does not apply to (RoPE), naming its sites.
  """
  return Model(dataclasses.replace(model.config, head_width=circuit_path.head_width(model.spec)))
