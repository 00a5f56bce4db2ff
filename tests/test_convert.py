"""Hugging Face converters: logits parity (float32, <= 1e-4), round trips, bad checkpoints.

Only the parity tests need PyTorch (``_torch``). The config and bad-checkpoint
tests need ``transformers``' config classes only, and run with ``torch``
hidden (``no_torch``): a converter path that imports it fails them.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_symmetry import models
from attn_symmetry import spec as spec_lib
from attn_symmetry.models import convert

B, T, TOL = 2, 7, 1e-4
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
GPT2 = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16)


def _torch():
  """(torch, transformers) for a parity test; skips it where PyTorch is not installed."""
  return pytest.importorskip("torch"), pytest.importorskip("transformers")


@pytest.fixture
def no_torch(monkeypatch):
  """``transformers`` with ``import torch`` failing for the length of the test."""
  transformers = pytest.importorskip("transformers")
  for name in ("GPT2Config", "LlamaConfig", "BertConfig", "ViTConfig", "T5Config"):
    getattr(transformers, name)  # loaded first: where torch is installed, transformers uses it
  monkeypatch.setitem(sys.modules, "torch", None)  # also fails "import torch.nn"
  return transformers


def _hf(name):
  """A small random HF model with every parameter perturbed (biases, norm scales included)."""
  torch, transformers = _torch()
  torch.manual_seed(0)
  llama = dict(SMALL, vocab_size=64, num_key_value_heads=2, max_position_embeddings=32,
               rope_parameters={"rope_type": "default", "rope_theta": 500.0})
  bert = dict(SMALL, vocab_size=64, max_position_embeddings=16, num_labels=3)
  vit = dict(SMALL, image_size=8, patch_size=4, num_channels=3, num_labels=5)
  model = {
      "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)),
      "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama)),
      "llama-tied": lambda: transformers.LlamaForCausalLM(
          transformers.LlamaConfig(**llama, tie_word_embeddings=True)),
      "bert": lambda: transformers.BertForSequenceClassification(transformers.BertConfig(**bert)),
      "bert-mlm": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**bert)),
      "bert-encoder": lambda: transformers.BertModel(transformers.BertConfig(**bert)),
      "bert-encoder_no_pooler": lambda: transformers.BertModel(transformers.BertConfig(**bert),
                                                               add_pooling_layer=False),
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
  """The HF model's logits, or a bare encoder's (``BertModel``) last hidden state."""
  torch, _ = _torch()
  with torch.no_grad():
    if family == "vit":
      return hf_model(pixel_values=torch.from_numpy(x["images"].transpose(0, 3, 1, 2))).logits.numpy()
    kwargs = {"input_ids": torch.from_numpy(x["tokens"])}
    if family == "bert":
      kwargs |= {"attention_mask": torch.from_numpy(x["mask"].astype(np.int64)),
                 "token_type_ids": torch.from_numpy(x["segments"])}
    out = hf_model(**kwargs)
    return (out.logits if "logits" in out else out.last_hidden_state).numpy()


def _our_logits(apply_fn, params, family, x):
  if family == "vit":
    return np.asarray(apply_fn(params, jnp.asarray(x["images"]))[0])
  kwargs = {}
  if family == "bert":
    kwargs = {"mask": jnp.asarray(x["mask"]), "segments": jnp.asarray(x["segments"], jnp.int32)}
  return np.asarray(apply_fn(params, jnp.asarray(x["tokens"], jnp.int32), **kwargs)[0])


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-tied", "bert", "bert-mlm", "bert-encoder",
                                  "bert-encoder_no_pooler", "vit"])
def test_logits_match_hf(name):
  _torch()
  family = name.split("-")[0]
  hf_model = _hf(name)
  apply_fn, params = convert.from_hf(hf_model)
  x = _inputs(family)
  ours, theirs = _our_logits(jax.jit(apply_fn), params, family, x), _hf_logits(hf_model, family, x)
  assert ours.shape == theirs.shape
  assert np.abs(theirs).max() > 0.1  # a non-trivial function
  np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)


def test_a_bare_encoder_is_bert_model_with_its_pooler():
  """A ``BertModel`` state dict (no "bert." prefix) reads as head "encoder": the output is the
  last hidden state and intermediates["pooled"] is HF's pooler_output (float32, <= 1e-4)."""
  torch, _ = _torch()
  hf_model = _hf("bert-encoder")
  assert not any(k.startswith("bert.") for k in hf_model.state_dict())
  model, params = convert.load_hf(hf_model)
  assert (model.config.head, model.task) == ("encoder", "features")
  x = _inputs("bert")
  with torch.no_grad():
    want = hf_model(input_ids=torch.from_numpy(x["tokens"]),
                    attention_mask=torch.from_numpy(x["mask"].astype(np.int64)),
                    token_type_ids=torch.from_numpy(x["segments"])).pooler_output.numpy()
  _, inter = model.apply(params, jnp.asarray(x["tokens"], jnp.int32), mask=jnp.asarray(x["mask"]),
                         segments=jnp.asarray(x["segments"], jnp.int32))
  np.testing.assert_allclose(np.asarray(inter["pooled"]), want, atol=TOL, rtol=0)


