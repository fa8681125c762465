"""A small reader for MATLAB level-5 MAT files, enough for the ILSVRC2012 devkit's meta.mat.

scipy is not a dependency of the trainer, so this replaces ``scipy.io.loadmat`` for the one file
we need. Supported: numeric, char, struct and cell arrays, zlib-compressed variables, both byte
orders. Not supported: sparse, objects, function handles, v7.3 (HDF5) files.

Values come back as plain Python objects with shapes dropped, flattened in MATLAB's column-major
order: numeric -> list of numbers, char -> str (list of row strings if it has several rows),
struct -> list of dicts (one per element), cell -> list.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

# Data types (tag type field) and array classes from the MAT-file format reference.
MI_INT8, MI_UINT8, MI_UINT16, MI_INT32, MI_UINT32 = 1, 2, 4, 5, 6
MI_MATRIX, MI_COMPRESSED, MI_UTF8, MI_UTF16, MI_UTF32 = 14, 15, 16, 17, 18
MX_CELL, MX_STRUCT, MX_CHAR = 1, 2, 4
MX_FLOAT_CLASSES = (6, 7)  # double, single; 8..15 are the integer classes
NUMERIC_FORMATS = {1: "b", 2: "B", 3: "h", 4: "H", 5: "i", 6: "I", 7: "f", 9: "d", 12: "q",
                   13: "Q"}
COMPLEX_FLAG = 0x0800


class MatFileError(ValueError):
    """The bytes are not a MAT v5 file this reader understands."""


class _Reader:
    """Walks the data elements of one file with the file's byte order."""

    def __init__(self, order: str) -> None:
        self.order = order  # "<" or ">"

    def element(self, buf: bytes, pos: int) -> tuple[int, bytes, int]:
        """(type, payload, position after the element, padding included)."""
        if pos + 8 > len(buf):
            raise MatFileError(f"truncated data element at byte {pos}")
        word, nbytes = struct.unpack_from(self.order + "II", buf, pos)
        if word >> 16:  # small data element: type and size share one word, data in the next 4
            return word & 0xFFFF, buf[pos + 4:pos + 4 + (word >> 16)], pos + 8
        end = pos + 8 + nbytes
        if end > len(buf):
            raise MatFileError(f"data element at byte {pos} runs past the end of the file")
        # Compressed elements are not padded; everything else is aligned to 8 bytes.
        return word, buf[pos + 8:end], end if word == MI_COMPRESSED else end + (-nbytes % 8)

    def numbers(self, mtype: int, data: bytes) -> list:
        """The values of a numeric data element."""
        fmt = NUMERIC_FORMATS.get(mtype)
        if fmt is None:
            raise MatFileError(f"unexpected numeric data type {mtype}")
        count = len(data) // struct.calcsize(fmt)
        return list(struct.unpack_from(f"{self.order}{count}{fmt}", data))

    def text(self, mtype: int, data: bytes) -> str:
        """Decode the characters of a char array element."""
        endian = "le" if self.order == "<" else "be"
        codecs = {MI_UTF8: "utf-8", MI_UINT16: f"utf-16-{endian}", MI_UTF16: f"utf-16-{endian}",
                  MI_UTF32: f"utf-32-{endian}", MI_UINT8: "latin-1", MI_INT8: "latin-1"}
        if mtype not in codecs:
            raise MatFileError(f"unexpected char data type {mtype}")
        return data.decode(codecs[mtype])

    def matrix(self, payload: bytes) -> tuple[str, Any]:
        """(name, value) of one miMATRIX payload."""
        if not payload:  # an empty array may be written as a bare tag
            return "", []
        _, flags, pos = self.element(payload, 0)
        word = struct.unpack_from(self.order + "I", flags)[0]
        cls, is_complex = word & 0xFF, bool(word & COMPLEX_FLAG)
        _, dims_raw, pos = self.element(payload, pos)
        dims = self.numbers(MI_INT32, dims_raw)
        _, name, pos = self.element(payload, pos)
        count = 1
        for d in dims:
            count *= d
        if cls == MX_STRUCT:
            return name.decode("ascii"), self._struct(payload, pos, count)
        if cls == MX_CELL:
            items = []
            for _ in range(count):
                _, sub, pos = self._sub_matrix(payload, pos)
                items.append(sub)
            return name.decode("ascii"), items
        mtype, data, pos = self.element(payload, pos)
        if cls == MX_CHAR:
            chars = self.text(mtype, data)
            rows = dims[0] if dims else 1
            value: Any = chars if rows <= 1 else [chars[r::rows] for r in range(rows)]
        elif 6 <= cls <= 15:
            value = self.numbers(mtype, data)
            if cls in MX_FLOAT_CLASSES:
                value = [float(v) for v in value]
            if is_complex:
                itype, idata, pos = self.element(payload, pos)
                value = [complex(r, i) for r, i in zip(value, self.numbers(itype, idata))]
        else:
            raise MatFileError(f"unsupported MATLAB array class {cls} (sparse, object, ...)")
        return name.decode("ascii"), value

    def _sub_matrix(self, buf: bytes, pos: int) -> tuple[str, Any, int]:
        """A nested miMATRIX element (struct field or cell) at ``pos``."""
        mtype, payload, end = self.element(buf, pos)
        if mtype != MI_MATRIX:
            raise MatFileError(f"expected a nested array at byte {pos}, found data type {mtype}")
        name, value = self.matrix(payload)
        return name, value, end

    def _struct(self, payload: bytes, pos: int, count: int) -> list[dict[str, Any]]:
        """The elements of a struct array, fields in file order."""
        _, width_raw, pos = self.element(payload, pos)
        width = self.numbers(MI_INT32, width_raw)[0]
        _, names_raw, pos = self.element(payload, pos)
        fields = [names_raw[i:i + width].split(b"\0", 1)[0].decode("ascii")
                  for i in range(0, len(names_raw), width)] if width else []
        items = []
        for _ in range(count):
            item = {}
            for field in fields:
                _, item[field], pos = self._sub_matrix(payload, pos)
            items.append(item)
        return items


def load_mat(data: bytes) -> dict[str, Any]:
    """The variables of a MAT v5 file, by name."""
    if len(data) < 128 or not data.startswith(b"MATLAB"):
        raise MatFileError("not a MATLAB 5.0 MAT-file (the 128-byte text header is missing)")
    if data.startswith(b"MATLAB 7.3"):
        raise MatFileError("MATLAB 7.3 (HDF5) MAT-files are not supported; save with -v7")
    orders = {b"IM": "<", b"MI": ">"}
    if data[126:128] not in orders:
        raise MatFileError("not a MAT v5 file: bad endian indicator in the header")
    reader = _Reader(orders[data[126:128]])
    try:
        return _variables(reader, data)
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise MatFileError(f"malformed MAT-file: {exc}") from None


def _variables(reader: _Reader, data: bytes) -> dict[str, Any]:
    """Every top-level variable after the header, decompressing where needed."""
    variables: dict[str, Any] = {}
    pos = 128
    while pos < len(data):
        mtype, payload, pos = reader.element(data, pos)
        if mtype == MI_COMPRESSED:
            try:
                payload = zlib.decompress(payload)
            except zlib.error as exc:
                raise MatFileError(f"corrupt compressed variable: {exc}") from None
            mtype, payload, _ = reader.element(payload, 0)
        if mtype != MI_MATRIX:
            raise MatFileError(f"unexpected top-level data type {mtype}")
        name, value = reader.matrix(payload)
        variables[name] = value
    return variables
