"""The stages' progress lines and seconds (``Clock``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from attn_symmetry import runtime


class Clock:
  """The stages' progress lines and seconds.

  ``with clock.stage("load") as stage: ...; stage.summary = "both models"``
  records the block's seconds as ``clock.seconds["load"]``, returns the C
  heap's free pages to the system (``runtime.release_free_memory``: each stage
  starts from the live arrays), and says "load: both models (2.1 s)". A stage
  that raises says nothing.

  Attributes:
    say: called with each progress line.
    tick: called as ``tick(pass, groups done, groups)`` as a long pass over the groups of
      tensors goes (a progress bar: ``ProgressBar``).
    seconds: {stage or part name: seconds}, in the order they ended (the
      report's "time_s").
  """

  def __init__(self, say: Callable[[str], None] | None = None,
               tick: Callable[[str, int, int], None] | None = None):
    self.say = say or (lambda line: None)
    self.tick = tick or (lambda what, done, total: None)
    self.seconds: dict[str, float] = {}

  def stage(self, name: str) -> Stage:
    return Stage(self, name)


class Stage(contextlib.AbstractContextManager):
  """One stage of a ``Clock``: a context manager whose body sets ``summary``."""

  def __init__(self, clock: Clock, name: str):
    self.clock, self.name, self.summary = clock, name, ""
    self._start = 0.0  # set on entering the block
    self._stopped = False
    self._parts: list[tuple[str, str]] = []  # (label, key of clock.seconds)

  def __enter__(self) -> Stage:
    self._start = time.perf_counter()
    return self

  def __exit__(self, exc_type, *_) -> None:
    if exc_type is None:
      self.stop()
      runtime.release_free_memory()
      parts = "".join(f", {label} {self.clock.seconds[key]:.1f} s"
                      for label, key in self._parts)
      self.clock.say(f"{self.name}: {self.summary} ({self.clock.seconds[self.name]:.1f} s{parts})")

  def say(self, line: str) -> None:
    """A progress line from inside the stage."""
    self.clock.say(line)

  def tick(self, what: str, done: int, total: int) -> None:
    """``done`` of the ``total`` groups of pass ``what`` are done."""
    self.clock.tick(what, done, total)

  def stop(self) -> None:
    """Records the stage's seconds now rather than at its end (later calls change nothing): the
    save stage stops its clock just before it writes the report that holds them."""
    if not self._stopped:
      self.clock.seconds[self.name] = time.perf_counter() - self._start
      self._stopped = True

  @contextlib.contextmanager
  def part(self, key: str, label: str) -> Iterator[None]:
    """Times a step of the stage as ``clock.seconds[key]`` (a step in several blocks: their
    sum), releases the heap's free pages after it, and names it in the stage's line ("(12.0 s,
    LABEL 9.5 s)")."""
    start = time.perf_counter()
    yield
    self.clock.seconds[key] = self.clock.seconds.get(key, 0.0) + time.perf_counter() - start
    runtime.release_free_memory()
    if (label, key) not in self._parts:
      self._parts.append((label, key))


class ProgressBar:
  """A ``Clock``'s ``tick`` that shows a pass's progress on ``stream``: on a terminal one line
  redrawn in place and cleared when the pass ends; elsewhere (a log file) a line at most every
  ``interval`` seconds of a pass."""

  def __init__(self, stream: TextIO, prefix: str = "[align] ", interval: float = 30.0):
    self.stream, self.prefix, self.interval = stream, prefix, interval
    self.terminal = stream.isatty()
    self._said = time.perf_counter()

  def __call__(self, what: str, done: int, total: int) -> None:
    now = time.perf_counter()
    if done == 1:
      self._said = now
    text = f"{self.prefix}{what}: {done}/{total} groups"
    if self.terminal:
      end = "\r" + " " * len(text) + "\r" if done == total else ""
      self.stream.write(f"\r{text}{end}")
      self.stream.flush()
    elif done < total and now - self._said >= self.interval:
      self.stream.write(text + "\n")
      self.stream.flush()
      self._said = now
