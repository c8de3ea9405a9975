"""Image data: scikit-learn's digits and ImageNet-style class folders.

Both return an ``ArrayDataset`` whose batches have ``image`` [n, H, W, C] and ``label`` i32,
and the class names by label id on ``class_names``. A folder of 8-bit images is held, and
batched, as uint8 codes: the train and eval steps make them the model's floats on the
device (:func:`model_pixels`: a quarter of float32's bytes copied, no host work per batch);
other images are f32 in [0, 1]. A pretrained model's pixels are normalized as its HF image
processor does (:func:`pixel_normalization`): 8-bit codes in the step, float images per
batch on the host (:func:`normalized`), to the same values. The digits are resized for a
model of another size (:func:`resized`), per batch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import unicodedata
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from train.dataset import ArrayDataset, MissingFileError

DIGITS_NUM_CLASSES = 10
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".bmp", ".gif", ".webp", ".tif",
                  ".tiff", ".ppm", ".pgm", ".pbm", ".pnm")


def digits(split: str = "train", *, test_fraction: float = 0.2, seed: int = 0) -> ArrayDataset:
  """scikit-learn's bundled 8x8 digits (1797 images, no download), split per class.

  The split is stratified: within each class a ``default_rng(seed)`` permutation sends
  ``round(test_fraction * count)`` images to "test" and the rest to "train" (disjoint, fixed).
  """
  if split not in ("train", "test"):
    raise ValueError(f"digits split must be 'train' or 'test', got {split!r}")
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
  try:
    from sklearn.datasets import load_digits
  except ImportError as e:
    raise ImportError("digits() needs scikit-learn: pip install scikit-learn") from e
  images, labels = load_digits(return_X_y=True)
  labels = labels.astype(np.int32)
  rng = np.random.default_rng(seed)
  test = []
  for c in range(DIGITS_NUM_CLASSES):
    members = rng.permutation(np.flatnonzero(labels == c))
    test.append(members[:int(round(test_fraction * len(members)))])
  is_test = np.zeros(len(labels), bool)
  is_test[np.concatenate(test)] = True
  rows = np.flatnonzero(is_test if split == "test" else ~is_test)
  image = (images[rows] / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
  ds = ArrayDataset({"image": image, "label": labels[rows]})
  ds.class_names = [str(c) for c in range(DIGITS_NUM_CLASSES)]
  return ds


@dataclasses.dataclass(frozen=True)
class ImageFiles:
  """An image folder's files and label ids (:func:`scan_folder`), before any is decoded;
  ``ignored``: the files in it that are not images, said, not read."""
  root: Path
  files: list[Path]
  labels: list[int]
  class_names: list[str]
  ignored: list[Path]

  def summary(self) -> str:
    """One line: how many images and classes, and what was left out."""
    line = (f"{len(self.files)} images in {len(set(self.labels))} classes from {self.root}")
    if self.ignored:
      line += (f"; {len(self.ignored)} other files ignored (e.g. "
               + ", ".join(str(f.relative_to(self.root)) for f in self.ignored[:3]) + ")")
    return line


def scan_folder(path, *, class_names: list[str] | None = None,
                class_names_from: str | None = None,
                num_labels: int | None = None) -> ImageFiles:
  """The files of an ImageNet-style folder ``path/<class_name>/.../<image>`` and their
  label ids, nothing decoded (so an eval folder's mistakes are found before the training
  images are read). Ids follow sorted class names, or ``class_names`` (the training set's,
  read from ``class_names_from``) for an eval folder, which may hold fewer classes but no
  other; names are compared in Unicode NFC (a folder copied from a Mac has NFD names).
  Every label must be below ``num_labels``. A class folder's subfolders are read too, as
  torchvision's ``ImageFolder`` does; hidden entries are skipped, other files ignored and
  counted (:meth:`ImageFiles.summary`)."""
  root = Path(path)
  if not root.exists():
    raise MissingFileError(f"image folder not found: {root}")
  if not root.is_dir():
    raise ValueError(f"image folder is not a directory: {root}")
  broken = sorted(p for p in root.iterdir() if p.is_symlink() and not p.exists())
  if broken:
    raise ValueError(f"{broken[0]}: a class folder that is a link to nothing "
                     f"({os.readlink(broken[0])}, not found)")
  present = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
  if not present:
    raise ValueError(f"no class folders in {root} (expected {root}/<class_name>/<images>)")
  spelled = {}
  for name in present:
    other = spelled.setdefault(unicodedata.normalize("NFC", name), name)
    if other != name:
      raise ValueError(f"class folders {root / other} and {root / name} differ only in "
                       f"Unicode form ({ascii(other)} vs {ascii(name)}), one class to a "
                       "reader; merge them")
  if class_names is None:
    class_names = present
  index = {unicodedata.normalize("NFC", name): i for i, name in enumerate(class_names)}
  files, labels, ignored = [], [], []
  for name in present:
    label = index.get(unicodedata.normalize("NFC", name))
    if label is None:
      raise ValueError(f"class folder {root / name}: class {name!r} does not occur in the "
                       f"training data {class_names_from or ''} (its classes: {class_names})")
    found = []
    for f in _walk(root / name):
      (found if f.suffix.lower() in IMAGE_SUFFIXES + (".npy",) else ignored).append(f)
    if not found:
      raise ValueError(f"class folder {root / name} holds no images "
                       f"(.npy or {', '.join(IMAGE_SUFFIXES)})")
    if num_labels is not None and label >= num_labels:
      raise ValueError(f"{found[0]}: class {name!r} is label {label}, outside the "
                       f"model's num_labels={num_labels} ({len(class_names)} classes; set "
                       f"model.num_labels={len(class_names)})")
    files += found
    labels += [label] * len(found)
  return ImageFiles(root, files, labels, list(class_names), ignored)


def _walk(folder: Path) -> list[Path]:
  """The files under ``folder``, sorted, hidden entries and what they hold skipped, links
  followed; a link to a folder read already (a loop, or the same images twice) is a
  ValueError naming it."""
  out, seen = [], {}
  for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
    here = os.stat(dirpath)
    key = (here.st_dev, here.st_ino)
    if key in seen:
      raise ValueError(f"{dirpath}: a link to {seen[key]}, read already (a loop, or the "
                       "same images twice); remove the link")
    seen[key] = dirpath
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    out += [Path(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
  return sorted(out)


def image_folder(path, *, image_size: int, channels: int = 3,
                 class_names: list[str] | None = None, class_names_from: str | None = None,
                 num_labels: int | None = None) -> ArrayDataset:
  """An ImageNet-style folder (:func:`scan_folder`) read (:func:`load_images`)."""
  return load_images(scan_folder(path, class_names=class_names,
                                 class_names_from=class_names_from, num_labels=num_labels),
                     image_size=image_size, channels=channels)


def load_images(scan: ImageFiles, *, image_size: int, channels: int = 3) -> ArrayDataset:
  """The images of a :func:`scan_folder`, decoded.

  Images (read with Pillow, turned upright as their EXIF orientation says, as HF's
  ``datasets`` and ``load_image`` do) and ``.npy`` files (an HxWxC or HxW array: uint8 in
  [0, 255], uint16 in [0, 65535] or float in [0, 1]) are resized to ``image_size`` squared
  (bilinear, antialiased, aspect ratio not kept).
  Returns ``image`` [n, H, W, C], uint8 codes while every image is 8-bit (the steps make
  them floats: :func:`model_pixels`), else f32 in [0, 1], and ``label`` i32;
  ``class_names`` on the dataset.
  """
  if image_size < 1:
    raise ValueError(f"image_size must be >= 1, got {image_size}")
  if channels not in (1, 3, 4):
    raise ValueError(f"channels must be 1, 3 or 4, got {channels}")
  files = scan.files
  pil = None
  if any(f.suffix.lower() != ".npy" for f in files):
    try:
      from PIL import Image as pil
    except ImportError as e:
      raise ImportError(f"image_folder needs Pillow to read images in {scan.root}: "
                        "pip install pillow") from e
  # held and batched as 8-bit codes while every image is one (Pillow resizes in 8 bits; a
  # uint8 .npy of the size), made [0, 1] in the step: the same values, 4x less memory and
  # 4x fewer bytes to the device; in float32 from the first image that is not
  image = np.empty((len(files), image_size, image_size, channels), np.uint8)
  if len(files) >= SAY_DECODING:
    wide = (", or 4x that as float32 if a .npy is not 8-bit"
            if any(f.suffix.lower() == ".npy" for f in files) else "")
    print(f"images: decoding {len(files)} files of {scan.root} into "
          f"{image.nbytes / 2**30:.2f} GiB ({len(files)} x {image_size} x {image_size} x "
          f"{channels} uint8{wide}) on {DECODE_THREADS} threads", flush=True)

  def load(f):
    if f.suffix.lower() == ".npy":
      return _load_npy_image(f, image_size, channels)
    return _load_pil_image(pil, f, image_size, channels)

  # Pillow decodes and resizes without the GIL: threads decode in parallel
  with concurrent.futures.ThreadPoolExecutor(DECODE_THREADS) as pool:
    for i, a in enumerate(pool.map(load, files)):
      if a.dtype != np.uint8:
        image = _unit(image)  # a no-op once the folder is float32
      image[i] = a if image.dtype == np.uint8 else _unit(a)
  ds = ArrayDataset({"image": image, "label": np.asarray(scan.labels, np.int32)})
  ds.class_names = scan.class_names
  return ds


# a folder of at least this many files says what it decodes into, and on how many threads
SAY_DECODING = 1000
DECODE_THREADS = min(os.cpu_count() or 1, 16)


def _unit(a: np.ndarray) -> np.ndarray:
  """8-bit codes -> f32 in [0, 1] (as Pillow's images are read); float32 as it is."""
  return a.astype(np.float32) / 255.0 if a.dtype == np.uint8 else a


# Pillow's modes of more than 8 bits per sample (16-bit PNG and TIFF, 32-bit int and float
# TIFF): convert() to L/RGB clips these to 0..255 (a 16-bit ramp read as 0, 1, 1, ...),
# so they are read as arrays and scaled as a .npy of that dtype is
_WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def _load_pil_image(pil, f: Path, size: int, channels: int) -> np.ndarray:
  """One image file, upright as its EXIF orientation says -> uint8 [size, size, channels]
  (8-bit codes, Pillow's resize); an image of more than 8 bits per sample -> f32 in [0, 1]
  (:func:`_array_image`)."""
  from PIL import ImageOps
  mode = {1: "L", 3: "RGB", 4: "RGBA"}[channels]
  try:
    with pil.open(f) as im:
      # a JPEG at least 4x the size across: decoded at a power-of-two scale of it, still
      # twice the size, then resized as any (a 12 MP photo: 3.8x faster; within 3 codes)
      im.draft(None, (2 * size, 2 * size))
      im = _upright(im, ImageOps)  # a phone photo upright, as it is shown
      if im.mode in _WIDE_MODES:
        wide = np.asarray(im)
      else:
        im = im.convert(mode).resize((size, size), pil.Resampling.BILINEAR)
        return np.asarray(im, np.uint8).reshape(size, size, channels)
  except (OSError, ValueError, pil.DecompressionBombError) as e:
    raise ValueError(f"cannot read image {f}: {e}") from e
  if wide.dtype.kind in "iu":  # 16-bit samples (mode I holds them in int32)
    if wide.size and (wide.min() < 0 or wide.max() > 65535):
      raise ValueError(f"{f}: integer image values must lie in [0, 65535], got "
                       f"[{wide.min()}, {wide.max()}]")
    wide = wide.astype(np.uint16)
  return _array_image(wide, f, size, channels)


def _upright(im, image_ops):
  """``im`` turned as its EXIF orientation says: in place (Pillow >= 10, no copy of an
  image that needs no turn), else a turned copy (older Pillow)."""
  im.load()
  try:
    image_ops.exif_transpose(im, in_place=True)
    return im
  except TypeError:  # Pillow < 10: no in_place
    return image_ops.exif_transpose(im)


def _load_npy_image(f: Path, size: int, channels: int) -> np.ndarray:
  """One .npy HxWxC (or HxW) array -> [size, size, channels] (:func:`_array_image`)."""
  try:
    a = np.load(f, allow_pickle=False)
  except (OSError, ValueError) as e:
    raise ValueError(f"cannot read {f}: {e}") from e
  return _array_image(a, f, size, channels)


def _array_image(a: np.ndarray, f: Path, size: int, channels: int) -> np.ndarray:
  """An HxWxC (or HxW) image array of ``f`` -> [size, size, channels]: uint8 codes stay
  codes (resized in [0, 1], rounded back to codes, as Pillow resizes in 8 bits); uint16
  (/ 65535), bool and float in [0, 1] -> f32 in [0, 1]."""
  if a.ndim == 2:
    a = a[:, :, None]
  if a.ndim != 3 or a.shape[0] < 1 or a.shape[1] < 1:
    raise ValueError(f"{f}: expected an HxWxC or HxW image array, got shape {a.shape}")
  if a.dtype == np.uint8 and a.shape == (size, size, channels):
    return a
  if a.dtype == np.uint8:
    a = _resize(_convert_channels(_unit(a), channels, f), size)
    return np.round(a * 255.0).astype(np.uint8)
  if a.dtype == np.uint16:
    a = a.astype(np.float32) / 65535.0
  elif a.dtype == np.bool_ or np.issubdtype(a.dtype, np.floating):
    a = a.astype(np.float32)
    if a.size and (not np.isfinite(a).all() or a.min() < 0.0 or a.max() > 1.0):
      raise ValueError(f"{f}: float image values must lie in [0, 1], "
                       f"got [{a.min()}, {a.max()}]")
  else:
    raise ValueError(f"{f}: unsupported image dtype {a.dtype} (uint8, uint16 or float in [0, 1])")
  return _resize(_convert_channels(a, channels, f), size)


def _resize(a: np.ndarray, size: int) -> np.ndarray:
  """[..., H, W, C] in [0, 1] -> f32 [..., size, size, C] in [0, 1] (bilinear,
  :func:`_resize_weights`): one image or a batch of one size."""
  if a.shape[-3:-1] == (size, size):
    return np.clip(a, 0.0, 1.0)
  a = np.moveaxis(a, -1, -3)  # [..., C, H, W]: two matmuls (einsum's path is 20x slower)
  a = _resize_weights(a.shape[-2], size) @ a @ _resize_weights(a.shape[-1], size).T
  return np.moveaxis(np.clip(a, 0.0, 1.0, out=a), -3, -1)


def _convert_channels(a: np.ndarray, channels: int, f: Path) -> np.ndarray:
  """[..., C] in [0, 1] -> [..., ``channels``] as Pillow's convert: grey is repeated, RGB ->
  L is ITU-R 601 luma, alpha is dropped or added as 1."""
  c = a.shape[-1]
  if c == channels:
    return a
  if c not in (1, 3, 4):
    raise ValueError(f"{f}: image has {c} channels; expected 1, 3 or 4")
  if channels == 1:
    return a[..., :3] @ np.array([[0.299], [0.587], [0.114]], np.float32)
  # grey -> RGB: a read-only view (each consumer makes its own array of it)
  rgb = np.broadcast_to(a, a.shape[:-1] + (3,)) if c == 1 else a[..., :3]
  if channels == 3:
    return rgb
  return np.concatenate([rgb, np.ones_like(rgb[..., :1])], axis=-1)


def _resize_weights(n_in: int, n_out: int) -> np.ndarray:
  """[n_out, n_in] bilinear (triangle filter) resampling matrix, widened when downsampling
  (antialiased, as Pillow's BILINEAR resize); half-pixel centres."""
  scale = n_in / n_out
  support = max(scale, 1.0)
  centres = (np.arange(n_out) + 0.5) * scale
  w = np.maximum(0.0, 1.0 - np.abs((np.arange(n_in)[None, :] + 0.5 - centres[:, None]) / support))
  return (w / w.sum(1, keepdims=True)).astype(np.float32)  # every row has a pixel within 0.5


def pixel_normalization(model_dir) -> tuple[np.ndarray, np.ndarray] | None:
  """``(mean, std)`` per channel with which the HF image processor of ``model_dir``
  (``preprocessor_config.json``: ``image_mean``, ``image_std``) normalizes pixels in
  [0, 1], as the model was pretrained; None without that file or with ``do_normalize``
  false. A bad file is a ValueError naming it."""
  file = Path(model_dir) / "preprocessor_config.json"
  if not file.is_file():
    return None
  try:
    config = json.loads(file.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{file}: not valid JSON ({e})") from None
  if not isinstance(config, dict):
    raise ValueError(f"{file}: expected a JSON object, got {type(config).__name__}")
  if not config.get("do_normalize", True):
    return None
  if config.get("do_rescale", True) and abs(config.get("rescale_factor", 1 / 255)
                                            - 1 / 255) > 1e-9:
    raise ValueError(f"{file}: rescale_factor {config['rescale_factor']} is not 1/255; "
                     "only 8-bit pixel scaling is supported")
  stats = []
  for key in ("image_mean", "image_std"):
    value = config.get(key)
    if (not isinstance(value, list) or not value or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
      raise ValueError(f"{file}: {key} must be a list of numbers (one per channel), "
                       f"got {value!r}")
    stats.append(np.asarray(value, np.float32))
  if len(stats[0]) != len(stats[1]) or not (stats[1] > 0).all():
    raise ValueError(f"{file}: image_std must be positive, one per image_mean channel; got "
                     f"image_mean {config['image_mean']}, image_std {config['image_std']}")
  return stats[0], stats[1]


def resized(ds: ArrayDataset, image_size: int, channels: int) -> ArrayDataset:
  """``ds`` with every image resized to ``image_size`` squared and converted to
  ``channels``, as :func:`image_folder` reads a file (bilinear; grey repeated), class names
  kept: the 8x8 digits for a model pretrained at another size. Done per batch
  (:meth:`ArrayDataset.with_transform`): the host holds the small images and one batch
  of large ones (the digits for a 224 px ViT: 1.1 GB of float32 otherwise). 8-bit codes
  are resized as [0, 1] floats."""
  def resize(batch):  # channels last (linear, so it commutes with the resize): 3x less work
    image = _convert_channels(_resize(_unit(batch["image"]), image_size), channels,
                              Path("images"))
    return {**batch, "image": image.astype(np.float32, copy=False)}
  return ds.with_transform(resize)


def normalized(ds: ArrayDataset, mean: np.ndarray, std: np.ndarray) -> ArrayDataset:
  """``ds`` with ``image`` as ``(image - mean) / std`` per channel (class names kept), per
  batch on the host (:meth:`ArrayDataset.with_transform`: no normalized copy of the images
  held); 8-bit codes are made [0, 1] first. For float images; a run leaves 8-bit codes to
  the step (:func:`model_pixels`), which gives the same values."""
  channels = ds.take(np.arange(1))["image"].shape[-1]
  if len(mean) not in (1, channels):
    raise ValueError(f"image normalization has {len(mean)} channels, the images {channels}")
  mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)

  def normalize(batch):
    # per example as one row against mean and std laid out as an example: numpy's inner
    # loop then runs over H W C values, not C (5x faster, the same values)
    image = _unit(batch["image"])
    shape, n = image.shape, len(image)
    tiled = [np.broadcast_to(x, shape[1:]).reshape(1, -1) for x in (mean, std)]
    rows = np.subtract(image.reshape(n, -1), tiled[0], dtype=np.float32)
    rows /= tiled[1]
    return {**batch, "image": rows.reshape(shape)}
  return ds.with_transform(normalize)


def code_values(stats: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
  """The model's input for each 8-bit code, f32 ``[256, K]``: row ``code`` is
  ``(code / 255 - mean) / std`` per channel (``stats``: ``(mean, std)``, K channels), or
  ``code / 255`` without ``stats`` (K = 1), computed as :func:`normalized` computes a
  float batch: the values the host fed the model before the step took codes."""
  values = _unit(np.arange(256, dtype=np.uint8))[:, None]
  if stats is None:
    return values
  mean, std = (np.asarray(x, np.float32).reshape(1, -1) for x in stats)
  return np.subtract(values, mean, dtype=np.float32) / std


def model_pixels(image, values: np.ndarray | None = None):
  """A batch's ``image`` as the model takes it, inside the jitted step: uint8 codes looked
  up per channel in ``values`` (:func:`code_values`; None: ``code / 255``), a constant of
  the step; float pixels as they are (made and normalized on the host). A lookup, not
  ``(x / 255 - mean) / std``: XLA turns a division by a constant into a multiplication by
  its reciprocal (on the CPU up to 7.2e-7 from the host's values for ImageNet's mean and
  std); the table gives the host's floats bit for bit on any backend."""
  if image.dtype != jnp.uint8:
    return image
  values = code_values() if values is None else values
  channels = image.shape[-1]
  if values.shape[-1] not in (1, channels):
    raise ValueError(f"image normalization has {values.shape[-1]} channels, the images "
                     f"{channels}")
  table = jnp.asarray(np.broadcast_to(values, (256, channels)))
  return table.at[image.astype(jnp.int32), np.arange(channels)].get(mode="promise_in_bounds")
