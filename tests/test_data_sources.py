"""The paper's data sets (TFDS layout), our download builders, bad input, image preprocessing.

The paper's data sets cannot be downloaded here. Their reading path is tested
on data sets written by TFDS's own builder classes (same features, versions and
folders as the real ones), filled with a few examples instead of the download.
Our download builders are tested on local archives of real text.
"""

import csv
import io
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from attn_symmetry import data
from attn_symmetry.data import _builders
from attn_symmetry.data import _catalog
from attn_symmetry.data import _images
from attn_symmetry.data import _records

KW = dict(process_index=0, process_count=1)


def _fake_tfds(name, data_dir, splits):
  """Prepares TFDS data set ``name`` (its real builder class) from the given examples."""
  real = tfds.builder_cls(name)  # Outside skip_registration, which would hide it too.
  with tfds.core.registered.skip_registration():
    class Fake(real):  # pylint: disable=missing-class-docstring
      def _split_generators(self, dl_manager):
        return {split: self._generate_examples(examples) for split, examples in splits.items()}

      def _generate_examples(self, examples):  # pylint: disable=arguments-differ
        yield from enumerate(examples)
  Fake.name = name
  Fake(data_dir=data_dir, file_format="array_record").download_and_prepare()


def _encode(image, fmt):
  out = io.BytesIO()
  Image.fromarray(image).save(out, format=fmt)
  return out.getvalue()


def _text_lines(limit):
  """Real English sentences: the Lee news corpus in gensim's test data."""
  with open(_builders._gensim_test_file("lee_background.cor"), "rb") as f:
    return [line.strip() for line in f if line.strip()][:limit]


def _window_bytes(name, data_dir, split, seq_len):
  windows = [w for b in data.eval_iterator(name, batch_size=50, split=split, seq_len=seq_len,
                                           data_dir=data_dir, **KW)
             for w, v in zip(b["tokens"], b["valid"]) if v]
  return windows, bytes(np.concatenate([w[:-1] for w in windows]).astype(np.uint8))


def _padded_windows(image, crop, pad):
  """[((top, left), mirrored)] of every window of ``image`` zero-padded by ``pad`` equal to
  ``crop`` or to its mirror image (a reference written here, independent of ``_images``)."""
  padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
  height, width = image.shape[:2]
  return [((top, left), mirror) for top in range(2 * pad + 1) for left in range(2 * pad + 1)
          for mirror in (False, True)
          if np.array_equal(padded[top:top + height, left:left + width],
                            crop[:, ::-1] if mirror else crop)]


def test_cifar10_layout_decodes_images_and_augments(tmp_path):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, size=(40, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, size=40)
  examples = [{"id": f"train_{i}", "image": _encode(im, "PNG"), "label": int(lab)}
              for i, (im, lab) in enumerate(zip(images, labels))]
  _fake_tfds("cifar10", str(tmp_path), {"train": examples[:30], "test": examples[30:]})
  info = data.dataset_info("cifar10", data_dir=str(tmp_path))
  assert (info.task, info.num_classes, info.image_shape, info.flip) == \
      ("classification", 10, (32, 32, 3), True)
  assert info.splits == {"train": 30, "test": 10}
  batch = next(data.train_iterator("cifar10", batch_size=8, seed=0, augment=True,
                                   data_dir=str(tmp_path), **KW))
  assert batch["image"].shape == (8, 32, 32, 3) and batch["image"].dtype == np.float32
  # Each augmented image is a 32 x 32 window of its zero-padded (by 4) source, maybe mirrored.
  label_of = {im.tobytes(): int(lab) for im, lab in zip(images, labels)}
  moved = 0
  for out, label in zip(np.round((batch["image"] + 1) * 127.5).astype(np.uint8), batch["label"]):
    found = [(im, top, left, mirror) for im in images[:30] for (top, left), mirror in
             _padded_windows(im, out, pad=4)]
    assert len(found) == 1, f"{len(found)} source windows match an augmented image"
    im, top, left, mirror = found[0]
    assert label == label_of[im.tobytes()]
    moved += (top, left, mirror) != (4, 4, False)
  assert moved >= 6  # the identity crop has probability 1 / 162
  (test,) = data.eval_iterator("cifar10", batch_size=10, data_dir=str(tmp_path), **KW)
  decoded = np.round((test["image"] + 1) * 127.5).astype(np.uint8)
  expected = {(im.tobytes(), int(lab)) for im, lab in zip(images[30:], labels[30:])}
  assert {(im.tobytes(), int(lab)) for im, lab in zip(decoded, test["label"])} == expected


