r"""Runs one setting: training, then the study stages.

    python experiments/main.py --config=experiments/configs/quickstart.py --workdir=/tmp/quickstart

A setting file takes a variant argument after a colon and fields are
overridden with flags, e.g.
``--config=experiments/configs/vit_cifar.py:rope --config.train.num_steps=100``;
a tuple field takes a tuple, ``--config.study.methods="('naive', 'full')"``.
Every field is checked (``config_checks.validate``) before any stage runs.
Without ``--workdir`` the run goes to ``$TMPDIR/attn_symmetry/<setting>``.
Multi-host: start this command once per host with ``--multihost`` (see
``train.py``).
"""

import os
import sys
import tempfile
import time

import jax
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from attn_symmetry import runtime

if __package__ in (None, ""):  # run by path: the repository root holds the `experiments` package
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import checkpoints  # noqa: E402  (after the path above)
from experiments import config_checks
from experiments import study
from experiments import train

config_flags.DEFINE_config_file("config", None, "A setting in experiments/configs/.",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory of checkpoints, metrics and reports.")
flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() first.")
flags.DEFINE_string(
    "compilation_cache", runtime.COMPILATION_CACHE,
    "JAX's persistent compilation cache: programs compiled once (a model's training step, "
    "align_model for a scope) load from here in later runs of any setting. '' turns it off.")
flags.mark_flag_as_required("config")
FLAGS = flags.FLAGS

# The stages of a run, in order: each takes (config, workdir) and skips what the workdir
# already holds, so that a rerun after a crash continues where it stopped.
STAGES = (train.train_and_evaluate, study.run_study)


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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if not FLAGS["verbosity"].present:  # Keep orbax's INFO lines out of the progress output.
    logging.set_verbosity(logging.WARNING)
  if FLAGS.multihost:
    jax.distributed.initialize()
  if FLAGS.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", FLAGS.compilation_cache)
  try:  # before training, so a bad field costs nothing
    config_checks.validate(FLAGS.config)
  except ValueError as e:
    sys.exit(f"FATAL {e}")
  workdir = FLAGS.workdir or default_workdir(config_flags.get_config_filename(FLAGS["config"]))
  train.log.info("workdir: %s", workdir)
  start = time.perf_counter()
  seconds = {}
  try:
    with runtime.CompileClock() as clock:
      for stage in STAGES:
        stage_start = time.perf_counter()
        outputs = stage(FLAGS.config, workdir)
        seconds[stage.__name__] = time.perf_counter() - stage_start
  except checkpoints.CorruptCheckpointError as e:  # one line naming the file, no traceback
    sys.exit(f"FATAL {e}")
  for name, path in outputs.items():  # the study's reports
    print(f"{name}: {path}")
  print("wall time: " + ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items()))
  print(clock.summary(time.perf_counter() - start))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
