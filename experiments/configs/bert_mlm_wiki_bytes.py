"""Offline masked language modelling: BERT on gensim's shortened Wikipedia dump, as bytes.

    python experiments/main.py --config=experiments/configs/bert_mlm_wiki_bytes.py --workdir=/tmp/attn_symmetry/bert_mlm_wiki_bytes

Variants (``--config=experiments/configs/bert_mlm_wiki_bytes.py:rope``): "ape"
(BERT's learned positions, the default) or "rope"; "runlocal". BERT with its
masked-LM head on the windows that the byte-level language models read: 15 % of
each window's bytes are replaced by a mask token and predicted from both sides
(``evaluation.masked_positions``: an example hides the same bytes every time it
is met, so a path's points are evaluated on the same predictions). Sized for a
CPU (2 layers, 4 heads, D = 64, windows of 128 bytes). Every run trains on the
training split; a re-initialised run stops when its loss on the validation
split has not improved for 5 evaluations (500 steps), or after 3000 steps.
"""

from experiments.configs import default


def get_config(arg=None):
  return default.wiki_bytes_setting(arg, family="bert", head="mlm")
