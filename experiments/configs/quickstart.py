"""Quickstart: a ViT on scikit-learn's digits, the whole study in minutes on 2 CPU cores.

    python experiments/main.py --config=experiments/configs/quickstart.py --workdir=/tmp/quickstart

Variants (``--config=experiments/configs/quickstart.py:rope,runlocal``):
"ape" (learned absolute positions, the default) or "rope" (axial 2-D RoPE over
the patch grid), "runlocal" (seconds, for tests).

A base model with 4 heads, then every re-initialisation scope (docs/lmc.md,
'Re-initialisation') with three seeds, so that the study has three pairs per scope. Runs
offline: the digits come with scikit-learn. Every run trains on 90 % of the
training split; a re-initialised run stops when its loss on the other 10 %
has not improved for 4 evaluations (100 steps), or after 1000 steps (the
"full" scope: 500).
"""

from attn_symmetry import models
from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope"))
  config = default.get_config()
  config.model.family = "vit"
  config.model.preset = "tiny"
  config.model.overrides.width = 64
  config.model.overrides.mlp_dim = 128
  config.model.overrides.patch_size = 2
  default.set_position_encoding(config, variants, ape="learned", rope="rope2d")
  config.dataset.name = "digits"
  config.train.num_steps = 500
  config.train.batch_size = 64
  config.train.learning_rate = 3e-3
  config.train.warmup_steps = 50
  config.train.log_every = 100
  config.train.eval_every = 250
  config.train.checkpoint_every = 250
  config.reinit.scopes = models.SCOPES
  config.reinit.seeds = (1, 2, 3)
  config.reinit.num_steps = 1000
  config.reinit.learning_rate = 3e-3
  config.reinit.warmup_steps = 20
  default.stopping_rule(config, train_split="train[:90%]", validation_split="train[90%:]",
                        patience=4, validate_every=25)
  if "runlocal" in variants:
    default.runlocal(config)
  return config
