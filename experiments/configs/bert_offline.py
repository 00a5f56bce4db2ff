"""Offline text classification: BERT identifying the language of fortune cookies.

    python experiments/main.py --config=experiments/configs/bert_offline.py --workdir=/tmp/attn_symmetry/bert_offline

Variants (``--config=experiments/configs/bert_offline.py:rope``): "ape"
(BERT's learned positions, the default) or "rope"; "runlocal". Runs offline on
``fortune_languages`` (Debian's fortune cookies, 2,000 in each of English,
German, Spanish, Italian and Polish; ``apt-get install -y fortunes fortunes-de
fortunes-es fortunes-it fortunes-pl``), read as bytes cut to 64. Sized for a
CPU (2 layers, 4 heads, D = 64). Every run trains on the first 90 % of the
8,000 training cookies; a re-initialised run stops when its loss on the other
800 has not improved for 4 validations (100 steps apart), or after 2000 steps.
"""

from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope"))
  config = default.text_classifier(variants, dataset="fortune_languages", seq_len=64)
  default.cpu_schedule(config)
  config.reinit.num_steps = 2000
  default.stopping_rule(config, train_split="train[:90%]", validation_split="train[90%:]",
                        patience=4, validate_every=100)
  if "runlocal" in variants:
    default.runlocal(config)
  return config