def test_imagenet_layout_crops_variable_sizes(tmp_path):
  rng = np.random.default_rng(1)
  shapes = [(40, 60), (75, 50), (33, 33), (90, 41)]
  examples = [{"image": _encode(rng.integers(0, 256, size=(*s, 3), dtype=np.uint8), "JPEG"),
               "label": i, "file_name": f"n{i:08d}.JPEG"} for i, s in enumerate(shapes)]
  _fake_tfds("imagenet2012", str(tmp_path), {"train": examples, "validation": examples})
  info = data.dataset_info("imagenet2012", data_dir=str(tmp_path), image_size=24)
  assert info.image_shape == (24, 24, 3) and info.num_classes == 1000
  for augment in (False, True):
    batch = next(data.train_iterator("imagenet2012", batch_size=4, seed=0, augment=augment,
                                     image_size=24, data_dir=str(tmp_path), **KW))
    assert batch["image"].shape == (4, 24, 24, 3)
  (val,) = data.eval_iterator("imagenet2012", batch_size=4, split="validation", image_size=24,
                              data_dir=str(tmp_path), **KW)
  assert sorted(val["label"].tolist()) == [0, 1, 2, 3]


def test_ag_news_layout_joins_title_and_description(tmp_path):
  lines = _text_lines(20)
  examples = [{"title": lines[2 * i], "description": lines[2 * i + 1], "label": i % 4}
              for i in range(10)]
  _fake_tfds("ag_news_subset", str(tmp_path), {"train": examples[:6], "test": examples[6:]})
  info = data.dataset_info("ag_news_subset", data_dir=str(tmp_path), seq_len=512)
  assert (info.num_classes, info.vocab_size, info.splits) == (4, 256, {"train": 6, "test": 4})
  (batch,) = data.eval_iterator("ag_news_subset", batch_size=4, seq_len=512,
                                data_dir=str(tmp_path), **KW)
  texts = {bytes(t[m].astype(np.uint8)) for t, m in zip(batch["tokens"], batch["mask"])}
  assert texts == {(e["title"] + b"\n" + e["description"])[:512] for e in examples[6:]}


@pytest.mark.parametrize("in_memory", [True, False])
def test_lm1b_layout_reads_sentences_as_one_stream(tmp_path, monkeypatch, in_memory):
  if not in_memory:  # lm1b is 4 GB: read from the files, with the record lengths cached.
    monkeypatch.setattr(_records, "IN_MEMORY_BYTES", -1)
  sentences = [{"text": line} for line in _text_lines(120)]
  _fake_tfds("lm1b", str(tmp_path), {"train": sentences[:100], "test": sentences[100:]})
  builder = tfds.builder("lm1b", data_dir=str(tmp_path))
  records = builder.as_data_source(split="test")
  stream = b"".join(records[i]["text"] + b"\n" for i in range(len(records)))
  windows, joined = _window_bytes("lm1b", str(tmp_path), "test", 16)
  assert len(windows) == (len(stream) - 1) // 16
  assert joined == stream[:len(joined)]
  assert data.dataset_info("lm1b", data_dir=str(tmp_path), seq_len=16).splits["test"] == \
      len(windows)
  cached = list((tmp_path / "lm1b").glob("*/attn_symmetry-lengths-test-sep1.npy"))
  assert len(cached) == (0 if in_memory else 1)


@pytest.fixture(scope="module")
def wiki_stream():
  import bz2
  with bz2.open(_builders._gensim_test_file(_builders.WikiBytes.SOURCE), "rb") as f:
    return f.read(200_000)


def test_enwik8_builder_splits_the_archive_90_5_5(tmp_path, wiki_stream):
  archive = tmp_path / "enwik8.zip"
  with zipfile.ZipFile(archive, "w") as z:
    z.writestr("enwik8", wiki_stream)
  (tmp_path / "dd").mkdir()
  data.prepare_dataset("enwik8", str(tmp_path / "dd"), archive=str(archive))
  info = data.dataset_info("enwik8", data_dir=str(tmp_path / "dd"), seq_len=64)
  assert info.task == "lm" and set(info.splits) == {"train", "validation", "test"}
  _, joined = _window_bytes("enwik8", str(tmp_path / "dd"), "validation", 64)
  n = len(wiki_stream)
  assert joined == wiki_stream[round(0.9 * n):round(0.95 * n)][:len(joined)]
  assert len(joined) > round(0.05 * n) - 2 * 64  # Only the last partial window is dropped.


