r"""Runs one setting: training, then the study stages.

    python experiments/main.py --config=experiments/configs/quickstart.py --workdir=/tmp/quickstart

A setting file takes a variant argument after a colon and fields are
overridden with flags, e.g.
``--config=experiments/configs/vit_cifar.py:rope --config.train.num_steps=100``;
a tuple field takes a tuple, ``--config.study.methods="('naive', 'full')"``.
Every field is checked (``config_checks.validate``) before any stage runs.
Without ``--workdir`` the run goes to ``$TMPDIR/attn_symmetry/<setting>``.

Several processes (hosts, or processes on one host) run one setting together
over ``jax.distributed``: start the command once per process with the same
flags and workdir (a folder every process can read) and

    --coordinator_address=HOST:PORT --num_processes=P --process_id=I

(process I of P; process 0 serves the coordinator at HOST:PORT). A flag left
out is taken from the environment where a cluster sets it (Slurm, Open MPI,
Cloud TPU, ``JAX_COORDINATOR_ADDRESS``); ``--multihost`` alone takes all three
from there. Every process trains and studies on the global batches' shares of
its devices, process 0 writes the files (``train/trainer.py``, ``study/study.py``), and the
results are those of one process with as many devices. On CPU, the processes'
collectives run over gloo (JAX's default ``jax_cpu_collectives_implementation``).
"""

import logging as python_logging
import os
import sys
import tempfile
import time
from typing import Any

import jax
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from attn_symmetry import data
from attn_symmetry import runtime

if not __package__:  # run by path: import the package this file is in, from its own folder
  runtime.import_script_package(__file__)

# pylint: disable=g-import-not-at-top,wrong-import-position  (after the package above)
from experiments.report import report
from experiments.setting import config_checks
from experiments.study import study
from experiments.train import checkpoints
from experiments.train import inputs
from experiments.train import trainer

config_flags.DEFINE_config_file("config", None, "A setting in experiments/configs/.",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory of checkpoints, metrics and reports.")
flags.DEFINE_bool("multihost", False,
                  "Join a run of several processes whose coordinator address, process count "
                  "and index the cluster's environment gives (jax.distributed.initialize()).")
flags.DEFINE_string("coordinator_address", None,
                    "HOST:PORT of the coordinator (served by process 0) of a run of several "
                    "processes; implies --multihost.")
flags.DEFINE_integer("num_processes", None, "How many processes run the setting together; "
                     "implies --multihost.")
flags.DEFINE_integer("process_id", None, "This process's index, 0 to --num_processes - 1; "
                     "implies --multihost.")
flags.DEFINE_string(
    "compilation_cache", runtime.COMPILATION_CACHE,
    "JAX's persistent compilation cache: programs compiled once (a model's training step, "
    "align_model for a scope) load from here in later runs of any setting. '' turns it off.")
flags.mark_flag_as_required("config")
FLAGS = flags.FLAGS

# The stages of a run, in order: each takes (config, workdir) and skips what the workdir
# already holds, so that a rerun after a crash continues where it stopped. main() checks the
# config once, before the first; the stages see that it was (config_checks.validated).
STAGES = (trainer.train_and_evaluate, study.run_study)


def default_workdir(config_path: str) -> str:
  """$TMPDIR/attn_symmetry/<setting>[_<variant>] for "path/<setting>.py[:<variant>]"."""
  path, _, variant = config_path.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  if variant:
    name += "_" + variant.replace(",", "_")
  return os.path.join(tempfile.gettempdir(), "attn_symmetry", name)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with every bad flag reported in one line and exit status 1."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"FATAL Flags parsing error: {e}")
  except (AttributeError, KeyError) as e:  # ml_collections: an override of a missing field.
    while e.args and isinstance(e.args[0], BaseException):
      e = e.args[0]
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    sys.exit(f"FATAL Flags parsing error: one of {overrides} names a field that the config "
             f"does not have: {e.args[0] if e.args else e}")


def distributed_arguments() -> dict[str, Any] | None:
  """The keyword arguments of ``jax.distributed.initialize`` that the flags give (those left
  out are found by JAX in the environment), or None when this process runs alone.

  Raises:
    ValueError: one line naming the flag whose value cannot work.
  """
  given = {name: FLAGS[name].value for name in ("coordinator_address", "num_processes",
                                               "process_id") if FLAGS[name].value is not None}
  if not given and not FLAGS.multihost:
    return None
  count, index = given.get("num_processes"), given.get("process_id")
  if count is not None and count < 1:
    raise ValueError(f"--num_processes must be at least 1, got {count}")
  if index is not None and (index < 0 or (count is not None and index >= count)):
    raise ValueError(f"--process_id must be in [0, {count if count is not None else 'P'}), "
                     f"got {index}")
  address = given.get("coordinator_address")
  if address is not None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
      raise ValueError(f"--coordinator_address must be HOST:PORT, got {address!r}")
  return given


def join_processes() -> None:
  """``jax.distributed.initialize`` with ``distributed_arguments`` (nothing when this process
  runs alone); every failure exits with one line. The config's batches must split over the
  processes (``inputs.check_processes``): checked here, before waiting for the others, when
  the flags give their count, else once they have joined. Processes other than 0 then log
  warnings and errors only: process 0's progress lines are the run's."""
  try:
    arguments = distributed_arguments()
    if arguments is None:
      return
    count = arguments.get("num_processes")
    if count is not None:
      inputs.check_processes(FLAGS.config, count)
  except ValueError as e:
    sys.exit(f"FATAL {e}")
  try:
    jax.distributed.initialize(**arguments)
  except (ValueError, RuntimeError) as e:  # JAX's own errors: a missing field, no coordinator
    message = (str(e).strip().splitlines() or [type(e).__name__])[0]
    sys.exit(f"FATAL jax.distributed.initialize: {message}")
  if count is None:  # the cluster's count
    try:
      inputs.check_processes(FLAGS.config)
    except ValueError as e:
      sys.exit(f"FATAL {e}")
  if jax.process_index() != 0:
    # absl's handler passes each record to its python_handler, whose filters apply.
    logging.get_absl_handler().python_handler.addFilter(
        lambda record: record.levelno >= python_logging.WARNING)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if not FLAGS["verbosity"].present:  # Keep orbax's INFO lines out of the progress output.
    logging.set_verbosity(logging.WARNING)
  join_processes()
  if FLAGS.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", FLAGS.compilation_cache)
  try:  # once, before training, so a bad field costs nothing
    config_checks.validate(FLAGS.config)
  except ValueError as e:
    sys.exit(f"FATAL {e}")
  workdir = FLAGS.workdir or default_workdir(config_flags.get_config_filename(FLAGS["config"]))
  trainer.log.info("workdir: %s", workdir)
  start = time.perf_counter()
  seconds = {}
  try:
    with runtime.CompileClock() as clock:
      for stage in STAGES:
        stage_start = time.perf_counter()
        outputs = stage(FLAGS.config, workdir)
        seconds[stage.__name__] = time.perf_counter() - stage_start
  except (checkpoints.CorruptCheckpointError, data.DatasetUnavailable) as e:  # one line each
    sys.exit(f"FATAL {e}")
  if jax.process_index() != 0:
    return
  for name, path in outputs.items():  # the study's reports
    print(f"{name}: {path}")
  print("wall time: " + ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items()))
  print(clock.summary(time.perf_counter() - start))
  results = study.results_by_scope(outputs)
  if results:
    print("\n".join(["", *report.headline(results)]))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
