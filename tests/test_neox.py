"""GPT-NeoX (Pythia): logits parity with transformers, its symmetry group, a planted pair aligned.

Tiny random ``GPTNeoXForCausalLM`` models (width 32, 4 heads of 8 dims, 2 layers) with parallel
and sequential residuals and rotary fractions 0.25 (2 of 8 dims rotated) and 1.0 are compared
with the zoo's "gpt_neox" family; the planted pair B = g . A is written straight on the HF
tensors in numpy (``_plant``), independent of the library's converters and group actions.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from attn_symmetry import align
from attn_symmetry import group_action as ga
from attn_symmetry import models
from attn_symmetry import spec as spec_lib
from attn_symmetry.models import convert
from attn_symmetry.models import safetensors_io
# The align command's planted-pair options and its one-line refusal, as for the other families.
from tests.test_align_checkpoints import EXACT
from tests.test_align_checkpoints import _refusal

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

B, T = 2, 7
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             vocab_size=64, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
CASES = {"parallel-0.25": (True, 0.25), "parallel-1.0": (True, 1.0),
         "sequential-0.25": (False, 0.25), "sequential-1.0": (False, 1.0)}


def _hf_model(parallel=True, rotary=0.25, seed=0, **overrides):
  """A tiny random GPTNeoXForCausalLM with every parameter perturbed (biases, norms included)."""
  torch.manual_seed(seed)
  config = transformers.GPTNeoXConfig(**SMALL, use_parallel_residual=parallel,
                                      rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                       "partial_rotary_factor": rotary},
                                      **overrides)
  model = transformers.GPTNeoXForCausalLM(config)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  return model.eval()


def _tokens(seed=0):
  return np.random.default_rng(seed).integers(0, SMALL["vocab_size"], (B, T))


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(tokens)).logits.numpy()


def _perturbed(params, scale, dtype):
  """``params`` + scale * N(0, 1) noise on every leaf (non-zero biases, non-unit norm scales)."""
  rng = np.random.default_rng(0)
  return spec_lib.unflatten({p: jnp.asarray(x + scale * rng.normal(size=x.shape), dtype)
                             for p, x in spec_lib.flatten(params).items()})


def _rotary_tables_in_float64(self, x, position_ids):
  """GPTNeoXRotaryEmbedding.forward with its angles in float64 (transformers computes them in
  float32 whatever the model's dtype): cos and sin [B, T, r] of position * base^(-2j / r)."""
  theta = float(self.config.rope_parameters["rope_theta"])
  r = 2 * self.inv_freq.shape[0]
  inv_freq = theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
  angles = position_ids[..., None].to(torch.float64) * inv_freq
  angles = torch.cat((angles, angles), dim=-1)
  return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case, x64, monkeypatch):
  """float32: the converted model's logits within 1e-5 of transformers'. float64: the same
  parameters in float64 on both sides (transformers' rotary tables computed in float64 too)
  within 1e-12."""
  parallel, rotary = CASES[case]
  hf_model = _hf_model(parallel, rotary)
  model, params = convert.load_hf(hf_model)
  cfg = model.config
  assert (cfg.family, cfg.parallel_residual, cfg.rotary_fraction) == ("gpt_neox", parallel, rotary)
  assert cfg.rope_base == 500.0 and cfg.activation == "gelu" and not cfg.tied_embeddings
  tokens = _tokens()
  theirs = _hf_logits(hf_model, tokens)
  assert np.abs(theirs).max() > 1.0  # a non-trivial function
  apply = jax.jit(model.apply)
  ours = np.asarray(apply(params, jnp.asarray(tokens, jnp.int32))[0])
  assert ours.dtype == np.float32
  np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)

  from transformers.models.gpt_neox import modeling_gpt_neox  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(modeling_gpt_neox.GPTNeoXRotaryEmbedding, "forward",
                      _rotary_tables_in_float64)
  theirs64 = _hf_logits(hf_model.double(), tokens)
  ours64 = np.asarray(apply(jax.tree.map(lambda p: jnp.asarray(p, jnp.float64), params),
                            jnp.asarray(tokens, jnp.int32))[0])
  assert ours64.dtype == np.float64
  np.testing.assert_allclose(ours64, theirs64, atol=1e-12, rtol=0)


