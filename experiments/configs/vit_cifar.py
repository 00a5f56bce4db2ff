"""ViT on CIFAR-10 (the paper's vision setting; 6 layers, 4 heads).

    python experiments/main.py --config=experiments/configs/vit_cifar.py --workdir=/tmp/attn_symmetry/vit_cifar

Variants (``--config=experiments/configs/vit_cifar.py:rope``): "ape" (learned
absolute positions, the default) or "rope" (axial 2-D RoPE over the patch
grid); "runlocal". Needs ``python -m attn_symmetry.data.prepare cifar10``
first. Random crops and flips. The paper's hyper-parameters (its Appendix I)
are not in our copy; these are ours.
"""

from attn_symmetry import models
from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope"))
  config = default.get_config()
  config.model.family = "vit"
  config.model.preset = "paper"
  config.model.overrides.patch_size = 4
  default.set_position_encoding(config, variants, ape="learned", rope="rope2d")
  config.dataset.name = "cifar10"
  config.dataset.augment = True
  config.train.num_steps = 30000
  config.train.batch_size = 128
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 1000
  config.train.eval_every = 2000
  config.train.checkpoint_every = 2000
  config.reinit.scopes = models.SCOPES
  config.reinit.num_steps = 5000
  config.reinit.warmup_steps = 500
  default.stopping_rule(config, train_split="train[:90%]", validation_split="train[90%:]",
                        patience=5, validate_every=500)
  if "runlocal" in variants:
    default.runlocal(config)
  return config
