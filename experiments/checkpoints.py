"""Checkpoints of one training run, with orbax.

A run directory holds ``checkpoints/<step>/`` with three items: ``params``
and ``opt_state`` (array trees) and ``meta`` (JSON: the model's architecture,
the data position, the run's name). Saves are atomic (orbax writes to a
temporary directory and renames it when complete), asynchronous, and only the
last ``keep`` are kept.

The architecture recorded in ``meta`` is what makes a workdir safe to reuse:
``check_architecture`` compares it with the model about to be trained and
refuses, naming the parameters that differ, before anything is written.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from attn_symmetry import spec as spec_lib

Params = dict[str, Any]


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


class RunCheckpoints:
  """The checkpoints of one run under ``run_dir/checkpoints``.

  Args:
    run_dir: the run's directory.
    keep: how many of the most recent checkpoints to keep.
    read_only: open without creating or deleting anything.
  """

  def __init__(self, run_dir: str, *, keep: int = 2, read_only: bool = False):
    self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1,
        create=not read_only, read_only=read_only)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, params: Params, opt_state: Any, meta: dict[str, Any]) -> None:
    """Starts an asynchronous, atomic save of ``step``."""
    self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta)))

  def restore_meta(self, step: int) -> dict[str, Any]:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore_params(self, step: int, abstract_params: Params) -> Params:
    """The params of ``step``, shaped and placed like ``abstract_params``.

    ``abstract_params`` is a tree of ``jax.ShapeDtypeStruct`` (with a
    ``sharding`` to place the arrays).
    """
    return self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params))).params

  def restore(self, step: int, abstract_params: Params, abstract_opt_state: Any):
    """(params, opt_state, meta) of ``step``."""
    out = self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params),
        opt_state=ocp.args.StandardRestore(abstract_opt_state),
        meta=ocp.args.JsonRestore()))
    return out.params, out.opt_state, out.meta

  def wait(self) -> None:
    """Blocks until pending saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def check_architecture(run_dir: str, expected: dict[str, Any]) -> None:
  """Raises ValueError if ``run_dir`` holds checkpoints of another architecture.

  Reads only; a missing or empty directory passes.
  """
  if not os.path.isdir(os.path.join(run_dir, "checkpoints")):
    return
  ckpts = RunCheckpoints(run_dir, read_only=True)
  step = ckpts.latest_step()
  if step is None:
    return
  diffs = architecture_difference(ckpts.restore_meta(step)["architecture"], expected)
  if diffs:
    shown = "\n  ".join(diffs[:20]) + ("\n  ..." if len(diffs) > 20 else "")
    raise ValueError(
        f"{ckpts.directory} holds checkpoints (step {step}) of another architecture than the "
        f"configured model; use another --workdir or remove them. Differences:\n  {shown}")


def abstract_like(tree: Any, sharding: jax.sharding.Sharding) -> Any:
  """``jax.ShapeDtypeStruct`` of every leaf of ``tree``, placed with ``sharding``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
