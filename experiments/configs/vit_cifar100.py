"""ViT on CIFAR-100 (the paper's vision setting; 6 layers, 4 heads).

    python experiments/main.py --config=experiments/configs/vit_cifar100.py --workdir=/tmp/attn_symmetry/vit_cifar100

Variants (``--config=experiments/configs/vit_cifar100.py:rope``): "ape" (learned
absolute positions, the default) or "rope" (axial 2-D RoPE over the patch
grid); "runlocal". Needs ``python -m attn_symmetry.data.prepare cifar100``
first. Everything else as ``vit_cifar.py``.
"""

from experiments.configs import default
from experiments.configs import vit_cifar


def get_config(arg=None):
  variants = default.parse_arg(arg, allowed=("ape", "rope"))
  config = vit_cifar.get_config(",".join(sorted(variants - {"runlocal"})))
  config.dataset.name = "cifar100"
  if "runlocal" in variants:
    default.runlocal(config)
  return config
