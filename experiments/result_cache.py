"""Files of the study that are recomputed only when what they are drawn from changed.

``cached`` keeps one JSON result with the fields it was computed from
(``fingerprints.py``): a rerun reuses it while the fields are unchanged.
``Reports`` keeps the report files (results, figures, summary) with the
fingerprint of their inputs in ``report_fingerprints.json``. Every file is
written atomically (``atomic_io.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from experiments import atomic_io
from experiments import fingerprints

log = logging.getLogger(__name__)
log.setLevel(logging.INFO)


def cached(path: str, fields: Mapping[str, Any], compute: Callable[[], dict]
           ) -> tuple[dict, str | None]:
  """The JSON result at ``path`` if it was computed from ``fields``, else ``compute()``
  saved there (atomically) with them.

  Returns:
    (result, why): why is None when the saved result was reused, else why it
    was computed: "new" (nothing usable saved; a file that does not parse
    warns, naming it) or ``fingerprints.change_line`` of the changed fields.
  """
  fp = fingerprints.key(fields)
  saved = atomic_io.read_json_or_none(path, "study cache")
  why = "new"
  if isinstance(saved, dict) and "result" in saved:
    if saved.get("fingerprint") == fp:
      return saved["result"], None
    old = saved.get("fields")
    why = (fingerprints.change_line(old, fields) if isinstance(old, dict)
           else "inputs changed (saved before stages recorded their fields)")
  elif saved is not None:
    log.warning("study cache %s holds no result; recomputing it", path)
  result = compute()
  atomic_io.write_json(path, {"fingerprint": fp, "fields": dict(fields), "result": result})
  return result, why


class Reports:
  """The report files under one folder, each rewritten only when what it is drawn from changed.

  ``report_fingerprints.json`` in that folder maps each report (path relative
  to it) to the fingerprint of its inputs (the results and title it is drawn
  from); a report whose file exists with the same fingerprint is kept.
  """

  def __init__(self, directory: str):
    self.directory = directory
    self._path = os.path.join(directory, "report_fingerprints.json")
    saved = atomic_io.read_json_or_none(self._path, "report fingerprints")
    self._saved = saved if isinstance(saved, dict) else {}
    self.written: list[str] = []

  def write(self, name: str, drawn_from: Any, write: Callable[[str], Any]) -> str:
    """``write(path)`` for report ``name`` unless it is up to date; returns its path."""
    path = os.path.join(self.directory, name)
    fp = fingerprints.key({"report": name, "drawn_from": drawn_from})
    if self._saved.get(name) != fp or not os.path.exists(path):
      write(path)
      self._saved[name] = fp
      atomic_io.write_json(self._path, self._saved, indent=1, sort_keys=True)
      self.written.append(name)
    return path
