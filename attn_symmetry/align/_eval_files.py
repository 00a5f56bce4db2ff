"""Batches for ``align`` from a text file or an image folder: the evaluation's, with their
metric, and the match data's (``match_batches``: what the data-reading stages measure).

Text (``--eval-text FILE``), read with the model folder's ``tokenizer.json``
through the ``tokenizers`` package (imported here only):

* language models (GPT-2, Llama): the file's tokens cut into rows of
  ``seq_len + 1``; the loss is next-token cross-entropy;
* BERT with its masked-LM head: every non-empty line one sequence (cut to
  ``seq_len``), 15 % of its ordinary tokens (at least one) replaced by
  ``[MASK]`` at positions drawn with a fixed seed; the loss is on those;
* BERT with a classifier: lines ``LABEL<TAB>text``, LABEL a name of
  ``config.json``'s label2id or a class index.

Images (``--eval-images DIR``, ViT): ``DIR/LABEL/*.png`` (or jpg, bmp, ...),
LABEL as above, resized to the model's image size, scaled to [0, 1] and
normalised by ``preprocessor_config.json``'s image_mean and image_std (0.5
where absent, as transformers' ViTImageProcessor).

A batch is a dict of numpy arrays: "inputs" int32 tokens [B, T] or float32
images [B, S, S, C]; "mask" bool [B, T] (BERT); "labels" int32 [B, T] or [B];
"weights" float32 like "labels", 0 where nothing is predicted. Inputs, labels
and weights are ``tasks.model_batch``'s, as the experiments' evaluation reads them. The last batch
is padded to the batch size with weight 0, so one compiled evaluation serves
every batch.

The match data (``--match-data``) is read by the same readers, its kind following the model:
inputs only, keyed by the model's input key, in whole batches (``match_batches``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attn_symmetry import tasks
from attn_symmetry.models.model import Model

Batch = dict[str, np.ndarray]
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def metric_fn(model: Model) -> Callable[[Any, Mapping[str, jax.Array]], dict[str, jax.Array]]:
  """Pure ``(params, batch) -> {"loss", "correct", "count"}``: weighted sums of the
  cross-entropy, of correct argmax predictions and of the weights."""
  def metrics(params, batch):
    logits, _ = model.apply(params, batch["inputs"], mask=batch.get("mask"))
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
    w = batch["weights"]
    return {"loss": jnp.sum(losses * w), "correct": jnp.sum(correct * w), "count": jnp.sum(w)}
  return metrics


def _columns(inputs: np.ndarray, labels: np.ndarray, weights: np.ndarray,
             mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """The columns of a batch (module docstring) from ``tasks.model_batch``'s (inputs,
  targets, weights) and a text's real-token mask."""
  columns = {"inputs": inputs, "labels": labels, "weights": weights.astype(np.float32)}
  return columns if mask is None else {**columns, "mask": mask}


def _batches(columns: dict[str, np.ndarray], batch_size: int) -> list[Batch]:
  """Rows of ``columns`` in batches of ``batch_size``, the last padded with weight 0."""
  n = len(columns["weights"])
  pad = -n % batch_size
  padded = {k: np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)]) for k, v in columns.items()}
  return [{k: v[i:i + batch_size] for k, v in padded.items()} for i in range(0, n + pad, batch_size)]


def _label_id(name: str, hf_config: Mapping[str, Any], num_classes: int, where: str) -> int:
  label2id = hf_config.get("label2id") or {}
  if name in label2id:
    return int(label2id[name])
  if name.isdigit() and int(name) < num_classes:
    return int(name)
  raise ValueError(f"{where}: label {name!r} is neither a name of config.json's label2id "
                   f"({sorted(label2id)[:8]}) nor a class index below {num_classes}")


def _tokenizer(folder: str, flag: str):
  path = os.path.join(folder, "tokenizer.json")
  if not os.path.isfile(path):
    raise ValueError(f"{folder}: no tokenizer.json, which {flag} needs to read the text")
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f"{flag} needs the tokenizers package (pip install tokenizers)") from None
  return tokenizers.Tokenizer.from_file(path)


def _read_lines(path: str, flag: str) -> list[str]:
  """The non-empty lines of the text file ``path`` (``flag`` names it in the errors)."""
  if not os.path.isfile(path):
    raise ValueError(f"{flag} {path}: no such file")
  try:
    with open(path, encoding="utf-8") as f:
      lines = [line.rstrip("\n") for line in f]
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"{flag} {path}: unreadable ({e})") from None
  lines = [line for line in lines if line.strip()]
  if not lines:
    raise ValueError(f"{flag} {path}: no text")
  return lines


def _check_ids(ids: np.ndarray, vocab_size: int, where: str) -> None:
  if ids.size and ids.max() >= vocab_size:
    raise ValueError(f"{where}: the tokenizer gives token id {int(ids.max())}, beyond "
                     f"the model's vocab_size {vocab_size}")


