"""Reading a published weights file (`.npz` or `.safetensors`, any filesystem `tf.io.gfile` reads)
into NumPy arrays.

`.safetensors` is read by the small reader here (8-byte little-endian header length, a JSON
header, raw little-endian buffers) rather than the `safetensors` package: its NumPy API has no
bfloat16, in which many checkpoints are published, it reads local files only where this reads
`gs://` too through `tf.io.gfile`, and the format is a page long.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zipfile

import numpy as np
import tensorflow as tf

from framework.core.errors import FrameworkError

SUFFIXES = (".npz", ".safetensors")
# safetensors dtypes, as NumPy little-endian dtypes; BF16 is widened to float32 by hand.
SAFETENSORS_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}


class WeightsError(FrameworkError, ValueError):
    """The file cannot initialise this model: what is wrong, naming the tensors, in one line."""


def is_weights_file(path: str) -> bool:
    """Whether `path` names a published weights file (by its suffix), not a TF checkpoint."""
    return path.lower().endswith(SUFFIXES)


def read_safetensors(data: bytes, name: str = "safetensors data") -> dict[str, np.ndarray]:
    """The tensors of a `.safetensors` file's bytes; floating ones (F16, BF16, F64) as float32."""
    if len(data) < 8:
        raise WeightsError(f"{name} is not a safetensors file: {len(data)} bytes")
    (header_size,) = struct.unpack("<Q", data[:8])
    if 8 + header_size > len(data):
        raise WeightsError(
            f"{name} is not a safetensors file: its header would take {header_size} bytes "
            f"of {len(data)}"
        )
    try:
        header = json.loads(data[8 : 8 + header_size])
    except ValueError as error:
        raise WeightsError(f"{name} is not a safetensors file: bad header ({error})") from None
    start = 8 + header_size
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{name}: bad header entry for {key!r}: {info!r}") from None
        if dtype == "BF16":
            numpy_dtype = np.dtype("<u2")
        elif dtype in SAFETENSORS_DTYPES:
            numpy_dtype = np.dtype(SAFETENSORS_DTYPES[dtype])
        else:
            raise WeightsError(f"{name}: tensor {key!r} is of dtype {dtype}, which is not read")
        count = math.prod(shape)
        if end - begin != count * numpy_dtype.itemsize or start + end > len(data):
            raise WeightsError(
                f"{name}: tensor {key!r} ({dtype} {list(shape)}) has {end - begin} bytes at "
                f"{begin}: the file is truncated or corrupt"
            )
        value = np.frombuffer(data, numpy_dtype, count, start + begin).reshape(shape)
        if dtype == "BF16":  # bfloat16 is the top half of a float32
            value = (value.astype(np.uint32) << 16).view(np.float32)
        tensors[key] = value.astype(np.float32) if value.dtype.kind == "f" else value
    return tensors


def read_arrays(path: str) -> dict[str, np.ndarray]:
    """The tensors of a `.npz` or `.safetensors` file (any filesystem `tf.io.gfile` reads)."""
    if not tf.io.gfile.exists(path):
        raise WeightsError(f"no weights file at {path}")
    with tf.io.gfile.GFile(path, "rb") as f:
        data = f.read()
    if path.lower().endswith(".safetensors"):
        return read_safetensors(data, path)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile) as error:
        raise WeightsError(f"{path} is not a readable .npz file ({error})") from None
