"""The LMC study of the paper's Section 6, run after training (DESIGN.md sections 6-7).

For every re-initialisation scope of the config and every pair (A, B) of its
re-initialised seeds, each matching method aligns B to A inside the scope
(``matching.align_model`` with the scope's parameter prefixes), and the path
theta(lambda) = (1 - lambda) theta_A + lambda g.theta_B is evaluated on the
test split at ``study.num_lambdas`` points by one compiled function. Then:

* barriers per pair and method, and their mean, std and ratio to naive;
* for the "first_attention" scope with at most ``study.max_exhaustive_heads``
  heads: every head permutation followed by Stage 2 (the paper's Table 1
  ablation), giving the rank of Stage 1's choice and L̂;
* for the "first_attention" scope, the full method under every Stage 1 head
  distance of ``study.distances``;
* accuracy of the endpoints and of each method's midpoint under input noise
  (the paper's Appendix L).

Each (scope, pair, stage) result is stored under ``workdir/study/<scope>/``
with a fingerprint of everything it depends on (the study config, both
checkpoints' parameters, the evaluation data); a rerun reuses a result whose
fingerprint matches and recomputes one whose inputs changed. Reports:
``study/<scope>/results.json``, ``study/<scope>/curves.png`` and
``study/summary.md``.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attn_symmetry import group_action
from attn_symmetry import lmc
from attn_symmetry import matching
from attn_symmetry.spec import subtree
from experiments import evaluation
from experiments import inputs
from experiments import report
from experiments import train

Params = dict[str, Any]
log = logging.getLogger(__name__)
log.setLevel(logging.INFO)
METHODS = ("naive", "perm", "ortho", "full")
DISTANCES = ("frobenius", "squared", "normalised", "cosine")


def validate_study_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field of ``config.study`` that is wrong."""
  s = config.study
  bad = set(s.methods) - set(METHODS)
  if bad or "naive" not in s.methods:
    raise ValueError(f"config.study.methods must include 'naive' and be drawn from {METHODS}; "
                     f"got {list(s.methods)}")
  if s.distance not in DISTANCES or set(s.distances) - set(DISTANCES):
    raise ValueError(f"config.study.distance(s) must be drawn from {DISTANCES}")
  if s.num_lambdas < 3:
    raise ValueError(f"config.study.num_lambdas must be >= 3, got {s.num_lambdas}")
  if len(config.reinit.seeds) < 2 and config.reinit.scopes:
    raise ValueError("the study compares pairs of re-initialised seeds: config.reinit.seeds "
                     f"needs at least 2, got {list(config.reinit.seeds)}")


def check_scopes(config: ml_collections.ConfigDict, model) -> None:
  """Raises ValueError for a re-initialisation scope that no symmetry of the model acts on
  alone (there would be nothing to align)."""
  for scope in config.reinit.scopes:
    paths = model.scope_paths(scope)
    if not matching.active_names(model.spec, paths):
      raise ValueError(f"config.reinit.scopes: scope {scope!r} re-initialises {paths}, which no "
                       "symmetry factor or attention site of the model acts on alone: nothing to align")


# ----------------------------------------------------------------------------- caching


def params_digest(params: Params) -> str:
  """sha256 over every leaf's path, dtype, shape and bytes."""
  h = hashlib.sha256()
  for path, leaf in sorted(group_action.spec_lib.flatten(params).items()):
    leaf = np.asarray(leaf)
    h.update(f"{path}:{leaf.dtype}:{leaf.shape}".encode())
    h.update(np.ascontiguousarray(leaf).tobytes())
  return h.hexdigest()


def _fingerprint(**parts: Any) -> str:
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def cached(path: str, fingerprint: str, compute: Callable[[], dict]) -> tuple[dict, bool]:
  """The JSON result at ``path`` if its fingerprint matches, else ``compute()`` saved there.

  Returns:
    (result, reused). The file is written atomically (temporary file, then
    rename), so an interrupted run never leaves a half-written result.
  """
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    if saved.get("fingerprint") == fingerprint:
      return saved["result"], True
    log.info("inputs of %s changed since it was computed; recomputing", path)
  result = compute()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump({"fingerprint": fingerprint, "result": result}, f)
  os.replace(tmp, path)
  return result, False


# ----------------------------------------------------------------------------- evaluation


