"""Metrics of a training run: a JSON-lines log, TensorBoard summaries, progress lines.

``MetricWriter`` appends one JSON object per call to ``metrics.jsonl`` and the
same scalars to a TensorBoard event file, written by ``tensorboardX`` (which
needs neither TensorFlow nor the tensorboard package); ``tensorboard --logdir
DIR`` reads them. After a resume, log lines past the restored step are
dropped, so the log reads as one uninterrupted run, and the event file starts
by telling TensorBoard to discard the events after that step from earlier
files (tensorboardX's ``purge_step``).

``metrics.jsonl`` is an append log: a process killed while appending can
leave its last line cut short. ``read_jsonl`` drops such a line (with a
warning) and the next run rewrites the log without it, atomically.

``Progress`` formats one line per logging step with ``tqdm``'s meter (bar,
rate, time left) rather than a live bar: the runs log to files through absl,
where carriage-return updates would be unreadable.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Mapping

import tqdm

from experiments.workdir import atomic_io

log = logging.getLogger(__name__)


def _import_tensorboardx():
  """``tensorboardX``, imported by the runs that write (no other command of the experiments
  needs it) and without torch.

  Where torch is installed (the [hf] extra), tensorboardX's writer imports it at import time
  only to accept torch tensors, which no run passes: 1.4-1.6 s of every training process's
  start on a 2-core machine. Unless torch is already imported, ``import torch`` is made to
  fail (a None entry in ``sys.modules``) for the length of the import, so that tensorboardX
  takes the path it takes where torch is absent; the entry is removed afterwards, and a
  later ``import torch`` works as before."""
  if "torch" in sys.modules:
    import tensorboardX  # pylint: disable=import-outside-toplevel
    return tensorboardX
  sys.modules["torch"] = None
  try:
    import tensorboardX  # pylint: disable=import-outside-toplevel
  finally:
    if sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return tensorboardX


class MetricWriter:
  """Writes scalar metrics of one run to ``logdir``.

  Only the process with ``enabled=True`` (process 0 of a multi-host job)
  writes anything.

  Args:
    logdir: the run's directory; created if missing.
    resume_step: the step that training resumes from; entries of the JSON log
      with a larger step (written after the last checkpoint of a run that
      crashed) are dropped.
    enabled: whether this process writes.
  """

  def __init__(self, logdir: str, *, resume_step: int = 0, enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    os.makedirs(logdir, exist_ok=True)
    self.json_path = os.path.join(logdir, "metrics.jsonl")
    if os.path.exists(self.json_path):
      kept = [e for e in read_jsonl(self.json_path) if e["step"] <= resume_step]
      atomic_io.write_text(self.json_path, "".join(json.dumps(e) + "\n" for e in kept))
    tensorboardx = _import_tensorboardx()
    # The suffix keeps the file name unique: tensorboardX names files by the second, and
    # opens them truncating.
    self._events = tensorboardx.SummaryWriter(
        logdir, purge_step=resume_step + 1 if resume_step else None,
        filename_suffix=f".{os.getpid()}.{time.monotonic_ns()}")

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    """Logs float scalars (e.g. {"train/loss": 0.3}) at ``step``."""
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    with open(self.json_path, "a") as f:
      f.write(json.dumps({"step": int(step), **scalars}) + "\n")
    for tag, value in scalars.items():
      self._events.add_scalar(tag, value, global_step=int(step))
    self._events.flush()

  def close(self) -> None:
    if self.enabled:
      self._events.close()


def read_jsonl(path: str) -> list[dict]:
  """The entries of a ``metrics.jsonl`` log.

  A last line cut short (a writer killed while appending) is dropped with a
  warning.

  Raises:
    ValueError: an earlier line does not parse (naming the file and line).
  """
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  entries = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      entries.append(json.loads(line))
    except ValueError as e:
      if number < len(lines):  # only the piece after the last newline can be cut short
        raise ValueError(f"{path}, line {number}, does not parse: {e}") from None
      log.warning("%s: last line is cut short (%r); dropped", path, line[:60])
  return entries


class Progress:
  """One-line progress reports with a bar, the step rate and the time left.

  The rate counts from ``begin``, called once the first step is done, so the
  compilation of the first step does not distort the time left.

  Args:
    total: the last step of the run.
    width: characters of the bar.
  """

  def __init__(self, total: int, width: int = 20):
    self.total = total
    self._format = ("[{bar:%d}] {percentage:3.0f}%% step {n}/{total}{postfix} | {rate_fmt} | "
                    "ETA {remaining}" % width)
    self._t0, self._s0 = time.perf_counter(), 0

  def begin(self, step: int) -> None:
    """Starts the clock at ``step``."""
    self._t0, self._s0 = time.perf_counter(), step

  def line(self, step: int, scalars: Mapping[str, float]) -> str:
    """E.g. "[##########          ]  50% step 50/100, loss 0.41 | 12.50step/s | ETA 00:04"
    (``tqdm.tqdm.format_meter``; a rate below one step per second reads "s/step")."""
    values = " ".join(f"{k} {v:.4g}" for k, v in scalars.items())
    return tqdm.tqdm.format_meter(step, self.total, time.perf_counter() - self._t0,
                                  initial=self._s0, unit="step", postfix=values, ascii=" #",
                                  bar_format=self._format)
