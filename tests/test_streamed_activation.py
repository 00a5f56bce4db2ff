"""Method "activation" streamed (``matching.align_activations_streamed`` fed by
``Model.activations_streamed``; ``attn-symmetry align --method activation``): the element of the
whole-model method, with the models read a group of leaves at a time, and a memory need checked
before any work (``_memory.check_memory``)."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_symmetry import group_action as ga
from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry import spec as spec_lib
from attn_symmetry.align import _memory
from attn_symmetry.align._records import InputError, Options
from attn_symmetry.models import Model
from attn_symmetry.models import convert
from tests.test_activation_matching import _float64, _inputs, _model, _planted
from tests.test_streamed_alignment import MISTRAL


def _streamed(model, a, b, batches, scope=None, residual="permutation"):
  """(element, info, the groups read: top-level keys of each read) of the streamed method on
  the in-memory pair (a, b)."""
  flats, reads = (spec_lib.flatten(a), spec_lib.flatten(b)), []

  def read(paths):
    paths = list(paths)
    reads.append(sorted({p.split("/")[0] for p in paths if p.startswith("layers_")})
                 or ["outside"])
    return tuple({p: flat[p] for p in paths} for flat in flats)

  shapes = jax.eval_shape(model.batch_activations, a, batches[0])
  element, info = matching.align_activations_streamed(
      model.spec, lambda: model.activations_streamed(read, batches), shapes, scope=scope,
      steps=200, batches=len(batches), residual=residual)
  return element, info, reads


def _same_element(spec, got, want, tolerance):
  for name in spec.factors:
    if spec.factors[name].kind == "permutation":
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    else:
      np.testing.assert_allclose(got[name], want[name], rtol=0, atol=tolerance, err_msg=name)
  for name in spec.attention:
    np.testing.assert_array_equal(got[name].perm, want[name].perm, err_msg=name)
    for m in ("qk", "vo"):
      np.testing.assert_allclose(getattr(got[name], m), getattr(want[name], m), rtol=0,
                                 atol=tolerance, err_msg=f"{name} {m}")


@pytest.mark.parametrize("family, scope, residual", [
    ("gpt2", None, "permutation"), ("gpt2", None, "orthogonal"), ("llama", None, "permutation"),
    ("bert", None, "permutation"), ("llama", "layers_1", "permutation")], ids=repr)
def test_streamed_is_the_whole_model_method(x64, family, scope, residual):
  """Independent float64 pairs (GPT-2: LayerNorm, a permuted residual, or its O(d - 1) one,
  the W^O that Stage 1 reads projected onto 1-perp in each step; Llama with GQA: RMSNorm, the
  Procrustes residual, folded; BERT: the head's factors after the layers): the streamed
  element is the whole-model one, identical permutations and matrices to 1e-9. Every read is
  one group: the outside, then each layer in order (the outside again for BERT's head); the
  sites wait for the residual in a second pass where it is in scope."""
  model = _model(family)
  a = _float64(model.init(jax.random.key(0)))
  b = _float64(model.init(jax.random.key(1)))
  if residual == "orthogonal":  # an O(d - 1) residual acts on an untied head only
    (model, a), (_, b) = models.untie_head(model, a), models.untie_head(model, b)
  batches = [{model.input_key: _inputs(model, s)} for s in (1, 2)]
  want, want_info = matching.align_model(model.spec, a, b, method="activation", scope=scope,
                                         activations=model.batch_activations,
                                         match_batches=batches, residual=residual)
  got, info, reads = _streamed(model, a, b, batches, scope, residual)
  _same_element(matching.residual_spec(model.spec, residual), got, want, 1e-9)
  for key in ("folded_norm_scales", "batches", "samples"):
    assert info[key] == want_info[key], key
  passes = 1 if scope else 2
  one = ([["outside"]] + [[f"layers_{i}"] for i in range(model.config.depth)] +
         ([["outside"]] if family == "bert" else []))
  assert info["passes"] == passes and reads == one * passes


def test_planted_pair_is_recovered_streamed(x64):
  """Llama with GQA, B = g . fold(A): aligned B is folded A to 1e-9, the permutations g's."""
  model = _model("llama")
  a, b, g = _planted("llama")
  batches = [{model.input_key: _inputs(model, s)} for s in (1, 2)]
  element, info, _ = _streamed(model, a, b, batches)
  ga.check_model_element(model.spec, element)
  aligned = spec_lib.flatten(ga.apply_model(model.spec, b, element))
  target = spec_lib.flatten(ga.fold_norm_scales(model.spec, a))
  assert info["folded_norm_scales"]
  for p, x in target.items():
    assert np.linalg.norm(aligned[p] - x) <= 1e-9 * max(np.linalg.norm(x), 1e-300), p
  for name in model.spec.attention:
    np.testing.assert_array_equal(element[name].perm, np.argsort(g[name].perm))


def test_a_non_finite_activation_is_refused_naming_the_model_batch_and_key(x64):
  """A NaN in B's layer 1 FFN: refused at layer 1's step, naming B, the batch and a key of
  layer 1 (the FFN's units or the layer's output)."""
  model = _model("gpt2")
  a = _float64(model.init(jax.random.key(0)))
  b = jax.tree.map(np.copy, a)
  b["layers_1"]["mlp"]["wi"]["kernel"][0, 0] = np.nan
  batches = [{model.input_key: _inputs(model, 1)}]
  with pytest.raises(ValueError, match=r"activations of model B on match batch 0: "
                                       r"'(layers_1/mlp|residual:layers_1)' has NaN or Inf"):
    _streamed(model, a, b, batches)


def test_a_7b_pair_is_checked_against_the_budget_before_any_work():
  """A Mistral-7B-shaped pair (config only): the streamed activation method needs the weight
  method's two groups of each model, plus the hidden states of both models on the match
  batches and the sums; a budget below that is refused in one line naming the numbers, and
  the need is far below the whole models'."""
  hf = dict(MISTRAL, model_type="mistral", num_hidden_layers=32, max_position_embeddings=4096,
            rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None, tie_word_embeddings=False)
  model = Model(convert.config_from_hf(hf, "lm"))
  ckpt = types.SimpleNamespace(nbytes=2 * _memory.whole_bytes(model) // 4)
  options = Options(method="activation", match_data="data.txt", match_batches=8)
  assert _memory.streams(options)
  group = _memory.group_bytes(model)[0]
  hidden, sums = _memory.activation_bytes(model, options)
  assert hidden == 2 * 8 * 4 * 8 * 128 * 4096  # both models, 8 batches [8, 128, 4096]
  # the residual's sums, one FFN's and one site's
  assert sums > 4 * 4096 ** 2 + 4 * 14336 ** 2
  need = 4 * group + hidden + sums
  assert need < _memory.whole_bytes(model) / 4
  _memory.check_memory(ckpt, ckpt, model, dataclasses.replace(options, memory_budget=need))
  with pytest.raises(InputError) as refused:
    _memory.check_memory(ckpt, ckpt, model,
                         dataclasses.replace(options, memory_budget=0.99 * need))
  line = str(refused.value)
  assert "\n" not in line and "--method activation adds both models' hidden states on 8 " \
      f"match batches ({_memory.gb(hidden)}) and its sums ({_memory.gb(sums)}): " \
      f"{_memory.gb(need)}, above the memory budget" in line, line
