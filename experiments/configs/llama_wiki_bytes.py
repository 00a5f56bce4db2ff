"""Offline byte-level language modelling: Llama on gensim's shortened Wikipedia dump.

    python experiments/main.py --config=experiments/configs/llama_wiki_bytes.py --workdir=/tmp/attn_symmetry/llama_wiki_bytes

Variants (``--config=experiments/configs/llama_wiki_bytes.py:runlocal``):
"rope" (the default) or "ape" (learned absolute positions); "runlocal". The enwik8 analogue that runs offline: the text is
English Wikipedia XML from the ``gensim`` wheel's test data. Sized for a
CPU (2 layers, 4 heads, D = 64, windows of 128 bytes).
"""

from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope"))
  config = default.language_model(variants, family="llama", dataset="wiki_bytes", seq_len=128,
                                  default_pe="rope")
  default.cpu_schedule(config)
  if "runlocal" in variants:
    default.runlocal(config)
  return config
