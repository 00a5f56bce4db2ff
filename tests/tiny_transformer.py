"""A two-layer pure-JAX Transformer and its symmetry spec, for testing the spec mechanism.

Two flavours, chosen by ``rms``:
* LayerNorm, GELU MLP, learned absolute positions, biases: the residual
  stream has a permutation symmetry;
* RMSNorm, SwiGLU, grouped-query RoPE attention, no biases: the residual
  stream has an orthogonal symmetry once the norm scales are folded.
"""

import jax
import jax.numpy as jnp

from attn_symmetry import attention
from attn_symmetry import spec as spec_lib

VOCAB, WIDTH, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS, MAX_LEN = 11, 12, 4, 2, 6, 20, 2, 9


def _norm(x, p, rms):
  if rms:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["scale"]
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]


def init(key, *, rms=False, dtype=jnp.float64):
  keys = iter(jax.random.split(key, 64))
  normal = lambda shape, scale=0.3: scale * jax.random.normal(next(keys), shape, dtype)
  def norm():
    return {"scale": 1.0 + normal((WIDTH,))} | ({} if rms else {"bias": normal((WIDTH,))})
  params = {"embed": {"embedding": normal((VOCAB, WIDTH), 1.0)}, "final_norm": norm(),
            "head": {"kernel": normal((WIDTH, VOCAB))}}
  if not rms:
    params["pos_embed"] = {"embedding": normal((MAX_LEN, WIDTH))}
  for i in range(LAYERS):
    attn = attention.init_attention(next(keys), width=WIDTH, num_heads=HEADS, head_dim=HEAD_DIM,
                                    num_kv_heads=KV_HEADS if rms else None, use_bias=not rms,
                                    dtype=dtype)
    if rms:
      mlp = {"gate": {"kernel": normal((WIDTH, HIDDEN))}, "up": {"kernel": normal((WIDTH, HIDDEN))},
             "down": {"kernel": normal((HIDDEN, WIDTH))}}
    else:
      mlp = {"wi": {"kernel": normal((WIDTH, HIDDEN)), "bias": normal((HIDDEN,))},
             "wo": {"kernel": normal((HIDDEN, WIDTH)), "bias": normal((WIDTH,))}}
    params[f"layers_{i}"] = {"attention_norm": norm(), "attention": attn, "mlp_norm": norm(),
                             "mlp": mlp}
  return params


def apply(params, tokens, *, rms=False):
  """tokens [B, T] -> logits [B, T, VOCAB]; causal."""
  x = params["embed"]["embedding"][tokens]
  if not rms:
    x = x + params["pos_embed"]["embedding"][: tokens.shape[1]]
  for i in range(LAYERS):
    p = params[f"layers_{i}"]
    h = _norm(x, p["attention_norm"], rms)
    x = x + attention.multi_head_attention(p["attention"], h, causal=True,
                                           pos_encoding="rope" if rms else "learned")
    h = _norm(x, p["mlp_norm"], rms)
    m = p["mlp"]
    if rms:
      x = x + (jax.nn.silu(h @ m["gate"]["kernel"]) * (h @ m["up"]["kernel"])) @ m["down"]["kernel"]
    else:
      x = x + jax.nn.gelu(h @ m["wi"]["kernel"] + m["wi"]["bias"]) @ m["wo"]["kernel"] + m["wo"]["bias"]
  return _norm(x, params["final_norm"], rms) @ params["head"]["kernel"]


def symmetry_spec(*, rms=False):
  r = "residual"
  factors = {r: spec_lib.Factor(WIDTH, "orthogonal" if rms else "permutation")}
  norm = lambda prefix: {f"{prefix}/scale": (r,)} | ({} if rms else {f"{prefix}/bias": (r,)})
  axes = {"embed/embedding": (None, r), "head/kernel": (r, None)} | norm("final_norm")
  norm_scales = {"final_norm/scale": ("head/kernel",)}
  if not rms:
    axes["pos_embed/embedding"] = (None, r)
  sites = {}
  for i in range(LAYERS):
    lp, ffn = f"layers_{i}", f"layers_{i}/mlp"
    factors[ffn] = spec_lib.Factor(HIDDEN)
    axes |= norm(f"{lp}/attention_norm") | norm(f"{lp}/mlp_norm")
    readers = tuple(f"{lp}/attention/{n}/kernel" for n in ("query", "key", "value"))
    axes |= {readers[0]: (r, None, None), readers[1]: (r, None, None),
             readers[2]: (r, None, None), f"{lp}/attention/out/kernel": (None, None, r)}
    if rms:
      mlp_readers = (f"{ffn}/gate/kernel", f"{ffn}/up/kernel")
      axes |= {mlp_readers[0]: (r, ffn), mlp_readers[1]: (r, ffn), f"{ffn}/down/kernel": (ffn, r)}
    else:
      mlp_readers = (f"{ffn}/wi/kernel",)
      axes |= {f"{ffn}/wi/kernel": (r, ffn), f"{ffn}/wi/bias": (ffn,),
               f"{ffn}/wo/kernel": (ffn, r), f"{ffn}/wo/bias": (r,)}
      axes |= {f"{lp}/attention/{n}/bias": (None, None) for n in ("query", "key", "value")}
      axes[f"{lp}/attention/out/bias"] = (r,)
    norm_scales[f"{lp}/attention_norm/scale"] = readers
    norm_scales[f"{lp}/mlp_norm/scale"] = mlp_readers
    sites[f"{lp}/attention"] = spec_lib.AttentionSite(
        HEADS, HEAD_DIM, num_kv_heads=KV_HEADS if rms else None, group="rope" if rms else "gl")
  return spec_lib.SymmetrySpec(factors, axes, sites, norm_scales if rms else {})
