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
import re
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry.models import convert
from tests import child_memory
from tests.conftest import with_xla_flags
from attn_symmetry import runtime
from attn_symmetry import spec as spec_lib

GIB = 2 ** 30
# Mistral-7B's shapes (depth aside): width, FFN, heads, kv heads, head dim, vocabulary.
MISTRAL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=32000)


def write_mistral(folder, depth, seed, **sizes):
  """A random bfloat16 Mistral folder of ``depth`` layers (``MISTRAL`` sizes, or ``sizes``):
  weights N(0, 0.02), norm gains one, generated and written one tensor at a time
  (``_write_tensors``), so that a 7B-shaped folder never needs its size in memory."""
  cfg = MISTRAL | sizes
  d, f, n, k, h, v = (cfg[x] for x in ("hidden_size", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads", "head_dim", "vocab_size"))
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
            "lm_head.weight": (v, d)}
  for i in range(depth):
    p = f"model.layers.{i}."
    shapes |= {p + "self_attn.q_proj.weight": (n * h, d), p + "self_attn.k_proj.weight": (k * h, d),
               p + "self_attn.v_proj.weight": (k * h, d), p + "self_attn.o_proj.weight": (d, n * h),
               p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
               p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
               p + "post_attention_layernorm.weight": (d,)}
  rng = np.random.default_rng(seed)

  def make(name):
    if name.endswith("norm.weight"):
      return np.ones(shapes[name], ml_dtypes.bfloat16)
    return (0.02 * rng.standard_normal(shapes[name], np.float32)).astype(ml_dtypes.bfloat16)

  _write_tensors(folder, shapes, make, dict(
      cfg, model_type="mistral", architectures=["MistralForCausalLM"], num_hidden_layers=depth,
      max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
      tie_word_embeddings=False, torch_dtype="bfloat16"))


def _write_tensors(folder, shapes, make, config):
  """Writes ``folder``/model.safetensors (bfloat16 tensors of ``shapes``, {name: shape}, in that
  order, each ``make(name)``, called in that order and written before the next) and its
  config.json. The header is written first: it needs only the shapes."""
  os.makedirs(folder)
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape in shapes.items():
    size = 2 * int(np.prod(shape))
    header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  with open(os.path.join(folder, "model.safetensors"), "wb") as f:
    f.write(len(text).to_bytes(8, "little") + text)
    for name, shape in shapes.items():
      x = np.ascontiguousarray(make(name), ml_dtypes.bfloat16)
      assert x.shape == tuple(shape), (name, x.shape, shape)
      f.write(x.tobytes())
  with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f)


