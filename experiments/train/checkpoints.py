"""Checkpoints of one training run, with orbax, verified by content hashes.

A run directory holds ``checkpoints/<step>/`` with three items: ``params``
and ``opt_state`` (array trees) and ``meta`` (JSON: the model's architecture,
the data position, the run's name, and ``sha256``, the content hash
``fingerprints.tree_digest`` of the params and of the optimiser state as they
were saved). Saves are atomic (orbax writes to a temporary directory and
renames it when complete), asynchronous, and only the last ``keep`` are kept.

Every restore checks the hashes: a checkpoint whose files cannot be read, or
whose arrays do not hash to what its ``meta`` recorded (a flipped bit, a
truncated file), raises ``CorruptCheckpointError``, one line naming the
checkpoint and what was expected. Checkpoints written before hashes were
recorded cannot be verified and are refused the same way; a rerun of
training moves such a run aside (``trainer.py``) and trains it again.

The architecture recorded in ``meta`` is what makes a workdir safe to reuse:
``check_architecture`` compares it with the model about to be trained and
refuses, naming the parameters that differ, before anything is written.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from attn_symmetry import spec as spec_lib
from experiments.setting import fingerprints
from experiments.workdir import processes

Params = dict[str, Any]


class CorruptCheckpointError(ValueError):
  """A checkpoint that cannot be read, or whose arrays do not match their recorded hash."""


def architecture(family: str, abstract_params: Params) -> dict[str, Any]:
  """JSON-able description of a model: its family and every leaf's shape and dtype."""
  leaves = spec_lib.flatten(abstract_params)
  return {"family": family,
          "params": {p: [list(x.shape), np.dtype(x.dtype).name] for p, x in sorted(leaves.items())}}


