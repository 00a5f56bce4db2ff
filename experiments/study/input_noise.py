"""Input noise for the study's robustness check (the paper's Appendix L)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import numpy as np


def noisy(batches: Iterable[Mapping[str, np.ndarray]], level: float, *, key: jax.Array,
          input_key: str, vocab_size: int | None) -> Iterable[dict[str, np.ndarray]]:
  """Batches with noise on their inputs ``batch[input_key]``: Gaussian of std ``level``
  added to float inputs (images), or each token of integer inputs replaced by a
  uniformly random one of ``vocab_size`` with probability ``level``.

  Batch i draws from ``fold_in(key, i)``, so the same batches get the same noise.
  """
  for i, batch in enumerate(batches):
    k1, k2 = jax.random.split(jax.random.fold_in(key, i))
    batch = dict(batch)
    x = batch[input_key]
    if np.issubdtype(x.dtype, np.floating):
      batch[input_key] = x + level * np.asarray(jax.random.normal(k1, x.shape), x.dtype)
    else:
      replace = np.asarray(jax.random.bernoulli(k1, level, x.shape))
      random = np.asarray(jax.random.randint(k2, x.shape, 0, vocab_size), x.dtype)
      batch[input_key] = np.where(replace, random, x)
    yield batch