def plant(folder_a, folder_b, seed):
  """Writes B = g . A, one tensor at a time read from A: in every layer the query heads
  permuted within their kv groups and the kv groups permuted, and the FFN units permuted (exact
  in bfloat16: nothing is rounded)."""
  with open(os.path.join(folder_a, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  n, k, h = (config[x] for x in ("num_attention_heads", "num_key_value_heads", "head_dim"))
  rng = np.random.default_rng(seed)
  heads = lambda w, perm: w.reshape(len(perm), h, -1)[perm].reshape(w.shape)
  moves = {}  # tensor name -> its map from A's tensor to B's
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    sigma = rng.permutation(k)
    tau = (sigma[:, None] * (n // k) + np.stack([rng.permutation(n // k) for _ in range(k)]))
    tau = tau.reshape(-1)
    moves[p + "self_attn.q_proj.weight"] = lambda w, tau=tau: heads(w, tau)
    for name in ("k_proj", "v_proj"):
      moves[p + f"self_attn.{name}.weight"] = lambda w, sigma=sigma: heads(w, sigma)
    moves[p + "self_attn.o_proj.weight"] = lambda w, tau=tau: heads(w.T, tau).T
    pi = rng.permutation(config["intermediate_size"])
    for name in ("gate_proj", "up_proj"):
      moves[p + f"mlp.{name}.weight"] = lambda w, pi=pi: w[pi]
    moves[p + "mlp.down_proj.weight"] = lambda w, pi=pi: w[:, pi]
  with safe_open(os.path.join(folder_a, "model.safetensors"), framework="numpy",
                 backend="pread") as f:  # mmap would count every page read in this RSS
    shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    move = lambda name: moves.get(name, lambda w: w)(f.get_tensor(name))
    _write_tensors(folder_b, shapes, move, config)


def differing_tensors(folder_x, folder_y):
  """The names of the tensors of ``folder_x``/model.safetensors that ``folder_y``'s lacks or
  holds with other values (or dtype), and those only ``folder_y``'s holds; read one tensor at a
  time."""
  with (safe_open(os.path.join(folder_x, "model.safetensors"), framework="numpy",
                  backend="pread") as x,
        safe_open(os.path.join(folder_y, "model.safetensors"), framework="numpy",
                  backend="pread") as y):
    names_x, names_y = set(x.keys()), set(y.keys())
    differ = sorted(names_x ^ names_y)
    for name in sorted(names_x & names_y):
      a, b = x.get_tensor(name), y.get_tensor(name)
      if a.dtype != b.dtype or a.shape != b.shape or not (a == b).all():
        differ.append(name)
  return differ


_ALIGN = ("import sys; from attn_symmetry import align; "
          "sys.exit(align.cli(['align', *sys.argv[1:]]))")


def _align_in_child(*args):
  """(exit status, peak RSS in bytes, stderr) of ``attn-symmetry align ARGS`` in a child: the
  child's own peak (``child_memory``), not this process's."""
  child = child_memory.run(_ALIGN, *args)
  return child.status, child.peak, child.stderr


# A narrower Mistral (width 1024, FFN 3584, 8 query heads in 2 kv groups of 128, vocabulary
# 4096): a layer of both models is 54 MB in bfloat16, far above the run-to-run noise of a peak
# RSS, and a pair of depth 8 aligns in about a minute. Mistral-7B's own width:
# benchmarks/bench_streamed_alignment.py.
NARROW = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
              num_key_value_heads=2, head_dim=128, vocab_size=4096)


@pytest.mark.slow
def test_peak_memory_grows_with_depth_by_less_than_the_added_layers(tmp_path):
  """Planted bfloat16 pairs of the narrow Mistral, depth 1 and 4, aligned by the command in a
  child ("perm": the planted element has no per-head matrices) under a 0.3 GB budget, so both
  stream end to end, the function check reading the written folders back a layer at a time:
  A comes back tensor for tensor (in bfloat16, exactly), and the peak RSS
  grows from depth 1 to 4 by less than half of what the three added layers of both models
  take in float32, the least an alignment that holds the models would add (0.30 GiB).

  glibc's allocator keeps freed buffers of under 32 MB for reuse once its mmap threshold has
  risen to their size (a layer's tensors are 4-15 MB here), and the command fixes that
  threshold (``runtime.return_freed_buffers``), so the peak is what the alignment holds. The
  child's own peak (``child_memory``), measured: 0.73 GiB at depth 1 and at depth 4."""
  peaks, added = {}, 0
  for depth in (1, 4):
    a, b, out = (str(tmp_path / f"{x}{depth}") for x in ("a", "b", "out"))
    write_mistral(a, depth, seed=depth, **NARROW)
    plant(a, b, seed=10 + depth)
    if depth == 4:  # float32 bytes of layers 1-3 of both models
      with safe_open(os.path.join(a, "model.safetensors"), framework="numpy") as f:
        added = 2 * sum(4 * np.prod(f.get_slice(name).get_shape()) for name in f.keys()
                        if name.startswith("model.layers.") and name.split(".")[2] != "0")
    status, peaks[depth], err = _align_in_child(a, b, "--out", out, "--method", "perm",
                                                "--max-rounds", "1", "--memory-budget", "0.3")
    assert status == 0, err
    assert "of B's (read back a layer at a time)" in err
    for side in ("aligned_a", "aligned_b"):
      assert differing_tensors(a, os.path.join(out, side)) == [], side
    for folder in (a, b, out):
      subprocess.run(["rm", "-rf", folder], check=True)
  print(f"peak RSS {peaks[1] / GIB:.2f} GiB at depth 1, {peaks[4] / GIB:.2f} GiB at depth 4; "
        f"the added layers in float32 {added / GIB:.2f} GiB")
  assert peaks[4] - peaks[1] < 0.5 * added


@pytest.mark.slow
@pytest.mark.parametrize("family,method", [("gpt2", "full"), ("llama", "ortho")])
def test_streamed_descent_is_the_in_memory_one(family, method):
  """Random tiny pairs (GPT-2's permutation residual; Llama's orthogonal one, norm scales
  folded): the streamed descent gives ``align_model``'s element, identical permutations and
  matrices within 1e-5, after the same rounds and with the same distances (to rounding). Each
  pass over the groups says one progress line: the first pass, the passes of each round, the
  distance."""
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
    lines = []
    got, info = matching.align_model_streamed(model.spec, read, shapes, method=method,
                                              progress=lines.append)
  groups = len(matching.stream_groups(model.spec))
  assert set(reads) == set(matching.stream_groups(model.spec))  # one group per read
  assert info["rounds"] == int(want_info["rounds"]) > 1
  passes = [re.fullmatch(rf"(.+): a pass over {groups} groups \(\d+\.\d s\)", l) for l in lines]
  assert all(passes), lines
  what = [m[1] for m in passes]
  assert what[0].startswith("first pass") and what[-1] == "the distance", what
  rounds = [int(w.split(",")[0].removeprefix("round ")) for w in what[1:-1]]
  assert rounds == sorted(rounds) and set(rounds) == set(range(1, info["rounds"] + 1)), what
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


# In a child with 4 CPU devices (their count is fixed when JAX starts) and float64, so that the
# sums split over devices agree with one device's to float64 rounding.
_SHARDED = """
import json, os, sys
import jax
import numpy as np
jax.config.update("jax_enable_x64", True)
from attn_symmetry import align, matching, models, spec as spec_lib
from tests import test_streamed_alignment as helpers

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
P = jax.sharding.PartitionSpec
out = {"devices": len(jax.devices()), "elements": {},
       "sharding": [matching.leaf_sharding((6, 8), mesh).spec == P(None, ("devices",)),
                    matching.leaf_sharding((3, 5), mesh).spec == P(None, None)]}
for family, method in (("llama", "full"),):
  model = models.build(family, "tiny")
  flat = [{p: np.asarray(x, np.float64) for p, x in spec_lib.flatten(model.init(jax.random.key(k))).items()}
          for k in (0, 1)]
  read = lambda paths: tuple({p: f[p] for p in paths} for f in flat)
  shapes = {p: (x.shape, x.dtype) for p, x in flat[0].items()}
  one, _ = matching.align_model_streamed(model.spec, read, shapes, method=method)
  four, info = matching.align_model_streamed(model.spec, read, shapes, method=method, mesh=mesh)
  leaves = [(np.asarray(x), np.asarray(y)) for name in one
            for x, y in zip(jax.tree.leaves(one[name]), jax.tree.leaves(four[name]))]
  out["elements"][family] = {
      "permutations_equal": all((x == y).all() for x, y in leaves if x.dtype.kind == "i"),
      "permutations": sum(x.dtype.kind == "i" for x, _ in leaves),
      "matrices_max_abs": max(float(np.abs(x - y).max()) for x, y in leaves if x.dtype.kind == "f"),
      "rounds": info["rounds"]}
  if family == "llama":
    shapes32 = {p: (s, np.dtype(np.float32)) for p, (s, _) in shapes.items()}
    out["bytes"] = [matching.layer_program_memory(model.spec, shapes32, mesh=m)["argument"]
                    for m in (None, mesh)]
work = sys.argv[1]
a, b, o = (os.path.join(work, x) for x in "abo")
helpers.write_mistral(a, 2, seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128)
helpers.plant(a, b, seed=1)
assert align.cli(["align", a, b, "--out", o, "--method", "perm", "--quiet"]) == 0
out["planted_recovered"] = helpers.differing_tensors(a, os.path.join(o, "aligned_b")) == []
out["report_devices"] = json.load(open(os.path.join(o, "report.json")))["devices"]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_mesh_of_four_devices_gives_one_devices_element_and_splits_the_layer(tmp_path):
  """On 4 forced CPU devices, in float64: the streamed descent with its groups split over a
  mesh gives the one-device element (identical permutations, matrices within 1e-12; tiny
  Llama with its orthogonal residual and GQA, method "full"); a layer's program holds at most
  0.3x one device's argument bytes on each device; and the command splits over every local
  device (report.json's "devices") and recovers a planted pair tensor for tensor."""
  env = dict(os.environ, XLA_FLAGS=with_xla_flags(os.environ.get("XLA_FLAGS"),
                                                  "--xla_force_host_platform_device_count=4"),
             PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  done = subprocess.run([sys.executable, "-c", _SHARDED, str(tmp_path)], env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert out["devices"] == 4
  assert out["sharding"] == [True, True]  # the longest axis 4 divides; none: replicated
  for family, got in out["elements"].items():
    assert got["permutations"] > 0 and got["permutations_equal"], (family, got)
    assert got["matrices_max_abs"] < 1e-12, (family, got)
    assert got["rounds"] > 1, (family, got)
  one, four = out["bytes"]
  assert four <= 0.3 * one, out["bytes"]
  assert out["planted_recovered"] and out["report_devices"] == 4


@pytest.mark.slow
def test_a_layer_program_fits_a_gpu_at_mistral_7b_shapes():
  """A Mistral-7B layer (bfloat16 stored, float32 computed) in the streamed descent: its
  program's per-device memory (arguments, outputs, temporaries; compiled, not run) is at most
  8 GB on one device, so it fits any current GPU. Measured: 0.88 + 0.06 + 4.17 GiB."""
  hf = dict(MISTRAL, model_type="mistral", num_hidden_layers=2, max_position_embeddings=4096,
            rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None, tie_word_embeddings=False)
  model = models.Model(convert.config_from_hf(hf, "lm"))
  shapes = {p: (tuple(s), np.dtype(ml_dtypes.bfloat16)) for p, s in model.param_shapes.items()}
  memory = matching.layer_program_memory(model.spec, shapes, method="full")
  assert sum(memory.values()) <= 8e9, memory


def test_leaf_sharding_splits_the_longest_axis_the_devices_divide():
  """On one device every axis divides: the longest is split, the first on a tie (4 devices:
  the sharded test's child)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
  split = lambda shape: matching.leaf_sharding(shape, mesh).spec
  P = jax.sharding.PartitionSpec
  assert split((3, 8)) == P(None, ("devices",))
  assert split((8, 3)) == P(("devices",), None)
  assert split((5, 5)) == P(("devices",), None)


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