def test_fused_qkv_is_split_per_head():
  """Head n's query, key and value are rows [n, part] of query_key_value viewed as [N, 3, H, D]."""
  hf_model = _hf_model()
  _, params = convert.load_hf(hf_model)
  state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
  qkv = state["gpt_neox.layers.1.attention.query_key_value.weight"].reshape(4, 3, 8, 32)
  qkv_bias = state["gpt_neox.layers.1.attention.query_key_value.bias"].reshape(4, 3, 8)
  for part, name in enumerate(("query", "key", "value")):
    leaf = params["layers_1"]["attention"][name]
    np.testing.assert_array_equal(leaf["kernel"], qkv[:, part].transpose(2, 0, 1))
    np.testing.assert_array_equal(leaf["bias"], qkv_bias[:, part])


@pytest.mark.parametrize("overrides", [dict(), dict(parallel_residual=False, rotary_fraction=1.0,
                                                    tied_embeddings=True)])
def test_to_hf_round_trip(overrides):
  """Ours -> GPTNeoXForCausalLM (the same logits) -> ours (the same parameters, bit for bit)."""
  model = models.build("gpt_neox", "tiny", **overrides)
  params = _perturbed(model.init(jax.random.key(0)), 0.2, jnp.float32)
  hf_model = convert.to_hf(model, params)
  tokens = _tokens()
  ours = jax.jit(model.apply)(params, jnp.asarray(tokens, jnp.int32))[0]
  np.testing.assert_allclose(np.asarray(ours), _hf_logits(hf_model, tokens), atol=1e-5, rtol=0)
  back_model, back = convert.load_hf(hf_model)
  assert back_model.config == model.config
  for path, leaf in spec_lib.flatten(params).items():
    np.testing.assert_array_equal(np.asarray(spec_lib.flatten(back)[path]), np.asarray(leaf),
                                  err_msg=path)


def test_config_json_defaults_are_the_transformers_defaults():
  """A config.json that leaves every field out means GPTNeoXConfig's defaults, and Pythia's
  legacy rotary_pct / rotary_emb_base fields mean what transformers reads from them."""
  assert (convert.config_from_hf({"model_type": "gpt_neox"}, "lm")
          == convert.config_from_hf(transformers.GPTNeoXConfig(), "lm"))
  legacy = dict(SMALL, model_type="gpt_neox", rotary_pct=0.5, rotary_emb_base=1000)
  cfg = convert.config_from_hf(legacy, "lm")
  assert (cfg.rotary_fraction, cfg.rope_base) == (0.5, 1000.0)
  assert cfg == convert.config_from_hf(transformers.GPTNeoXConfig.from_dict(legacy), "lm")


def test_hf_shape_is_the_state_dict_shape():
  hf_model = _hf_model()
  cfg = convert.config_from_hf(hf_model.config.to_dict(), "lm")
  shapes = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
  table, _ = convert.param_table(cfg)
  ours = models.Model(cfg).param_shapes
  assert {src.key for src in table.values()} == set(shapes)
  for path, src in table.items():
    assert convert.hf_shape(path, ours[path], src) == shapes[src.key], path


def test_bad_configs_name_the_field():
  with pytest.raises(ValueError, match=r"^unsupported HF config: rotary_pct=0.3 \(head_dim 8 \* "
                     r"rotary_pct = 2.4 rotated dims"):
    convert.config_from_hf(dict(SMALL, model_type="gpt_neox", rotary_pct=0.3), "lm")
  with pytest.raises(ValueError, match=r"partial_rotary_factor'\]=0.125 \(head_dim 8 .* = 1 "):
    convert.config_from_hf(dict(SMALL, model_type="gpt_neox", rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.125}), "lm")
  with pytest.raises(ValueError, match="attention_bias=False"):
    convert.config_from_hf(dict(SMALL, model_type="gpt_neox", attention_bias=False), "lm")
  with pytest.raises(ValueError, match="rope type 'linear'"):
    convert.config_from_hf(dict(SMALL, model_type="gpt_neox", rope_scaling={
        "rope_type": "linear", "factor": 2.0}), "lm")
  with pytest.raises(ValueError, match="parallel_residual is for pre-norm models"):
    models.make_config("gpt_neox", post_norm=True)
  with pytest.raises(ValueError, match=r"cannot express config fields \{'pos_encoding': 'learned'"):
    convert.hf_config(models.make_config("gpt_neox", pos_encoding="learned"))


