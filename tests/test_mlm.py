"""Masked language modelling: BERT's MLM head trained and evaluated on byte-stream windows."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attn_symmetry import models
from attn_symmetry import tasks
from experiments.configs import bert_mlm_wiki_bytes
from experiments.configs import gpt2_wiki_bytes
from experiments.study import scope_study
from experiments.train import evaluation
from experiments.train import inputs


def _windows(seed, n=64, t=33, vocab=256):
  return np.random.default_rng(seed).integers(0, vocab, (n, t)).astype(np.int32)


def test_an_example_hides_the_same_positions_every_time():
  tokens = jnp.asarray(_windows(0)[:, :-1])
  hidden = evaluation.masked_positions(tokens)
  assert hidden.shape == tokens.shape and hidden.dtype == jnp.bool_
  np.testing.assert_array_equal(jax.jit(evaluation.masked_positions)(tokens), hidden)
  # An example's positions do not depend on the batch it is met in.
  np.testing.assert_array_equal(evaluation.masked_positions(tokens[5:9]), hidden[5:9])
  np.testing.assert_array_equal(evaluation.masked_positions(tokens[::-1]), hidden[::-1])
  # Another example (one byte changed) hides other positions.
  other = evaluation.masked_positions(tokens.at[:, 3].add(1))
  assert np.mean(np.any(np.asarray(other) != np.asarray(hidden), axis=1)) > 0.9


def test_about_the_fraction_of_positions_is_hidden_independently():
  tokens = jnp.asarray(_windows(1, n=2000)[:, :-1])
  hidden = np.asarray(evaluation.masked_positions(tokens))
  n = hidden.size
  p = tasks.MLM_MASK_FRACTION
  assert abs(hidden.mean() - p) < 5 * math.sqrt(p * (1 - p) / n)
  per_position = hidden.mean(0)  # no position is favoured: each near p over 2000 examples
  assert np.all(np.abs(per_position - p) < 5 * math.sqrt(p * (1 - p) / len(hidden)))


@pytest.fixture(scope="module")
def mlm_bert():
  model = models.build("bert", "tiny", head="mlm", vocab_size=257, max_len=32)
  return model, model.init(jax.random.key(0))


@pytest.mark.slow  # 11 s alone
def test_metrics_count_the_hidden_positions_of_valid_examples(mlm_bert):
  model, params = mlm_bert
  windows = jnp.asarray(_windows(2, n=8))
  valid = jnp.asarray([True] * 6 + [False] * 2)
  sums = jax.jit(lambda p, b: evaluation.batch_metrics(model, p, b))(
      params, {"tokens": windows, "valid": valid})
  tokens = windows[:, :-1]
  hidden = evaluation.masked_positions(tokens) & valid[:, None]
  assert evaluation.mask_token(model) == 256
  logits, _ = model.apply(params, jnp.where(evaluation.masked_positions(tokens), 256, tokens))
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
  assert float(sums["count"]) == int(hidden.sum()) > 0
  np.testing.assert_allclose(float(sums["loss"]), float(jnp.sum(losses * hidden)), rtol=1e-5)
  correct = (jnp.argmax(logits, -1) == tokens) & hidden
  assert float(sums["correct"]) == int(correct.sum())


def test_a_masked_lm_gets_a_mask_token_beyond_the_data_vocabulary():
  config = bert_mlm_wiki_bytes.get_config("runlocal")
  model = inputs.create_model(config)
  info = inputs.dataset_info(config, config.dataset.name)
  assert model.task == "mlm" and model.config.vocab_size == info.vocab_size + 1
  assert model.config.max_len == info.seq_len


@pytest.mark.parametrize("setting, dataset, error", [
    (bert_mlm_wiki_bytes, "newsgroups_mini", "'mlm' model, which trains on 'lm' data; data set "
                                             "'newsgroups_mini' holds 'classification' data"),
    (gpt2_wiki_bytes, "newsgroups_mini", "'lm' model, which trains on 'lm' data"),
])
def test_a_model_on_data_of_another_task_is_rejected(setting, dataset, error):
  config = setting.get_config("runlocal")
  config.dataset.name = dataset
  with pytest.raises(ValueError, match=error):
    inputs.create_model(config)


def test_a_classifier_on_a_byte_stream_is_rejected():
  config = bert_mlm_wiki_bytes.get_config("runlocal")
  config.model.overrides.head = "classifier"
  with pytest.raises(ValueError, match="'classifier' is a 'classification' model"):
    inputs.create_model(config)


def test_the_study_reports_the_masked_lm_loss_per_hidden_byte():
  study = scope_study.ScopeStudy.__new__(scope_study.ScopeStudy)  # only its unit is asked
  for bits, task, unit in ((False, tasks.CLASSIFICATION, "cross-entropy (nats)"),
                           (True, tasks.LM, "bits per byte"),
                           (True, tasks.MLM, "bits per hidden byte")):
    study.evaluator = types.SimpleNamespace(bits_per_byte=bits)
    study.model = types.SimpleNamespace(task=task)
    assert study._loss_unit() == unit  # pylint: disable=protected-access
