"""Several processes on one run (``jax.distributed``): who decides, who writes, who waits.

A run started as P processes (``main.py --num_processes=P``) computes every
stage in every process: the collectives of a sharded step need all of them, in
the same order. What a process does next must therefore not depend on what it
alone reads from the shared workdir, where another process may be writing at
that moment. The rule here: process 0 reads the workdir, decides and writes; the
others get its decision (``from_process_0``) or wait until its files are written
(``on_process_0``, ``barrier``). In one process every function is a plain call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

T = TypeVar("T")


def is_main() -> bool:
  """Whether this process writes the workdir's files (process 0)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits for every process (nothing to do in one); ``name`` must be the same in all."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def on_process_0(fn: Callable[[], T], name: str) -> T | None:
  """``fn()`` on process 0 only (a file operation on the shared workdir), then a barrier
  so that every process sees its effect; returns its result on process 0, else None."""
  result = fn() if is_main() else None
  barrier(name)
  return result


def from_process_0(fn: Callable[[], T]) -> T:
  """``fn()`` computed on process 0 and sent to every process: a JSON value (lists, dicts,
  strings, numbers, None) that every process then holds the same (as ``json`` reads it back:
  tuples become lists). ``fn`` runs on process 0 only; in one process, ``fn()`` itself."""
  if jax.process_count() == 1:
    return fn()
  data = json.dumps(fn()).encode() if is_main() else b""
  size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
  buffer = np.frombuffer(data, np.uint8) if is_main() else np.zeros(size, np.uint8)
  return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes())
