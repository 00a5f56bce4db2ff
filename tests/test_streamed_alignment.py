"""The streamed alignment (``matching.align_model_streamed``, ``align_checkpoints``): the same
element as the in-memory descent, and a peak memory that grows with depth by less than the added
layers would take (a narrow Mistral; Mistral-7B's width: benchmarks/bench_streamed_alignment.py).

``write_mistral`` writes random bfloat16 Mistral-shaped folders with numpy and safetensors
alone (no torch), and ``plant`` B = g . A with g permuting the heads within kv groups and the
FFN units of every layer; norm gains are one, so folding them changes nothing and A comes back
tensor for tensor.
"""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry import runtime
from attn_symmetry import spec as spec_lib

GIB = 2 ** 30
# Mistral-7B's shapes (depth aside): width, FFN, heads, kv heads, head dim, vocabulary.
MISTRAL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=32000)


def write_mistral(folder, depth, seed, **sizes):
  """A random bfloat16 Mistral folder of ``depth`` layers (``MISTRAL`` sizes, or ``sizes``):
  weights N(0, 0.02), norm gains one. Returns its tensors {name: bfloat16 array}."""
  cfg = MISTRAL | sizes
  d, f, n, k, h, v = (cfg[x] for x in ("hidden_size", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads", "head_dim", "vocab_size"))
  rng = np.random.default_rng(seed)
  normal = lambda *shape: (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
  ones = lambda: np.ones(d, ml_dtypes.bfloat16)
  tensors = {"model.embed_tokens.weight": normal(v, d), "model.norm.weight": ones(),
             "lm_head.weight": normal(v, d)}
  for i in range(depth):
    p = f"model.layers.{i}."
    tensors |= {p + "self_attn.q_proj.weight": normal(n * h, d),
                p + "self_attn.k_proj.weight": normal(k * h, d),
                p + "self_attn.v_proj.weight": normal(k * h, d),
                p + "self_attn.o_proj.weight": normal(d, n * h),
                p + "mlp.gate_proj.weight": normal(f, d), p + "mlp.up_proj.weight": normal(f, d),
                p + "mlp.down_proj.weight": normal(d, f),
                p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones()}
  _save(folder, tensors, dict(cfg, model_type="mistral", architectures=["MistralForCausalLM"],
                              num_hidden_layers=depth, max_position_embeddings=4096,
                              rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
                              tie_word_embeddings=False, torch_dtype="bfloat16"))
  return tensors


def _save(folder, tensors, config):
  os.makedirs(folder)
  save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f)


def plant(folder_a, folder_b, tensors, seed):
  """Writes B = g . A: in every layer the query heads permuted within their kv groups and the
  kv groups permuted, and the FFN units permuted (exact in bfloat16: nothing is rounded)."""
  with open(os.path.join(folder_a, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  n, k, h = (config[x] for x in ("num_attention_heads", "num_key_value_heads", "head_dim"))
  rng = np.random.default_rng(seed)
  out = dict(tensors)
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    sigma = rng.permutation(k)
    tau = (sigma[:, None] * (n // k) + np.stack([rng.permutation(n // k) for _ in range(k)]))
    tau = tau.reshape(-1)
    heads = lambda w, perm: w.reshape(len(perm), h, -1)[perm].reshape(w.shape)
    out[p + "self_attn.q_proj.weight"] = heads(tensors[p + "self_attn.q_proj.weight"], tau)
    for name in ("k_proj", "v_proj"):
      out[p + f"self_attn.{name}.weight"] = heads(tensors[p + f"self_attn.{name}.weight"], sigma)
    out[p + "self_attn.o_proj.weight"] = heads(tensors[p + "self_attn.o_proj.weight"].T, tau).T
    pi = rng.permutation(config["intermediate_size"])
    for name in ("gate_proj", "up_proj"):
      out[p + f"mlp.{name}.weight"] = tensors[p + f"mlp.{name}.weight"][pi]
    out[p + "mlp.down_proj.weight"] = tensors[p + "mlp.down_proj.weight"][:, pi]
  _save(folder_b, {name: np.ascontiguousarray(x) for name, x in out.items()}, config)


# The alignment in a child, so that its peak RSS (os.wait4's ru_maxrss) is its own.
_ALIGN = ("import sys; from attn_symmetry import align; "
          "sys.exit(align.cli(['align', *sys.argv[1:]]))")


def _align_in_child(*args, env=None):
  """(exit status, peak RSS in bytes, stderr) of ``attn-symmetry align ARGS`` in a child (with
  ``env`` added to this process's environment)."""
  with open(os.devnull, "wb") as null:
    child = subprocess.Popen([sys.executable, "-c", _ALIGN, *args], stdout=null,
                             stderr=subprocess.PIPE, env=os.environ | (env or {}))
    err = child.stderr.read().decode()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
  return child.returncode, usage.ru_maxrss * 1024, err


# A narrower Mistral (width 1024, FFN 3584, 8 query heads in 2 kv groups of 128, vocabulary
# 4096): a layer of both models is 54 MB in bfloat16, far above the run-to-run noise of a peak
# RSS, and a pair of depth 8 aligns in about a minute. Mistral-7B's own width:
# benchmarks/bench_streamed_alignment.py.
NARROW = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
              num_key_value_heads=2, head_dim=128, vocab_size=4096)


@pytest.mark.slow
def test_peak_memory_grows_with_depth_by_less_than_the_added_layers(tmp_path):
  """Planted bfloat16 pairs of the narrow Mistral, depth 1 and 8, aligned by the command in a
  child ("perm": the planted element has no per-head matrices) under a 0.3 GB budget, so both
  stream end to end: A comes back tensor for tensor (in bfloat16, exactly), and the peak RSS
  grows from depth 1 to 8 by less than half of what the seven added layers of both models
  take in float32, the least an alignment that holds the models would add (0.71 GiB).

  glibc's allocator keeps freed buffers of under 32 MB for reuse once its mmap threshold has
  risen to their size (a layer's tensors are 4-15 MB here; Mistral-7B's are over 32 MB and go
  back to the system when freed), so the child runs with a fixed threshold
  (``MALLOC_MMAP_THRESHOLD_``): the peak is then what the alignment holds. Measured with it, in
  three runs: 0.77-0.78 -> 0.91-0.94 GiB, each layer's descent peaking at 0.84-0.87 GiB at
  depth 8 and the apply pass flat; without it the peak grew by 0.16-0.33 GiB in four runs and by
  more than the bound in a fifth, retained free memory rising through the apply pass."""
  peaks, added = {}, 0
  for depth in (1, 8):
    a, b, out = (str(tmp_path / f"{x}{depth}") for x in ("a", "b", "out"))
    tensors = write_mistral(a, depth, seed=depth, **NARROW)
    plant(a, b, tensors, seed=10 + depth)
    if depth == 8:  # float32 bytes of layers 1-7 of both models
      added = 2 * sum(4 * x.size for name, x in tensors.items()
                      if name.startswith("model.layers.") and name.split(".")[2] != "0")
    status, peaks[depth], err = _align_in_child(a, b, "--out", out, "--method", "perm",
                                                "--max-rounds", "1", "--memory-budget", "0.3",
                                                env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert status == 0, err
    assert "function check skipped" in err
    for side in ("aligned_a", "aligned_b"):
      with safe_open(os.path.join(out, side, "model.safetensors"), framework="numpy") as f:
        assert set(f.keys()) == set(tensors)
        for name, x in tensors.items():
          np.testing.assert_array_equal(f.get_tensor(name), x, err_msg=f"{side} {name}")
    del tensors
    for folder in (a, b, out):
      subprocess.run(["rm", "-rf", folder], check=True)
  print(f"peak RSS {peaks[1] / GIB:.2f} GiB at depth 1, {peaks[8] / GIB:.2f} GiB at depth 8; "
        f"the added layers in float32 {added / GIB:.2f} GiB")
  assert peaks[8] - peaks[1] < 0.5 * added


@pytest.mark.slow
@pytest.mark.parametrize("family,method", [("gpt2", "full"), ("llama", "ortho")])
def test_streamed_descent_is_the_in_memory_one(family, method):
  """Random tiny pairs (GPT-2's permutation residual; Llama's orthogonal one, norm scales
  folded): the streamed descent gives ``align_model``'s element, identical permutations and
  matrices within 1e-5, after the same rounds and with the same distances (to rounding)."""
  model = models.build(family, "tiny")
  params_a, params_b = model.init(jax.random.key(0)), model.init(jax.random.key(1))
  flat_a, flat_b = spec_lib.flatten(params_a), spec_lib.flatten(params_b)
  reads = []

  def read(paths):
    reads.append(tuple(paths))
    return {p: np.asarray(flat_a[p]) for p in paths}, {p: np.asarray(flat_b[p]) for p in paths}

  shapes = {p: (x.shape, x.dtype) for p, x in flat_a.items()}
  with runtime.single_threaded_blas():
    want, want_info = matching.align_model(model.spec, params_a, params_b, method=method)
    got, info = matching.align_model_streamed(model.spec, read, shapes, method=method)
  assert set(reads) == set(matching.stream_groups(model.spec))  # one group per read
  assert info["rounds"] == int(want_info["rounds"]) > 1
  assert info["folded_norm_scales"] == want_info["folded_norm_scales"] == (family == "llama")
  for when in ("initial", "final"):
    np.testing.assert_allclose(info["distance"][when], want_info["distance"][when], rtol=1e-5)
  assert info["distance"]["final"] < 0.9 * info["distance"]["initial"]
  assert set(got) == set(want)
  for name in want:
    for x, y in zip(jax.tree.leaves(want[name]), jax.tree.leaves(got[name])):
      if np.asarray(x).dtype.kind == "i":
        np.testing.assert_array_equal(x, y, err_msg=name)
      else:
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0, err_msg=name)


def test_learned_is_not_streamed():
  model = models.build("gpt2", "tiny")
  shapes = {p: (s, np.dtype(np.float32)) for p, s in model.param_shapes.items()}
  with pytest.raises(ValueError, match="method 'learned' is not streamed .*use align_model"):
    matching.align_model_streamed(model.spec, lambda paths: ({}, {}), shapes, method="learned")


def test_stream_groups_keep_norm_scales_with_their_readers():
  """Every leaf in one group; Llama's final norm with the head that reads it, each layer alone."""
  spec = models.build("llama", "tiny").spec
  groups = matching.stream_groups(spec)
  assert sorted(p for g in groups for p in g) == sorted(spec.axes)
  tops = [sorted({p.split("/")[0] for p in g}) for g in groups]
  assert ["final_norm", "head"] in tops and ["layers_0"] in tops and ["embed"] in tops
