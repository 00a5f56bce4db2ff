"""Host-side helpers for programs built on the library: JSON values, whole arrays on the host,
LAPACK threads, memory, the compilation cache's default folder.

    from attn_symmetry import runtime
    jax.config.update("jax_compilation_cache_dir", runtime.COMPILATION_CACHE)
    json.dump(runtime.jsonable({"perm": jnp.arange(3), "loss": np.float32(0.5)}), f)
    with runtime.single_threaded_blas():   # jaxlib's LAPACK calls on CPU, one thread each
      element, info = matching.align_model(spec, params_a, params_b)
      jax.block_until_ready(element)
    del params_b; runtime.release_free_memory()   # hand freed heap pages back to the system
    runtime.return_freed_buffers()                 # and every large buffer as it is freed
    with runtime.CompileClock() as clock:          # JAX's tracing, lowering and compiling time
      ...
    print(clock.summary(wall_seconds))
    weights = runtime.host_array(params["w"])      # the whole array, however it is sharded

On CPU, jaxlib runs its LAPACK kernels (``jnp.linalg.inv``, ``solve``, ``svd``:
the batched H x H solves of attention matching, for example) from
``scipy.linalg.cython_lapack``, on the OpenBLAS that scipy bundles. XLA issues them from its own thread pool, and an OpenBLAS
that starts threads of its own inside each call oversubscribes the cores: on 2
cores the batched 64 x 64 inverses of Stage 2 ran 17x slower (2.2 s instead of
0.13 s for 50 inverses of [48, 64, 64]), and two such calls side by side could
deadlock. ``single_threaded_blas`` pins every BLAS library of the process to one
thread for the duration of a block and restores the previous settings after.
JAX dispatches asynchronously: block on the results inside the block.

A second deadlock is not about BLAS threads, and ``single_threaded_blas`` does
not prevent it: jaxlib's batched LAPACK kernels split a large batch over XLA's
intra-op thread pool (one thread per core) and wait for the pieces. A program
replicated over several CPU devices (arrays placed on a mesh of
``--xla_force_host_platform_device_count`` devices) runs one copy per device on
that pool; when every pool thread runs such a kernel, no thread is left for the
pieces, and the process sleeps forever (2 devices on 2 cores, in the batched
SVDs of ``matching.match_attention_exhaustive``). Run matching on arrays of one
device (host arrays go to the default device), as ``experiments/study/study.py`` does.

XLA's CPU buffers and numpy's arrays come from the C heap, and glibc's malloc
keeps freed memory of up to 32 MiB per block for reuse rather than returning it
to the system. After a large jitted program (whose temporaries are freed when it
ends), that memory stays in the process's resident set, and fragments of it
are not reused by the next stage's differently sized buffers: resident memory
grows stage after stage while the live arrays do not. ``release_free_memory``
returns those pages (glibc's ``malloc_trim``; nothing happens on other C
libraries). Compiling a large program leaves such pages too (XLA's and LLVM's
working memory), and a jitted call runs the program right after compiling it:
``release_memory_after_compiles`` returns them in between, so that they do not
sit beside the program's temporaries at its peak. Between two stages a trim is
enough; a pass that allocates and frees a layer's buffers over and over (the
streamed alignment) is better served by ``return_freed_buffers``: glibc then maps
every buffer of 128 KiB or more on its own and unmaps it when it is freed, so
the resident set is what is live (a narrow Mistral's streamed alignment peaked at
0.77 GiB so, at 0.99-1.06 GiB without).

``COMPILATION_CACHE`` is the default folder of JAX's persistent compilation
cache of the programs built on the library (``attn-symmetry align``'s
``--compilation-cache``, ``experiments/main.py``'s ``--compilation_cache``): one
folder for all of them, so that a program compiled by one run is loaded from
disk by every later run that builds it. The environment variable
``ATTN_SYMMETRY_COMPILATION_CACHE`` names another (the test run points it at its
own cache, so that no test reads or writes the user's).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

COMPILATION_CACHE_ENV = "ATTN_SYMMETRY_COMPILATION_CACHE"


def default_compilation_cache(environ: Mapping[str, str] = os.environ) -> str:
  """``$ATTN_SYMMETRY_COMPILATION_CACHE`` where it is set, else
  ``$TMPDIR/attn_symmetry/jax_cache``."""
  default = os.path.join(tempfile.gettempdir(), "attn_symmetry", "jax_cache")
  return environ.get(COMPILATION_CACHE_ENV) or default


COMPILATION_CACHE = default_compilation_cache()


def import_script_package(script: str) -> None:
  """Makes the package that holds ``script`` (a file run by path, whose folder has an
  ``__init__.py``) importable under its folder's name, without putting anything on
  ``sys.path``: how the commands of a package that is not installed (the repository's
  ``experiments/``) import their siblings. Does nothing once the package is imported."""
  folder = os.path.dirname(os.path.abspath(script))
  name = os.path.basename(folder)
  if name in sys.modules:
    return
  spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"))
  sys.modules[name] = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(sys.modules[name])


def jsonable(tree: Any) -> Any:
  """``tree`` with arrays as (nested) lists and scalars, keys as strings: ready for ``json.dump``.

  Mappings become dicts, lists and tuples lists; JAX and numpy arrays become
  nested lists of Python numbers (a 0-d array or numpy scalar becomes one
  Python number); everything else is returned as it is.
  """
  if isinstance(tree, Mapping):
    return {str(k): jsonable(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [jsonable(v) for v in tree]
  if isinstance(tree, (jax.Array, np.ndarray, np.generic)):
    return np.asarray(tree).tolist()
  return tree


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
  """Within the block, every BLAS library loaded in the process (OpenBLAS, MKL, ...) uses
  one thread; the earlier limits are restored on leaving it (module docstring)."""
  # pylint: disable=g-import-not-at-top
  # jaxlib takes its LAPACK kernels from scipy when it first needs one: load them now, so that
  # the OpenBLAS behind them is among the libraries limited.
  import scipy.linalg.cython_lapack  # pylint: disable=unused-import
  import threadpoolctl

  with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
    yield


def host_array(x: Any) -> np.ndarray:
  """The whole of ``x`` as a numpy array in this process, however it is placed.

  A replicated array is read from this process's copy; one split over this process's
  devices is assembled from its shards; one split over several processes' devices is
  gathered from all of them (``jax.experimental.multihost_utils.process_allgather``: a
  collective, so every process must call this on the same arrays in the same order).
  Anything that is not a ``jax.Array`` goes through ``np.asarray``. Reading only
  ``x.addressable_data(0)`` would give one shard of a split array.
  """
  if not isinstance(x, jax.Array) or x.is_fully_replicated:
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def physical_memory() -> int:
  """The machine's physical memory in bytes (the align command's default memory budget)."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def release_free_memory() -> bool:
  """Returns the C heap's free pages to the system (glibc's ``malloc_trim(0)``; module
  docstring). Returns whether any memory was released; False where malloc is not glibc's."""
  trim = getattr(_libc(), "malloc_trim", None)
  return bool(trim(0)) if trim is not None else False


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_buffers(min_bytes: int = 128 * 1024) -> bool:
  """From now on, in this whole process, glibc's malloc serves each allocation of at least
  ``min_bytes`` with its own mapping and returns it to the system when it is freed (``mallopt
  (M_MMAP_THRESHOLD)``; module docstring). By default the threshold starts at 128 KiB and
  rises to the size of each such block freed, up to 32 MiB, after which freed buffers under it
  stay in the heap; setting it fixes it. Returns whether it was set (False where malloc is not
  glibc's)."""
  mallopt = getattr(_libc(), "mallopt", None)
  return bool(mallopt(_M_MMAP_THRESHOLD, int(min_bytes))) if mallopt is not None else False


