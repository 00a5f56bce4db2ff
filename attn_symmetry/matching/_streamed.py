"""``align_model``'s descent over a model read one group of leaves at a time.

``align_model_streamed(spec, read, shapes, ...)`` returns the element that
``align_model`` returns for the same parameters and options, without holding
either model whole: ``read(paths)`` gives both models' leaves at ``paths`` (in
their stored dtype, bfloat16 kept as it is), and the descent asks it for one
group of ``stream_groups`` at a time (a ``layers_i``; the embeddings, final
norm and head together). Each group is computed in float32 (its leaves upcast
and, where the alignment needs it, brought to ``group_action.canonical_form``: norm scales
folded and, with ``residual="orthogonal"``, a pre-LayerNorm stream's writers projected onto
1-perp, each group on its own) in one compiled
program per group shape: groups are renamed to one canonical prefix
(``_Group``), so every layer of a model runs the same programs.

The descent is ``_model``'s, with the same plan, steps, first-round reads,
acceptance and pending rules, driven from the host:

* a step whose names all lie in one group each (FFN factors, attention sites)
  is one pass over the groups, each running ``_model._factor_step`` or
  ``_model._attention_step`` on its own leaves; consecutive such steps that
  share no leaf run in the same pass;
* a factor whose leaves span groups (the residual stream) is a reduction: its
  score M = sum_leaf A_(P) B_(P)^T [n, n] is summed over the groups
  (``_model._factor_scores`` of each), plus the leaves that score it the same in
  every round (``_model._fixed_scores``, once, in the first pass), and then
  solved by ``_model._factor_update``.

So one round of the descent is a pass over the layers for the local steps
plus one for the residual's reduction, and memory holds one group of each
model (on the device, its host copy dropped as it is copied), float32 copies of
the leaves a program is working on and the n x n scores (added in place, one
block of rows at a time: ``_model._add_leaf_scores``), whatever the depth. That
needs every pass to wait for a group's program before it reads the next group
(``_done``): JAX dispatches asynchronously, and a pass whose results are not
read until its end (the first pass, a reduction, the distance) would otherwise
read group after group while the programs queued on the same cores still hold
the earlier groups' leaves (a 4-layer Mistral-7B-shaped pair on one core: 6.5
GiB after the descent, whose steps each wait for their group's result, against
5.0 in it). The sums
over groups are associated differently from ``align_model``'s single sum, so
the two agree to rounding, not bit for bit: identical permutations and
matrices within 1e-5 on the tested models in float32. The "full" method's
refinement magnifies that rounding over rounds (tiny Llama, random pair, 9
rounds: matrices 2.9e-4 apart in float32), but the algorithm is the same: in
float64 (``jax_enable_x64``) the same pair ends 1.8e-15 apart after 10 rounds.

Sharded (``mesh``): each group's leaves are placed on the devices of a
``jax.sharding.Mesh``, every leaf split along its longest axis that the mesh's
device count divides (``leaf_sharding``), and the group programs, compiled for
those placements, are partitioned by XLA over the devices: a device holds
1/n of each leaf and computes its part of every score, and the scores are
summed across devices (the reductions the partitioner inserts). The element
is the same as on one device to rounding (the sums are associated otherwise;
``tests/test_streamed_alignment.py`` compares them in float64 on 4 devices).

Method "learned" trains on the task loss of the interpolated model, which
needs both whole models: it is not streamed (``align_model``), nor is a
registered method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import group_action
from attn_symmetry import spec as spec_lib
from attn_symmetry.matching import _attention
from attn_symmetry.matching import _features
from attn_symmetry.matching import _methods
from attn_symmetry.matching import _model
from attn_symmetry.matching import _options
from attn_symmetry.matching import _static

CANONICAL = "group"  # the prefix a group's own leaves and names take in its programs
STREAMED_METHODS = ("naive", *_attention.STAGES)
Flat = dict[str, Any]
Read = Callable[[Sequence[str]], tuple[Flat, Flat]]  # paths -> (A's leaves, B's leaves)


def stream_groups(spec: spec_lib.SymmetrySpec) -> list[tuple[str, ...]]:
  """The leaf paths of ``spec`` in the groups read one at a time, in leaf order: every
  top-level key (``layers_i``, ``embed``, ...), merged with the keys where the readers of its
  norm scales lie (``final_norm`` with an untied ``head``) and, for a mean-zero orthogonal
  stream, where each LayerNorm's bias lies, so that ``canonical_form`` stays in a group."""
  top = lambda path: path.split("/")[0]
  parent = {top(p): top(p) for p in spec.axes}

  def root(key):
    while parent[key] != key:
      key = parent[key]
    return key

  links = [(scale, reader) for scale, readers in spec.norm_scales.items() for reader in readers]
  links += [(scale, bias) for f, stream in spec.streams.items()
            if spec.factors[f].kind == "mean_zero_orthogonal"
            for scale, (bias, _) in stream.norms.items()]
  for scale, other in links:
    if root(top(other)) != root(top(scale)):
      parent[root(top(other))] = root(top(scale))
  groups: dict[str, list[str]] = {}
  for p in spec.axes:
    groups.setdefault(root(top(p)), []).append(p)
  return [tuple(paths) for paths in groups.values()]


