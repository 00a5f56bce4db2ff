"""GPT-2 on enwik8, byte-level language modelling (the paper's LM setting; 6 layers, 4 heads).

    python experiments/main.py --config=experiments/configs/gpt2_enwik8.py --workdir=/tmp/attn_symmetry/gpt2_enwik8

Variants (``--config=experiments/configs/gpt2_enwik8.py:rope``): "ape" (GPT-2's
learned positions, the default) or "rope"; "to_wikitext103" (enwik8 ->
WikiText-103: re-initialised scopes are fine-tuned on WikiText-103, also
bytes); "runlocal". Needs ``python -m attn_symmetry.data.prepare enwik8``
first. The paper's hyper-parameters (its Appendix I) are not in our copy;
these are ours.
"""

from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope", "to_wikitext103"))
  config = default.language_model(variants, family="gpt2", dataset="enwik8",
                                  transfers={"to_wikitext103": "wikitext103"})
  if "runlocal" in variants:
    default.runlocal(config)
  return config