class PathEvaluator:
  """Loss and accuracy along interpolation paths on a fixed evaluation set."""

  def __init__(self, model, batches: list[Mapping[str, np.ndarray]], *, chunk_size: int,
               bits_per_byte: bool):
    self.model = model
    self.batches = batches
    self.chunk_size = chunk_size
    self.bits_per_byte = bits_per_byte
    self._evaluator = lmc.path_evaluator(lambda p, b: evaluation.batch_metrics(model, p, b))
    mesh = inputs.create_mesh()
    self._put = lambda b: inputs.shard_batch(b, mesh)

  def __call__(self, params_a: Params, params_b: Params, lams: np.ndarray,
               batches: Iterable[Mapping[str, np.ndarray]] | None = None) -> dict[str, list[float]]:
    sums = lmc.evaluate_path(self._evaluator, params_a, params_b,
                             self.batches if batches is None else batches, lams,
                             chunk_size=self.chunk_size, put=self._put)
    loss = sums["loss"] / sums["count"]
    if self.bits_per_byte:
      loss = loss / np.log(2.0)
    return {"loss": loss.tolist(), "accuracy": (sums["correct"] / sums["count"]).tolist()}


def curve_result(curve: Mapping[str, list[float]], lams: np.ndarray) -> dict[str, Any]:
  return dict(curve, loss_barrier=lmc.barrier(lams, curve["loss"]),
              accuracy_barrier=lmc.barrier(lams, curve["accuracy"], higher_is_better=True))


def noisy(batches: Iterable[Mapping[str, np.ndarray]], level: float, *, key: jax.Array,
          vocab_size: int | None) -> Iterable[dict[str, np.ndarray]]:
  """Batches with input noise: Gaussian of std ``level`` added to images, or each
  token replaced by a uniformly random one with probability ``level``."""
  for i, batch in enumerate(batches):
    k1, k2 = jax.random.split(jax.random.fold_in(key, i))
    batch = dict(batch)
    if "image" in batch:
      x = batch["image"]
      batch["image"] = x + level * np.asarray(jax.random.normal(k1, x.shape), x.dtype)
    else:
      t = batch["tokens"]
      replace = np.asarray(jax.random.bernoulli(k1, level, t.shape))
      random = np.asarray(jax.random.randint(k2, t.shape, 0, vocab_size), t.dtype)
      batch["tokens"] = np.where(replace, random, t)
    yield batch


# ----------------------------------------------------------------------------- one scope


def _matching_kwargs(config: ml_collections.ConfigDict, **changes) -> dict[str, Any]:
  s = config.study
  return dict(dict(steps=s.match_steps, learning_rate=s.match_learning_rate, distance=s.distance),
              **changes)


