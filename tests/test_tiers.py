"""The test commands and how they spread the suite over the cores (tests/conftest.py).

Each test file runs on one worker, so that its module fixtures (trained workdirs among them) are
made once; the files of ``SPREAD_OVER_WORKERS`` go test by test; ``RUN_FIRST`` goes first.
xdist's ``--dist loadgroup`` stopped grouping silently under pytest 9.2 (every module fixture was
then made on both workers), so the grouping is checked here on a run of its own.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The commands of .ci/run and the README: every core, the suite's own scheduler.
COMMAND = re.compile(r"\.venv/bin/python -m pytest (?:-m \"not slow\" )?-n auto --dist loadfile\b")


def test_each_file_is_one_unit_but_the_spread_ones():
  assert conftest.xdist_scope("tests/test_study.py::test_a[x-1]") == "tests/test_study.py"
  assert conftest.xdist_scope("tests/test_study.py::Case::test_b") == "tests/test_study.py"
  spread = f"tests/{sorted(conftest.SPREAD_OVER_WORKERS)[0]}::test_c[p]"
  assert conftest.xdist_scope(spread) == spread
  assert set(conftest.RUN_FIRST) <= set(os.listdir(os.path.join(ROOT, "tests")))
  ranks = [conftest.run_first_rank(f"tests/{name}::test_x") for name in conftest.RUN_FIRST]
  assert ranks == list(range(len(conftest.RUN_FIRST)))  # in its order, the longest first
  assert conftest.run_first_rank("tests/test_no_such_file.py") == len(conftest.RUN_FIRST)


def test_the_commands_use_the_suites_scheduler():
  """``pytest_xdist_make_scheduler`` serves ``--dist loadfile`` only: a command with another
  mode would spread the files over the workers again."""
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    assert len(COMMAND.findall(f.read())) == 1
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  assert COMMAND.search(readme) and "--dist loadgroup" not in readme


@pytest.mark.slow  # starts a pytest run with two workers
def test_a_file_stays_on_one_worker_and_sets_up_its_fixtures_once(tmp_path):
  tests = tmp_path / "tests"
  tests.mkdir()
  (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  slow\n")
  (tests / "conftest.py").write_text(
      "from tests.conftest import pytest_xdist_make_scheduler  # noqa: F401\n")
  log = tmp_path / "setups.log"
  module = textwrap.dedent(f"""
      import os
      import time
      import pytest

      def _log(line):
        with open({str(log)!r}, "a") as f:
          f.write(f"{{line}} {{__name__}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")

      @pytest.fixture(scope="module")
      def made():
        _log("setup")

      """) + "".join(f"def test_{i}(made):\n  _log('test')\n  time.sleep(0.2)\n\n"
                     for i in range(6))
  # A test of the spread file waits (20 s at most) until the other worker runs one too, so
  # that the check does not depend on how fast the workers are: on a loaded machine one worker
  # could otherwise run the whole file while the other still runs its first unit.
  spread_module = module.replace("  time.sleep(0.2)\n", textwrap.indent(textwrap.dedent(f"""
      deadline = time.time() + 20
      while time.time() < deadline:
        with open({str(log)!r}) as f:
          if len({{w for k, n, w in (l.split() for l in f) if k == "test" and n == __name__}}) > 1:
            break
        time.sleep(0.05)
      """), "  "))
  names = ["test_a", "test_b", "test_c", os.path.splitext(conftest.RUN_FIRST[0])[0],
           os.path.splitext(sorted(conftest.SPREAD_OVER_WORKERS)[0])[0]]
  for name in names:
    (tests / f"{name}.py").write_text(spread_module if name == names[-1] else module)
  proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-q",
                         "-p", "no:cacheprovider", str(tests)],
                        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  lines = [line.split() for line in log.read_text().splitlines()]
  setups, workers, first = {}, {}, {}
  for kind, name, worker in lines:
    if kind == "setup":
      setups.setdefault(name, []).append(worker)
      first.setdefault(worker, name)
    workers.setdefault(name, set()).add(worker)
  spread = names[-1]
  assert sorted(setups) == sorted(names)
  assert all(len(setups[name]) == 1 and len(workers[name]) == 1 for name in names[:-1]), setups
  assert len(workers[spread]) == 2, workers
  assert names[3] in first.values(), first  # a file of RUN_FIRST is some worker's first


def test_the_run_compiles_with_its_options_and_a_committed_rerun_without_them():
  """This process (and those it starts) compile with the run's XLA options; a process whose
  numbers meet committed ones gets the flags the run started with."""
  flags = os.environ["XLA_FLAGS"].split()
  assert set(conftest.FAST_COMPILE_XLA_FLAGS) <= set(flags)
  before = os.environ["ATTN_SYMMETRY_XLA_FLAGS_BEFORE_TESTS"]
  rerun = conftest.compile_options_removed(os.environ)
  assert rerun.get("XLA_FLAGS", "") == before
  assert "ATTN_SYMMETRY_XLA_FLAGS_BEFORE_TESTS" not in rerun


def test_the_compile_options_join_a_users_flags_without_overriding_them():
  own = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=2"
  joined = conftest.with_fast_compile(own).split()
  assert joined[:2] == own.split()  # the user's level stays
  assert joined[2:] == ["--xla_cpu_use_fusion_emitters=false",
                        "--xla_cpu_parallel_codegen_split_count=1"]
  assert conftest.with_fast_compile("") == " ".join(conftest.FAST_COMPILE_XLA_FLAGS)
  assert conftest.compile_options_removed({"XLA_FLAGS": "x", "PATH": "p"}) == {"PATH": "p"}
  kernel = conftest.workload_env({"XLA_FLAGS": "x --xla_backend_optimization_level=0",
                                  "ATTN_SYMMETRY_XLA_FLAGS_BEFORE_TESTS": "x"})
  assert kernel == {"XLA_FLAGS": "x --xla_backend_optimization_level=1 "
                                 "--xla_cpu_use_fusion_emitters=false "
                                 "--xla_cpu_parallel_codegen_split_count=1"}
