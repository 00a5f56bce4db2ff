"""Atomic file writes, and reads that treat a damaged cache as missing.

Every JSON, markdown, figure and cache file that the runner writes goes
through ``atomic_write``: the bytes go to a temporary file in the same folder
(``.<name>.tmp-<pid>``), which is flushed, fsynced and renamed over the
target with ``os.replace``; the folder is then fsynced so that the rename
itself survives a power cut. A process killed at any point leaves either the
old file or the new one, never a truncated mix (at worst a stray temporary
file, which nothing reads).

``read_json_or_none`` is the read side for files that can be recomputed: a
missing file is None, and so is one that does not parse, with a warning that
names it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, IO, Iterator

log = logging.getLogger(__name__)


def _fsync_dir(directory: str) -> None:
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w") -> Iterator[IO]:
  """Opens a temporary file that replaces ``path`` when the block ends without error.

  Args:
    path: the file to write; its folder is created if missing.
    mode: "w" (text, UTF-8) or "wb".

  Yields:
    the open temporary file. If the block raises, the temporary file is
    removed and ``path`` is left as it was.
  """
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
  try:
    with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise
  _fsync_dir(directory)


def write_text(path: str, text: str) -> None:
  """Writes ``text`` to ``path`` atomically."""
  with atomic_write(path) as f:
    f.write(text)


def write_json(path: str, obj: Any, **dump_options) -> None:
  """Writes ``obj`` as JSON to ``path`` atomically (``json.dump`` options pass through)."""
  write_text(path, json.dumps(obj, **dump_options))


def save_figure(figure, path: str, **savefig_options) -> None:
  """``figure.savefig`` to ``path`` atomically, in the format of its extension."""
  fmt = os.path.splitext(path)[1].lstrip(".") or None
  with atomic_write(path, "wb") as f:
    figure.savefig(f, format=fmt, **savefig_options)


def read_json_or_none(path: str, what: str = "file") -> Any | None:
  """The JSON in ``path``; None if it is missing or does not parse (with a warning).

  Args:
    path: the file.
    what: what the file is, for the warning (e.g. "study cache").
  """
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors.
    log.warning("%s %s does not parse (%s: %s); treated as missing", what, path,
                type(e).__name__, e)
    return None