# ----------------------------------------------------------------------------- symmetry


@pytest.mark.parametrize("parallel", [True, False])
def test_logits_invariant_under_full_group(x64, parallel):
  """Head permutations, per-head H(H) on the 4 rotated dims (of 16) with GL(12) on the rest
  (QK) and GL(16) (VO), FFN permutations and a residual permutation leave the logits unchanged
  in float64; GL on the whole QK matrix does not."""
  model = models.build("gpt_neox", "tiny", width=64, parallel_residual=parallel)
  site = model.spec.attention["layers_0/attention"]
  assert (site.group, site.rotary_dims(), site.head_dim) == ("rope", 4, 16)
  assert model.spec.factors["residual"] == spec_lib.Factor(64, "permutation")
  assert not model.spec.norm_scales  # LayerNorm: nothing to fold
  params = _perturbed(model.init(jax.random.key(0)), 0.3, jnp.float64)
  tokens = jnp.asarray(_tokens(1), jnp.int32)
  apply = jax.jit(model.apply)
  logits, _ = apply(params, tokens)
  assert logits.dtype == jnp.float64 and float(jnp.abs(logits).max()) > 1.0

  element = ga.random_model_element(jax.random.key(2), model.spec)
  qk = np.asarray(element["layers_0/attention"].qk[0])
  assert np.abs(qk[4:, 4:] - np.eye(12)).max() > 0.1  # the unrotated block is a general matrix
  assert np.abs(qk[:4, 4:]).max() == np.abs(qk[4:, :4]).max() == 0.0  # H(H) x GL: block diagonal
  assert not np.array_equal(element["residual"], np.arange(64))
  assert not np.array_equal(element["layers_1/mlp"], np.arange(64 * 2))
  moved = ga.apply_model(model.spec, params, element)
  assert float(jnp.abs(moved["embed"]["embedding"] - params["embed"]["embedding"]).max()) > 0.1
  np.testing.assert_allclose(apply(moved, tokens)[0], logits, atol=1e-9, rtol=0)

  general = ga.random_model_element(jax.random.key(2), model.spec, attention_group="gl")
  assert float(jnp.abs(apply(ga.apply_model(model.spec, params, general), tokens)[0]
                       - logits).max()) > 1e-3


# ----------------------------------------------------------------------------- planted pair


def _read_folder(folder):
  """{name: array} of ``folder``'s model.safetensors, and its metadata."""
  with safe_open(os.path.join(folder, "model.safetensors"), framework="numpy") as f:
    return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _pythia_folder(folder):
  """A tiny GPTNeoXForCausalLM saved as Pythia's files are on the Hub: legacy rotary_pct and
  rotary_emb_base in config.json, and old buffers (causal masks, inv_freq) next to the weights."""
  _hf_model(parallel=True, rotary=0.5, seed=1).save_pretrained(folder)
  path = os.path.join(folder, "config.json")
  config = json.load(open(path))
  rope = config.pop("rope_parameters")
  config |= {"rotary_pct": rope["partial_rotary_factor"], "rotary_emb_base": rope["rope_theta"]}
  json.dump(config, open(path, "w"))
  tensors, meta = _read_folder(folder)
  for i in range(SMALL["num_hidden_layers"]):
    a = f"gpt_neox.layers.{i}.attention"
    tensors[f"{a}.bias"] = np.tril(np.ones((1, 1, 32, 32), bool))
    tensors[f"{a}.masked_bias"] = np.array(-1e9, np.float32)
    tensors[f"{a}.rotary_emb.inv_freq"] = (500.0 ** -(np.arange(0, 4, 2) / 4)).astype(np.float32)
  save_file(tensors, os.path.join(folder, "model.safetensors"), metadata=meta)
  return folder


