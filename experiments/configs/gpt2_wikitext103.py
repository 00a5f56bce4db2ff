"""GPT-2 on WikiText-103, byte-level language modelling (6 layers, 4 heads).

    python experiments/main.py --config=experiments/configs/gpt2_wikitext103.py --workdir=/tmp/attn_symmetry/gpt2_wikitext103

Variants (``--config=experiments/configs/gpt2_wikitext103.py:rope``): "ape"
(GPT-2's learned positions, the default) or "rope"; "to_enwik8" (WikiText-103
-> enwik8 for the re-initialised scopes); "runlocal". Needs ``python -m
attn_symmetry.data.prepare wikitext103`` first. The paper's hyper-parameters
(its Appendix I) are not in our copy; these are ours.
"""

from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope", "to_enwik8"))
  config = default.language_model(variants, family="gpt2", dataset="wikitext103",
                                  transfers={"to_enwik8": "enwik8"})
  if "runlocal" in variants:
    default.runlocal(config)
  return config
