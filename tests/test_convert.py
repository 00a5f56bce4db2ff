"""Hugging Face converters: logits parity (float32, <= 1e-4), round trips, bad checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_symmetry import models
from attn_symmetry import spec as spec_lib
from attn_symmetry.models import convert

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

B, T, TOL = 2, 7, 1e-4
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)


def _hf(name):
  """A small random HF model with every parameter perturbed (biases, norm scales included)."""
  torch.manual_seed(0)
  gpt2 = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16)
  llama = dict(SMALL, vocab_size=64, num_key_value_heads=2, max_position_embeddings=32,
               rope_parameters={"rope_type": "default", "rope_theta": 500.0})
  bert = dict(SMALL, vocab_size=64, max_position_embeddings=16, num_labels=3)
  vit = dict(SMALL, image_size=8, patch_size=4, num_channels=3, num_labels=5)
  model = {
      "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2)),
      "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama)),
      "llama-tied": lambda: transformers.LlamaForCausalLM(
          transformers.LlamaConfig(**llama, tie_word_embeddings=True)),
      "bert": lambda: transformers.BertForSequenceClassification(transformers.BertConfig(**bert)),
      "bert-mlm": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**bert)),
      "vit": lambda: transformers.ViTForImageClassification(transformers.ViTConfig(**vit)),
  }[name]()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  return model.eval()


def _inputs(family, vocab=64):
  rng = np.random.default_rng(0)
  if family == "vit":
    return {"images": rng.normal(size=(B, 8, 8, 3)).astype(np.float32)}
  out = {"tokens": rng.integers(0, vocab, (B, T))}
  if family == "bert":
    out["mask"] = np.arange(T)[None, :] < np.array([[T], [T - 3]])
    out["segments"] = (np.arange(T)[None, :] >= 3).astype(np.int64).repeat(B, 0)
  return out


def _hf_logits(hf_model, family, x):
  with torch.no_grad():
    if family == "vit":
      return hf_model(pixel_values=torch.from_numpy(x["images"].transpose(0, 3, 1, 2))).logits.numpy()
    kwargs = {"input_ids": torch.from_numpy(x["tokens"])}
    if family == "bert":
      kwargs |= {"attention_mask": torch.from_numpy(x["mask"].astype(np.int64)),
                 "token_type_ids": torch.from_numpy(x["segments"])}
    return hf_model(**kwargs).logits.numpy()


def _our_logits(apply_fn, params, family, x):
  if family == "vit":
    return np.asarray(apply_fn(params, jnp.asarray(x["images"]))[0])
  kwargs = {}
  if family == "bert":
    kwargs = {"mask": jnp.asarray(x["mask"]), "segments": jnp.asarray(x["segments"], jnp.int32)}
  return np.asarray(apply_fn(params, jnp.asarray(x["tokens"], jnp.int32), **kwargs)[0])


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-tied", "bert", "bert-mlm", "vit"])
def test_logits_match_hf(name):
  family = name.split("-")[0]
  hf_model = _hf(name)
  apply_fn, params = convert.from_hf(hf_model)
  x = _inputs(family)
  ours, theirs = _our_logits(jax.jit(apply_fn), params, family, x), _hf_logits(hf_model, family, x)
  assert ours.shape == theirs.shape
  assert np.abs(theirs).max() > 0.1  # a non-trivial function
  np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)


def test_state_dict_and_config_input():
  hf_model = _hf("llama")
  model, params = convert.load_hf(dict(hf_model.state_dict()), hf_model.config)
  assert model.config.kv_heads == 2 and model.config.rope_base == 500.0
  assert model.spec.attention["layers_0/attention"].group == "rope"
  x = _inputs("llama")
  np.testing.assert_allclose(_our_logits(model.apply, params, "llama", x),
                             _hf_logits(hf_model, "llama", x), atol=TOL, rtol=0)


@pytest.mark.parametrize("family, overrides", [
    ("gpt2", {}), ("llama", {}), ("bert", {}), ("bert", dict(head="mlm")), ("vit", {}),
    ("bert", dict(head="mlm", tied_embeddings=False)),
])
def test_to_hf_round_trip(family, overrides):
  model = models.build(family, "tiny", **overrides)
  key = jax.random.key(0)
  params = jax.tree.map(lambda p: p + 0.2 * jax.random.normal(key, p.shape), model.init(key))
  hf_model = convert.to_hf(model, params)
  x = _inputs(family, model.config.vocab_size)
  np.testing.assert_allclose(_our_logits(model.apply, params, family, x),
                             _hf_logits(hf_model, family, x), atol=TOL, rtol=0)
  back_model, back = convert.load_hf(hf_model)
  assert back_model.config == model.config
  for path, leaf in spec_lib.flatten(params).items():
    np.testing.assert_array_equal(np.asarray(spec_lib.flatten(back)[path]), np.asarray(leaf),
                                  err_msg=path)


def test_bad_checkpoint_names_the_parameters():
  hf_model = _hf("gpt2")
  state = dict(hf_model.state_dict())
  del state["transformer.h.1.mlp.c_fc.bias"]
  state["transformer.h.0.attn.extra"] = torch.zeros(3)
  state["transformer.wpe.weight"] = torch.zeros(15, 32)
  with pytest.raises(ValueError, match=r"missing \['transformer.h.1.mlp.c_fc.bias'\]; extra "
                     r"\['transformer.h.0.attn.extra'\]; misshapen \['transformer.wpe.weight: "
                     r"\(15, 32\) instead of \(16, 32\)'\]"):
    convert.from_hf(state, hf_model.config)
  state = dict(hf_model.state_dict())
  state["lm_head.weight"] = state["lm_head.weight"] + 1.0
  with pytest.raises(ValueError, match=r"tied parameters \['lm_head.weight'\] differ"):
    convert.from_hf(state, hf_model.config)
  with pytest.raises(ValueError, match="needs hf_config"):
    convert.from_hf(state)


def test_unsupported_configs_raise():
  llama = transformers.LlamaConfig(**SMALL, vocab_size=64, rope_parameters={
      "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
  with pytest.raises(ValueError, match="rope type 'linear'"):
    convert.config_from_hf(llama, "lm")
  vit = transformers.ViTConfig(**SMALL, image_size=8, patch_size=4, qkv_bias=False)
  with pytest.raises(ValueError, match="qkv_bias=False"):
    convert.config_from_hf(vit, "classifier")
  with pytest.raises(ValueError, match="unsupported HF model type 't5'"):
    convert.config_from_hf(transformers.T5Config(), "lm")
  with pytest.raises(ValueError, match="cannot express config fields {'pos_encoding': 'rope'}"):
    convert.hf_config(models.make_config("gpt2", pos_encoding="rope"))
