"""``python -m attn_symmetry.align MODEL_A MODEL_B --out DIR ...`` (``_cli.main``)."""

import sys

from attn_symmetry.align import _cli

sys.exit(_cli.main())
