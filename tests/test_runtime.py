"""attn_symmetry.runtime: JSON values, the BLAS thread limit and heap release."""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import threadpoolctl

from attn_symmetry import runtime
from tests import child_memory


def test_jsonable_turns_arrays_and_keys_into_json():
  tree = {1: (jnp.arange(3), np.float32(0.5)), "m": {"x": np.eye(2), "s": jnp.asarray(2)},
          "keep": "text"}
  out = runtime.jsonable(tree)
  assert out == {"1": [[0, 1, 2], 0.5], "m": {"x": [[1.0, 0.0], [0.0, 1.0]], "s": 2},
                 "keep": "text"}
  assert json.loads(json.dumps(out)) == out
  assert type(out["m"]["s"]) is int and type(out["1"][1]) is float


def _blas_threads():
  return {i["filepath"]: i["num_threads"] for i in threadpoolctl.threadpool_info()
          if i["user_api"] == "blas"}


def test_single_threaded_blas_limits_jaxlibs_lapack_and_restores():
  with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
    before = _blas_threads()
    with runtime.single_threaded_blas():
      inside = _blas_threads()
      x = jnp.linalg.inv(jnp.eye(4) * 2.0)  # runs on the limited LAPACK
    after = _blas_threads()
    assert {k: after[k] for k in before} == before
  # scipy's OpenBLAS (jaxlib's LAPACK) is loaded by the block itself and limited.
  assert any("scipy" in path for path in inside)
  assert inside and set(inside.values()) == {1}
  np.testing.assert_allclose(x, np.eye(4) / 2)


def _rss_bytes():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux") or
                    getattr(runtime._libc(), "malloc_trim", None) is None,  # pylint: disable=protected-access
                    reason="malloc_trim is glibc's")
def test_release_free_memory_returns_freed_heap_pages():
  # 120 MB in 4 kB heap blocks, all freed but the last, which keeps the heap's top in use:
  # glibc keeps the freed pages resident until they are trimmed.
  blocks = [bytearray(4000) for _ in range(30_000)]
  last = blocks[-1]
  del blocks
  held = _rss_bytes()
  assert runtime.release_free_memory() is True
  assert held - _rss_bytes() > 50e6
  del last


# With malloc itself (as XLA's buffers are allocated): frees a 16 MiB block (glibc's threshold
# rises to it), then allocates 40 blocks of 8 MiB, each followed by one of 1 MiB that stays (small
# ones could come from free fragments below, leaving the 40 at the heap's top, which is trimmed),
# frees the 40 and prints the resident bytes released.
_FREED_BUFFERS = """
import ctypes, os, sys
from attn_symmetry import runtime
if sys.argv[1] == "fixed":
  assert runtime.return_freed_buffers()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
libc.free(libc.malloc(16 << 20))
blocks, pins = [], []
for _ in range(40):
  blocks.append(libc.malloc(8 << 20))
  ctypes.memset(blocks[-1], 1, 8 << 20)
  pins.append(libc.malloc(1 << 20))
before = rss()
for block in blocks:
  libc.free(block)
print(before - rss(), file=sys.stderr)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or
                    getattr(runtime._libc(), "mallopt", None) is None,  # pylint: disable=protected-access
                    reason="mallopt is glibc's")
def test_return_freed_buffers_hands_each_large_buffer_back_when_freed():
  """In a child (the setting is the whole process's): 320 MiB of 8 MiB buffers, freed, stay
  resident under glibc's default (its threshold has risen to 16 MiB) and leave with
  ``return_freed_buffers``."""
  released = {}
  for how in ("default", "fixed"):
    child = child_memory.run(_FREED_BUFFERS, how)
    assert child.status == 0, child.stderr
    released[how] = int(child.stderr.split()[-1])
  assert released["default"] < 50 * 2 ** 20 < 300 * 2 ** 20 < released["fixed"], released


def test_release_memory_after_compiles_runs_after_each_compile_in_the_block(monkeypatch):
  calls = []
  monkeypatch.setattr(runtime, "release_free_memory", lambda: calls.append(1))
  with runtime.release_memory_after_compiles(min_seconds=0.0):
    jax.jit(lambda x: x * 3.0 + 1.0)(jnp.ones(7)).block_until_ready()
  assert calls
  compiled_inside = len(calls)
  jax.jit(lambda x: x * 5.0 - 2.0)(jnp.ones(9)).block_until_ready()  # outside: listener gone
  assert len(calls) == compiled_inside


def test_compile_clock_counts_the_compiles_inside_its_block_only():
  unique = float(time.time_ns() % 10**9)  # a program no persistent cache can hold yet
  f = jax.jit(lambda x: jnp.sin(x) * unique + x.sum())
  with runtime.CompileClock() as clock:
    f(jnp.ones(7)).block_until_ready()
    f(jnp.ones(7)).block_until_ready()  # cached in memory: nothing more to count
  assert clock.programs >= 1 and all(s > 0 for s in clock.seconds.values())
  inside = dict(clock.seconds)
  f(jnp.ones(9)).block_until_ready()  # a new shape, compiled after the block
  assert clock.seconds == inside
  line = clock.summary(wall_seconds=10 * clock.total)
  assert line.startswith(f"JAX compilation: {clock.total:.1f} s of") and "(10 %;" in line
  np.testing.assert_allclose(sum(clock.by_function.values()), clock.total)
  assert "<lambda>" in clock.by_function and f"longest: <lambda> " in line
