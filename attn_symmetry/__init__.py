"""attn_symmetry: parameter symmetries of multi-head attention, weight matching and LMC.

Modules:
  attention       reference multi-head attention on the canonical layout, RoPE.
  group_action    pure group actions on attention layers and whole models.
  spec            symmetry specs: which factor acts on which axis of which leaf.
"""

from attn_symmetry import attention
from attn_symmetry import group_action
from attn_symmetry import spec

__version__ = "0.1.0"
