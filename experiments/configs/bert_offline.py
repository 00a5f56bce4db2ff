"""Offline text classification: BERT on a 20 Newsgroups sample (alt.atheism vs sci.space).

    python experiments/main.py --config=experiments/configs/bert_offline.py --workdir=/tmp/attn_symmetry/bert_offline

Variants (``--config=experiments/configs/bert_offline.py:rope``): "ape"
(BERT's learned positions, the default) or "rope"; "runlocal". Runs offline:
the 200 posts come with the ``gensim`` wheel's test data (label 0 alt.atheism,
1 sci.space), read as bytes cut to 256. Sized for a CPU (2 layers, 4 heads,
D = 64). Every run trains on 80 % of the 160 training posts; a re-initialised
run stops when its loss on the other 32 has not improved for 4 evaluations
(100 steps), or after 2000 steps (the "full" scope: 1000).
"""

from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope"))
  config = default.text_classifier(variants, dataset="newsgroups_mini", seq_len=256)
  default.cpu_schedule(config)
  config.reinit.num_steps = 2000
  default.stopping_rule(config, train_split="train[:80%]", validation_split="train[80%:]",
                        patience=4, validate_every=25)
  if "runlocal" in variants:
    default.runlocal(config)
  return config
