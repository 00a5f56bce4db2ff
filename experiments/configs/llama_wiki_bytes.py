"""Offline byte-level language modelling: Llama on gensim's shortened Wikipedia dump.

    python experiments/main.py --config=experiments/configs/llama_wiki_bytes.py --workdir=/tmp/attn_symmetry/llama_wiki_bytes

Variants (``--config=experiments/configs/llama_wiki_bytes.py:runlocal``):
"rope" (the default) or "ape" (learned absolute positions); "runlocal". The enwik8 analogue that runs offline: the text is
English Wikipedia XML from the ``gensim`` wheel's test data. Sized for a
CPU (2 layers, 4 heads, D = 64, windows of 128 bytes). Every run trains on the
training split; a re-initialised run stops when its loss on the validation
split has not improved for 5 evaluations (500 steps), or after 3000 steps
(the "full" scope: 1000).
"""

from experiments.configs import default


def get_config(arg=None):
  return default.wiki_bytes_setting(arg, family="llama", default_pe="rope")
