"""A model directory's fingerprint: which safetensors bytes a run started from, read cheaply.

A LoRA run's export (:func:`models.hf.save_lora_merged`) merges the adapters into the
checkpoint the run was loaded from, read again when the run ends. The train loop records
this fingerprint when a run starts (``pretrained.json`` in its folder) and compares it at
resume and before the export, so another revision saved into the same folder meanwhile is
an error naming the file, not adapters merged silently into other weights.

Per safetensors file: a CRC-32 of its header (every tensor's name, dtype, shape and
offsets) and of three samples of each tensor's bytes (its first, middle and last
:data:`SAMPLE_BYTES`): about 12 KiB read per tensor however large (3.5 MiB for
LLaMA-7B's 291 tensors). Training changes nearly every byte of a tensor, so another
revision is caught; an edit confined to bytes between the samples is not. A copy of the
same files (new paths, new times) has the same fingerprint.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

SAMPLE_BYTES = 4096


def fingerprint(path: str | os.PathLike) -> dict[str, str]:
  """Safetensors file name -> hex digest, for each file of the model directory ``path``
  (``model.safetensors``, or the shards its index names); a missing or unreadable file
  is a :class:`models.hf_state.CheckpointError` naming it."""
  from models.hf import read_safetensors
  files = read_safetensors(path)  # checks the directory, index and headers
  return {name: _file_digest(files.path / name) for name in sorted(set(files.weight_map.values()))}


def differences(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
  """The files whose digest differs, appeared or went, as ``"name (what)"``."""
  out = [f"{n} (changed)" for n in sorted(recorded.keys() & now.keys()) if recorded[n] != now[n]]
  out += [f"{n} (gone)" for n in sorted(recorded.keys() - now.keys())]
  return out + [f"{n} (new)" for n in sorted(now.keys() - recorded.keys())]


def _file_digest(file: Path) -> str:
  """The CRC-32 of ``file``'s header and its tensors' samples (safetensors layout: an
  8-byte little-endian header length, the JSON header, then the data its offsets index)."""
  with open(file, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = f.read(n)
    crc = zlib.crc32(header)
    entries = json.loads(header)
    spans = sorted(tuple(e["data_offsets"]) for key, e in entries.items()
                   if key != "__metadata__")
    for begin, end in spans:
      for start, size in _samples(begin, end):
        f.seek(8 + n + start)
        crc = zlib.crc32(f.read(size), crc)
  return f"{crc:08x}"


def _samples(begin: int, end: int) -> list[tuple[int, int]]:
  """``(start, size)`` of the samples of a tensor's bytes ``[begin, end)``: all of them
  where they fit in three samples, else its first, middle and last :data:`SAMPLE_BYTES`."""
  if end - begin <= 3 * SAMPLE_BYTES:
    return [(begin, end - begin)]
  return [(start, SAMPLE_BYTES) for start in
          (begin, (begin + end - SAMPLE_BYTES) // 2, end - SAMPLE_BYTES)]
