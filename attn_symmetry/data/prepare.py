r"""Prepares a data set into the data dir, in the array_record format that the reader needs.

Offline data sets are prepared on first use anyway; this command is for those
that download. TFDS data sets need TensorFlow to encode images and text:

  pip install -e '.[prepare]'
  python -m attn_symmetry.data.prepare cifar10 --data_dir ~/tensorflow_datasets
  python -m attn_symmetry.data.prepare imagenet2012 --manual_dir DIR  # ILSVRC2012_img_*.tar
  python -m attn_symmetry.data.prepare enwik8 --archive enwik8.zip    # a local copy
"""

from __future__ import annotations

import argparse
import os

from attn_symmetry.data import _catalog


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m attn_symmetry.data.prepare",
                                   description=__doc__.split("\n", 1)[0])
  parser.add_argument("names", nargs="+", choices=_catalog.DATASETS, metavar="NAME",
                      help=f"data sets to prepare: {', '.join(_catalog.DATASETS)}")
  parser.add_argument("--data_dir", default=None,
                      help=f"default: ${_catalog.DATA_DIR_ENV} or {_catalog.default_data_dir()}")
  parser.add_argument("--manual_dir", default=None,
                      help="files that must be downloaded by hand (imagenet2012)")
  parser.add_argument("--archive", default=None,
                      help="a local copy of the archive that enwik8, wikitext103 or dbpedia "
                           "would download")
  args = parser.parse_args(argv)
  data_dir = args.data_dir or _catalog.default_data_dir()
  os.makedirs(data_dir, exist_ok=True)
  for name in args.names:
    try:
      builder = _catalog.prepare_dataset(name, data_dir, manual_dir=args.manual_dir,
                                         archive=args.archive)
    except _catalog.DatasetUnavailable as e:
      parser.exit(2, f"{parser.prog}: error: {e}\n")
    print(f"{name}: prepared in {builder.data_path}")


if __name__ == "__main__":
  main()