def test_state_dict_and_config_input():
  _torch()
  hf_model = _hf("llama")
  model, params = convert.load_hf(dict(hf_model.state_dict()), hf_model.config)
  assert model.config.kv_heads == 2 and model.config.rope_base == 500.0
  assert model.spec.attention["layers_0/attention"].group == "rope"
  x = _inputs("llama")
  np.testing.assert_allclose(_our_logits(model.apply, params, "llama", x),
                             _hf_logits(hf_model, "llama", x), atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family, overrides", [
    ("gpt2", {}), ("llama", {}), ("bert", {}), ("bert", dict(head="mlm")), ("vit", {}),
    ("bert", dict(head="mlm", tied_embeddings=False)), ("bert", dict(head="encoder")),
    ("bert", dict(head="encoder_no_pooler")),
])
def test_to_hf_round_trip(family, overrides):
  _torch()
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


def _gpt2_state_shapes(c):
  """Key -> shape of the state dict of HF's GPT2LMHeadModel for config ``c``, written out from
  its layout (Conv1D weights [in, out], c_attn holding q, k, v side by side, lm_head tied)."""
  d, inner = c.n_embd, c.n_inner or 4 * c.n_embd
  shapes = {"transformer.wte.weight": (c.vocab_size, d),
            "transformer.wpe.weight": (c.n_positions, d), "transformer.ln_f.weight": (d,),
            "transformer.ln_f.bias": (d,), "lm_head.weight": (c.vocab_size, d)}
  for i in range(c.n_layer):
    h = f"transformer.h.{i}"
    shapes |= {f"{h}.ln_1.weight": (d,), f"{h}.ln_1.bias": (d,), f"{h}.ln_2.weight": (d,),
               f"{h}.ln_2.bias": (d,), f"{h}.attn.c_attn.weight": (d, 3 * d),
               f"{h}.attn.c_attn.bias": (3 * d,), f"{h}.attn.c_proj.weight": (d, d),
               f"{h}.attn.c_proj.bias": (d,), f"{h}.mlp.c_fc.weight": (d, inner),
               f"{h}.mlp.c_fc.bias": (inner,), f"{h}.mlp.c_proj.weight": (inner, d),
               f"{h}.mlp.c_proj.bias": (d,)}
  return shapes


def test_gpt2_state_shapes_match_hf():
  _, transformers = _torch()
  config = transformers.GPT2Config(**GPT2)
  cfg = convert.config_from_hf(config, "lm")
  assert convert._template(cfg, config) == _gpt2_state_shapes(config)


def test_bad_checkpoint_names_the_parameters(no_torch, monkeypatch):
  """A numpy state dict against HF's GPT-2 layout (``_gpt2_state_shapes``, checked against the
  meta-device model where PyTorch is installed): the checkpoint check itself needs no torch."""
  config = no_torch.GPT2Config(**GPT2)
  monkeypatch.setattr(convert, "_template", lambda cfg, hf_cfg: _gpt2_state_shapes(hf_cfg))
  rng = np.random.default_rng(0)
  good = {k: rng.normal(size=s).astype(np.float32) for k, s in _gpt2_state_shapes(config).items()}
  good["lm_head.weight"] = good["transformer.wte.weight"]
  _, params = convert.load_hf(good, config)  # the intact checkpoint loads
  np.testing.assert_array_equal(params["layers_1"]["mlp"]["wi"]["bias"],
                                good["transformer.h.1.mlp.c_fc.bias"])
  state = dict(good)
  del state["transformer.h.1.mlp.c_fc.bias"]
  state["transformer.h.0.attn.extra"] = np.zeros(3)
  state["transformer.wpe.weight"] = np.zeros((15, 32))
  with pytest.raises(ValueError, match=r"missing \['transformer.h.1.mlp.c_fc.bias'\]; extra "
                     r"\['transformer.h.0.attn.extra'\]; misshapen \['transformer.wpe.weight: "
                     r"\(15, 32\) instead of \(16, 32\)'\]"):
    convert.from_hf(state, config)
  state = dict(good, **{"lm_head.weight": good["lm_head.weight"] + 1.0})
  with pytest.raises(ValueError, match=r"tied parameters \['lm_head.weight'\] differ"):
    convert.from_hf(state, config)
  with pytest.raises(ValueError, match="needs hf_config"):
    convert.from_hf(state)


def test_unsupported_configs_raise(no_torch):
  transformers = no_torch
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