class ScopeStudy:
  """The study of one re-initialisation scope."""

  def __init__(self, config, model, scope: str, checkpoints: Mapping[str, Params],
               evaluator: PathEvaluator, workdir: str, data_fingerprint: str):
    self.config, self.model, self.scope = config, model, scope
    self.evaluator = evaluator
    self.dir = os.path.join(workdir, "study", scope)
    self.scope_paths = model.scope_paths(scope)
    self.seeds = list(config.reinit.seeds)
    self.params = {s: checkpoints[f"reinit/{scope}/seed_{s}"] for s in self.seeds}
    self.digests = {s: params_digest(p) for s, p in self.params.items()}
    self.lams = lmc.lambdas(config.study.num_lambdas)
    self.data_fingerprint = data_fingerprint
    self.reused = 0
    self.computed = 0
    self._alignments: dict[tuple, tuple[Params, Params, dict]] = {}
    # g.theta compiled once: the ablation applies one element per head permutation.
    self._apply = jax.jit(functools.partial(group_action.apply_model, model.spec))

  def _cached(self, name: str, compute: Callable[[], dict], *, a: int, b: int,
              **depends) -> dict:
    """``cached`` result of one stage of pair (a, b); it depends on both checkpoints, the
    evaluation data and lambdas, and the ``depends`` given (the options it used)."""
    fp = _fingerprint(scope=self.scope, data=self.data_fingerprint, lams=self.lams.tolist(),
                      a=self.digests[a], b=self.digests[b], **depends)
    start = time.perf_counter()
    result, reused = cached(os.path.join(self.dir, f"pairs/seed_{a}-seed_{b}", name + ".json"),
                            fp, compute)
    if not reused:
      log.info("%s seed %d-%d: %s took %.1fs", self.scope, a, b, name,
                   time.perf_counter() - start)
    self.reused += reused
    self.computed += not reused
    return result

  def _matching_options(self, method: str, **overrides) -> dict[str, Any]:
    return {} if method == "naive" else _matching_kwargs(self.config, **overrides)

  def align(self, a: int, b: int, method: str, **overrides) -> tuple[Params, Params, dict]:
    """(theta_A, g.theta_B, matching info): B aligned to A in this scope.

    When the alignment maps an orthogonal residual factor, both endpoints are
    returned with their norm scales folded (``group_action.fold_norm_scales``,
    which keeps each model's function), so the path joins like with like.
    Alignments are kept for the rest of the run, so every stage that needs one
    (paths, ablations, robustness) matches each pair once.
    """
    options = self._matching_options(method, **overrides)
    key = (a, b, method, json.dumps(options, sort_keys=True))
    if key not in self._alignments:
      self._alignments[key] = self._align(a, b, method, options)
    return self._alignments[key]

  def _align(self, a: int, b: int, method: str, options: dict[str, Any]):
    pa, pb = self.params[a], self.params[b]
    if method == "naive":
      return pa, pb, {}
    start = time.perf_counter()
    element, info = matching.align_model(self.model.spec, pa, pb, scope=self.scope_paths,
                                         method=method, **options)
    info = dict(_jsonable(info), seconds=time.perf_counter() - start)
    if info.get("folded_norm_scales"):
      pa, pb = (group_action.fold_norm_scales(self.model.spec, p) for p in (pa, pb))
    return pa, self._apply(pb, element), info

  def pair(self, a: int, b: int) -> dict[str, Any]:
    methods = {}
    for method in self.config.study.methods:
      def compute(method=method):
        pa, aligned, info = self.align(a, b, method)
        return dict(curve_result(self.evaluator(pa, aligned, self.lams), self.lams), matching=info)
      methods[method] = self._cached(method, compute, a=a, b=b, method=method,
                                     options=self._matching_options(method))
      log.info("%s seed %d-%d %-5s loss barrier %.4f accuracy barrier %.4f", self.scope, a, b,
                   method, methods[method]["loss_barrier"], methods[method]["accuracy_barrier"])
    return {"a": f"seed_{a}", "b": f"seed_{b}", "methods": methods}

  def permutation_ablation(self, a: int, b: int, naive: Mapping[str, float]) -> dict | None:
    """Every head permutation + Stage 2 on the first attention layer (the paper's Table 1).

    Runs for the "first_attention" scope, whose only symmetry is that layer's,
    when it has at most ``study.max_exhaustive_heads`` heads.
    """
    site = "layers_0/attention"
    if (self.scope != "first_attention" or not self.config.study.permutation_ablation
        or self.model.spec.attention[site].num_heads > self.config.study.max_exhaustive_heads):
      return None
    def compute():
      pa, pb = self.params[a], self.params[b]
      s = self.model.spec.attention[site]
      elements, info = matching.match_attention_exhaustive(
          subtree(pa, site), subtree(pb, site), group=s.group, rope_pairing=s.rope_pairing,
          rotary_fraction=s.rotary_fraction, rope_axes=s.rope_axes, method="full",
          **_matching_kwargs(self.config))
      chosen = int(info["stage1_index"])
      identity = group_action.identity_model(self.model.spec)
      barriers = []
      for i in range(elements.perm.shape[0]):
        element = dict(identity, **{site: jax.tree.map(lambda v, i=i: v[i], elements)})
        aligned = self._apply(pb, element)
        barriers.append(curve_result(self.evaluator(pa, aligned, self.lams), self.lams))
      out = {"chosen": chosen, "num_permutations": len(barriers),
             "perms": np.asarray(info["perms"]).tolist()}
      for metric in ("loss", "accuracy"):
        values = [r[f"{metric}_barrier"] for r in barriers]
        rank, lhat = report.rank_and_lhat(values[chosen], values, naive[f"{metric}_barrier"])
        out |= {f"{metric}_barriers": values, f"{metric}_rank": rank, f"{metric}_lhat": lhat}
      return out
    return self._cached("ablation_permutations", compute, a=a, b=b,
                        options=self._matching_options("full"))

  def distance_ablation(self, a: int, b: int) -> dict[str, dict]:
    """The full method under every Stage 1 distance, for the "first_attention" scope
    (as the paper's Appendix K)."""
    out = {}
    if self.scope != "first_attention":
      return out
    for distance in self.config.study.distances:
      def compute(distance=distance):
        pa, aligned, _ = self.align(a, b, "full", distance=distance)
        return curve_result(self.evaluator(pa, aligned, self.lams), self.lams)
      out[distance] = self._cached(f"ablation_distance_{distance}", compute, a=a, b=b,
                                   options=self._matching_options("full", distance=distance))
    return out

  def robustness(self, a: int, b: int) -> dict[str, list[float]]:
    """Accuracy of A, B and every method's midpoint at each noise level."""
    def compute():
      key = jax.random.key(self.config.seed)
      ends = np.array([0.0, 0.5, 1.0])
      out: dict[str, list[float]] = {"A": [], "B": []}
      for method in self.config.study.methods:
        pa, aligned, _ = self.align(a, b, method)
        out[f"midpoint ({method})"] = []
        for level in self.config.study.noise_levels:
          batches = noisy(self.evaluator.batches, level, key=key,
                          vocab_size=getattr(self.model.config, "vocab_size", None))
          acc = self.evaluator(pa, aligned, ends, batches)["accuracy"]
          out[f"midpoint ({method})"].append(acc[1])
          if method == "naive":
            out["A"].append(acc[0])
            out["B"].append(acc[2])
      return out
    return self._cached("robustness", compute, a=a, b=b, seed=self.config.seed,
                        noise_levels=list(self.config.study.noise_levels),
                        options={m: self._matching_options(m) for m in self.config.study.methods})

  def run(self) -> dict[str, Any]:
    pairs, ablations, distances, robust = [], [], {d: [] for d in self.config.study.distances}, []
    endpoints = {}
    for a, b in itertools.combinations(self.seeds, 2):
      entry = self.pair(a, b)
      pairs.append(entry)
      naive = entry["methods"]["naive"]
      for seed, i in ((a, 0), (b, -1)):  # the naive path's ends are the checkpoints themselves
        endpoints[f"seed_{seed}"] = {"loss": naive["loss"][i], "accuracy": naive["accuracy"][i]}
      abl = self.permutation_ablation(a, b, entry["methods"]["naive"])
      if abl is not None:
        ablations.append(abl)
      for d, res in self.distance_ablation(a, b).items():
        distances[d].append({"methods": {"naive": entry["methods"]["naive"], "full": res}})
      if self.config.study.noise_levels:
        robust.append(self.robustness(a, b))
    result: dict[str, Any] = {
        "scope": self.scope, "scope_paths": self.scope_paths, "lambdas": self.lams.tolist(),
        "loss_unit": "bits per byte" if self.evaluator.bits_per_byte else "cross-entropy (nats)",
        "endpoints": endpoints, "pairs": pairs,
        "methods": report.summarise_methods(pairs), "ablation": {}}
    if ablations:
      result["ablation"]["permutations"] = {
          "num_permutations": ablations[0]["num_permutations"], "per_pair": ablations,
          "summary": report.summarise_permutation_ablation(ablations)}
    if any(distances.values()):
      result["ablation"]["distances"] = {d: report.summarise_methods(v)["full"]
                                         for d, v in distances.items() if v}
    if robust:
      models = list(robust[0])
      result["robustness"] = {
          "noise_levels": list(self.config.study.noise_levels), "models": models,
          "accuracy": {m: np.mean([r[m] for r in robust], axis=0).tolist() for m in models}}
    return result


