r"""Settings per hour when ``experiments/reproduce.py`` runs one setting at a time or two.

    python -m benchmarks.bench_settings_at_once [--setting=table1_vit_fashion_ape] [--full]

Runs ``--setting`` (its reduced form, unless ``--full``) by the committed
command, each run in a fresh workdir and all of them on one warm JAX
compilation cache (filled by a first, untimed run), so that compilation counts
about equally:

  every core   one process on every core (``--noone_core``);
  one core     one process on one core (the command's default);
  two          two processes at the same time, each on a core of its own
               (what ``--jobs=2`` does).

Prints each run's wall time and settings per hour, the ratio of "two" to
"every core" (what ``--jobs=2`` gains over running the settings one after
another on the whole machine), and whether each run's ``results.json`` equals
the "one core" run's in every number but the recorded seconds: a process on
one core has a thread pool of one whatever runs beside it, so "two" should
equal it, and "every core" (a pool of one thread per core) need not.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

from experiments.report import committed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(setting: str, root: str, tag: str, cache: str, *, reduced: bool, one_core=True,
          core: int | None = None):
  """A run of ``setting`` into ``root/tag`` (on ``core`` if given), started, not waited for."""
  argv = [sys.executable, os.path.join(REPO, "experiments", "reproduce.py"),
          f"--setting={setting}", f"--workdir_root={root}/{tag}/work",
          f"--results={root}/{tag}/results", f"--compilation_cache={cache}",
          f"--one_core={one_core}", *(["--reduced"] if reduced else []),
          *([] if core is None else [f"--core={core}"])]
  with open(os.path.join(root, tag + ".log"), "w") as log:
    return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=REPO))


def run(setting, root, cache, runs, *, reduced) -> float:
  """Wall seconds of ``runs`` ({tag: start() keywords}), started together, until the last
  one ends."""
  t0 = time.perf_counter()
  processes = {tag: start(setting, root, tag, cache, reduced=reduced, **kw)
               for tag, kw in runs.items()}
  for tag, p in processes.items():
    if p.wait():
      sys.exit(f"{tag} failed; see {root}/{tag}.log")
  return time.perf_counter() - t0


def numbers(root: str, tag: str, setting: str, *, reduced: bool, one_core: bool = True):
  """The run's results.json (first scope) without the seconds an alignment took."""
  run = committed.Run(setting, committed.folder(os.path.join(root, tag, "results"), setting,
                                                reduced=reduced, one_core=one_core))
  def strip(x):
    if isinstance(x, dict):
      return {k: strip(v) for k, v in x.items() if k != "seconds"}
    return [strip(v) for v in x] if isinstance(x, list) else x
  return strip(run.results(run.scopes()[0]))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--setting", default="table1_vit_fashion_ape")
  parser.add_argument("--full", action="store_true", help="the setting itself, not reduced")
  args = parser.parse_args()
  reduced = not args.full
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < 2:
    sys.exit("needs two cores")
  root = tempfile.mkdtemp(prefix="bench_settings_")
  cache = os.path.join(root, "jax_cache")
  print(f"{args.setting}{' --reduced' if reduced else ''}, {len(cores)} cores; runs under {root}")
  run(args.setting, root, cache, {"warmup": {}}, reduced=reduced)
  every = run(args.setting, root, cache, {"all_cores": {"one_core": False}}, reduced=reduced)
  one = run(args.setting, root, cache, {"one_core": {}}, reduced=reduced)
  two = run(args.setting, root, cache, {"two_a": {"core": cores[0]}, "two_b": {"core": cores[1]}},
            reduced=reduced)
  for name, seconds, settings in (("every core", every, 1), ("one core", one, 1),
                                  ("two at once", two, 2)):
    print(f"{name:12s} {seconds:7.1f} s  {settings * 3600 / seconds:6.1f} settings/h")
  print(f"two at once / every core: {2 * every / two:.2f}x the settings per hour")
  reference = numbers(root, "one_core", args.setting, reduced=reduced)
  for tag, one_core in (("two_a", True), ("two_b", True), ("all_cores", False)):
    same = numbers(root, tag, args.setting, reduced=reduced, one_core=one_core) == reference
    print(f"{tag}: results {'equal to' if same else 'differ from'} the one-core run's")


if __name__ == "__main__":
  main()
