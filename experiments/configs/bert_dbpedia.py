"""BERT on DBpedia ontology classification, 14 classes (6 layers, 4 heads).

    python experiments/main.py --config=experiments/configs/bert_dbpedia.py --workdir=/tmp/attn_symmetry/bert_dbpedia

Variants (``--config=experiments/configs/bert_dbpedia.py:rope``): "ape"
(BERT's learned positions, the default) or "rope"; "runlocal". Texts are read
as bytes, cut to 256. Needs ``python -m attn_symmetry.data.prepare dbpedia``
first. The paper's hyper-parameters (its Appendix I) are not in our copy;
these are ours.
"""

from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope"))
  config = default.text_classifier(variants, dataset="dbpedia", seq_len=256)
  if "runlocal" in variants:
    default.runlocal(config)
  return config
