r"""Reruns the CPU-sized settings of the paper's Section 6 and copies their reports to results/.

    python experiments/reproduce.py --setting=table1_vit_mnist_ape      # one setting
    python experiments/reproduce.py --setting=table1_vit_mnist_ape --reduced
    python experiments/reproduce.py --all                               # every setting, in turn
    python experiments/reproduce.py --all --jobs=2                      # two at a time
    python experiments/reproduce.py --setting=lm_gpt2_wiki_full,lm_llama_wiki_full --jobs=2
    python experiments/reproduce.py --list
    python experiments/reproduce.py --table                             # results/README.md's table

A setting is a variant of ``experiments/configs/cpu_paper.py`` (its docstring
describes each); this script trains and studies it exactly as
``experiments/main.py --config=experiments/configs/cpu_paper.py:<setting>``
would (same stages, same workdir reuse), then copies ``summary.md``, every
scope's ``results.json`` and figures, the config and a ``run.json`` (the
command, the git commit, wall time, the machine) into
``results/<setting>/`` (``results/<setting>/reduced/`` with ``--reduced``;
``report/committed.py`` spells the layout and writes it).
Files already in the target folder are replaced only by this setting's new
reports.

A variant of ``cpu_paper.STUDY_VARIANTS`` (the learned method from another start
or lambda scheme, the full-model rows with the O(d-1) residual) trains exactly what
its base setting trains: when its workdir is absent and its base's is in
``--workdir_root``, its workdir starts as a copy of the base's
(``runner.seed_workdir``, said in the log), so that only the study stages its
fields key are computed; run it after its base has finished. With the base's workdir
elsewhere, copy it by hand first (``cp -r <base's workdir> <root>/<variant>``).

Each setting runs on one CPU core (``runner.use_one_core``), so that its numbers do
not depend on the machine's core count or on what runs beside it: XLA splits
a computation over its process's thread pool, which has one thread per core
the process may use, and another split rounds float32 sums differently
(measured: the reduced ``table1_vit_fashion_ape`` on one core and on two
differ from the base model's first loss on). ``--noone_core`` runs on every
core instead (faster alone, another float32 trajectory): its reports go to
``results/<setting>/every_core/``, beside the one-core run's, and
results/README.md says whether each of its means falls inside the one-core
run's interval over seeds. ``--jobs=N`` runs N settings
at a time, each in a process of its own on a core of its own, the longest
first (by the wall time of its committed run): on a 2-core machine two
settings at a time finish more settings per hour than one on both cores,
because XLA's CPU code for models this small gains little from a second
thread (``benchmarks/bench_settings_at_once.py``).

The pieces: ``reproduction/runner.py`` runs one setting (``run_setting``,
``use_one_core``), ``reproduction/scheduler.py`` several at a time
(``run_settings``), ``report/committed.py`` writes each run into ``results/`` and
reads it back, and ``report/results_table.py`` writes the table of
``results/README.md``; this script is their command line.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import jax
from absl import app
from absl import flags
from absl import logging

from attn_symmetry import runtime

if not __package__:  # run by path: import the package this file is in, from its own folder
  runtime.import_script_package(__file__)

# pylint: disable=g-import-not-at-top,wrong-import-position  (after the package above)
from experiments.configs import cpu_paper
from experiments.report import committed
from experiments.report import results_table
from experiments.reproduction import runner
from experiments.reproduction import scheduler
from experiments.setting import config_checks

FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if FLAGS.list:
    print("\n".join(sorted(cpu_paper.SETTINGS)))
    return
  if FLAGS.table:
    print(results_table.write(FLAGS.results))
    return
  if FLAGS.all == bool(FLAGS.setting):
    sys.exit("FATAL give exactly one of --setting=NAME and --all (--list lists the settings)")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if FLAGS.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", FLAGS.compilation_cache)
  if FLAGS.jobs < 1:
    sys.exit(f"FATAL --jobs must be at least 1, got {FLAGS.jobs}")
  settings = (sorted(set(cpu_paper.SETTINGS) - set(cpu_paper.ACCELERATOR_ONLY)) if FLAGS.all
              else list(dict.fromkeys(FLAGS.setting)))
  unknown = sorted(set(settings) - set(cpu_paper.SETTINGS))
  if unknown:
    sys.exit(f"FATAL unknown setting(s) {unknown}; choose from {sorted(cpu_paper.SETTINGS)}")
  if FLAGS.jobs > 1 and len(settings) > 1:
    _run_in_processes(settings)
    return
  try:
    core = runner.use_one_core(FLAGS.core) if FLAGS.one_core else None  # before JAX's CPU client
  except ValueError as e:
    sys.exit(f"FATAL {e}")
  if core is not None:
    print(f"running on core {core} of {os.cpu_count()} (to run on every core: --noone_core)",
          flush=True)
  for setting in settings:
    out = committed.folder(FLAGS.results, setting, reduced=FLAGS.reduced,
                           one_core=FLAGS.one_core)
    seeded = runner.seed_workdir(FLAGS.workdir_root, setting, reduced=FLAGS.reduced)
    if seeded:
      print(f"{setting}: its workdir starts as a copy of {seeded} (its base setting's trained "
            "runs and study stages; the stages whose fields differ are recomputed)", flush=True)
    try:
      record = runner.run_setting(setting, reduced=FLAGS.reduced,
                                  workdir=runner.workdir(FLAGS.workdir_root, setting,
                                                         reduced=FLAGS.reduced),
                                  results_dir=out, jobs=FLAGS.jobs, one_core=FLAGS.one_core)
    except ValueError as e:
      sys.exit(f"FATAL {e}")
    print(f"{setting}: {record['wall_seconds']:.0f} s, reports in {out}")
    # Each compiled program holds ~14 memory mappings while JAX caches it; one setting leaves
    # ~10,000, and a process may hold 65,530 (vm.max_map_count): --all would reach it.
    jax.clear_caches()


def _run_in_processes(settings: list[str]) -> None:
  """``settings``, ``FLAGS.jobs`` at a time, each by this script in a process of its own
  (``scheduler.run_settings``); every config is checked before any starts."""
  variant = ",reduced" if FLAGS.reduced else ""
  for setting in settings:
    try:
      config_checks.validate(cpu_paper.get_config(setting + variant))
    except ValueError as e:
      sys.exit(f"FATAL {setting}: {e}")
  shared = [f"--jobs={FLAGS.jobs}", f"--one_core={FLAGS.one_core}",
            f"--workdir_root={FLAGS.workdir_root}",
            f"--results={FLAGS.results}", f"--compilation_cache={FLAGS.compilation_cache}",
            *(["--reduced"] if FLAGS.reduced else [])]
  argv = lambda setting: [sys.executable, os.path.abspath(__file__), f"--setting={setting}",
                          *shared]
  start = time.perf_counter()
  status = scheduler.run_settings(settings, argv, jobs=FLAGS.jobs, one_core=FLAGS.one_core,
                                  results_root=FLAGS.results, log_dir=FLAGS.workdir_root)
  failed = sorted(name for name, code in status.items() if code)
  print(f"{len(settings)} settings, {FLAGS.jobs} at a time: "
        f"{(time.perf_counter() - start) / 60:.0f} min")
  if failed:
    sys.exit(f"FATAL {len(failed)} setting(s) failed: {failed}; their logs are in "
             f"{FLAGS.workdir_root}")


def _define_flags() -> None:
  """The command's flags (defined only when run as a script, so that importing this module
  next to ``experiments.main`` defines no flag twice)."""
  flags.DEFINE_list("setting", None, f"One of {sorted(cpu_paper.SETTINGS)}, or several, "
                    "separated by commas (run one after another, or --jobs at a time).")
  flags.DEFINE_bool("all", False, "Run every setting, one after another (see --jobs), but "
                    "those for an accelerator (experiments/accelerator_sweep.py).")
  flags.DEFINE_bool("one_core", True, "Run each setting on one core, so that its numbers do "
                    "not depend on the core count (--noone_core: on every core, faster alone, "
                    "reports in results/<setting>/every_core/).")
  flags.DEFINE_integer("core", None, "The core of --one_core (default: the lowest this "
                       "process may use; --jobs gives each setting its own).")
  flags.DEFINE_integer("jobs", 1, "Settings run at the same time (--all, or several "
                       "--setting), each in a process of its own; with --setting, recorded in "
                       "run.json as the number of settings that shared the machine.")
  flags.DEFINE_bool("list", False, "List the settings and exit.")
  flags.DEFINE_bool("table", False, "Rewrite the table and the verdicts of results/README.md "
                    "from the committed results, after restating each run's statistics from its "
                    "measured pairs (results.json, summary.md), and exit.")
  flags.DEFINE_bool("reduced", False, "The reduced form of the setting (about a minute).")
  flags.DEFINE_string("workdir_root", os.path.join(tempfile.gettempdir(), "attn_symmetry",
                                                   "reproduce"),
                      "Where each setting's workdir (checkpoints, study stages) lives.")
  flags.DEFINE_string("results", committed.RESULTS_ROOT,
                      "Where the reports are copied.")
  flags.DEFINE_string("compilation_cache", runtime.COMPILATION_CACHE,
                      "JAX's persistent compilation cache ('' turns it off).")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