def test_wikitext103_builder_reads_the_three_files(tmp_path, wiki_stream):
  parts = {"train": wiki_stream[:100_000], "valid": wiki_stream[100_000:150_000],
           "test": wiki_stream[150_000:]}
  archive = tmp_path / "wikitext-103-raw-v1.zip"
  with zipfile.ZipFile(archive, "w") as z:
    for split, text in parts.items():
      z.writestr(f"wikitext-103-raw/wiki.{split}.raw", text)
  (tmp_path / "dd").mkdir()
  data.prepare_dataset("wikitext103", str(tmp_path / "dd"), archive=str(archive))
  for split, part in (("validation", "valid"), ("test", "test")):
    _, joined = _window_bytes("wikitext103", str(tmp_path / "dd"), split, 128)
    assert joined == parts[part][:len(joined)] and len(joined) > len(parts[part]) - 2 * 128


def test_dbpedia_builder_parses_the_csv(tmp_path):
  lines = [line.decode() for line in _text_lines(24)]
  rows = {split: [(str(1 + i % 14), f"Title, {i} \"quoted\"", lines[i]) for i in range(12)]
          for split in ("train", "test")}
  archive = tmp_path / "dbpedia_csv.tgz"
  with tarfile.open(archive, "w:gz") as tar:
    for split, table in rows.items():
      out = io.StringIO()
      csv.writer(out).writerows(table)
      raw = out.getvalue().encode()
      member = tarfile.TarInfo(f"dbpedia_csv/{split}.csv")
      member.size = len(raw)
      tar.addfile(member, io.BytesIO(raw))
  (tmp_path / "dd").mkdir()
  data.prepare_dataset("dbpedia", str(tmp_path / "dd"), archive=str(archive))
  info = data.dataset_info("dbpedia", data_dir=str(tmp_path / "dd"))
  assert info.num_classes == 14 and info.splits == {"train": 12, "test": 12}
  (batch,) = data.eval_iterator("dbpedia", batch_size=12, seq_len=1024,
                                data_dir=str(tmp_path / "dd"), **KW)
  got = {(bytes(t[m].astype(np.uint8)), int(lab))
         for t, m, lab in zip(batch["tokens"], batch["mask"], batch["label"])}
  assert got == {(f"{title}\n{text}".encode()[:1024], int(label) - 1)
                 for label, title, text in rows["test"]}


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("digits"))
  data.dataset_info("digits", data_dir=path)
  return path


@pytest.mark.parametrize("call, error, match", [
    (lambda d: data.dataset_info("cifar11", data_dir=d), ValueError, "Unknown dataset 'cifar11'"),
    (lambda d: data.dataset_info("digits", data_dir=d + "/nope"), ValueError, "does not exist"),
    (lambda d: data.train_iterator("digits", batch_size=8, seed=0, split="validation",
                                   data_dir=d, **KW), ValueError, "no split 'validation'"),
    (lambda d: data.eval_iterator("digits", batch_size=8, split="dev", data_dir=d, **KW),
     ValueError, "splits: train, test"),
    (lambda d: data.train_iterator("digits", batch_size=2000, seed=0, data_dir=d, **KW),
     ValueError, "larger than split 'train'"),
    (lambda d: data.eval_iterator("digits", batch_size=8, split="train[5:5]", data_dir=d, **KW),
     ValueError, r"'train\[5:5\]' holds no records"),
    (lambda d: data.train_iterator("digits", batch_size=8, seed=0, split="train+test",
                                   data_dir=d, **KW), ValueError, "is a union"),
    (lambda d: data.split_range("digits", "train[:9O%]", data_dir=d), ValueError,
     "not a split or a slice of one"),
    (lambda d: data.dataset_info("digits", slices=("dev[:10%]",), data_dir=d), ValueError,
     r"no split 'dev\[:10%\]'; splits: train, test"),
    (lambda d: data.train_iterator("digits", batch_size=9, seed=0, data_dir=d, process_index=0,
                                   process_count=2), ValueError, "not divisible"),
    (lambda d: data.train_iterator("digits", batch_size=8, seed=0, data_dir=d, process_index=2,
                                   process_count=2), ValueError, "process_index 2"),
    (lambda d: data.train_iterator("digits", batch_size=0, seed=0, data_dir=d, **KW),
     ValueError, "batch_size must be positive"),
    (lambda d: data.train_iterator("digits", batch_size=8, seed=0, seq_len=16, data_dir=d, **KW),
     ValueError, "seq_len applies to text"),
    (lambda d: data.dataset_info("digits", image_size=32, data_dir=d), ValueError,
     "variable image shape"),
])
def test_bad_input_is_a_clear_error(call, error, match, digits_dir):
  with pytest.raises(error, match=match):
    call(digits_dir)