@functools.cache
def _libc() -> ctypes.CDLL | None:
  name = ctypes.util.find_library("c")
  try:
    return ctypes.CDLL(name) if name else None
  except OSError:
    return None


@contextlib.contextmanager
def release_memory_after_compiles(min_seconds: float = 1.0) -> Iterator[None]:
  """Within the block, ``release_free_memory`` runs after every XLA compilation that took at
  least ``min_seconds`` (``jax.monitoring``'s backend-compile event), before the program runs."""
  def listener(event: str, seconds: float, **_):
    if event == _BACKEND_COMPILE and seconds >= min_seconds:
      release_free_memory()

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

# jax.monitoring's duration events of the three phases of turning a function into a program.
COMPILE_PHASES = {"tracing": "/jax/core/compile/jaxpr_trace_duration",
                  "lowering": "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "compiling": _BACKEND_COMPILE}


class CompileClock(contextlib.AbstractContextManager):
  """Adds up, within a ``with`` block, the seconds JAX spends tracing, lowering and compiling.

  Reads ``jax.monitoring``'s duration events (``COMPILE_PHASES``), so it counts
  every jit, pmap and eager primitive compilation of the process while the block
  is open, whichever thread triggers it; a program found in the persistent
  compilation cache adds its tracing and lowering but no compiling.

  Attributes:
    seconds: {phase: seconds} for "tracing", "lowering" and "compiling".
    programs: how many programs were compiled by XLA.
    by_function: {name: seconds} of all three phases per jitted function (the
      name JAX reports, such as "_align_core"; "?" where it reports none).
  """

  def __init__(self):
    self.seconds = dict.fromkeys(COMPILE_PHASES, 0.0)
    self.programs = 0
    self.by_function: dict[str, float] = {}
    self._phase = {event: phase for phase, event in COMPILE_PHASES.items()}

  def _listener(self, event: str, seconds: float, fun_name: str = "?", **_):
    phase = self._phase.get(event)
    if phase is not None:
      self.seconds[phase] += seconds
      self.programs += phase == "compiling"
      name = fun_name[4:-1] if fun_name.startswith("jit(") else fun_name  # lowering's "jit(f)"
      self.by_function[name] = self.by_function.get(name, 0.0) + seconds

  def __enter__(self) -> CompileClock:
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listener)

  @property
  def total(self) -> float:
    return sum(self.seconds.values())

  def summary(self, wall_seconds: float, top: int = 3) -> str:
    """One line: each phase's seconds, their sum and its share of ``wall_seconds``, and the
    ``top`` functions that took longest to compile."""
    phases = ", ".join(f"{phase} {s:.1f} s" for phase, s in self.seconds.items())
    share = 100 * self.total / wall_seconds if wall_seconds > 0 else 0.0
    slowest = sorted(self.by_function.items(), key=lambda kv: -kv[1])[:top]
    names = ", ".join(f"{name} {s:.1f} s" for name, s in slowest)
    return (f"JAX compilation: {self.total:.1f} s of {wall_seconds:.1f} s wall ({share:.0f} %; "
            f"{phases}; {self.programs} programs compiled; longest: {names or 'none'})")
