"""A model family defined in this file alone: Qwen2, Llama's architecture with biases on the
query, key and value projections and on nothing else.

``QWEN2`` is one ``models.Family`` with its Hugging Face mapping (``hf.HFMapping``), built from
the decoder's module, spec and Llama's tensor table; no library file names it. Registered, it
converts both ways against transformers' ``Qwen2ForCausalLM``, and ``attn-symmetry align
--import MODULE`` (a module that registers it) aligns a planted pair of its checkpoint folders,
written by ``test_align_checkpoints._plant`` straight on the HF tensors, and gives A back; without
the import the command refuses the folders' model type.
"""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from attn_symmetry import align
from attn_symmetry import models
from attn_symmetry import registry
from attn_symmetry import tasks
from attn_symmetry.models import convert
from attn_symmetry.models import decoder
from attn_symmetry.models import hf
from tests import test_align_checkpoints as planted

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TOL = 1e-4
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, vocab_size=64, max_position_embeddings=32,
             rope_parameters={"rope_type": "default", "rope_theta": 500.0})
# The module that ``--import`` runs: it registers the family of this file.
MODULE = """from attn_symmetry import models
from tests.test_qwen2_family import QWEN2

models.register_family(QWEN2)
"""


def _from_hf(c, head):
  del head  # "lm", its only head
  hf.require(c, "use_sliding_window", lambda v: not v, "the zoo's attention has no sliding window")
  return models.make_config(
      "qwen2", width=c.hidden_size, depth=c.num_hidden_layers, num_heads=c.num_attention_heads,
      num_kv_heads=c.num_key_value_heads or c.num_attention_heads, mlp_dim=c.intermediate_size,
      max_len=c.max_position_embeddings, vocab_size=c.vocab_size, norm_eps=c.rms_norm_eps,
      rope_base=hf.rope_theta(c), activation=hf.activation(c.hidden_act),
      tied_embeddings=c.tie_word_embeddings)


def _to_hf(cfg):
  return transformers.Qwen2Config(
      hidden_size=cfg.width, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.mlp_dim,
      max_position_embeddings=cfg.max_len, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.norm_eps,
      rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
      hidden_act=hf.ACT_TO_HF[cfg.activation], tie_word_embeddings=cfg.tied_embeddings)


QWEN2 = models.Family(
    "qwen2", decoder.Decoder, decoder.symmetry_spec, input_key="tokens", heads={"lm": tasks.LM},
    defaults=dict(pos_encoding="rope", rope_pairing="half", norm="rms", norm_eps=1e-6,
                  activation="silu", gated_mlp=True, causal=True, use_bias=False, qkv_bias=True,
                  tied_embeddings=False),
    hf=hf.HFMapping(
        model_types=("qwen2",), classes={"lm": "Qwen2ForCausalLM"}, config_from_hf=_from_hf,
        hf_config=_to_hf, table=decoder.llama_table, prefix="model.",
        defaults={"qwen2": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=32, intermediate_size=22016,
                                max_position_embeddings=32768, vocab_size=151936,
                                rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                                use_sliding_window=False, rope_theta=10000.0)}))


@pytest.fixture
def qwen2():
  """QWEN2 registered for one test."""
  with registry.scoped():
    yield models.register_family(QWEN2)


def _hf_model(seed=0):
  """A tiny random Qwen2ForCausalLM with every parameter perturbed (biases and norms included)."""
  torch.manual_seed(seed)
  model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, bos_token_id=0,
                                                                 eos_token_id=0))
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  return model.eval()


def _tokens():
  return np.random.default_rng(1).integers(0, SMALL["vocab_size"], (2, 7))


def test_registration_makes_the_model_type_read(qwen2):
  """The HF model type is read once the family is registered; a family with another mapping
  cannot read it too."""
  assert "qwen2" in convert.model_types() and convert.family_of("qwen2") is qwen2
  assert convert.config_from_hf({"model_type": "qwen2"}, "lm") == convert.config_from_hf(
      transformers.Qwen2Config(), "lm")  # config.json's absent fields: the class defaults
  shapes = models.build("qwen2").param_shapes
  assert sorted(p for p in shapes if p.startswith("layers_0/") and p.endswith("/bias")) == [
      f"layers_0/attention/{name}/bias" for name in ("key", "query", "value")]
  copy = models.register_family(dataclasses.replace(QWEN2, name="qwen2_copy"))  # one mapping
  assert convert.family_of("qwen2") is qwen2 and convert.model_types().count("qwen2") == 1
  with pytest.raises(ValueError, match=r"HF model types \['qwen2'\] are read by family 'qwen2'"):
    models.register_family(dataclasses.replace(
        QWEN2, name="qwen2_other", hf=dataclasses.replace(copy.hf, prefix="qwen.")))
  with pytest.raises(ValueError, match=r"hf.classes names heads \['mlm'\]"):
    models.register_family(dataclasses.replace(
        QWEN2, name="other", hf=dataclasses.replace(QWEN2.hf, model_types=("other",),
                                                    classes={"mlm": "Qwen2ForMaskedLM"})))


