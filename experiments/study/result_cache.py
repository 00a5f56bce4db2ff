"""Files of the study that are recomputed only when what they are drawn from changed.

``cached`` keeps one JSON result with the fields it was computed from
(``fingerprints.py``): a rerun reuses it while the fields are unchanged.
With several processes, process 0 reads and writes them all (``processes.py``).
``Reports`` keeps the report files (results, figures, summary) with the
fingerprint of their inputs in ``report_fingerprints.json``. Every file is
written atomically (``atomic_io.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from experiments.setting import fingerprints
from experiments.workdir import atomic_io
from experiments.workdir import processes

log = logging.getLogger(__name__)
log.setLevel(logging.INFO)


def cached(path: str, fields: Mapping[str, Any], compute: Callable[[], dict]
           ) -> tuple[dict, str | None]:
  """The JSON result at ``path`` if it was computed from ``fields``, else ``compute()``
  saved there (atomically) with them.

  Several processes: process 0 reads the file and decides, and every process follows its
  decision (``processes.from_process_0``): all reuse its saved result, or all compute (the
  computation's collectives need every process) and process 0 saves it.

  Returns:
    (result, why): why is None when the saved result was reused, else why it
    was computed: "new" (nothing usable saved; a file that does not parse
    warns, naming it) or ``fingerprints.change_line`` of the changed fields.
  """
  fp = fingerprints.key(fields)
  saved = processes.from_process_0(lambda: _saved(path, fp, fields))
  if saved["why"] is None:
    return saved["result"], None
  result = compute()
  if processes.is_main():
    atomic_io.write_json(path, {"fingerprint": fp, "fields": dict(fields), "result": result})
  return result, saved["why"]


def _saved(path: str, fp: str, fields: Mapping[str, Any]) -> dict[str, Any]:
  """{"result": the result saved at ``path`` with fingerprint ``fp``, "why": None}, or
  {"result": None, "why": why it has to be computed} (``cached``)."""
  saved = atomic_io.read_json_or_none(path, "study cache")
  if isinstance(saved, dict) and "result" in saved:
    if saved.get("fingerprint") == fp:
      return {"result": saved["result"], "why": None}
    old = saved.get("fields")
    return {"result": None, "why": fingerprints.change_line(old, fields) if isinstance(old, dict)
            else "inputs changed (saved before stages recorded their fields)"}
  if saved is not None:
    log.warning("study cache %s holds no result; recomputing it", path)
  return {"result": None, "why": "new"}


class Reports:
  """The report files under one folder, each rewritten only when what it is drawn from changed.

  ``report_fingerprints.json`` in that folder maps each report (path relative
  to it) to the fingerprint of its inputs (the results and title it is drawn
  from); a report whose file exists with the same fingerprint is kept. Only
  process 0 reads and writes them (``processes.py``); in the others ``write``
  returns the path alone.
  """

  def __init__(self, directory: str):
    self.directory = directory
    self._path = os.path.join(directory, "report_fingerprints.json")
    saved = (atomic_io.read_json_or_none(self._path, "report fingerprints")
             if processes.is_main() else None)
    self._saved = saved if isinstance(saved, dict) else {}
    self.written: list[str] = []

  def write(self, name: str, drawn_from: Any, write: Callable[[str], Any]) -> str:
    """``write(path)`` for report ``name`` unless it is up to date; returns its path."""
    path = os.path.join(self.directory, name)
    if not processes.is_main():
      return path
    fp = fingerprints.key({"report": name, "drawn_from": drawn_from})
    if self._saved.get(name) != fp or not os.path.exists(path):
      write(path)
      self._saved[name] = fp
      atomic_io.write_json(self._path, self._saved, indent=1, sort_keys=True)
      self.written.append(name)
    return path
