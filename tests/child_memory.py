"""The peak resident memory of Python code run in a child process (``run``).

The peak is the child's own ``VmHWM`` (``/proc/self/status``), read by the child as it exits:
its high-water RSS since its ``exec``. ``os.wait4``'s ``ru_maxrss`` is not that: Linux keeps
the largest RSS of every memory image the process had, and a child started by ``subprocess``
(``vfork``, then ``exec``) had its parent's before its own, so ``ru_maxrss`` is at least the
parent's own peak: 3.0 GiB for ``python -c pass`` started by a process that once held 3 GiB.
A benchmark that writes a 7B-shaped checkpoint before it starts the alignment would report
the writer's peak as the alignment's.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

# Runs the code in argv[1] with argv[2:] as its arguments, then says the peak RSS last on stderr.
_WRAPPER = """import sys
code = sys.argv.pop(1)
try:
  exec(compile(code, "<child>", "exec"), {"__name__": "__main__"})
finally:
  with open("/proc/self/status") as status:
    peak = next(line.split()[1] for line in status if line.startswith("VmHWM"))
  print("peak_rss_kib:", peak, file=sys.stderr, flush=True)
"""
_MARK = "peak_rss_kib: "


@dataclasses.dataclass
class Child:
  """What ``run`` saw.

  Attributes:
    status: the exit status.
    peak: the child's peak RSS in bytes (its VmHWM: module docstring); None where it died
      before it could say it (killed).
    stderr: its standard error, the peak's line left out.
    lines: (seconds since the start, line) of each stderr line, in order.
    samples: (seconds since the start, RSS in bytes), every ``sample_every`` seconds.
    seconds: the wall time.
  """
  status: int
  peak: int | None
  stderr: str
  lines: list[tuple[float, str]]
  samples: list[tuple[float, int]]
  seconds: float


def run(code: str, *args: str, sample_every: float | None = None) -> Child:
  """Runs the Python ``code`` in a child with ``sys.argv[1:] == args``, its stdout discarded;
  its RSS sampled every ``sample_every`` seconds where given (``/proc/PID/status``'s VmRSS)."""
  start = time.perf_counter()
  argv: Sequence[str] = [sys.executable, "-c", _WRAPPER, code, *args]
  lines: list[tuple[float, str]] = []
  samples: list[tuple[float, int]] = []
  with open(os.devnull, "wb") as null:
    child = subprocess.Popen(argv, stdout=null, stderr=subprocess.PIPE, text=True)
    reader = threading.Thread(target=lambda: lines.extend(
        (time.perf_counter() - start, line.rstrip("\n")) for line in child.stderr))
    reader.start()
    while sample_every is not None and child.poll() is None:
      try:
        with open(f"/proc/{child.pid}/status", encoding="utf-8") as f:
          kib = next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
        samples.append((time.perf_counter() - start, kib * 1024))
      except (OSError, StopIteration):  # exiting: no memory image left
        pass
      time.sleep(sample_every)
    status = child.wait()
    reader.join()
  peaks = [int(line[len(_MARK):]) * 1024 for _, line in lines if line.startswith(_MARK)]
  lines = [(t, line) for t, line in lines if not line.startswith(_MARK)]
  return Child(status, peaks[-1] if peaks else None, "\n".join(line for _, line in lines), lines,
               samples, time.perf_counter() - start)
