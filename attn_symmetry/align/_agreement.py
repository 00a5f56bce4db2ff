"""What a merge of two bare encoders keeps (``--eval-text`` on a model without a task head,
whose output is its last hidden states): each model's sentence embeddings set against A's and
B's, the agreement a sentence-embedding user checks.

A sentence's embedding is the mean of the last hidden states over its real tokens (the mask),
e [N, D] for N sentences. For a model M and a reference R (A or B):

* cosine: the mean over sentences of cos(e_M[i], e_R[i]);
* Spearman: the rank correlation between M's and R's sentence-similarity matrices, the cosines
  of every pair of sentences (the upper triangle), which order the pairs a search ranks.

The models: A, B, the naive merge (1 - lam) A + lam B and the aligned merge
(1 - lam) A' + lam B' (what DIR/merged holds; lam is ``--merge``, 1/2 without it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn_symmetry import lmc
from attn_symmetry.align._records import Aligned, Inputs, Options, Params
from attn_symmetry.models import Model

MODELS = ("a", "b", "naive_merge", "aligned_merge")


@functools.partial(jax.jit, static_argnums=0)
def _mean_hidden(model: Model, params: Params, tokens: jax.Array, mask: jax.Array) -> jax.Array:
  """[B, D]: the last hidden states [B, T, D] averaged over the real tokens of each row."""
  hidden = model.apply(params, tokens, mask=mask)[0].astype(jnp.float32)
  weights = mask.astype(jnp.float32)[..., None]
  return jnp.sum(hidden * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)


def embeddings(model: Model, params: Params, batches: Sequence[dict[str, np.ndarray]]
               ) -> np.ndarray:
  """[N, D] float64: the sentence embeddings of every row of ``batches`` (each {"tokens",
  "mask"})."""
  return np.concatenate([np.asarray(_mean_hidden(model, params, b["tokens"], b["mask"]),
                                    np.float64) for b in batches])


def ranks(x: np.ndarray) -> np.ndarray:
  """[N] float64: the ranks 0..N-1 of ``x``'s entries, tied entries at their mean rank."""
  order = np.argsort(x, kind="stable")
  plain = np.empty(len(x))
  plain[order] = np.arange(len(x))
  _, tie, counts = np.unique(x, return_inverse=True, return_counts=True)
  return (np.bincount(tie, weights=plain) / counts)[tie]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
  """Spearman's rank correlation of ``x`` and ``y`` [N]: Pearson's of their ``ranks``."""
  return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def _unit(e: np.ndarray) -> np.ndarray:
  return e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-30)


def agreement(embeds: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
  """{model: {"cosine_a", "cosine_b", "spearman_a", "spearman_b"}} of every model of
  ``embeds`` ({name: [N, D]}, with "a" and "b") against A's and B's (module docstring)."""
  unit = {name: _unit(e) for name, e in embeds.items()}
  upper = np.triu_indices(len(unit["a"]), k=1)
  similarity = {name: (u @ u.T)[upper] for name, u in unit.items()}
  out = {}
  for name, u in unit.items():
    out[name] = {}
    for ref in ("a", "b"):
      out[name][f"cosine_{ref}"] = float(np.mean(np.sum(u * unit[ref], axis=1)))
      out[name][f"spearman_{ref}"] = spearman(similarity[name], similarity[ref])
  return out


def evaluate(inputs: Inputs, options: Options, aligned: Aligned, a: Params, b: Params
             ) -> dict[str, Any]:
  """The agreement of A, B, the naive and the aligned merge at lam (module docstring) on the
  evaluation batches: {"lambda", "sentences", "models": ``agreement``'s, "beats_naive": the
  aligned merge's mean Spearman correlation (with A's and with B's) above the naive merge's}.

  Raises:
    ValueError: fewer than 3 sentences (no Spearman correlation of 1 pair).
  """
  lam = 0.5 if options.merge is None else options.merge
  model, batches = inputs.model, inputs.batches
  sentences = sum(len(batch["tokens"]) for batch in batches)
  if sentences < 3:
    raise ValueError(f"--eval-text {options.eval_text}: {sentences} sentences; the agreement "
                     "of similarity matrices needs at least 3")
  models = {"a": a, "b": b, "naive_merge": lmc.interpolate(a, b, lam),
            "aligned_merge": lmc.interpolate(aligned.params_a, aligned.params, lam)}
  found = agreement({name: embeddings(model, params, batches) for name, params in models.items()})
  spearman = lambda name: (found[name]["spearman_a"] + found[name]["spearman_b"]) / 2
  return {"lambda": lam, "sentences": sentences, "models": found,
          "beats_naive": spearman("aligned_merge") > spearman("naive_merge")}


def lines(agreed: dict[str, Any]) -> list[str]:
  """The summary's lines: a row per model, and whether the aligned merge beat the naive one."""
  names = {"a": "A", "b": "B", "naive_merge": "naive merge", "aligned_merge": "aligned merge"}
  out = [f"sentence embeddings on {agreed['sentences']} sentences (merges at lambda "
         f"{agreed['lambda']:g}): cosine to A, to B; Spearman of the similarity matrix with A's, "
         "with B's"]
  for name in MODELS:
    m = agreed["models"][name]
    out.append(f"  {names[name]}: cosine {m['cosine_a']:.4f}, {m['cosine_b']:.4f}; Spearman "
               f"{m['spearman_a']:.4f}, {m['spearman_b']:.4f}")
  beat = "beat" if agreed["beats_naive"] else "did not beat"
  out.append(f"the aligned merge {beat} the naive merge on the Spearman correlation with A's and "
             "B's similarity matrices")
  return out
