"""Image preprocessing on the host: normalisation, crop and flip augmentation, resizing.

Images are stored as uint8 [Hi, Wi, C] and handed to models as float32 in
[-1, 1] (x / 127.5 - 1, big_vision's ``value_range(-1, 1)``, the usual ViT
input). Augmentation for small fixed-size images (CIFAR style): pad by Hi / 8
pixels (4 for 32x32) with zeros, take a random Hi x Wi crop, and flip
horizontally with probability 1/2 where flips keep the label. Data sets of
variable size (ImageNet) are cut to ``size`` x ``size``: a random resized crop
(area 8-100 %, aspect 3/4-4/3) in training with augmentation, else the shorter
side resized to size / 0.875 and the centre cropped.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

_CENTER_CROP_FRACTION = 0.875


def normalise(image: np.ndarray) -> np.ndarray:
  """uint8 [..., Hi, Wi, C] -> float32 in [-1, 1]."""
  return image.astype(np.float32) * np.float32(1 / 127.5) - np.float32(1)


def pad_crop(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Zero-pads by Hi / 8 (at least 1) on each side and crops Hi x Wi at random."""
  height, width = image.shape[:2]
  pad = max(1, height // 8)
  padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
  top, left = rng.integers(0, 2 * pad + 1, size=2)
  return padded[top:top + height, left:left + width]


def random_flip(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Mirrors left-right with probability 1/2."""
  return image[:, ::-1] if rng.random() < 0.5 else image


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
  pil = Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1 else image)
  out = np.asarray(pil.resize((width, height), Image.BILINEAR))
  return out.reshape(height, width, image.shape[-1])


def center_crop(image: np.ndarray, size: int) -> np.ndarray:
  """Resizes the shorter side to size / 0.875 and crops the central size x size."""
  height, width = image.shape[:2]
  scale = size / _CENTER_CROP_FRACTION / min(height, width)
  new_h, new_w = max(size, round(height * scale)), max(size, round(width * scale))
  resized = _resize(image, new_h, new_w)
  top, left = (new_h - size) // 2, (new_w - size) // 2
  return resized[top:top + size, left:left + size]


def random_resized_crop(image: np.ndarray, size: int, rng: np.random.Generator, *,
                        area: tuple[float, float] = (0.08, 1.0),
                        aspect: tuple[float, float] = (3 / 4, 4 / 3)) -> np.ndarray:
  """Inception crop: a random box of the given area and aspect ranges, resized to size."""
  height, width = image.shape[:2]
  for _ in range(10):
    target = height * width * rng.uniform(*area)
    ratio = math.exp(rng.uniform(math.log(aspect[0]), math.log(aspect[1])))
    box_w = round(math.sqrt(target * ratio))
    box_h = round(math.sqrt(target / ratio))
    if 0 < box_w <= width and 0 < box_h <= height:
      top = int(rng.integers(0, height - box_h + 1))
      left = int(rng.integers(0, width - box_w + 1))
      return _resize(image[top:top + box_h, left:left + box_w], size, size)
  return center_crop(image, size)


def preprocess(image: np.ndarray, *, size: int | None, rng: np.random.Generator | None,
               flip: bool) -> np.ndarray:
  """uint8 image -> float32 [size or Hi, size or Wi, C]; augmented when ``rng`` is given.

  Args:
    image: uint8 [Hi, Wi, C].
    size: output side for variable-size data sets, None to keep Hi x Wi.
    rng: random generator for augmentation, None for the deterministic path.
    flip: whether augmentation flips (only where flips keep the label).
  """
  if size is not None:
    image = center_crop(image, size) if rng is None else random_resized_crop(image, size, rng)
  elif rng is not None:
    image = pad_crop(image, rng)
  if rng is not None and flip:
    image = random_flip(image, rng)
  return normalise(image)