def architecture_difference(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
  """Human-readable differences between two ``architecture`` records (empty if equal)."""
  diffs = []
  if saved["family"] != expected["family"]:
    diffs.append(f"family {saved['family']!r} != {expected['family']!r}")
  a, b = saved["params"], expected["params"]
  diffs += [f"{p}: only in the checkpoint" for p in sorted(set(a) - set(b))]
  diffs += [f"{p}: missing from the checkpoint" for p in sorted(set(b) - set(a))]
  diffs += [f"{p}: checkpoint {a[p]} != model {b[p]}" for p in sorted(set(a) & set(b))
            if list(a[p]) != list(b[p])]
  return diffs


def _first_line(error: BaseException, limit: int = 200) -> str:
  """"<type>: <the first line of its message>", without TensorStore's spec dump."""
  text = (str(error).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
  text = text if len(text) <= limit else text[:limit] + "..."
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _collect_quietly() -> None:
  """Collects the coroutines that a failed orbax restore leaves behind, without printing
  an "Exception ignored in <coroutine>" traceback for each (the error is reported once)."""
  hook = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None
  try:
    gc.collect()
  finally:
    sys.unraisablehook = hook


class RunCheckpoints:
  """The checkpoints of one run under ``run_dir/checkpoints``.

  Args:
    run_dir: the run's directory.
    keep: how many of the most recent checkpoints to keep.
    read_only: open without creating or deleting anything.
  """

  def __init__(self, run_dir: str, *, keep: int = 2, read_only: bool = False):
    self.run_dir = os.path.abspath(run_dir)
    self.directory = os.path.join(self.run_dir, "checkpoints")
    self._keep, self._read_only = keep, read_only
    self._open()

  def _open(self) -> None:
    ro = self._read_only
    # Read-only is enforced here (nothing created, kept or cleaned up, ``save`` refused)
    # rather than with orbax's read_only, which logs a warning every time. When writing,
    # cleanup_tmp_directories removes a save that a killed process left uncommitted.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if ro else self._keep, save_interval_steps=0 if ro else 1,
        create=not ro, cleanup_tmp_directories=not ro)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, params: Params, opt_state: Any, meta: dict[str, Any]) -> None:
    """Starts an asynchronous, atomic save of ``step``; ``meta`` gains the content hashes."""
    if self._read_only:
      raise ValueError(f"{self.directory} was opened read-only")
    meta = dict(meta, sha256={"params": fingerprints.tree_digest(params),
                              "opt_state": fingerprints.tree_digest(opt_state)})
    self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta)))

  def _restore(self, step: int, **items) -> Any:
    """orbax's restore of ``items``, its errors turned into one CorruptCheckpointError line."""
    try:
      return self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax, tensorstore and json raise many types for a damaged file.
      message = f"checkpoint {self.step_dir(step)} cannot be read ({_first_line(e)})"
    _collect_quietly()  # outside the except clause, so that the traceback is released
    raise CorruptCheckpointError(message)

  def restore_meta(self, step: int) -> dict[str, Any]:
    meta = self._restore(step, meta=ocp.args.JsonRestore()).meta
    if not isinstance(meta, dict):
      raise CorruptCheckpointError(f"checkpoint {self.step_dir(step)}: meta is not a JSON object")
    return meta

  def digest(self, step: int, item: str = "params", meta: dict[str, Any] | None = None) -> str:
    """The content hash that ``step``'s meta (read unless given) recorded for ``item``;
    the arrays are not read.

    Raises:
      CorruptCheckpointError: the meta cannot be read or has no hash (a
        checkpoint written before hashes were recorded).
    """
    recorded = (self.restore_meta(step) if meta is None else meta).get("sha256", {})
    if item not in recorded:
      raise CorruptCheckpointError(
          f"checkpoint {self.step_dir(step)} records no content hash (written before checkpoints "
          f"were verified), so it cannot be trusted: move {self.run_dir} aside and train it again")
    return recorded[item]

  def _verified(self, step: int, item: str, tree: Any, meta: dict[str, Any] | None = None) -> Any:
    expected, found = self.digest(step, item, meta), fingerprints.tree_digest(tree)
    if found != expected:
      raise CorruptCheckpointError(
          f"checkpoint {self.step_dir(step)}: {item} hash to sha256 {found[:12]}, not "
          f"{expected[:12]} as saved: the files under {os.path.join(self.step_dir(step), item)} "
          "are damaged")
    return tree

  def restore_params(self, step: int, abstract_params: Params) -> Params:
    """The params of ``step``, shaped and placed like ``abstract_params``, verified.

    ``abstract_params`` is a tree of ``jax.ShapeDtypeStruct`` (with a
    ``sharding`` to place the arrays).

    Raises:
      CorruptCheckpointError: unreadable, unverifiable or not as saved.
    """
    params = self._restore(step, params=ocp.args.StandardRestore(abstract_params)).params
    return self._verified(step, "params", params)

  def restore(self, step: int, abstract_params: Params, abstract_opt_state: Any):
    """(params, opt_state, meta) of ``step``, verified as ``restore_params``."""
    out = self._restore(step, params=ocp.args.StandardRestore(abstract_params),
                        opt_state=ocp.args.StandardRestore(abstract_opt_state),
                        meta=ocp.args.JsonRestore())
    if not isinstance(out.meta, dict):
      raise CorruptCheckpointError(f"checkpoint {self.step_dir(step)}: meta is not a JSON object")
    self._verified(step, "params", out.params, out.meta)
    self._verified(step, "opt_state", out.opt_state, out.meta)
    return out.params, out.opt_state, out.meta

  def move_aside(self, step: int) -> str | None:
    """Moves checkpoint ``step`` out of the way, to
    ``run_dir/corrupt_checkpoints/<step>.corrupt-<time>`` (never deleted).

    Returns:
      the new path (None on processes other than 0, which wait for the move).
    """
    self._manager.close()
    moved = processes.on_process_0(lambda: fingerprints.move_aside(
        self.step_dir(step), "corrupt", into=os.path.join(self.run_dir, "corrupt_checkpoints")),
                         f"move_aside {self.step_dir(step)}")
    self._open()
    return moved

  def wait(self) -> None:
    """Blocks until pending saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def check_architecture(run_dir: str, expected: dict[str, Any]) -> None:
  """Raises ValueError if ``run_dir`` holds checkpoints of another architecture.

  Reads only; a missing or empty directory passes, and so does one whose
  checkpoints' meta cannot be read (training and loading report those).
  """
  if not os.path.isdir(os.path.join(run_dir, "checkpoints")):
    return
  ckpts = RunCheckpoints(run_dir, read_only=True)
  for step in sorted(ckpts.all_steps(), reverse=True):
    try:
      saved = ckpts.restore_meta(step)["architecture"]
    except (CorruptCheckpointError, KeyError):
      continue
    diffs = architecture_difference(saved, expected)
    if diffs:
      shown = "\n  ".join(diffs[:20]) + ("\n  ..." if len(diffs) > 20 else "")
      raise ValueError(
          f"{ckpts.directory} holds checkpoints (step {step}) of another architecture than the "
          f"configured model; use another --workdir or remove them. Differences:\n  {shown}")
    return


def abstract_like(tree: Any, place: Callable[[tuple[int, ...]], jax.sharding.Sharding]) -> Any:
  """``jax.ShapeDtypeStruct`` of every leaf of ``tree``, placed with ``place(its shape)``
  (``inputs.placement``)."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place(tuple(x.shape))), tree)