def _token_rows(lines: list[str], tok, length: int, rows: int, vocab_size: int, where: str
                ) -> np.ndarray:
  """int32 [n, length]: the lines' tokens (each line ending in a newline), one stream cut into
  at most ``rows`` rows; n is 0 when the text is shorter than one row."""
  ids: list[int] = []
  for line in lines:
    ids += tok.encode(line + "\n", add_special_tokens=False).ids
    if len(ids) >= rows * length:
      break
  n = min(len(ids) // length, rows)
  tokens = np.asarray(ids[: n * length], np.int32).reshape(n, length)
  _check_ids(tokens, vocab_size, where)
  return tokens


def _sequences(tok, lines: list[str], seq_len: int, hf_config: Mapping[str, Any],
               vocab_size: int, where: str) -> tuple[np.ndarray, np.ndarray, list[Any]]:
  """(int32 tokens [n, seq_len], bool real-token mask [n, seq_len], the encodings): each line
  one sequence with the tokenizer's special tokens, cut to ``seq_len`` and padded with [PAD]
  (else config.json's pad_token_id, else 0)."""
  encodings = [tok.encode(line) for line in lines]
  pad = tok.token_to_id("[PAD]")
  if pad is None:
    pad = hf_config.get("pad_token_id") or 0
  inputs = np.full((len(encodings), seq_len), pad, np.int32)
  mask = np.zeros((len(encodings), seq_len), bool)
  for i, e in enumerate(encodings):
    inputs[i, : len(e.ids[:seq_len])] = e.ids[:seq_len]
    mask[i, : len(e.ids[:seq_len])] = True
  _check_ids(inputs, vocab_size, where)
  return inputs, mask, encodings


def _image_files(path: str, flag: str) -> list[tuple[str, str]]:
  """(label, file) of every image ``path/LABEL/*.png`` (or another ``IMAGE_SUFFIXES``), in
  order."""
  if not os.path.isdir(path):
    raise ValueError(f"{flag} {path}: no such folder")
  files = [(label, os.path.join(path, label, f)) for label in sorted(os.listdir(path))
           if os.path.isdir(os.path.join(path, label))
           for f in sorted(os.listdir(os.path.join(path, label))) if f.lower().endswith(IMAGE_SUFFIXES)]
  if not files:
    raise ValueError(f"{flag} {path}: no images in label folders ({path}/LABEL/*.png)")
  return files


def _read_images(files: list[str], folder: str, cfg: Any, flag: str) -> np.ndarray:
  """float32 [n, S, S, C]: the image ``files`` resized to the model's image size, scaled to
  [0, 1] and normalised by ``folder``'s preprocessor_config.json (module docstring)."""
  processor = {}
  if os.path.isfile(os.path.join(folder, "preprocessor_config.json")):
    with open(os.path.join(folder, "preprocessor_config.json"), encoding="utf-8") as f:
      processor = json.load(f)
  mean = np.asarray(processor.get("image_mean", 0.5), np.float32)
  std = np.asarray(processor.get("image_std", 0.5), np.float32)
  try:
    from PIL import Image  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f"{flag} needs the Pillow package (pip install pillow)") from None

  size, mode = cfg.image_size, "RGB" if cfg.num_channels == 3 else "L"
  images = np.zeros((len(files), size, size, cfg.num_channels), np.float32)
  for i, file in enumerate(files):
    try:
      with Image.open(file) as img:
        pixels = np.asarray(img.convert(mode).resize((size, size), Image.BILINEAR), np.float32)
    except OSError as e:
      raise ValueError(f"{flag} {file}: unreadable image ({e})") from None
    images[i] = ((pixels.reshape(size, size, -1) / 255.0) - mean) / std
  return images