@dataclasses.dataclass(frozen=True)
class _Group:
  """One group of leaves, renamed for its programs.

  Attributes:
    paths: the group's leaf paths.
    leaf: path -> its canonical path; names: factor or site acting on the group -> its
      canonical name. A group of one top-level key K has K/ replaced by ``CANONICAL``/ in
      both (global factors such as "residual" keep their names).
    spec: the canonical part spec (``SymmetrySpec.part``), static for jit.
    plan: ``plan``'s steps restricted to the group's names and leaves, canonical; steps with
      no name in the group are empty.
  """
  paths: tuple[str, ...]
  leaf: dict[str, str]
  names: dict[str, str]
  spec: _static.StaticSpec
  plan: tuple[_model._Step, ...]

  @classmethod
  def make(cls, spec: spec_lib.SymmetrySpec, plan: list[_model._Step], paths: tuple[str, ...]
           ) -> _Group:
    keys = {p.split("/")[0] for p in paths}
    key = keys.pop() + "/" if len(keys) == 1 else None
    rename = lambda n: CANONICAL + "/" + n[len(key):] if key and n.startswith(key) else n
    part = spec.part(paths)
    names = {n: rename(n) for n in (*part.factors, *part.attention)}
    streams = {names[f]: spec_lib.LayerNormStream(
        tuple(map(rename, s.writers)),
        {rename(k): (rename(b), tuple(map(rename, r))) for k, (b, r) in s.norms.items()})
               for f, s in part.streams.items()}
    canonical = spec_lib.SymmetrySpec(
        {names[f]: v for f, v in part.factors.items()},
        {rename(p): tuple(None if f is None else names[f] for f in a) for p, a in part.axes.items()},
        {names[s]: v for s, v in part.attention.items()},
        {rename(s): tuple(map(rename, r)) for s, r in part.norm_scales.items()},
        streams=streams)
    steps = tuple(_model._Step(tuple(names[n] for n in step.names if n in names), step.attention,
                               frozenset(rename(p) for p in step.leaves if p in paths))
                  for step in plan)
    return cls(paths, {p: rename(p) for p in paths}, names, _static.StaticSpec(canonical), steps)

  def own(self, i: int) -> bool:
    """Whether step ``i`` of the plan has names in this group."""
    return bool(self.plan[i].names)

  def sub(self, values: Mapping[str, Any]) -> dict[str, Any]:
    """{canonical name: value} of a mapping keyed by the original names (elements, masks)."""
    return {c: values[n] for n, c in self.names.items()}

  def back(self, values: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of ``sub``."""
    return {n: values[c] for n, c in self.names.items()}


def _done(result: Any) -> Any:
  """``result`` once its program has run: a pass waits for each group's program before it
  reads the next group, so that one group's leaves are held at a time (module docstring)."""
  return jax.block_until_ready(result)


def leaf_sharding(shape: Sequence[int], mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """A leaf of ``shape`` split over every device of ``mesh``: along its longest axis whose size
  the device count divides (the first such, on a tie), replicated where none does."""
  n = mesh.devices.size
  fits = [i for i, size in enumerate(shape) if size % n == 0]
  spec = [None] * len(shape)
  if fits:
    spec[max(fits, key=lambda i: (shape[i], -i))] = mesh.axis_names
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


# ----------------------------------------------------------------------------- group programs


def _prepare(flat_a: Flat, flat_b: Flat, spec: spec_lib.SymmetrySpec, fold: bool
             ) -> tuple[Flat, Flat]:
  """A group's leaves in their compute dtype (``_attention.upcast``), in
  ``group_action.canonical_form`` (norm scales folded) if ``fold``."""
  out = []
  for flat in (flat_a, flat_b):
    flat = _attention.upcast(flat)
    if fold:
      flat = spec_lib.flatten(group_action.canonical_form(spec, spec_lib.unflatten(flat)))
    out.append(flat)
  return out[0], out[1]


@functools.partial(jax.jit, static_argnames=("spec", "fold", "factors"))
def _first_pass(flat_a, flat_b, on, *, spec, fold, factors):
  """(||A - B||^2 of the group, {f: the group's ``_fixed_scores`` of f} for ``factors``)."""
  a, b = _prepare(flat_a, flat_b, spec.spec, fold)
  fixed = _model._fixed_scores(spec.spec, a, b, on)
  return sum(jnp.sum((a[p] - b[p]) ** 2) for p in a), {f: fixed[f] for f in factors}


@functools.partial(jax.jit, static_argnames=("spec", "plan", "fold", "factor"))
def _group_scores(flat_a, flat_b, element, read, rounds, *, spec, plan, fold, factor):
  """The group's share of ``factor``'s scores (``_model._factor_scores``), fixed leaves left
  out (``_first_pass`` has them)."""
  a, b = _prepare(flat_a, flat_b, spec.spec, fold)
  n = spec.spec.factors[factor].size
  dtype = next(iter(a.values())).dtype
  zeros = (jnp.zeros((n, n), dtype), jnp.zeros((), dtype), jnp.zeros((), dtype))
  return _model._factor_scores(spec.spec, list(plan), factor, a, b, element, read, rounds, zeros)


@functools.partial(jax.jit, static_argnames=("spec", "plan", "fold", "run", "steps", "init",
                                             "solver"))
def _group_steps(flat_a, flat_b, element, reads, rounds, on, learning_rate, stage, distance, *,
                 spec, plan, fold, run, steps, init, solver):
  """Runs the steps ``run`` (indices into ``plan``) on the group, one after another:
  (element, [changed per step], the most refinement iterations)."""
  spec, plan = spec.spec, list(plan)
  a, b = _prepare(flat_a, flat_b, spec, fold)
  fixed = _model._fixed_scores(spec, a, b, on)
  changed, taken = [], jnp.int32(0)
  for i in run:
    step = plan[i]
    if step.attention:
      sites_on = jnp.stack([on[s] for s in step.names])
      element, moved, t = _model._attention_step(spec, step, a, b, element, learning_rate,
                                                 rounds == 0, stage, sites_on, distance,
                                                 steps=steps, init=init, solver=solver)
      taken = jnp.maximum(taken, t)
    else:
      element, moved = _model._factor_step(spec, plan, step, a, b, element, reads, rounds, on,
                                           fixed)
    changed.append(moved)
  return element, changed, taken


@functools.partial(jax.jit, static_argnames=("spec", "plan", "fold"))
def _group_distance(flat_a, flat_b, element, *, spec, plan, fold):
  """||A - g . B||^2 over the group's leaves (``_model._distance``)."""
  a, b = _prepare(flat_a, flat_b, spec.spec, fold)
  return _model._distance(spec.spec, list(plan), a, b, element)


@functools.partial(jax.jit, static_argnames=("spec", "plan", "fold", "steps", "init", "solver"))
def _group_refine(flat_a, flat_b, element, on, learning_rate, *, spec, plan, fold, steps, init,
                  solver):
  """The "full" refinement of the group's sites (``refine="final"``): (element, iterations)."""
  spec, plan = spec.spec, list(plan)
  a, b = _prepare(flat_a, flat_b, spec, fold)
  taken = jnp.int32(0)
  for step in plan:
    if step.attention and step.names:
      sites_on = jnp.stack([on[s] for s in step.names])
      element, t = _model._refine_step(spec, step, a, b, element, learning_rate, sites_on,
                                       steps=steps, init=init, solver=solver)
      taken = jnp.maximum(taken, t)
  return element, taken


_update = jax.jit(_model._factor_update, static_argnums=0)


# ----------------------------------------------------------------------------- the descent


class _Descent:
  """The host side of the streamed descent: the element, and passes over the groups."""

  def __init__(self, spec, read, shapes, names, *, fold, options, mesh=None, progress=None,
               on_group=None):
    self.spec, self.read, self.fold, self.options, self.mesh = spec, read, fold, options, mesh
    self.progress, self.on_group = progress, on_group
    dtype = _attention.compute_dtype(next(iter(shapes.values()))[1])
    stand_in = {p: jax.ShapeDtypeStruct(tuple(s), dtype) for p, (s, _) in shapes.items()}
    self.plan = _model._plan(spec, stand_in)
    self.groups = [_Group.make(spec, self.plan, paths) for paths in stream_groups(spec)]
    for s in spec.attention:
      if sum(s in g.names for g in self.groups) != 1:
        raise ValueError(f"attention site {s!r} spans groups {stream_groups(spec)}")
    active = jnp.asarray([n in names for n in _model._active_names(spec)], bool)
    self.on = dict(zip(_model._active_names(spec), active))
    reads, again = _model._first_round_reads(spec, self.plan, self.on)
    self.reads = {f: {p: r for p, r in leaves.items()} for f, leaves in reads.items()}
    self.again = [bool(x) for x in again]
    self.neighbours = np.asarray(_model._neighbours(spec, self.plan, active))
    self.element = group_action.identity_model(spec, dtype)
    self.dtype = dtype
    self.taken = 0

  @contextlib.contextmanager
  def _pass(self, what: str) -> Iterator[Iterator[_Group]]:
    """A pass over the groups: the block iterates the groups it is given, each announced to
    ``on_group(WHAT, groups done, groups)`` once its work is done; "WHAT: a pass over N groups
    (S s)" is said to ``progress`` once the pass ends."""
    start = time.perf_counter()
    yield self._groups(what)
    if self.progress is not None:
      self.progress(f"{what}: a pass over {len(self.groups)} groups "
                    f"({time.perf_counter() - start:.1f} s)")

  def _groups(self, what: str) -> Iterator[_Group]:
    for done, group in enumerate(self.groups, 1):
      yield group
      if self.on_group is not None:
        self.on_group(what, done, len(self.groups))

  def _global(self, i: int) -> bool:
    """Whether step ``i`` solves a factor whose leaves span groups (a reduction)."""
    step = self.plan[i]
    return not step.attention and any(sum(f in g.names for g in self.groups) > 1
                                      for f in step.names)

  def _leaves(self, group: _Group) -> tuple[Flat, Flat]:
    """Both models' leaves of ``group`` as device arrays under their canonical paths (split
    over the mesh's devices, ``leaf_sharding``, when there is a mesh), each host array dropped
    as soon as it is copied (only the device copy is held)."""
    out = []
    for flat in self.read(group.paths):
      flat, leaves = dict(flat), {}
      for p in group.paths:
        x = flat.pop(p)
        leaves[group.leaf[p]] = jax.device_put(
            x, None if self.mesh is None else leaf_sharding(np.shape(x), self.mesh))
      out.append(leaves)
    return out[0], out[1]

  def _reads(self, group: _Group) -> dict[str, dict[str, jax.Array]]:
    return {group.names[f]: {group.leaf[p]: r for p, r in leaves.items() if p in group.leaf}
            for f, leaves in self.reads.items() if f in group.names}

  def first_pass(self) -> jax.Array:
    """||A - B||^2, and the fixed scores of every factor that spans groups."""
    spanning = [f for i in range(len(self.plan)) if self._global(i) for f in self.plan[i].names]
    self.fixed, initial = {}, jnp.zeros((), self.dtype)
    with self._pass("first pass, the distance before and the fixed scores") as groups:
      for group in groups:
        factors = tuple(group.names[f] for f in spanning if f in group.names)
        part, fixed = _done(_first_pass(*self._leaves(group), group.sub(self.on),
                                        spec=group.spec, fold=self.fold, factors=factors))
        initial = initial + part
        for f in spanning:
          if f in group.names:
            add = fixed[group.names[f]]
            self.fixed[f] = add if f not in self.fixed else tuple(map(jnp.add, self.fixed[f], add))
    return initial

  def solve_spanning(self, i: int, rounds: int) -> bool:
    """Step ``i``'s factors, one after another, each scored over every group it acts on."""
    changed = False
    for f in self.plan[i].names:
      if not bool(self.on[f]):
        continue
      total = self.fixed[f]
      with self._pass(f"round {rounds + 1}, the scores of {f}") as groups:
        for group in groups:
          if f in group.names:
            part = _done(_group_scores(*self._leaves(group), group.sub(self.element),
                                       self._reads(group)[group.names[f]], jnp.int32(rounds),
                                       spec=group.spec, plan=group.plan, fold=self.fold,
                                       factor=group.names[f]))
            total = tuple(map(jnp.add, total, part))
      self.element[f], moved = _update(self.spec.factors[f].kind, total, self.element[f])
      changed |= bool(moved)
    return changed

  def _steps_call(self, group: _Group, leaves: tuple[Flat, Flat], run: tuple[int, ...],
                  rounds: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments and static options of ``_group_steps`` on ``group``'s ``leaves``."""
    o = self.options
    return ((*leaves, group.sub(self.element), self._reads(group), jnp.int32(rounds),
             group.sub(self.on), jnp.asarray(o["learning_rate"], self.dtype),
             jnp.int32(o["descent"]), jnp.int32(o["distance"])),
            dict(spec=group.spec, plan=group.plan, fold=self.fold, run=run, steps=o["steps"],
                 init=o["init"], solver=o["solver"]))

  def local_steps_memory(self, group: _Group, shapes: Mapping[str, tuple[Any, Any]]
                         ) -> dict[str, int]:
    """Per-device bytes of the program running every local step of ``group`` at once,
    compiled for abstract leaves of ``shapes`` placed as ``_leaves`` places them."""
    run = tuple(i for i in range(len(self.plan)) if not self._global(i) and group.own(i))
    abstract = {group.leaf[p]: jax.ShapeDtypeStruct(
        tuple(shapes[p][0]), shapes[p][1],
        sharding=None if self.mesh is None else leaf_sharding(shapes[p][0], self.mesh))
                for p in group.paths}
    args, static = self._steps_call(group, (abstract, abstract), run, 0)
    stats = _group_steps.lower(*args, **static).compile().memory_analysis()
    return {"argument": int(stats.argument_size_in_bytes),
            "output": int(stats.output_size_in_bytes), "temp": int(stats.temp_size_in_bytes)}

  def solve_local(self, run: Sequence[int], rounds: int) -> list[bool]:
    """The local steps ``run`` in one pass over the groups; whether each changed."""
    changed = [False] * len(run)
    kinds = sorted({"attention sites" if self.plan[i].attention else "factors" for i in run})
    with self._pass(f"round {rounds + 1}, {len(run)} steps of {' and '.join(kinds)}") as groups:
      for group in groups:
        mine = tuple(i for i in run if group.own(i))
        if not mine:
          continue
        args, static = self._steps_call(group, self._leaves(group), mine, rounds)
        element, moved, taken = _group_steps(*args, **static)
        self.element.update(group.back(element))
        self.taken = max(self.taken, int(taken))
        for i, m in zip(mine, moved):
          changed[run.index(i)] |= bool(m)
    return changed

  def refine(self) -> None:
    o = self.options
    with self._pass("the final refinement of the attention sites") as groups:
      for group in groups:
        if not any(step.attention and step.names for step in group.plan):
          continue
        element, taken = _group_refine(
            *self._leaves(group), group.sub(self.element), group.sub(self.on),
            jnp.asarray(o["learning_rate"], self.dtype), spec=group.spec, plan=group.plan,
            fold=self.fold, steps=o["steps"], init=o["init"], solver=o["solver"])
        self.element.update(group.back(element))
        self.taken = max(self.taken, int(taken))

  def distance(self) -> jax.Array:
    """||A - g . B||^2 over every leaf, a pass over the groups."""
    total = jnp.zeros((), self.dtype)
    with self._pass("the distance") as groups:
      for group in groups:
        total = total + _done(_group_distance(*self._leaves(group), group.sub(self.element),
                                              spec=group.spec, plan=group.plan, fold=self.fold))
    return total

  def _run_from(self, i: int) -> list[int]:
    """Step ``i`` and the local steps after it that share no leaf with any of them."""
    run = [i]
    for j in range(i + 1, len(self.plan)):
      if self._global(j) or self.neighbours[run, j].any():
        break
      run.append(j)
    return run

  def descend(self, max_rounds: int) -> int:
    """The rounds of ``_model._align_core``'s loop; returns how many ran."""
    pending = [any(bool(self.on[n]) for n in step.names) for step in self.plan]
    rounds = 0
    while any(pending) and rounds < max_rounds:
      i = 0
      while i < len(self.plan):
        if self._global(i):
          run, changed = [i], [self.solve_spanning(i, rounds) if pending[i] else None]
        else:
          run = self._run_from(i)
          todo = [j for j in run if pending[j]]
          moved = dict(zip(todo, self.solve_local(todo, rounds) if todo else []))
          changed = [moved.get(j) for j in run]
        for j, c in zip(run, changed):
          if c is not None:  # ran: as _align_core's loop body
            pending[j] = self.again[j] and rounds == 0
            pending = [p or (c and bool(self.neighbours[j, k])) for k, p in enumerate(pending)]
        i = run[-1] + 1
      rounds += 1
    return rounds


def align_model_streamed(spec: spec_lib.SymmetrySpec, read: Read,
                         shapes: Mapping[str, tuple[tuple[int, ...], Any]], *,
                         scope: str | Sequence[str] | None = None, method: str = "full",
                         mesh: jax.sharding.Mesh | None = None,
                         progress: Callable[[str], None] | None = None,
                         on_group: Callable[[str, int, int], None] | None = None,
                         **options) -> tuple[dict[str, Any], dict[str, Any]]:
  """``align_model`` of B to A, reading the models one group of leaves at a time.

  Args:
    spec: the models' symmetry spec.
    read: ``read(paths)`` -> (A's leaves, B's leaves), each {path: array} for the
      leaf ``paths`` of one group of ``stream_groups(spec)``, in their stored dtype
      (bfloat16 and float16 are computed in float32, one group at a time). It is
      called once per group per pass; it should check the leaves (finite) itself.
    shapes: {path: (shape, stored dtype)} of every leaf of ``spec`` (both models').
    scope, method, **options: as ``align_model`` (the options: fields of
      ``MatchOptions``); ``method`` one of ``STREAMED_METHODS``.
    mesh: where given, each group's leaves are split over its devices and the group
      programs partitioned over them (module docstring); None: the default device.
    progress: called with one line after each pass over the groups ("round 1, the scores of
      residual: a pass over 34 groups (80.2 s)"); a round is one pass or more.
    on_group: called as ``on_group(pass, groups done, groups)`` once each group's work in a
      pass is done ("round 1, the scores of residual", 3, 34): for a progress bar.

  Returns:
    (element, info) as ``align_model`` returns them for the same parameters (module
    docstring: equal to rounding): info["distance"] {"initial", "final"} (and
    "before_refinement" for "full" with ``refine="final"``), info["rounds"],
    info["refinement_steps"] for "full", info["folded_norm_scales"].

  Raises:
    ValueError: an unknown option, a scope prefix that matches nothing, or a method that is
      not streamed ("learned" and registered methods need the whole models: ``align_model``).
  """
  o = _options.MatchOptions(**options)
  if method == "naive":
    _check(spec, shapes, method, o)
    dtype = _attention.compute_dtype(next(iter(shapes.values()))[1])
    return group_action.identity_model(spec, dtype), {"folded_norm_scales": False}
  descent = _descent(spec, read, shapes, scope=scope, method=method, options=o, mesh=mesh,
                     progress=progress, on_group=on_group)
  full, final, fold = method == "full", o.refine == "final", descent.fold
  distances = {"initial": descent.first_pass()}
  rounds = descent.descend(int(o.max_rounds))
  if full and final:
    distances["before_refinement"] = descent.distance()
    descent.refine()
  distances["final"] = descent.distance()
  info = {"distance": distances, "rounds": rounds, "folded_norm_scales": fold}
  if full:
    info["refinement_steps"] = descent.taken
  return descent.element, info


def _check(spec, shapes, method: str, o: _options.MatchOptions) -> None:
  _attention.check_options(method, o.distance, o.steps, o.init, methods=_methods.METHODS,
                           solver=o.solver)
  if o.refine not in _options.REFINES:
    raise ValueError(f"refine must be one of {_options.REFINES}, got {o.refine!r}")
  if method not in STREAMED_METHODS:
    raise ValueError(f"method {method!r} is not streamed (only {', '.join(STREAMED_METHODS)}): "
                     "it needs both whole models in memory; use align_model")
  missing = sorted(set(spec.axes) - set(shapes))
  if missing:
    raise ValueError(f"shapes lacks leaves of the spec: {missing[:4]}")


def _descent(spec, read, shapes, *, scope, method, options: _options.MatchOptions, mesh,
             progress=None, on_group=None) -> _Descent:
  """The checked ``options``' descent (method not "naive")."""
  _check(spec, shapes, method, options)
  names = _model.active_names(spec, scope)
  spec = _model.residual_spec(spec, options.residual, names)
  o, full, final = options, method == "full", options.refine == "final"
  program = dict(learning_rate=o.learning_rate, steps=int(o.steps), init=o.init,
                 solver=o.solver, distance=_features.DISTANCES.index(o.distance),
                 descent=_attention.STAGES.index("ortho" if full and final else method))
  return _Descent(spec, read, shapes, names, fold=_model._needs_folding(spec, names),
                  options=program, mesh=mesh, progress=progress, on_group=on_group)


align_model_streamed.__signature__ = _options.signature(align_model_streamed)


def layer_program_memory(spec: spec_lib.SymmetrySpec,
                         shapes: Mapping[str, tuple[tuple[int, ...], Any]], *,
                         method: str = "full", mesh: jax.sharding.Mesh | None = None,
                         **options) -> dict[str, int]:
  """What one device holds to run a layer's steps in ``align_model_streamed``: the per-device
  bytes of its largest program (every local step of the group ``layers_0``: its FFN factors
  and attention sites), compiled for the leaves of ``shapes`` placed on ``mesh`` (or the
  default device). Nothing is read or run: the leaves are abstract, so a 7B-shaped layer is
  measured without its weights.

  Returns:
    {"argument", "output", "temp"}: ``compiled.memory_analysis()``'s sizes in bytes.

  Raises:
    ValueError: an option as ``align_model_streamed``'s, or a spec without ``layers_0``.
  """
  scope = options.pop("scope", None)
  descent = _descent(spec, None, shapes, scope=scope, method=method,
                     options=_options.MatchOptions(**options), mesh=mesh)
  group = next((g for g in descent.groups if g.paths[0].startswith("layers_0/")), None)
  if group is None:
    raise ValueError(f"the spec has no group layers_0 (groups: "
                     f"{[g.paths[0].split('/')[0] for g in descent.groups]})")
  return descent.local_steps_memory(group, shapes)