def test_augment_on_text_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="augment apply to image"):
    data.train_iterator("newsgroups_mini", batch_size=8, seed=0, augment=True,
                        data_dir=str(tmp_path), **KW)


@pytest.mark.parametrize("name, extra", [
    ("cifar10", "pip install -e '.[prepare]' && "),
    ("lm1b", "pip install -e '.[prepare]' && "),
    ("imagenet2012", "pip install -e '.[prepare]' && "),
    ("enwik8", ""),
    ("dbpedia", ""),
])
def test_unprepared_paper_dataset_fails_with_the_command(name, extra, tmp_path):
  with pytest.raises(FileNotFoundError) as info:
    data.train_iterator(name, batch_size=8, seed=0, data_dir=str(tmp_path), **KW)
  command = f"{extra}python -m attn_symmetry.data.prepare {name} --data_dir {tmp_path}"
  assert command in str(info.value)
  assert ("--manual_dir" in str(info.value)) == (name == "imagenet2012")
  assert list(tmp_path.iterdir()) == []  # Nothing was started.


def test_preparing_a_tfds_dataset_without_tensorflow_names_the_extra(tmp_path, monkeypatch,
                                                                    capsys):
  monkeypatch.setattr(_catalog, "tensorflow_available", lambda: False)
  with pytest.raises(data.DatasetUnavailable, match=r"needs TensorFlow, which is not installed, "
                     r"and a network \(it downloads\): pip install -e '\.\[prepare\]'"):
    data.train_iterator("cifar10", batch_size=8, seed=0, data_dir=str(tmp_path), download=True,
                        **KW)
  from attn_symmetry.data import prepare
  with pytest.raises(SystemExit) as done:
    prepare.main(["cifar10", "--data_dir", str(tmp_path)])
  err = capsys.readouterr().err
  assert done.value.code == 2 and err.count("\n") == 1, err
  assert err.startswith("python -m attn_symmetry.data.prepare: error: preparing TFDS dataset "
                        "'cifar10' needs TensorFlow"), err


