"""The samples of one WebDataset tar shard, read in order by a lean and strict tar parser.

A shard is a tar whose consecutive members with the same key form a sample: ``KEY.jpg`` and
``KEY.cls`` (the key is the member path up to the first dot of its file name). The 512-byte
headers are parsed here rather than by ``tarfile``: tarfile's objects cost ~50 us per member,
as much as decoding a small JPEG. The parser is strict where tarfile's stream mode is not: a shard
cut at a member boundary or missing its end-of-archive block ends with ``ShardError`` naming it,
never with a silently shorter shard. Samples passed over with ``skip`` are never read: a seekable
file seeks past them, a download reads and drops their bytes.
"""

from __future__ import annotations

import io
from typing import BinaryIO

from imagenet.errors import DataError

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")  # regular file, old-style regular file, contiguous file
# A sample's image member, by extension (a tar member's, a Parquet row's path): the first one
# present is used.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp")


class ShardError(DataError):
    """A shard that is missing, unreadable, truncated or not what ``_info.json`` says."""


def split_key(name: str) -> tuple[str, str]:
    """(key, extension) of a member name: ``a/b.c.d`` -> (``a/b``, ``c.d``), as WebDataset."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1:].lower()


class SampleReader:
    """Samples of one open shard in stored order: ``next()`` reads one, ``skip(n)`` passes over n.

    ``wanted`` are the extensions whose bytes are read; other members are passed over.
    ``index`` counts the samples read or skipped so far.
    """

    def __init__(self, f: BinaryIO, name: str, wanted: frozenset[str]) -> None:
        self.f, self.name, self.wanted = f, name, wanted
        self.seekable = f.seekable()
        self.offset = 0  # bytes of the shard consumed
        self.index = 0
        self._ahead: tuple[str, str, int] | None = None  # the next sample's first member
        self._ended = False

    def next(self) -> dict[str, bytes | str] | None:
        """The next sample as ``{"__key__": key, ext: bytes}``; None after the last one."""
        return self._sample(read=True)

    def skip(self, n: int) -> int:
        """Pass over up to ``n`` samples without reading their data; returns how many."""
        for done in range(n):
            if self._sample(read=False) is None:
                return done
        return n

    def close(self) -> None:
        """Close the underlying file (a download's connection or command too)."""
        self.f.close()

    # ---- samples from members

    def _sample(self, read: bool) -> dict[str, bytes | str] | None:
        member = self._member()
        if member is None:
            return None
        key = member[0]
        sample: dict[str, bytes | str] = {"__key__": key}
        while member is not None and member[0] == key:
            _, ext, size = member
            if read and ext in self.wanted:
                sample[ext] = self._data(size, f"member {key}.{ext}")
            else:
                self._pass(size)
            member = self._member()
        self._ahead = member
        self.index += 1
        return sample

    def _member(self) -> tuple[str, str, int] | None:
        """(key, extension, size) of the next regular file; None at the end-of-archive block."""
        if self._ahead is not None:
            member, self._ahead = self._ahead, None
            return member
        if self._ended:
            return None
        header = self._header()
        if header is None:
            self._ended = True
            return None
        name, size = header
        return (*split_key(name), size)

    # ---- tar headers

    def _header(self) -> tuple[str, int] | None:
        """(name, size) of the next regular member, extended headers applied; None at the end."""
        long_name: str | None = None
        pax: dict[str, str] = {}
        while True:
            at = self.offset
            block = self._read(BLOCK, "header", eof_ok=True)
            if not block:
                if self.seekable:  # a seek may have gone past the end
                    at = min(at, self.f.seek(0, io.SEEK_END))
                raise ShardError(f"shard {self.name} is truncated: it ends at byte {at} without "
                                 "the end-of-archive block (copy or download it again)")
            if block == _ZERO_BLOCK:
                return None
            size = self._check(block, at)
            kind = block[156:157]
            if kind in (b"x", b"L"):  # pax extended header / GNU long name: apply to the next
                data = self._data(size, "extended header")
                if kind == b"L":
                    long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
                else:
                    pax.update(_pax_records(data))
                continue
            if kind not in _REGULAR:  # directories, links, global pax headers: nothing to read
                self._pass(size)
                continue
            name = pax.get("path") or long_name or _ustar_name(block)
            return name, int(pax.get("size", size))

    def _check(self, block: bytes, at: int) -> int:
        """The member size of a header block; ShardError if the block is not a tar header."""
        try:
            stored = int(block[148:156].strip(b"\0 ") or b"-1", 8)
        except ValueError:
            stored = -1
        if stored != sum(block[:148]) + 256 + sum(block[156:]):
            raise ShardError(f"shard {self.name} is not a tar file or is corrupt (no valid tar "
                             f"header at byte {at})")
        field = block[124:136]
        if field[0] & 0x80:  # GNU base-256 for sizes of 8 GiB and more
            return int.from_bytes(field[1:], "big")
        return int(field.strip(b"\0 ") or b"0", 8)

    # ---- bytes

    def _data(self, size: int, what: str) -> bytes:
        """A member's data, then past its padding to the next 512-byte boundary."""
        data = self._read(size, what)
        self._pass(-size % BLOCK, data_done=True)
        return data

    def _pass(self, size: int, data_done: bool = False) -> None:
        """Move past ``size`` bytes (plus padding, unless ``data_done``) without keeping them."""
        total = size if data_done else size + -size % BLOCK
        if total == 0:
            return
        if self.seekable:
            self.f.seek(total, io.SEEK_CUR)  # past the end is caught by the next header read
            self.offset += total
            return
        while total:
            total -= len(self._read(min(total, 1 << 20), "skipped data"))

    def _read(self, n: int, what: str, eof_ok: bool = False) -> bytes:
        data = self.f.read(n)
        if len(data) < n and not (eof_ok and not data):
            raise ShardError(f"shard {self.name} is truncated at byte {self.offset + len(data)} "
                             f"({what}: {len(data)} of {n} bytes); copy or download it again")
        self.offset += len(data)
        return data


def _ustar_name(block: bytes) -> str:
    """The member name of a ustar header: prefix/name."""
    name = block[:100].split(b"\0", 1)[0]
    if block[257:262] == b"ustar":
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _pax_records(data: bytes) -> dict[str, str]:
    """``length key=value\\n`` records of a pax extended header."""
    records, pos = {}, 0
    while pos < len(data) and data[pos:pos + 1] != b"\0":
        length = int(data[pos:data.index(b" ", pos)])
        key, _, value = data[data.index(b" ", pos) + 1:pos + length - 1].partition(b"=")
        records[key.decode()] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records