def test_unregistered_the_model_type_is_refused():
  with pytest.raises(ValueError, match="unsupported HF model type 'qwen2'; supported: gpt2, llama"):
    convert.config_from_hf({"model_type": "qwen2"}, "lm")


def test_a_family_without_a_mapping_is_named():
  with registry.scoped():
    models.register_family(dataclasses.replace(QWEN2, name="no_hf", hf=None))
    with pytest.raises(ValueError, match="model family 'no_hf' has no Hugging Face mapping"):
      convert.param_table(models.make_config("no_hf"))
    assert "qwen2" not in convert.model_types()


def test_converts_both_ways(qwen2):
  """``load_hf`` gives transformers' logits; ``to_hf`` gives back its state dict exactly."""
  del qwen2
  hf_model = _hf_model()
  model, params = convert.load_hf(hf_model)
  cfg = model.config
  assert (cfg.family, cfg.qkv_bias, cfg.out_bias, cfg.mlp_bias, cfg.kv_heads) == (
      "qwen2", True, False, False, 2)
  tokens = _tokens()
  logits, _ = model.apply(params, tokens)
  with torch.no_grad():
    want = hf_model(input_ids=torch.from_numpy(tokens)).logits.numpy()
  np.testing.assert_allclose(np.asarray(logits), want, atol=TOL, rtol=0)
  back = convert.to_hf(model, params)
  assert type(back).__name__ == "Qwen2ForCausalLM"
  state, want_state = back.state_dict(), hf_model.state_dict()
  assert set(state) == set(want_state)
  for key, value in want_state.items():
    np.testing.assert_array_equal(state[key].numpy(), value.numpy(), err_msg=key)
  with pytest.raises(ValueError, match="Qwen2ForCausalLM cannot express config fields "
                                       "{'out_bias': True}"):
    convert.hf_config(models.make_config("qwen2", num_kv_heads=2, out_bias=True))


@pytest.mark.slow
def test_the_command_aligns_a_planted_pair_through_import(tmp_path, monkeypatch, capsys):
  """Without ``--import`` the command refuses the folders; with it, A comes back (its RMSNorm
  gains folded: the orthogonal residual) and aligned_b has B's function under transformers."""
  monkeypatch.setitem(planted.ATTENTION, "qwen2", planted.ATTENTION["llama"])
  monkeypatch.setattr(planted, "ROPE", (*planted.ROPE, "qwen2"))  # H(H) plants, norms folded
  a = str(tmp_path / "a")
  _hf_model().save_pretrained(a)
  b = planted._plant("qwen2", a, str(tmp_path / "b"), seed=1)
  out = str(tmp_path / "out")
  refusal = planted._refusal(capsys, a, b, "--out", out)
  assert "unsupported HF model type 'qwen2' in config.json" in refusal
  (tmp_path / "qwen2_family.py").write_text(MODULE)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  with registry.scoped():
    try:
      status = align.cli(["align", a, b, "--out", out, "--quiet", "--import", "qwen2_family",
                          "--init", "best", "--steps", "0"])  # test_align_checkpoints.EXACT
    finally:
      sys.modules.pop("qwen2_family", None)
  assert status == 0 and "qwen2" not in models.FAMILIES
  report = json.load(open(os.path.join(out, "report.json")))
  assert report["model_type"] == "qwen2" and report["config"]["qkv_bias"]
  assert report["folded_norm_scales"] and report["distance"]["after"]["relative"] <= TOL
  aligned = os.path.join(out, "aligned_b")
  planted._check_recovered("qwen2", a, aligned)
  logits = [transformers.Qwen2ForCausalLM.from_pretrained(f).eval()(
      input_ids=torch.from_numpy(_tokens())).logits.detach().numpy() for f in (aligned, b)]
  np.testing.assert_allclose(*logits, atol=TOL, rtol=0)
