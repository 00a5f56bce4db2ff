"""attn_symmetry: parameter symmetries of multi-head attention, weight matching and LMC.

Modules:
  attention       reference multi-head attention on the canonical layout, RoPE.
  group_action    pure group actions on attention layers and whole models.
  spec            symmetry specs: which factor acts on which axis of which leaf.
  registry        the tables that extensions register into; ``registry.scoped()`` undoes a
                  block's registrations.
  align           align and merge two Hugging Face checkpoints (``align_checkpoints``, the
                  ``attn-symmetry align`` command); imported on first use of ``align_checkpoints``.
"""

from attn_symmetry import attention
from attn_symmetry import group_action
from attn_symmetry import spec

from attn_symmetry._version import __version__


def __getattr__(name: str):
  # align_checkpoints needs the model zoo (Flax): imported on first use, so that importing the
  # pure core (group_action, spec) stays light.
  if name == "align_checkpoints":
    from attn_symmetry.align import align_checkpoints  # pylint: disable=g-import-not-at-top
    return align_checkpoints
  raise AttributeError(f"module 'attn_symmetry' has no attribute {name!r}")