def _h_times_gl(rng, h, r):
  """A QK matrix of the partial-rotary group: on pair (j, j + r/2), j < r/2, the 2 x 2 block
  [[a, b], [-b, a]] (commutes with every rotation); a general matrix on dims r..h-1."""
  m = np.zeros((h, h))
  for j in range(r // 2):
    a, b = rng.normal(size=2)
    m[j, j] = m[j + r // 2, j + r // 2] = a
    m[j, j + r // 2], m[j + r // 2, j] = b, -b
  m[r:, r:] = rng.normal(size=(h - r, h - r)) + 2 * np.eye(h - r)
  return m


def _plant(folder_a, folder_b, seed):
  """B = g . A on the HF tensors: a residual permutation rho (the stream's coordinate j is A's
  rho[j]); per layer a head permutation tau, per head a QK matrix C_n (``_h_times_gl``) and a
  VO matrix E_n, and an FFN permutation pi. Head n of B is head tau[n] of A with
  q C_n, k C_n^-T, v E_n and output rows E_n^-1 W^O."""
  rng = np.random.default_rng(seed)
  config = json.load(open(os.path.join(folder_a, "config.json")))
  d, n, f = config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]
  h = d // n
  r = int(h * config["rotary_pct"])
  tensors, meta = _read_folder(folder_a)
  out = {k: np.asarray(v, np.float64) if v.dtype == np.float32 else v for k, v in tensors.items()}
  rho = rng.permutation(d)
  out["gpt_neox.embed_in.weight"] = out["gpt_neox.embed_in.weight"][:, rho]
  out["embed_out.weight"] = out["embed_out.weight"][:, rho]
  for name in ("weight", "bias"):
    out[f"gpt_neox.final_layer_norm.{name}"] = out[f"gpt_neox.final_layer_norm.{name}"][rho]
  for i in range(config["num_hidden_layers"]):
    p = f"gpt_neox.layers.{i}."
    for norm in ("input_layernorm", "post_attention_layernorm"):
      for name in ("weight", "bias"):
        out[f"{p}{norm}.{name}"] = out[f"{p}{norm}.{name}"][rho]
    tau, pi = rng.permutation(n), rng.permutation(f)
    c = np.stack([_h_times_gl(rng, h, r) for _ in range(n)])
    e = rng.normal(size=(n, h, h)) + 3 * np.eye(h)
    # Rows of query_key_value [N, 3, H, D]: head n's q = x W[n, 0]^T, so q C = x (C^T W[n, 0])^T.
    mats = np.stack([c.transpose(0, 2, 1), np.linalg.inv(c), e.transpose(0, 2, 1)], 1)
    qkv = p + "attention.query_key_value"
    w = out[qkv + ".weight"].reshape(n, 3, h, d)[tau][..., rho]
    out[qkv + ".weight"] = np.einsum("npij,npjd->npid", mats, w).reshape(3 * d, d)
    bias = out[qkv + ".bias"].reshape(n, 3, h)[tau]
    out[qkv + ".bias"] = np.einsum("npij,npj->npi", mats, bias).reshape(-1)
    dense = out[p + "attention.dense.weight"].reshape(d, n, h)[rho][:, tau]  # [D, N, H]
    out[p + "attention.dense.weight"] = np.einsum("dnj,nij->dni", dense,
                                                  np.linalg.inv(e)).reshape(d, d)
    out[p + "attention.dense.bias"] = out[p + "attention.dense.bias"][rho]
    out[p + "mlp.dense_h_to_4h.weight"] = out[p + "mlp.dense_h_to_4h.weight"][pi][:, rho]
    out[p + "mlp.dense_h_to_4h.bias"] = out[p + "mlp.dense_h_to_4h.bias"][pi]
    out[p + "mlp.dense_4h_to_h.weight"] = out[p + "mlp.dense_4h_to_h.weight"][rho][:, pi]
    out[p + "mlp.dense_4h_to_h.bias"] = out[p + "mlp.dense_4h_to_h.bias"][rho]
  os.makedirs(folder_b)
  save_file({k: np.ascontiguousarray(v, tensors[k].dtype) for k, v in out.items()},
            os.path.join(folder_b, "model.safetensors"), metadata=meta)
  for side in os.listdir(folder_a):
    if side != "model.safetensors":
      shutil.copyfile(os.path.join(folder_a, side), os.path.join(folder_b, side))
  return folder_b


def _logits(folder):
  model = transformers.GPTNeoXForCausalLM.from_pretrained(folder).eval()
  return _hf_logits(model, _tokens(2))


@pytest.mark.slow
def test_planted_pair_is_recovered(tmp_path):
  """A Pythia-style folder A and B = g . A (``_plant``: residual, head, QK (H(H) x GL on the
  partial rotary) and VO, FFN factors in every layer): ``align_checkpoints`` gives A back
  tensor for tensor, in B's file names with its buffers kept; transformers loads the result
  with B's function."""
  a = _pythia_folder(str(tmp_path / "a"))
  b = _plant(a, str(tmp_path / "b"), seed=3)
  ckpt = safetensors_io.Checkpoint(b)
  assert ckpt.config.rotary_fraction == 0.5 and ckpt.names["lm_head.weight"] == "embed_out.weight"
  np.testing.assert_allclose(_logits(b), _logits(a), atol=1e-4, rtol=0)  # the planted g is one
  result = align.align_checkpoints(a, b, out=str(tmp_path / "out"), merge=0.5, **EXACT)
  aligned = str(tmp_path / "out" / "aligned_b")
  want, _ = _read_folder(a)
  got, _ = _read_folder(aligned)
  assert set(got) == set(want)
  for k, x in want.items():
    if x.dtype == bool or k.endswith(("masked_bias", "inv_freq")):  # buffers, copied from B
      np.testing.assert_array_equal(got[k], x, err_msg=k)
      continue
    err = np.linalg.norm(got[k].astype(np.float64) - x) / np.linalg.norm(x)
    assert err <= 1e-4, (k, err)
  assert result.report["distance"]["after"]["relative"] <= 1e-4
  assert result.report["distance"]["before"]["relative"] > 0.5
  assert not result.report["folded_norm_scales"]
  np.testing.assert_allclose(_logits(aligned), _logits(b), atol=1e-4, rtol=0)
  np.testing.assert_allclose(_logits(str(tmp_path / "out" / "merged")), _logits(a), atol=1e-3,
                             rtol=0)


def test_align_refuses_bad_neox_input_with_one_line(tmp_path, capsys):
  """A rotary fraction that does not fit the head dim names rotary_pct; a NeoX folder against a
  Llama one of the same sizes is an architecture mix."""
  a = str(tmp_path / "a")
  _hf_model().save_pretrained(a)
  llama = str(tmp_path / "llama")
  transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).save_pretrained(llama)
  odd = str(tmp_path / "odd")
  _hf_model().save_pretrained(odd)
  path = os.path.join(odd, "config.json")
  config = json.load(open(path))
  del config["rope_parameters"]
  json.dump(dict(config, rotary_pct=0.3), open(path, "w"))
  out = str(tmp_path / "out")
  line = _refusal(capsys, a, odd, "--out", out)
  assert "MODEL_B" in line and "unsupported HF config: rotary_pct=0.3" in line
  for pair, (first, second) in (((a, llama), ("gpt_neox", "llama")),
                                 ((llama, a), ("llama", "gpt_neox"))):
    line = _refusal(capsys, *pair, "--out", out)
    assert (f"MODEL_A and MODEL_B have different architectures: config.json's model_type is "
            f"{first!r} in MODEL_A") in line and f"but {second!r} in MODEL_B" in line, line
  assert not os.path.exists(out)
