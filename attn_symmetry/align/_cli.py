"""The command line: ``attn-symmetry align`` and ``python -m attn_symmetry.align``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import warnings
from collections.abc import Sequence

import jax

from attn_symmetry import matching
from attn_symmetry import runtime
from attn_symmetry._version import __version__
from attn_symmetry.align import _check
from attn_symmetry.align import _agreement
from attn_symmetry.align import _outputs
from attn_symmetry.align import _pipeline
from attn_symmetry.align._clock import ProgressBar
from attn_symmetry.align._records import (MATCHING_OPTIONS, OUTPUTS, AlignWarning, InputError,
                                          Options)

DESCRIPTION = "Align and merge two Hugging Face checkpoints"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The command's arguments: the two folders, one flag per field of ``Options`` (its flag, doc
  and argparse arguments; the matching options' from ``matching.OPTIONS``), and the flags of
  the command itself (``--import``, ``--quiet``, ``--compilation-cache``)."""
  parser.add_argument("model_a", metavar="MODEL_A", help="HF model folder A (the reference)")
  parser.add_argument("model_b", metavar="MODEL_B", help="HF model folder B (aligned to A)")
  groups: dict[str, argparse._MutuallyExclusiveGroup] = {}  # pylint: disable=protected-access
  for field in dataclasses.fields(Options):
    if field.name == "matching":
      add_matching_flags(parser)
      continue
    meta, group = field.metadata, parser
    if meta["exclusive"] is not None:
      if meta["exclusive"] not in groups:
        groups[meta["exclusive"]] = parser.add_mutually_exclusive_group()
      group = groups[meta["exclusive"]]
    group.add_argument(meta["flag"], dest=field.name, default=field.default, help=meta["doc"],
                       **meta["cli"])
  parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                      help="import MODULE first (repeatable; the current folder is on the path): "
                           "a module that registers a matching method or a model family")
  parser.add_argument("--quiet", action="store_true", help="no progress lines or bar")
  parser.add_argument("--compilation-cache", metavar="DIR", default=runtime.COMPILATION_CACHE,
                      help="JAX's persistent compilation cache: a later alignment of the same "
                           "architecture skips compiling (default "
                           f"{runtime.COMPILATION_CACHE}; '' off)")


def add_matching_flags(parser: argparse.ArgumentParser) -> None:
  """One flag per matching option (``matching.OPTIONS``, the fields of ``matching.MatchOptions``):
  ``--learning-rate`` for ``learning_rate``, its type the parser of its range, its help the
  option's doc and range; not given, it is left to the method (None)."""
  for option in matching.OPTIONS:
    shown = str(option.default).lower() if isinstance(option.default, bool) else option.default
    default = "" if option.default is None else f"; default {shown}"
    parser.add_argument(_check.flag(option.name), type=option.range.parse,
                        metavar=option.range.metavar or option.name.upper(),
                        help=f"{option.doc} (must {option.range.says}{default})")


def options_of(args: argparse.Namespace) -> Options:
  """The options the flags give: every field of ``Options`` by its name, the matching options
  given (``MATCHING_OPTIONS``) in ``matching``."""
  return Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Options)
                    if f.name != "matching"},
                 matching={k: getattr(args, k) for k in MATCHING_OPTIONS
                           if getattr(args, k) is not None})


def _run(args: argparse.Namespace, prog: str) -> int:
  if args.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
  say = None if args.quiet else lambda line: print(f"[align] {line}", file=sys.stderr, flush=True)
  bar = None if args.quiet else ProgressBar(sys.stderr)
  with warnings.catch_warnings():  # restores showwarning
    warnings.simplefilter("always", AlignWarning)
    warnings.showwarning = lambda message, *_, **__: print(f"{prog}: warning: {message}",
                                                           file=sys.stderr, flush=True)
    try:
      _import_modules(args.imports)
      result = _pipeline.align_checkpoints(args.model_a, args.model_b, options_of(args),
                                           progress=say, progress_bar=bar)
    except InputError as e:
      print(f"{prog}: error: {e}", file=sys.stderr)
      return 2
    except KeyboardInterrupt:  # the staging folder is gone: nothing half-written is left
      where = f"to {args.out}" if args.out else "(no --out)"
      print(f"{prog}: interrupted: nothing written {where}", file=sys.stderr)
      return 130
  print("\n".join(summary(result.report, args.out)))
  return 0