@pytest.mark.slow
def test_the_study_stops_on_an_unprepared_dataset_with_one_line(tmp_path):
  """experiments/main.py on a paper config whose data set needs a download: one line with the
  command that prepares it and that it needs a network; no traceback, no TFDS warning."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run(
      [sys.executable, "experiments/main.py", "--config=experiments/configs/vit_cifar.py",
       f"--workdir={tmp_path / 'work'}"], cwd=root, capture_output=True, text=True,
      env=dict(os.environ, **{data.DATA_DIR_ENV: str(tmp_path / "data")}))
  lines = [l for l in done.stderr.splitlines() if not re.match(r"I\d{4} ", l)]  # absl's INFO
  assert done.returncode == 1 and len(lines) == 1, done.stderr
  assert lines[0] == (f"FATAL dataset 'cifar10' is not prepared in {tmp_path / 'data'}; "
                      "preparing it downloads it (it needs a network): pip install -e "
                      f"'.[prepare]' && python -m attn_symmetry.data.prepare cifar10 --data_dir "
                      f"{tmp_path / 'data'}")


def test_fashion_mnist_without_the_debian_files_names_the_apt_command(tmp_path, monkeypatch):
  monkeypatch.setattr(_builders.FashionMnistDeb, "SOURCE_DIR", str(tmp_path / "absent"))
  with pytest.raises(FileNotFoundError) as info:
    data.dataset_info("fashion_mnist_deb", data_dir=str(tmp_path))
  assert "apt-get install -y dataset-fashion-mnist" in str(info.value)
  assert not (tmp_path / "fashion_mnist_deb" / "1.1.0").exists()


def test_fortune_languages_without_the_debian_files_names_the_apt_command(tmp_path, monkeypatch):
  monkeypatch.setattr(_builders.FortuneLanguages, "SOURCE_DIR", str(tmp_path / "absent"))
  with pytest.raises(FileNotFoundError) as info:
    data.dataset_info("fortune_languages", data_dir=str(tmp_path))
  assert "computers, cookie" in str(info.value) and "pl" in str(info.value)
  assert "apt-get install -y fortunes fortunes-de fortunes-es fortunes-it fortunes-pl" in str(
      info.value)
  assert not (tmp_path / "fortune_languages" / "1.1.0").exists()


def test_normalise_maps_the_uint8_range_to_minus_one_one():
  x = np.array([0, 127, 128, 255], np.uint8).reshape(1, 2, 2, 1)
  y = _images.normalise(x)
  assert y.dtype == np.float32 and y.min() == -1 and y.max() == 1
  np.testing.assert_allclose((y + 1) * 127.5, x, atol=1e-4)


@pytest.mark.parametrize("shape", [(40, 60, 3), (75, 50, 1), (24, 24, 3)])
def test_crops_have_the_asked_size_and_are_seeded(shape):
  image = np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)
  assert _images.center_crop(image, 24).shape == (24, 24, shape[2])
  a = _images.random_resized_crop(image, 24, np.random.default_rng(7))
  b = _images.random_resized_crop(image, 24, np.random.default_rng(7))
  assert a.shape == (24, 24, shape[2]) and a.dtype == np.uint8
  np.testing.assert_array_equal(a, b)


def test_pad_crop_cuts_windows_of_the_zero_padded_image():
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, size=(300, 16, 16, 3), dtype=np.uint8)
  keys = _images.example_keys(3, np.arange(300))
  crops = _images.pad_crop(images, keys)
  assert crops.shape == images.shape and crops.dtype == np.uint8
  offsets = []
  for image, crop in zip(images, crops):
    found = _padded_windows(image, crop, pad=2)  # pad 16 / 8
    assert len(found) == 1 and not found[0][1], found  # one window, never mirrored
    offsets.append(found[0][0])
  assert set(offsets) == {(t, l) for t in range(5) for l in range(5)}  # every offset is drawn
  # An image's crop depends on its key only, not on the rest of the batch.
  np.testing.assert_array_equal(_images.pad_crop(images[7:9], keys[7:9]), crops[7:9])


def test_random_flip_mirrors_exactly_the_images_whose_key_has_bit_40():
  images = np.random.default_rng(0).integers(0, 256, size=(64, 5, 7, 2), dtype=np.uint8)
  keys = _images.example_keys(0, np.arange(64))
  mirror = ((keys >> np.uint64(40)) & np.uint64(1)).astype(bool)
  assert 0 < mirror.sum() < 64
  flipped = _images.random_flip(images, keys)
  for image, out, m in zip(images, flipped, mirror):
    np.testing.assert_array_equal(out, image[:, ::-1] if m else image)


def test_random_resized_crop_resizes_a_box_of_the_image():
  """On an image that holds its own coordinates (channel 0 = 4 row, channel 1 = 4 column),
  the crop's interior pixels read back the box it cut: inside the image, area 8-100 %,
  aspect 3/4-4/3, and rows still rows."""
  height, width, size = 40, 60, 24
  rows, cols = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
  image = np.stack([4 * rows, 4 * cols, np.zeros_like(rows)], -1).astype(np.uint8)
  inner = np.arange(4, size - 4)  # away from the box edges, where the filter is cut off
  boxes = set()
  for seed in range(20):
    crop = _images.random_resized_crop(image, size, np.random.default_rng(seed)).astype(float) / 4
    row_of, col_of = crop[inner, size // 2, 0], crop[size // 2, inner, 1]
    np.testing.assert_allclose(crop[inner][:, inner, 0], row_of[:, None] + 0 * inner, atol=0.2)
    np.testing.assert_allclose(crop[inner][:, inner, 1], col_of[None, :] + 0 * inner[:, None],
                               atol=0.2)
    box = []
    for coord in (row_of, col_of):  # output pixel i samples source top + (i + 1/2) step - 1/2
      step, start = np.polyfit(inner, coord, 1)
      np.testing.assert_allclose(coord, start + step * inner, atol=0.3)  # a straight ramp
      box += [start - step / 2 + 0.5, step * size]  # box start, box extent
    top, box_h, left, box_w = box
    assert -0.5 < top and top + box_h < height + 0.5 and -0.5 < left and left + box_w < width + 0.5
    assert 0.08 * 0.9 < box_h * box_w / (height * width) < 1.0 + 0.05
    assert 0.75 * 0.93 < box_w / box_h < 4 / 3 / 0.93
    boxes.add((round(top), round(box_h), round(left), round(box_w)))
  assert len(boxes) > 10  # the box moves with the seed


def test_center_crop_keeps_the_centre():
  # Resized to 32 x 48 (side 28 / 0.875), then cut [2:30, 10:38]: source columns 20-76.
  image = np.zeros((64, 96, 3), np.uint8)
  image[:, 16:80] = 255
  np.testing.assert_array_equal(_images.center_crop(image, 28), 255)
  image[:, 16:80] = 0
  image[:, :16] = image[:, 80:] = 255  # Outside the crop: it must not be seen.
  np.testing.assert_array_equal(_images.center_crop(image, 28), 0)
