"""Llama on the One Billion Word benchmark, byte-level (6 layers, 4 heads, 2 kv heads).

    python experiments/main.py --config=experiments/configs/llama_lm1b.py --workdir=/tmp/attn_symmetry/llama_lm1b

Variants (``--config=experiments/configs/llama_lm1b.py:ape``): "rope" (Llama's
own, the default) or "ape" (learned absolute positions instead);
"to_wikitext103" (lm1b -> WikiText-103 for the re-initialised scopes);
"runlocal". Needs ``python -m attn_symmetry.data.prepare lm1b`` first (TFDS;
the command says what it needs). The paper's hyper-parameters (its Appendix
I) are not in our copy; these are ours.
"""

from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope", "to_wikitext103"))
  config = default.language_model(variants, family="llama", dataset="lm1b", seq_len=128,
                                  transfers={"to_wikitext103": "wikitext103"},
                                  default_pe="rope", num_kv_heads=2)
  if "runlocal" in variants:
    default.runlocal(config)
  return config
