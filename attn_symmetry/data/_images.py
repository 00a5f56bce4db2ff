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


def example_keys(seed: int, positions: np.ndarray) -> np.ndarray:
  """A random uint64 per stream position: splitmix64 of (seed, position).

  Counter-based, so an example's augmentation depends only on the seed and its
  position in the global stream, not on the batch or process that reads it.
  """
  x = np.asarray(positions, np.uint64) + np.array([seed % 2**64], np.uint64) * np.uint64(
      0x9E3779B97F4A7C15)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def _key_digits(keys: np.ndarray, shift: int, modulus: int) -> np.ndarray:
  """Integers in [0, modulus) from 20 bits of each key, starting at bit ``shift``."""
  return ((keys >> np.uint64(shift)) & np.uint64(0xFFFFF)).astype(np.int64) % modulus


def pad_crop(images: np.ndarray, keys: np.ndarray) -> np.ndarray:
  """Zero-pads [B, Hi, Wi, C] by Hi / 8 (at least 1) and crops Hi x Wi at offsets from keys."""
  batch, height, width, channels = images.shape
  pad = max(1, height // 8)
  padded = np.zeros((batch, height + 2 * pad, width + 2 * pad, channels), images.dtype)
  padded[:, pad:pad + height, pad:pad + width] = images
  top, left = _key_digits(keys, 0, 2 * pad + 1), _key_digits(keys, 20, 2 * pad + 1)
  # [B, 2 pad + 1, 2 pad + 1, C, Hi, Wi]: every crop, as a view; pick one per image.
  crops = np.lib.stride_tricks.sliding_window_view(padded, (height, width), axis=(1, 2))
  return np.moveaxis(crops[np.arange(batch), top, left], 1, -1)


def random_flip(images: np.ndarray, keys: np.ndarray) -> np.ndarray:
  """Mirrors left-right the images [B, Hi, Wi, C] whose key has bit 40 set (probability 1/2)."""
  flip = _key_digits(keys, 40, 2).astype(bool)
  return np.where(flip[:, None, None, None], images[:, :, ::-1], images)


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


def preprocess(images, *, size: int | None, keys: np.ndarray | None, flip: bool) -> np.ndarray:
  """uint8 images -> float32 [B, size or Hi, size or Wi, C]; augmented when ``keys`` are given.

  Args:
    images: uint8 [B, Hi, Wi, C], or B arrays [Hi, Wi, C] of several sizes
      when ``size`` is set.
    size: output side for variable-size data sets, None to keep Hi x Wi.
    keys: uint64 [B] random keys (``example_keys``) for augmentation, or None
      for the deterministic path.
    flip: whether augmentation flips (only where flips keep the label).
  """
  if size is not None and keys is None:
    batch = np.stack([center_crop(image, size) for image in images])
  elif size is not None:
    batch = np.stack([random_resized_crop(image, size, np.random.default_rng(int(key)))
                      for image, key in zip(images, keys)])
  else:
    batch = np.asarray(images)
    if keys is not None:
      batch = pad_crop(batch, keys)
  if keys is not None and flip:
    batch = random_flip(batch, keys)
  return normalise(batch)
