"""The tasks a model is trained on: one spelling each, shared by models and data sets.

A model's task follows from its head (``models.Config.task``); a data set's
from what it holds (``data.DatasetInfo.task``). Everything that branches on
the task compares with these names:

  CLASSIFICATION  one label per example: ViT, BERT's classifier head; image
                  and labelled-text data sets.
  LM              next-token prediction: GPT-2, Llama; byte streams.
  MLM             masked-token prediction: BERT's MLM head.
  FEATURES        no task head: the model outputs its last hidden state [B, T, D] (BERT's bare
                  encoder, ``BertModel``: sentence-transformers and embedding models); it has
                  no targets and no loss, so nothing to train or evaluate it on.

``model_batch`` says, once for the host and for jit, what a model of each task
reads and predicts from a batch: the LM's shift by one token, the MLM's hidden
tokens, the classifier's labels.
"""

CLASSIFICATION = "classification"
LM = "lm"
MLM = "mlm"
FEATURES = "features"
TASKS = (CLASSIFICATION, LM, MLM, FEATURES)
MLM_MASK_FRACTION = 0.15  # of a masked-LM example's tokens, hidden and predicted (BERT's share)


def model_batch(task: str, inputs, *, labels=None, hidden=None, mask_id: int | None = None):
  """What a model of ``task`` reads and predicts from a batch: (inputs, targets, weights).

  The one convention of the package for the tasks, on the host (numpy arrays) and inside jit
  (jax arrays): the result is in the array namespace of ``inputs``, by
  ``inputs.__array_namespace__()``. B examples:

  * ``LM``: ``inputs`` int tokens [B, T + 1]; the model reads tokens[:, :-1] and predicts
    every next token, targets tokens[:, 1:] [B, T], weights all True [B, T].
  * ``MLM``: ``inputs`` int tokens [B, T] and ``hidden`` bool [B, T], the positions hidden
    (chosen by the caller); the model reads the tokens with ``mask_id`` at the hidden
    positions and predicts the original tokens there: targets the tokens [B, T], weights
    ``hidden``.
  * ``CLASSIFICATION``: ``inputs`` images [B, S, S, C] or tokens [B, T], read as they are;
    targets ``labels`` int [B], weights all True [B].

  Args:
    task: one of ``TASKS``.
    inputs: the raw batch's model entry (tokens or images), as above.
    labels: int [B], classification only.
    hidden: bool [B, T], MLM only.
    mask_id: the token id that replaces a hidden token, MLM only.

  Returns:
    (model inputs, targets, weights bool like targets: True where a prediction counts).

  Raises:
    ValueError: an unknown task, ``FEATURES`` (which has no targets), or an argument the task
      needs missing (or one it does not read given).
  """
  if task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")
  if task == FEATURES:
    raise ValueError(f"a {FEATURES!r} model (a bare encoder, no task head) has no targets: there "
                     "is nothing to predict from a batch")
  given = {"labels": labels is not None, "hidden": hidden is not None,
           "mask_id": mask_id is not None}
  needed = {LM: (), MLM: ("hidden", "mask_id"), CLASSIFICATION: ("labels",)}[task]
  if any(given[k] != (k in needed) for k in given):
    raise ValueError(f"a {task!r} batch takes {' and '.join(needed) or 'no argument but inputs'}; "
                     f"got {', '.join(k for k in given if given[k]) or 'none'}")
  xp = inputs.__array_namespace__()
  if task == LM:
    if inputs.ndim != 2 or inputs.shape[1] < 2:
      raise ValueError(f"an 'lm' batch takes tokens [B, T + 1] with T >= 1, got shape "
                       f"{inputs.shape}")
    targets = inputs[:, 1:]
    return inputs[:, :-1], targets, xp.ones(targets.shape, dtype=bool)
  if task == MLM:
    if hidden.shape != inputs.shape:
      raise ValueError(f"an 'mlm' batch's hidden positions {hidden.shape} must have the shape "
                       f"of its tokens {inputs.shape}")
    return xp.where(hidden, xp.asarray(mask_id, dtype=inputs.dtype), inputs), inputs, hidden
  return inputs, labels, xp.ones(labels.shape, dtype=bool)
