"""A cheap fingerprint of a model's files, to tell whether saved KV came from the same model.

Per file (a GGUF file, or the weights, configs and tokenizer files of a directory): its
name, size, modification time and a sha256 of its first and last MiB. Hashing every byte
would take seconds to minutes per start for large weights; the header of a GGUF file and
of a safetensors file holds every tensor's name, shape and offset, and a file rewritten in
place gets a new modification time. A copied model (a new modification time) is a new
model: its saved blocks are not found (misses), never mistaken.

Standard library only.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

_EDGE_BYTES = 1 << 20
_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".json", ".model", ".txt")


def file_fingerprint(path: str) -> dict[str, Any]:
    """name, size, mtime_ns and the sha256 of the first and last MiB of one file."""
    info = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        digest.update(file.read(_EDGE_BYTES))
        if info.st_size > 2 * _EDGE_BYTES:
            file.seek(info.st_size - _EDGE_BYTES)
        digest.update(file.read(_EDGE_BYTES))
    return {
        "name": os.path.basename(path),
        "size": info.st_size,
        "mtime_ns": info.st_mtime_ns,
        "sha256_edges": digest.hexdigest(),
    }


def model_identity(model_path: str | None) -> list[dict[str, Any]]:
    """The fingerprints of a model file, or of a model directory's files (sorted by name).

    Raises:
        OSError: the path cannot be read.
    """
    if model_path is None:
        return []
    if os.path.isfile(model_path):
        return [file_fingerprint(model_path)]
    names = sorted(n for n in os.listdir(model_path) if n.endswith(_SUFFIXES))
    return [file_fingerprint(os.path.join(model_path, n)) for n in names]
