"""The tasks a model is trained on: one spelling each, shared by models and data sets.

A model's task follows from its head (``models.Config.task``); a data set's
from what it holds (``data.DatasetInfo.task``). Everything that branches on
the task compares with these names:

  CLASSIFICATION  one label per example: ViT, BERT's classifier head; image
                  and labelled-text data sets.
  LM              next-token prediction: GPT-2, Llama; byte streams.
  MLM             masked-token prediction: BERT's MLM head.
"""

CLASSIFICATION = "classification"
LM = "lm"
MLM = "mlm"
TASKS = (CLASSIFICATION, LM, MLM)
MLM_MASK_FRACTION = 0.15  # of a masked-LM example's tokens, hidden and predicted (BERT's share)
