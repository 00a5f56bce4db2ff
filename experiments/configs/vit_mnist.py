"""ViT on MNIST (the paper's vision setting; 6 layers, 4 heads).

    python experiments/main.py --config=experiments/configs/vit_mnist.py --workdir=/tmp/attn_symmetry/vit_mnist

Variants (``--config=experiments/configs/vit_mnist.py:rope``): "ape" (learned
absolute positions, the default) or "rope" (axial 2-D RoPE over the patch
grid); "to_fashion" (MNIST -> Fashion-MNIST: re-initialised scopes are
fine-tuned on Fashion-MNIST, Debian's ``dataset-fashion-mnist``); "runlocal".
Needs ``python -m attn_symmetry.data.prepare mnist`` first. The paper's
hyper-parameters (its Appendix I) are not in our copy; these are ours.
"""

from attn_symmetry import models
from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope", "to_fashion"))
  config = default.get_config()
  config.model.family = "vit"
  config.model.preset = "paper"
  config.model.overrides.patch_size = 4
  default.set_position_encoding(config, variants, ape="learned", rope="rope2d")
  config.dataset.name = "mnist"
  config.train.num_steps = 5000
  config.train.batch_size = 128
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 500
  config.reinit.scopes = models.SCOPES
  config.reinit.num_steps = 2000
  config.reinit.warmup_steps = 200
  if "to_fashion" in variants:
    config.reinit.dataset = "fashion_mnist_deb"
  # Validations 250 steps apart: 500 apart, patience 5 could not stop before step 3,000, past the
  # fine-tuned scopes' 2,000-step budget (config_checks refuses such a rule).
  default.stopping_rule(config, train_split="train[:90%]", validation_split="train[90%:]",
                        patience=5, validate_every=250)
  if "runlocal" in variants:
    default.runlocal(config)
  return config
