"""``tasks.model_batch``, the one batch convention of the tasks, and its two callers.

Each test compares with the convention as it was written before it was shared (the
``_previous_*`` references below: the host's in ``_eval_files``, jit's in
``experiments.train.evaluation.batch_metrics``), bit for bit, on fixed inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attn_symmetry.align import _eval_files
from attn_symmetry import models
from attn_symmetry import tasks
from experiments.train import evaluation

WORDS = "the cat sat on a mat dog ran far away while birds sang in tall green trees".split()


def _assert_identical(new, previous):
  for n, p in zip(new, previous, strict=True):
    n, p = np.asarray(n), np.asarray(p)
    assert n.dtype == p.dtype and n.shape == p.shape, (n.dtype, n.shape, p.dtype, p.shape)
    np.testing.assert_array_equal(n, p)


def _previous_host_mlm(inputs, ordinary_positions, mask_id):
  """_eval_files' masking before model_batch: rng positions, float weights, [MASK] there."""
  rng = np.random.default_rng(0)
  weights = np.zeros(inputs.shape, np.float32)
  for i, ordinary in enumerate(ordinary_positions):
    if ordinary.size:
      hidden = max(1, round(tasks.MLM_MASK_FRACTION * ordinary.size))
      weights[i, rng.choice(ordinary, hidden, replace=False)] = 1.0
  return np.where(weights > 0, mask_id, inputs).astype(np.int32), inputs, weights


def _previous_batch_metrics(model, params, batch):
  """experiments.train.evaluation.batch_metrics before model_batch."""
  if model.task == tasks.LM:
    tokens = batch[model.input_key]
    logits, _ = model.apply(params, tokens[:, :-1])
    labels = tokens[:, 1:]
    counted = jnp.ones(labels.shape, bool)
  elif model.task == tasks.MLM:
    labels = batch[model.input_key][:, :-1]
    counted = evaluation.masked_positions(labels)
    logits, _ = model.apply(params, jnp.where(counted, evaluation.mask_token(model), labels))
  else:
    logits, _ = model.apply(params, batch[model.input_key], mask=batch.get("mask"))
    labels = batch["label"]
    counted = jnp.ones(labels.shape, bool)
  valid = batch.get("valid", jnp.ones(labels.shape[:1], bool))
  weights = (counted & valid.reshape(valid.shape + (1,) * (labels.ndim - 1))).astype(jnp.float32)
  logits = logits.astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  return {"loss": jnp.sum(losses * weights), "correct": jnp.sum(correct * weights),
          "count": jnp.sum(weights)}


def _tokens(seed, shape, vocab=64):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def test_lm_reads_all_but_the_last_token_and_predicts_the_next():
  tokens = _tokens(0, (5, 9))
  inputs, targets, weights = tasks.model_batch(tasks.LM, tokens)
  _assert_identical((inputs, targets, weights.astype(np.float32)),
                    (tokens[:, :-1], tokens[:, 1:], np.ones((5, 8), np.float32)))
  # Inside jit, jax arrays: the same tokens.
  traced = jax.jit(lambda t: tasks.model_batch(tasks.LM, t))(jnp.asarray(tokens))
  assert all(isinstance(x, jax.Array) for x in traced)
  _assert_identical(traced, (inputs, targets, weights))


def test_mlm_hides_the_given_positions_on_the_host_as_before():
  tokens = _tokens(1, (7, 12))
  ordinary = [np.arange(1, 1 + n) for n in (10, 0, 3, 1, 10, 7, 2)]  # [CLS] first, then words
  previous = _previous_host_mlm(tokens, ordinary, mask_id=4)
  hidden = previous[2] > 0
  assert hidden.sum() > 7
  inputs, targets, weights = tasks.model_batch(tasks.MLM, tokens, hidden=hidden, mask_id=4)
  _assert_identical((inputs, targets, weights.astype(np.float32)), previous)


def test_mlm_hides_the_masked_positions_inside_jit_as_before():
  windows = jnp.asarray(_tokens(2, (16, 33), vocab=256))

  def previous(w):
    labels = w[:, :-1]
    counted = evaluation.masked_positions(labels)
    return jnp.where(counted, 256, labels), labels, counted

  def shared(w):
    tokens = w[:, :-1]
    return tasks.model_batch(tasks.MLM, tokens, hidden=evaluation.masked_positions(tokens),
                             mask_id=256)

  _assert_identical(jax.jit(shared)(windows), jax.jit(previous)(windows))


def test_classification_reads_its_inputs_and_predicts_the_label():
  labels = np.asarray([2, 0, 1], np.int32)
  images = np.random.default_rng(3).normal(size=(3, 4, 4, 3)).astype(np.float32)
  for inputs in (images, _tokens(3, (3, 6))):
    out = tasks.model_batch(tasks.CLASSIFICATION, inputs, labels=labels)
    _assert_identical((out[0], out[1], out[2].astype(np.float32)),
                      (inputs, labels, np.ones(3, np.float32)))
    traced = jax.jit(lambda x, y: tasks.model_batch(tasks.CLASSIFICATION, x, labels=y))(
        jnp.asarray(inputs), jnp.asarray(labels))
    _assert_identical(traced, out)


