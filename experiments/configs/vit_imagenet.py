"""ViT on ImageNet-1k (the paper's largest vision setting; 6 layers, 4 heads, 16x16 patches).

    python experiments/main.py --config=experiments/configs/vit_imagenet.py --workdir=/tmp/attn_symmetry/vit_imagenet

Variants (``--config=experiments/configs/vit_imagenet.py:rope``): "ape"
(learned absolute positions, the default) or "rope" (axial 2-D RoPE over the
patch grid); "runlocal". Needs ImageNet prepared by hand (``python -m
attn_symmetry.data.prepare imagenet2012 --manual_dir DIR``). 224x224 crops,
random crops and flips; meant for accelerators (data parallel over all
devices). The paper's hyper-parameters (its Appendix I) are not in our copy;
these are ours.
"""

from attn_symmetry import models
from experiments.configs import default


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope"))
  config = default.get_config()
  config.model.family = "vit"
  config.model.preset = "paper"
  config.model.overrides.patch_size = 16
  default.set_position_encoding(config, variants, ape="learned", rope="rope2d")
  config.dataset.name = "imagenet2012"
  config.dataset.image_size = 224
  config.dataset.augment = True
  config.dataset.num_workers = 8
  config.train.num_steps = 100000
  config.train.batch_size = 512
  config.train.eval_batch_size = 512
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 5000
  config.train.log_every = 200
  config.train.eval_every = 10000
  config.train.checkpoint_every = 5000
  config.reinit.scopes = models.SCOPES
  config.reinit.num_steps = 10000
  config.reinit.warmup_steps = 1000
  default.stopping_rule(config, train_split="train[:99%]", validation_split="train[99%:]",
                        patience=5, validate_every=500)
  if "runlocal" in variants:
    default.runlocal(config)
    config.dataset.image_size = 32
  return config