def _jsonable(tree: Any) -> Any:
  if isinstance(tree, Mapping):
    return {str(k): _jsonable(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_jsonable(v) for v in tree]
  if isinstance(tree, (jax.Array, np.ndarray, np.generic)):
    arr = np.asarray(tree)
    return arr.item() if arr.ndim == 0 else arr.tolist()
  return tree


# ----------------------------------------------------------------------------- the whole study


def run_study(config: ml_collections.ConfigDict, workdir: str) -> dict[str, str]:
  """Runs (or resumes) the study of every re-initialisation scope; returns the report paths."""
  validate_study_config(config)
  if not config.reinit.scopes:
    log.info("config.reinit.scopes is empty: no study to run")
    return {}
  model = inputs.create_model(config)
  check_scopes(config, model)
  checkpoints = train.load_checkpoints(config, workdir)
  dataset = config.reinit.dataset or config.dataset.name
  batches = list(inputs.eval_batches(config, dataset))
  data_fp = _fingerprint(dataset=dataset, digests=[params_digest(b) for b in batches])
  evaluator = PathEvaluator(model, batches, chunk_size=config.study.lambda_chunk,
                            bits_per_byte=model.task == "lm" and model.config.vocab_size == 256)
  paths, results = {}, {}
  for scope in config.reinit.scopes:
    study = ScopeStudy(config, model, scope, checkpoints, evaluator, workdir, data_fp)
    start = time.perf_counter()
    res = study.run()
    log.info("study of scope %s: %d stage(s) computed, %d reused, %.1fs", scope, study.computed,
                 study.reused, time.perf_counter() - start)
    results[scope] = res
    out = os.path.join(workdir, "study", scope, "results.json")
    with open(out + ".tmp", "w") as f:
      json.dump(res, f, indent=1)
    os.replace(out + ".tmp", out)
    paths[f"{scope}/results.json"] = out
    paths[f"{scope}/curves.png"] = report.plot_curves(
        os.path.join(workdir, "study", scope, "curves.png"),
        f"{config.model.family} on {dataset}: re-initialised {scope}", res["lambdas"], res["pairs"],
        loss_name=f"test loss ({res['loss_unit']})")
  summary = os.path.join(workdir, "study", "summary.md")
  with open(summary, "w") as f:
    f.write(report.markdown_summary(f"LMC study: {config.model.family} on {dataset}", results))
  paths["summary.md"] = summary
  return paths