@pytest.mark.parametrize("task, kwargs, match", [
    ("regression", {}, "task must be one of"),
    (tasks.LM, {"labels": np.zeros(2, np.int32)}, "'lm' batch takes no argument but inputs; "
                                                  "got labels"),
    (tasks.MLM, {"hidden": np.zeros((2, 5), bool)}, "'mlm' batch takes hidden and mask_id; "
                                                    "got hidden"),
    (tasks.MLM, {"hidden": np.zeros((2, 4), bool), "mask_id": 1}, "hidden positions \\(2, 4\\)"),
    (tasks.CLASSIFICATION, {}, "'classification' batch takes labels; got none"),
    (tasks.FEATURES, {}, "'features' model \\(a bare encoder, no task head\\) has no targets"),
])
def test_a_batch_without_what_its_task_needs_is_refused(task, kwargs, match):
  with pytest.raises(ValueError, match=match):
    tasks.model_batch(task, _tokens(4, (2, 5)), **kwargs)
  with pytest.raises(ValueError, match="'lm' batch takes tokens \\[B, T \\+ 1\\]"):
    tasks.model_batch(tasks.LM, _tokens(4, (2, 1)))


@pytest.mark.parametrize("family, overrides, batch", [
    ("gpt2", dict(vocab_size=64, max_len=16), {"tokens": _tokens(5, (6, 13)),
                                   "valid": np.array([1, 1, 1, 1, 0, 0], bool)}),
    ("bert", dict(head="mlm", vocab_size=65, max_len=16), {"tokens": _tokens(6, (6, 13)),
                                              "valid": np.array([1, 1, 1, 1, 1, 0], bool)}),
    ("bert", dict(num_classes=3, vocab_size=64, max_len=16),
     {"tokens": _tokens(7, (6, 12)), "mask": np.arange(12) < np.arange(2, 14, 2)[:, None],
      "label": np.array([0, 2, 1, 1, 0, 2], np.int32), "valid": np.array([1] * 5 + [0], bool)}),
    ("vit", dict(num_classes=2, image_size=16),
     {"image": np.random.default_rng(8).normal(size=(4, 16, 16, 3)).astype(np.float32),
      "label": np.array([0, 1, 1, 0], np.int32)}),
], ids=["lm", "mlm", "text_classification", "image_classification"])
def test_batch_metrics_are_the_previous_ones_bit_for_bit(family, overrides, batch):
  model = models.build(family, "tiny", **overrides)
  params = model.init(jax.random.key(0))
  new = jax.jit(lambda p, b: evaluation.batch_metrics(model, p, b))(params, batch)
  previous = jax.jit(lambda p, b: _previous_batch_metrics(model, p, b))(params, batch)
  assert float(new["count"]) > 0
  _assert_identical([new[k] for k in sorted(new)], [previous[k] for k in sorted(previous)])


def test_eval_files_text_batches_are_the_previous_ones(tmp_path):
  """--eval-text's LM rows and MLM masks, through model_batch, select the tokens the host
  code selected before it."""
  import tokenizers  # pylint: disable=g-import-not-at-top

  special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
  vocab = {w: i for i, w in enumerate(special + WORDS)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
  tok.save(str(tmp_path / "tokenizer.json"))
  rng = np.random.default_rng(9)
  lines = [" ".join(rng.choice(WORDS, rng.integers(1, 20))) for _ in range(11)]
  text = tmp_path / "text.txt"
  text.write_text("\n".join(lines) + "\n")
  seq_len, batch_size = 12, 4

  lm = models.build("gpt2", "tiny", vocab_size=64, max_len=16)
  batches = _eval_files.text_batches(str(text), str(tmp_path), lm, {}, batch_size=batch_size,
                                     seq_len=seq_len, max_batches=3)
  ids = [i for line in lines for i in tok.encode(line + "\n", add_special_tokens=False).ids]
  n = min(len(ids) // (seq_len + 1), 3 * batch_size)
  tokens = np.asarray(ids[:n * (seq_len + 1)], np.int32).reshape(n, seq_len + 1)
  rows = {k: np.concatenate([b[k] for b in batches])[:n] for k in ("inputs", "labels", "weights")}
  _assert_identical((rows["inputs"], rows["labels"], rows["weights"]),
                    (tokens[:, :-1], tokens[:, 1:], np.ones((n, seq_len), np.float32)))

  mlm = models.build("bert", "tiny", head="mlm", vocab_size=64, max_len=16)
  batches = _eval_files.text_batches(str(text), str(tmp_path), mlm, {}, batch_size=batch_size,
                                     seq_len=seq_len, max_batches=3)
  encodings = [tok.encode(line) for line in lines]
  inputs = np.zeros((len(lines), seq_len), np.int32)  # [PAD] is 0
  for i, e in enumerate(encodings):
    inputs[i, :len(e.ids[:seq_len])] = e.ids[:seq_len]
  ordinary = [np.flatnonzero(~np.asarray(e.special_tokens_mask[:seq_len], bool))
              for e in encodings]
  previous = _previous_host_mlm(inputs, ordinary, mask_id=vocab["[MASK]"])
  rows = {k: np.concatenate([b[k] for b in batches])[:len(lines)]
          for k in ("inputs", "labels", "weights")}
  _assert_identical((rows["inputs"], rows["labels"], rows["weights"]), previous)