def summary(report: dict, out: str | None) -> list[str]:
  """The lines the command ends with: what was written where, the two folders to compare, the
  distance before and after, the function check, and with an evaluation the barriers and the
  merged model's loss (the REPAIRed one's with ``--repair``, beside the plain merge's)."""
  lines = []
  if out is None:
    lines.append("nothing written (no --out)")
  else:
    written = [name for name in OUTPUTS if os.path.lexists(os.path.join(out, name))]
    lines.append(f"written to {out}: {', '.join(written)}")
    compare = [report["model_a"] if name == "MODEL_A" else os.path.join(out, name)
               for name in report["compare"]]
    lines.append(f"compare or merge: {compare[0]} and {compare[1]}")
  before, after = report["distance"]["before"], report["distance"]["after"]
  lines.append(f"distance to A: {before['total']:.6g} before, {after['total']:.6g} after "
               f"(relative {before['relative']:.4g} -> {after['relative']:.4g})")
  check = report["function_check"]
  if "aligned_b" in check:
    b = check["aligned_b"]
    lines.append(f"function check: aligned B's {check.get('outputs', 'logits')} within "
                 f"{b['relative']:.2g} of B's (tolerance {b['tolerance']:.2g})")
  else:
    lines.append(f"function check skipped: {check.get('skipped')}")
  if "barrier" in report:
    loss = {when: report["barrier"][when]["loss"] for when in ("before", "after")}
    lines.append(f"loss barrier: {loss['before']:.4g} before alignment, {loss['after']:.4g} "
                 "after")
  m = report.get("merged", {})
  if "repaired" in m:
    lines.append(f"REPAIRed merged model (lambda {m['lambda']:g}): loss "
                 f"{m['repaired']['loss']:.4g} (plain merge {m['loss']:.4g}, naive merge "
                 f"{m['naive']['loss']:.4g}, A {m['a']['loss']:.4g}, B {m['b']['loss']:.4g})")
  elif "loss" in m:
    lines.append(f"merged model (lambda {m['lambda']:g}): loss {m['loss']:.4g} (naive merge "
                 f"{m['naive']['loss']:.4g}, A {m['a']['loss']:.4g}, B {m['b']['loss']:.4g})")
  if "naive" in m:
    lines.append(_outputs.verdict_line(m))
  if "agreement" in report:
    lines += _agreement.lines(report["agreement"])
  elif "repair" in m:
    points = m["repair"].values()
    lines.append(f"REPAIRed merged model (lambda {m['lambda']:g}): "
                 f"{sum(p['corrected'] for p in points)} of "
                 f"{sum(p['channels'] for p in points)} channels corrected at {len(points)} "
                 "points (no evaluation file to measure its loss)")
  return lines


def _import_modules(names: Sequence[str]) -> None:
  """Imports the ``--import`` modules, the current folder first on the path, so that the
  methods and families they register are known to the alignment.

  Raises:
    InputError: a module is not found (an error inside a module that is found propagates
      with its traceback).
  """
  if names and os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  for name in names:
    try:
      importlib.import_module(name)
    except ModuleNotFoundError as e:
      if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
        raise  # the module was found and fails on an import of its own
      raise InputError(f"--import {name}: no module named {e.name!r} in the current folder or "
                       "on the Python path") from e


def _version(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--version", action="version",
                      version=f"%(prog)s {__version__}")


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m attn_symmetry.align MODEL_A MODEL_B --out DIR ...``: the same as
  ``attn-symmetry align``."""
  parser = argparse.ArgumentParser(prog="python -m attn_symmetry.align",
                                   description=DESCRIPTION)
  _version(parser)
  add_arguments(parser)
  return _run(parser.parse_args(argv), "attn-symmetry align")


def cli(argv: Sequence[str] | None = None) -> int:
  """The ``attn-symmetry`` console script: ``attn-symmetry align MODEL_A MODEL_B --out DIR ...``."""
  parser = argparse.ArgumentParser(prog="attn-symmetry")
  _version(parser)
  commands = parser.add_subparsers(dest="command", required=True)
  align = commands.add_parser("align", help="align (and merge) two HF checkpoints",
                              description=DESCRIPTION)
  _version(align)
  add_arguments(align)
  return _run(parser.parse_args(argv), "attn-symmetry align")
