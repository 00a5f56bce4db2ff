"""``child_memory.run`` measures the child's own peak RSS, whatever its parent held."""

import numpy as np

from tests import child_memory

MIB = 2 ** 20


def test_the_peak_is_the_childs_own_not_its_parents():
  """A child that holds 256 MiB peaks above 256 MiB; one that holds nothing stays under 100 MiB
  although this process holds 512 MiB as it starts it (``os.wait4``'s ``ru_maxrss`` would say
  512 MiB or more). Its arguments, exit status, stderr and RSS samples come back."""
  held = np.ones(512 * MIB // 8)
  idle = child_memory.run("import sys; print(sys.argv[1:], file=sys.stderr); sys.exit(3)",
                          "x", "y")
  busy = child_memory.run("import numpy as np, time; y = np.ones(2 ** 28 // 8); time.sleep(1)",
                          sample_every=0.2)
  assert held.sum() == held.size
  assert (idle.status, idle.stderr) == (3, "['x', 'y']")
  assert idle.peak < 100 * MIB, idle.peak / MIB
  assert busy.status == 0 and busy.peak > 256 * MIB, busy.peak / MIB
  assert busy.samples and max(rss for _, rss in busy.samples) > 256 * MIB
