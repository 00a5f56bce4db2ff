"""BERT on IMDB movie reviews, positive or negative (6 layers, 4 heads).

    python experiments/main.py --config=experiments/configs/bert_imdb.py --workdir=/tmp/attn_symmetry/bert_imdb

Variants (``--config=experiments/configs/bert_imdb.py:rope``): "ape"
(BERT's learned positions, the default) or "rope"; "runlocal". Texts are read
as bytes, cut to 512. Needs ``python -m attn_symmetry.data.prepare imdb_reviews``
first. The paper's hyper-parameters (its Appendix I) are not in our copy;
these are ours.
"""

from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope"))
  config = default.text_classifier(variants, dataset="imdb_reviews", seq_len=512)
  if "runlocal" in variants:
    default.runlocal(config)
  return config
