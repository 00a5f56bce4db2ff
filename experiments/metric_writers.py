"""Metrics of a training run: a JSON-lines log, TensorBoard summaries, progress lines.

``MetricWriter`` appends one JSON object per call to ``metrics.jsonl`` and the
same scalars to a TensorBoard event file, written directly (TFRecord framing of
``Event`` protocol buffers, encoded by hand), so that neither TensorFlow nor
the tensorboard package is needed to write them; ``tensorboard --logdir DIR``
reads them. After a resume, log lines past the restored step are dropped, so
the log reads as one uninterrupted run.

``metrics.jsonl`` is an append log: a process killed while appending can
leave its last line cut short. ``read_jsonl`` drops such a line (with a
warning) and the next run rewrites the log without it, atomically.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import struct
import time
from typing import Mapping

from experiments import atomic_io

log = logging.getLogger(__name__)

_CRC32C_POLY = 0x82F63B78  # Castagnoli, bit-reflected.


def _crc32c_table() -> list[int]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ _CRC32C_POLY if crc & 1 else crc >> 1
    table.append(crc)
  return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli) of ``data``, as TFRecord framing uses."""
  crc = 0xFFFFFFFF
  for b in data:
    crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    low, n = n & 0x7F, n >> 7
    out.append(low | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
  return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _event(step: int, wall_time: float, *, scalars: Mapping[str, float] | None = None,
           file_version: str | None = None) -> bytes:
  """Encodes a tensorflow ``Event`` (wall_time=1, step=2, file_version=3, summary=5)."""
  out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
  if file_version is not None:
    out += _length_delimited(3, file_version.encode())
  if scalars:
    # Summary.value=1 holding Summary.Value(tag=1, simple_value=2 as float32).
    values = b"".join(
        _length_delimited(1, _length_delimited(1, tag.encode()) + _varint(2 << 3 | 5)
                          + struct.pack("<f", value))
        for tag, value in scalars.items())
    out += _length_delimited(5, values)
  return out


def _record(data: bytes) -> bytes:
  """TFRecord framing: length, masked CRC of the length, data, masked CRC of the data."""
  length = struct.pack("<Q", len(data))
  return length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data))


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
    name = f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}"
    self._events = open(os.path.join(logdir, name), "ab")
    self._events.write(_record(_event(0, time.time(), file_version="brain.Event:2")))

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    """Logs float scalars (e.g. {"train/loss": 0.3}) at ``step``."""
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    with open(self.json_path, "a") as f:
      f.write(json.dumps({"step": int(step), **scalars}) + "\n")
    self._events.write(_record(_event(int(step), time.time(), scalars=scalars)))
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


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  minutes, s = divmod(int(round(seconds)), 60)
  h, m = divmod(minutes, 60)
  return f"{h}:{m:02d}:{s:02d}"


class Progress:
  """One-line progress reports with a bar, the step rate and the time left.

  The rate counts from ``begin``, called once the first step is done, so the
  compilation of the first step does not distort the ETA.

  Args:
    total: the last step of the run.
    width: characters of the bar.
  """

  def __init__(self, total: int, width: int = 20):
    self.total, self.width = total, width
    self._t0, self._s0 = time.perf_counter(), 0

  def begin(self, step: int) -> None:
    """Starts the clock at ``step``."""
    self._t0, self._s0 = time.perf_counter(), step

  def line(self, step: int, scalars: Mapping[str, float]) -> str:
    """E.g. "[##########..........]  50% step 50/100 loss 0.41 | 12.5 steps/s | ETA 0:00:04"."""
    elapsed = time.perf_counter() - self._t0
    rate = (step - self._s0) / elapsed if step > self._s0 and elapsed > 0 else math.nan
    filled = int(step / self.total * self.width)
    values = " ".join(f"{k} {v:.4g}" for k, v in scalars.items())
    return (f"[{'#' * filled}{'.' * (self.width - filled)}] {100 * step / self.total:3.0f}% "
            f"step {step}/{self.total} {values} | {rate:.3g} steps/s | "
            f"ETA {_duration((self.total - step) / rate)}")
