"""Flax NNX model zoo: ViT, BERT, GPT-2, Llama and GPT-NeoX on one Transformer core.

    model = models.build("vit", "tiny", pos_encoding="rope2d")
    params = model.init(jax.random.key(0))         # plain nested dict
    logits, intermediates = model.apply(params, images)
    model.spec                                      # SymmetrySpec of params
    model.scope_paths("first_layer")                # ["layers_0"]

The modules are NNX modules; ``Model`` exposes them as pure functions over a
plain parameter dict (see ``model.py``). Attention parameters sit at
``layers_i/attention`` in the canonical layout of ``attn_symmetry.attention``.
A family registers itself next to its code, with its Hugging Face mapping
(``register_family``, ``hf.HFMapping``; see docs/extending.md).
"""

from attn_symmetry.models.config import FAMILIES, PRESETS, Config, Family, make_config
from attn_symmetry.models.config import get_family, register_family
from attn_symmetry.models.model import SCOPES, Model, build, circuit_model, untie_head
# The built-in families register themselves on import (in this order: FAMILIES, and the HF
# model types that convert.model_types lists).
from attn_symmetry.models import decoder, bert, vit  # pylint: disable=unused-import
from attn_symmetry.models import config

config._REGISTRY.mark_built_in()  # pylint: disable=protected-access

__all__ = ["FAMILIES", "PRESETS", "SCOPES", "Config", "Family", "Model", "build",
           "circuit_model", "get_family", "make_config", "register_family", "untie_head"]
