"""Shared pytest fixtures."""

import jax
from jax.experimental.compilation_cache import compilation_cache
import pytest


@pytest.fixture
def x64():
  """Runs a test in float64 (restored afterwards, so other tests keep float32)."""
  with jax.enable_x64(True):
    yield


@pytest.fixture(autouse=True)
def no_persistent_compilation_cache_after():
  """A test that turns on JAX's persistent compilation cache in this process (the align
  command and main.py do, by default) leaves it off for the tests after it: JAX keeps a
  cache it has once opened, whatever the config says later, and the rest of the suite then
  wrote every program it compiled into the user's cache directory."""
  before = jax.config.jax_compilation_cache_dir
  yield
  if jax.config.jax_compilation_cache_dir != before:
    jax.config.update("jax_compilation_cache_dir", before)
  compilation_cache.reset_cache()


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs_after_each_module():
  """Every program XLA:CPU compiles keeps about 14 memory mappings for as long as JAX caches
  it, and a process may hold 65,530 (vm.max_map_count). The whole suite compiles thousands of
  programs in one process: near the limit, an mmap of LLVM's failed and XLA crashed with
  SIGSEGV while compiling (in test_reproduce, then test_reruns). Each module's programs are
  released when it ends."""
  yield
  jax.clear_caches()
