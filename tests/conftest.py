"""Shared pytest fixtures and the test tiers.

Tiers: a test that trains a model, spawns a process, executes a notebook, or takes more than
15 s alone on a 2-core machine is marked ``@pytest.mark.slow``. ``pytest -m "not slow"`` runs
the rest, the fast tier; ``pytest`` (``.ci/run``) runs every test. Both take ``-n auto --dist
loadfile`` (pytest-xdist): one worker per core, each test file on one worker (its module
fixtures and the trained workdirs it asks for are made once), except the tests of the files in
``SPREAD_OVER_WORKERS``, which are long, independent and go to whichever worker is free
(``pytest_xdist_make_scheduler``). The invariance and group-axiom tests of the core,
and a planted-recovery case of each group, stay in the fast tier whatever they take.

Trained workdirs are shared: ``trained_workdir(config, dest)`` trains ``config`` (and, with
``study=True``, runs its study) once per test session and process, then copies the finished
workdir to ``dest`` for the test to use or change.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache
import pytest


# Files whose tests each run long on their own and share no fixture that costs: spread test by
# test over the workers, so that no worker is left with all of them at the end of the run.
SPREAD_OVER_WORKERS = frozenset({"test_colabs.py", "test_learned.py",
                                 "test_streamed_alignment.py"})
# The longest units, longest first (measured on an idle 2-core AMD EPYC, `--durations`): handed
# out before every other unit (a spread file test by test), so that the run ends on short units
# and no worker idles while the other finishes a long one. xdist hands out the files with the
# most tests first, and these hold few: unsorted, the few-test end-to-end files made the tail.
# The longest unit first, whatever the rest: the "longest processing time first" rule.
RUN_FIRST = ("test_processes.py", "test_colabs.py", "test_reproduce.py",
             "test_streamed_alignment.py", "test_study.py", "test_accelerator_sweep.py",
             "test_learned.py", "test_train.py", "test_extending.py", "test_stopping.py",
             "test_device_check.py", "test_tiers.py", "test_layer_norm_residual.py")


def xdist_scope(nodeid: str) -> str:
  """The unit of work a test goes to a worker in: its file, or the test itself in the files
  of ``SPREAD_OVER_WORKERS``."""
  path = nodeid.split("::", 1)[0]
  return nodeid if os.path.basename(path) in SPREAD_OVER_WORKERS else path


def run_first_rank(scope: str) -> int:
  """A unit's place in ``RUN_FIRST`` (its file's), ``len(RUN_FIRST)`` for the other units."""
  name = os.path.basename(scope.split("::", 1)[0])
  return RUN_FIRST.index(name) if name in RUN_FIRST else len(RUN_FIRST)


def pytest_xdist_make_scheduler(config, log):
  """``--dist loadfile`` with the files of ``SPREAD_OVER_WORKERS`` spread test by test.

  xdist's own ``--dist loadgroup`` (an ``xdist_group`` mark per file) no longer groups under
  pytest 9.2, where a test's node id cannot be renamed: every test went to whichever worker was
  free, and both workers set up (and trained) the module fixtures of most files. The scheduler
  groups node ids itself (``xdist_scope``), and hands out the units of ``RUN_FIRST`` first, in
  its order (``run_first_rank``); tests/test_tiers.py checks that it groups."""
  if config.getvalue("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=import-outside-toplevel

  class FileScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
      return xdist_scope(nodeid)

    def _assign_work_unit(self, node) -> None:
      first = min(self.workqueue, key=run_first_rank)
      if run_first_rank(first) < len(RUN_FIRST):
        self.workqueue.move_to_end(first, last=False)
      super()._assign_work_unit(node)

  return FileScheduling(config, log)


@pytest.fixture
def x64():
  """Runs a test in float64 (restored afterwards, so other tests keep float32)."""
  with jax.enable_x64(True):
    yield


# XLA:CPU options for the test run, which spends most of its time compiling small programs
# (every eager float64 op, every test's own shapes) rather than running them: LLVM at -O0, and
# XLA's element-wise code generator instead of its fusion emitters. Measured on one core,
# side by side: tests/test_matching.py 417 s -> 126 s, tests/test_group_action.py 144 s ->
# 48 s, a training file pair (test_stopping, test_mlm) 115 s -> 84 s. And each program's
# machine code generated as one LLVM module: XLA splits it into parts for threads to compile
# side by side, and a worker bound to one core (``_bind_worker_to_its_core``) compiled them one
# after another, each part with its own overhead. Measured on a 2-core Intel Xeon, one core
# each, side by side and swapped: test_matching_model + test_group_action 113.7/116.7 s ->
# 110.1/105.8 s, test_stopping + test_learned_factors 115.9/106.5 s -> 112.0/98.9 s; files of
# eager ops gain nothing (test_models + test_repair + test_attention 74.5/79.6 s, then
# 74.8/78.5 s). The programs compute the same functions; float32 sums may round in another
# order, which no test's tolerance depends on. Tests that compare with committed numbers run
# their process without them (``compile_options_removed``).
def fast_compile_flags(optimization_level: int = 0) -> tuple[str, ...]:
  """The compile options, LLVM at ``optimization_level``."""
  return (f"--xla_backend_optimization_level={optimization_level}",
          "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")


FAST_COMPILE_XLA_FLAGS = fast_compile_flags(0)
# A notebook's kernel runs whole trainings and path evaluations, where -O0's slower code costs
# more than its faster compiling saves: LLVM at -O1 there. One core, colabs/03 (training, then
# 28 paths of 13 points): 95 s at XLA's defaults, 148 s at -O0, 59 s at -O1; colabs/02 87 s at
# -O0, 74 s at -O1; colabs/01 (small programs) 23 s at -O0, 30 s at -O1, so it keeps -O0
# (tests/test_colabs.py, COMPILE_BOUND).
WORKLOAD_OPTIMIZATION_LEVEL = 1


def with_fast_compile(flags: str, optimization_level: int = 0) -> str:
  """``flags`` (an ``XLA_FLAGS`` value) with the options of ``fast_compile_flags`` that it
  does not set yet appended."""
  own = {f.split("=", 1)[0] for f in flags.split()}
  return with_xla_flags(flags, *(f for f in fast_compile_flags(optimization_level)
                                 if f.split("=", 1)[0] not in own))


def with_xla_flags(flags: str | None, *more: str) -> str:
  """``flags`` (an ``XLA_FLAGS`` value, or None) with ``more`` appended."""
  return " ".join([*(flags or "").split(), *more])


def workload_env(env: dict[str, str]) -> dict[str, str]:
  """``env`` for a process that runs a whole workload (a notebook's kernel): the flags the run
  started with, plus the compile options at ``WORKLOAD_OPTIMIZATION_LEVEL``."""
  env = compile_options_removed(env)
  env["XLA_FLAGS"] = with_fast_compile(env.get("XLA_FLAGS", ""), WORKLOAD_OPTIMIZATION_LEVEL)
  return env


def compile_options_removed(env: dict[str, str]) -> dict[str, str]:
  """``env`` with ``XLA_FLAGS`` as it was before the test run added its compile options: for a
  process whose numbers are compared with numbers computed without them."""
  env = dict(env)
  flags = env.pop("ATTN_SYMMETRY_XLA_FLAGS_BEFORE_TESTS", None)
  env.pop("XLA_FLAGS", None)
  if flags:
    env["XLA_FLAGS"] = flags
  return env


def _xla_accepts(flags: str) -> bool:
  """Whether a JAX process starts with ``XLA_FLAGS=flags``: XLA aborts on a flag it does not
  know, and a later jaxlib may drop one of these."""
  code = "import jax; jax.numpy.zeros(1).block_until_ready()"
  probe = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, XLA_FLAGS=flags),
                         capture_output=True, timeout=120)
  return probe.returncode == 0


def _use_fast_compile(config) -> None:
  """Sets ``XLA_FLAGS`` for this run (in the controlling process, before xdist starts its
  workers, which inherit it, as do the processes that tests start)."""
  if "PYTEST_XDIST_WORKER" in os.environ or "ATTN_SYMMETRY_XLA_FLAGS_BEFORE_TESTS" in os.environ:
    return
  before = os.environ.get("XLA_FLAGS", "")
  os.environ["ATTN_SYMMETRY_XLA_FLAGS_BEFORE_TESTS"] = before
  flags = with_fast_compile(before)
  if flags == before:
    return
  if not _xla_accepts(flags):  # tests/test_tiers.py then fails: the options need updating
    config.issue_config_time_warning(pytest.PytestConfigWarning(
        f"this jaxlib refuses XLA_FLAGS={flags!r}: the tests compile at XLA's defaults "
        "(slower)"), stacklevel=2)
    return
  os.environ["XLA_FLAGS"] = flags


def _bind_worker_to_its_core() -> None:
  """Under xdist with one worker per core, binds this worker (and the processes it starts) to a
  core of its own, before JAX starts its CPU backend.

  XLA:CPU sizes its thread pool by the cores the process may use. Unbound, each of two workers
  splits its computations over two threads, and each split waits for the thread that the other
  worker's computation holds the core from. Measured on this 2-core machine, side by side, five
  files (test_learned, test_reruns, test_matching_model, test_group_action, test_study: 167
  tests): 287 s unbound, 225 s bound, and 495 s of CPU against 394 s; on a fresh clone, the
  whole suite 945 s unbound, 735 s bound, and the fast tier 128 s and 115 s. A test that starts
  processes of its own starts them on its worker's core (the two-process test: 83 s unbound,
  105 s bound, and no faster with each process bound to a core of the run's)."""
  worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
  if not (worker and count and hasattr(os, "sched_setaffinity")):
    return
  cores = sorted(os.sched_getaffinity(0))
  if int(count) == len(cores) > 1:
    os.sched_setaffinity(0, {cores[int(worker.removeprefix("gw")) % len(cores)]})


def pytest_configure(config):
  """One persistent compilation cache for the test run, shared by its xdist workers: tests
  build the same programs again and again (every training builds its step anew, every study
  its evaluator), and a program compiled once, by either worker, then loads from disk. It
  lives in the run's temporary folder, so that no run reads another's programs. And the
  run's XLA compile options (``FAST_COMPILE_XLA_FLAGS``). The library's commands default to the
  same cache (``ATTN_SYMMETRY_COMPILATION_CACHE``)."""
  _use_fast_compile(config)
  _bind_worker_to_its_core()
  run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
  config.run_cache = os.path.join(tempfile.gettempdir(), "attn_symmetry_tests", run)
  cache = os.path.join(config.run_cache, "jax_cache")
  jax.config.update("jax_compilation_cache_dir", cache)
  # The library's default cache (attn_symmetry.runtime.COMPILATION_CACHE, read when it is first
  # imported, after this) for the commands the tests run, in this process and in the processes
  # it starts: the run's, so that no test reads or writes the user's cache, and a test takes as
  # long on a fresh machine as on one where the commands ran before.
  os.environ["ATTN_SYMMETRY_COMPILATION_CACHE"] = cache
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_unconfigure(config):
  """The run's compilation cache is removed when the run ends (by the controlling process
  under xdist, after its workers)."""
  if "PYTEST_XDIST_WORKER" not in os.environ and hasattr(config, "run_cache"):
    shutil.rmtree(config.run_cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_persistent_compilation_cache_after():
  """A test that points JAX's persistent compilation cache elsewhere (the align command and
  main.py do, by default) leaves the run's own cache in place for the tests after it: JAX
  keeps a cache it has once opened, whatever the config says later, and the rest of the suite
  then wrote every program it compiled into the user's cache directory."""
  before = jax.config.jax_compilation_cache_dir
  yield
  if jax.config.jax_compilation_cache_dir != before:
    jax.config.update("jax_compilation_cache_dir", before)
  compilation_cache.reset_cache()


def _memory_mappings() -> tuple[int, int] | None:
  """(memory mappings this process holds, the most it may hold), or None off Linux."""
  try:
    with open("/proc/self/maps") as f:
      held = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      return held, int(f.read())
  except (OSError, ValueError):
    return None


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs_near_the_mapping_limit():
  """Every program XLA:CPU compiles keeps about 14 memory mappings for as long as JAX caches
  it, and a process may hold ``vm.max_map_count`` (65,530 by default). Near the limit an mmap
  of LLVM's failed and XLA crashed with SIGSEGV while compiling. When a module ends with
  the process holding more than half of the limit, every compiled program is released;
  below it, they stay cached for the modules after it (releasing them after every module
  compiled the same programs again in the next)."""
  yield
  mappings = _memory_mappings()
  if mappings is None or mappings[0] > mappings[1] // 2:
    jax.clear_caches()


class TrainedWorkdirs:
  """Finished runs of test configs, each trained once per session, handed out as copies."""

  def __init__(self, root: str):
    self._root = root
    self._finished: dict[str, tuple[str, dict[str, Any]]] = {}

  def _source(self, config, study: bool) -> tuple[str, dict[str, Any]]:
    from experiments.setting import fingerprints  # pylint: disable=import-outside-toplevel
    from experiments.study import study as study_lib  # pylint: disable=import-outside-toplevel
    from experiments.train import trainer  # pylint: disable=import-outside-toplevel
    key = fingerprints.key({"config": json.loads(config.to_json(sort_keys=True)),
                            "study": study})[:16]
    if key not in self._finished:
      workdir = os.path.join(self._root, key)
      results = trainer.train_and_evaluate(config, workdir)
      if study:
        study_lib.run_study(config, workdir)
      self._finished[key] = workdir, results
    return self._finished[key]

  def __call__(self, config, dest: str | os.PathLike, *, study: bool = False
               ) -> tuple[str, dict[str, Any]]:
    """(``dest``, the training's final metrics by run): a copy of ``config``'s finished
    workdir (training, and the study with ``study``) at ``dest``, which must not exist."""
    source, results = self._source(config, study)
    shutil.copytree(source, dest)
    return str(dest), copy.deepcopy(results)


@pytest.fixture(scope="session")
def trained_workdir(tmp_path_factory) -> TrainedWorkdirs:
  return TrainedWorkdirs(str(tmp_path_factory.mktemp("trained_workdirs")))