def text_batches(path: str, folder: str, model: Model, hf_config: Mapping[str, Any], *,
                 batch_size: int, seq_len: int, max_batches: int,
                 flag: str = "--eval-text") -> list[Batch]:
  """Batches of the text file ``path`` for ``model`` (module docstring), at most
  ``max_batches``, tokenised with ``folder``'s tokenizer.json; ``flag`` names the file in the
  errors."""
  cfg, where = model.config, f"{flag} {path}"
  if model.input_key != "tokens":
    raise ValueError(f"--eval-text needs a text model; this checkpoint ({cfg.family}) reads "
                     f"{model.input_key!r} (use --eval-images)")
  seq_len = min(seq_len, cfg.max_len)
  lines, tok = _read_lines(path, flag), _tokenizer(folder, flag)
  rows = batch_size * max_batches
  if model.task == tasks.FEATURES:  # a bare encoder: its sentences, for their embeddings
    tokens, mask, _ = _sequences(tok, lines[:rows], seq_len, hf_config, cfg.vocab_size, where)
    return [{"tokens": tokens[i:i + batch_size], "mask": mask[i:i + batch_size]}
            for i in range(0, len(tokens), batch_size)]
  if model.task == tasks.LM:
    tokens = _token_rows(lines, tok, seq_len + 1, rows, cfg.vocab_size, where)
    if not len(tokens):
      raise ValueError(f"{where}: fewer tokens than one sequence of {seq_len + 1}")
    return _batches(_columns(*tasks.model_batch(model.task, tokens)), batch_size)
  labels = []
  if model.task == tasks.CLASSIFICATION:
    for i, line in enumerate(lines[:rows]):
      if "\t" not in line:
        raise ValueError(f"{where}: line {i + 1} is not LABEL<TAB>text, as a classifier's "
                         "evaluation needs")
      name, line = line.split("\t", 1)
      labels.append(_label_id(name.strip(), hf_config, cfg.num_classes, where))
      lines[i] = line
  inputs, mask, encodings = _sequences(tok, lines[:rows], seq_len, hf_config, cfg.vocab_size,
                                       where)
  if model.task == tasks.CLASSIFICATION:
    return _batches(_columns(*tasks.model_batch(model.task, inputs,
                                                labels=np.asarray(labels, np.int32)), mask=mask),
                    batch_size)
  mask_id = tok.token_to_id("[MASK]")
  if mask_id is None:
    raise ValueError(f"{folder}: the tokenizer has no [MASK] token for the masked-LM evaluation")
  rng = np.random.default_rng(0)
  hidden = np.zeros(inputs.shape, bool)
  for i, e in enumerate(encodings):
    ordinary = np.flatnonzero(~np.asarray(e.special_tokens_mask[:seq_len], bool))
    if ordinary.size:
      count = max(1, round(tasks.MLM_MASK_FRACTION * ordinary.size))
      hidden[i, rng.choice(ordinary, count, replace=False)] = True
  return _batches(_columns(*tasks.model_batch(model.task, inputs, hidden=hidden, mask_id=mask_id),
                           mask=mask), batch_size)


def image_batches(path: str, folder: str, model: Model, hf_config: Mapping[str, Any], *,
                  batch_size: int, max_batches: int, flag: str = "--eval-images"
                  ) -> list[Batch]:
  """Batches of the image folder ``path`` (``path/LABEL/*.png``) for a ViT ``model``; ``flag``
  names the folder in the errors."""
  cfg = model.config
  if model.input_key != "image":
    raise ValueError(f"--eval-images needs a model that reads images; this checkpoint "
                     f"({cfg.family}) reads {model.input_key!r} (use --eval-text)")
  files = _image_files(path, flag)[: batch_size * max_batches]
  labels = [_label_id(label, hf_config, cfg.num_classes, f"{flag} {path}") for label, _ in files]
  images = _read_images([file for _, file in files], folder, cfg, flag)
  return _batches(_columns(*tasks.model_batch(model.task, images,
                                              labels=np.asarray(labels, np.int32))), batch_size)


def match_batches(path: str, folder: str, model: Model, hf_config: Mapping[str, Any], *,
                  batch_size: int, seq_len: int, max_batches: int) -> list[Batch]:
  """The batches that the data-reading stages measure the models on (``--match-data``: the
  methods that read activations, REPAIR): whole batches of ``batch_size`` examples,
  at most ``max_batches``, each {``model.input_key``: inputs} with a bool "mask" [B, T] for
  BERT, as ``Model.batch_activations`` and ``repair.repair`` read them.

  What ``path`` is follows the model, as the evaluation files are read: for a model of images
  (ViT) a folder ``path/LABEL/*.png`` (the labels are not read); for a text model a text
  file, read with ``folder``'s tokenizer.json: a language model's tokens in rows of ``seq_len``
  (at most the model's length), a BERT's lines one sequence each (cut to ``seq_len``, with the
  real-token mask; a classifier's ``LABEL<TAB>`` column, as its evaluation file has it, is
  dropped where present). No example is padded: a last batch that is not whole is dropped.

  Raises:
    ValueError: naming ``path``: missing, without text or images, or too short for one batch.
  """
  cfg, flag, where = model.config, "--match-data", f"--match-data {path}"
  key, rows = model.input_key, batch_size * max_batches

  def enough(count: int, what: str) -> None:
    if count < batch_size:
      raise ValueError(f"{where}: {count} of the {batch_size} {what} that one batch needs "
                       "(--batch-size)")

  if key == "image":
    files = _image_files(path, flag)
    enough(len(files), "images")
    columns = {key: _read_images([f for _, f in files[:rows]], folder, cfg, flag)}
  else:
    seq_len = min(seq_len, cfg.max_len)
    lines, tok = _read_lines(path, flag), _tokenizer(folder, flag)
    if model.task == tasks.LM:
      columns = {key: _token_rows(lines, tok, seq_len, rows, cfg.vocab_size, where)}
      enough(len(columns[key]), f"sequences of {seq_len} tokens")
    else:
      enough(len(lines), "lines")
      if model.task == tasks.CLASSIFICATION:  # an evaluation file's labels are not text
        lines = [line.split("\t", 1)[1] if "\t" in line else line for line in lines]
      tokens, mask, _ = _sequences(tok, lines[:rows], seq_len, hf_config, cfg.vocab_size, where)
      columns = {key: tokens, "mask": mask}
  whole = len(next(iter(columns.values()))) // batch_size * batch_size
  return [{k: v[i:i + batch_size] for k, v in columns.items()} for i in range(0, whole, batch_size)]
