"""Open a shard for one sequential read: a local file, an ``http(s)://`` URL, a ``pipe:`` command
or an object-storage URL (``s3://``, ``gs://``, any fsspec URL: ``objectstore``).

A download (http or pipe) is checked to be complete - urllib's read() returns b"" on a dropped
connection without raising, and a command can fail after writing part of a shard - and gets a
bounded retry: ``ATTEMPTS`` tries in all, each continuing where the last one stopped (an http
Range request, or the bytes already delivered read again and dropped). Reads that wait longer
than ``TIMEOUT`` seconds count as a failed attempt, so a stalled server or command cannot hang
training. Local files are not retried: a missing or cut file does not heal by waiting.
A ``pipe:`` command runs in a process group of its own, killed whole when a try ends. A small
file (``_info.json``) fetched by a command gets one try: its failure is reported with the
command's stderr, not taken for a missing file. No dependency beyond the standard library,
except fsspec (and its backend) for object storage.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import os
import select
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import BinaryIO

import imagenet.data.objectstore as objectstore
from imagenet.data.shards.tarreader import ShardError
from imagenet.settings.images import is_url

ATTEMPTS = 3  # tries per download
BACKOFF = 1.0  # seconds before the second try, doubled for each further one
TIMEOUT = 60.0  # seconds without a byte before a try fails
SMALL_TIMEOUT = 20.0  # seconds without a byte before a pipe: command fetching _info.json fails
BUFFER = 1 << 20  # bytes read from a shard at once


class ShardMissing(ShardError):
    """A shard (or ``_info.json``) that does not exist."""


class _Incomplete(Exception):
    """A try that ended before the whole shard arrived (retried)."""


class CommandFailed(ShardError):
    """A ``pipe:`` command fetching a small file failed or stalled; the message has the tail of
    its stderr."""

    def __init__(self, message: str, stalled: bool) -> None:
        super().__init__(message)
        self.stalled = stalled


OBJECT_BLOCK = 16 << 20  # bytes per ranged GET from object storage (a stream reads ahead)


def open_shard(url: str) -> BinaryIO:
    """A buffered binary stream of the shard at ``url``; ShardError if it cannot be opened."""
    if url.startswith("pipe:"):
        return io.BufferedReader(Download(url, _PipeTry), BUFFER)
    if url.startswith(("http://", "https://")):
        return io.BufferedReader(Download(url, _HttpTry), BUFFER)
    if is_url(url):
        return io.BufferedReader(Download(url, _ObjectTry), BUFFER)
    path = url.removeprefix("file://")
    try:
        return open(path, "rb", buffering=BUFFER)
    except FileNotFoundError:
        raise ShardMissing(f"shard {path} is missing") from None
    except OSError as exc:
        raise ShardError(f"shard {path} cannot be read: {exc.strerror or exc}") from None


def read_small_file(url: str) -> bytes | None:
    """The whole of a small file such as ``_info.json``; None if it does not exist.

    A ``pipe:`` command gets one try of at most ``SMALL_TIMEOUT`` seconds without output: a
    command that fails cannot say whether the file is missing or its credentials are, so it is
    a CommandFailed with its stderr, at once, for the caller to judge.
    """
    if url.startswith("pipe:"):
        return _fetch_with_command(url)
    try:
        with open_shard(url) as f:
            return f.read()
    except ShardMissing:
        return None


def _fetch_with_command(url: str) -> bytes:
    """The whole output of ``pipe:`` command ``url`` (one try), or CommandFailed."""
    attempt = _PipeTry(url, 0, SMALL_TIMEOUT)
    chunks, buffer = [], bytearray(BUFFER)
    try:
        while n := attempt.readinto(buffer):
            chunks.append(bytes(buffer[:n]))
        attempt.check_complete()
    except _Incomplete as exc:  # its message names the command, its exit code, its stderr
        raise CommandFailed(str(exc), stalled=False) from None
    except OSError as exc:  # a stall (TimeoutError) or a failed read
        tail = attempt.stderr_tail()
        raise CommandFailed(f"'{attempt.command}' {exc}{f': {tail}' if tail else ''}",
                            stalled=isinstance(exc, TimeoutError)) from None
    finally:
        attempt.close()
    return b"".join(chunks)


class Download(io.RawIOBase):
    """Bytes of a remote shard from start to end, over as many tries as ``ATTEMPTS`` allows."""

    def __init__(self, url: str, kind: type[_HttpTry] | type[_PipeTry] | type[_ObjectTry]
                 ) -> None:
        super().__init__()
        self.url, self.kind = url, kind
        self.pos, self.tries = 0, 0
        self.current = self._connect()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        while True:
            try:
                n = self.current.readinto(buffer)
                if n:
                    self.pos += n
                    return n
                self.current.check_complete()
                return 0
            except (OSError, http.client.HTTPException, _Incomplete) as exc:
                self.current.close()
                self._pause(exc)
                self.current = self._connect()

    def close(self) -> None:
        if not self.closed and hasattr(self, "current"):
            self.current.close()
        super().close()

    def _connect(self) -> _HttpTry | _PipeTry | _ObjectTry:
        """A new try from byte ``pos``; transient failures are retried here too."""
        while True:
            self.tries += 1
            try:
                return self.kind(self.url, self.pos)
            except (OSError, http.client.HTTPException, _Incomplete) as exc:
                self._pause(exc)

    def _pause(self, exc: BaseException) -> None:
        """Wait before the next try, or give up with a ShardError."""
        if self.tries >= ATTEMPTS:
            raise ShardError(f"shard {self.url}: download failed {self.tries} times, at byte "
                             f"{self.pos} ({_reason(exc)})") from None
        time.sleep(BACKOFF * 2 ** (self.tries - 1))


class _HttpTry:
    """One GET of an http(s) shard from byte ``start`` on."""

    def __init__(self, url: str, start: int) -> None:
        request = urllib.request.Request(url, headers={"Range": f"bytes={start}-"} if start else {})
        try:
            self.response = urllib.request.urlopen(request, timeout=TIMEOUT)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code in (404, 410):
                raise ShardMissing(f"shard {url} is missing (HTTP {exc.code})") from None
            if exc.code < 500 and exc.code not in (408, 429):
                raise ShardError(f"shard {url}: HTTP {exc.code} {exc.reason} (not retried; a "
                                 "gated store needs credentials: use a pipe:curl command with "
                                 "its header)") from None
            raise
        if start and self.response.status != 206:  # no Range support: drop what we have
            try:
                _drop(self.response.readinto, start)
            except BaseException:
                self.close()
                raise

    def readinto(self, buffer) -> int:
        return self.response.readinto(buffer)

    def check_complete(self) -> None:
        missing = self.response.length  # bytes of Content-Length not delivered
        if missing:
            raise _Incomplete(f"connection closed {missing} bytes before the end")

    def close(self) -> None:
        self.response.close()


class _PipeTry:
    """One run of a ``pipe:`` command, its output from byte ``start`` on.

    The command runs in a process group of its own: ending a try kills the whole group, so the
    programs a shell command starts (``aws``, ``curl`` in a pipeline) end with it.
    """

    def __init__(self, url: str, start: int, timeout: float = 0.0) -> None:
        self.command = url.removeprefix("pipe:")
        self.timeout = timeout or TIMEOUT  # seconds without output before the try fails
        self.errors = tempfile.TemporaryFile()  # never a pipe: a chatty command would block
        # Unbuffered: select() must see every byte not yet read, none may wait in a buffer.
        self.proc = subprocess.Popen(self.command, shell=True, stdout=subprocess.PIPE, bufsize=0,
                                     stderr=self.errors, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        self.out = self.proc.stdout
        try:
            _drop(self.readinto, start)
        except BaseException:
            self.close()
            raise

    def readinto(self, buffer) -> int:
        ready, _, _ = select.select([self.out], [], [], self.timeout)
        if not ready:
            raise TimeoutError(f"gave no output for {self.timeout:.0f} s")
        return self.out.readinto(buffer)  # type: ignore[attr-defined]

    def check_complete(self) -> None:
        code = self.proc.wait()
        if code != 0:
            tail = self.stderr_tail()
            raise _Incomplete(f"'{self.command}' exited with code {code}"
                              + (f": {tail}" if tail else ""))

    def stderr_tail(self, lines: int = 3, chars: int = 300) -> str:
        """The last lines the command wrote to stderr, on one line."""
        self.errors.seek(0)
        said = [line.strip() for line in
                self.errors.read().decode(errors="replace").splitlines() if line.strip()]
        return " / ".join(said[-lines:])[-chars:]

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # The group outlives the shell when a child is still running: end them all (a shard
            # read only in part: the rest is not wanted).
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.out.close()
        self.errors.close()


class _ObjectTry:
    """One read of a shard in object storage (fsspec) from byte ``start`` on: ranged GETs of
    ``OBJECT_BLOCK`` bytes. The backend retries its own transient errors; what it gives up on
    is retried here from the byte reached, like a broken http download."""

    def __init__(self, url: str, start: int) -> None:
        fs, path = objectstore.filesystem(url)
        try:
            self.f = fs.open(path, "rb", block_size=OBJECT_BLOCK, cache_type="readahead")
        except FileNotFoundError:
            raise ShardMissing(f"shard {url} is missing") from None
        except PermissionError as exc:
            raise ShardError(f"shard {url}: access denied ({objectstore.first_line(exc)}); "
                             "check the credentials") from None
        self.size = self.f.size
        self.f.seek(start)

    def readinto(self, buffer) -> int:
        try:
            return self.f.readinto(buffer)
        except OSError:
            raise
        except Exception as exc:  # the backends raise their own types for network failures
            raise OSError(objectstore.first_line(exc)) from None

    def check_complete(self) -> None:
        if self.size is not None and self.f.tell() < self.size:
            raise _Incomplete(f"ended {self.size - self.f.tell()} bytes before the end")

    def close(self) -> None:
        self.f.close()


def _drop(readinto: Callable[[memoryview], int], n: int) -> None:
    """Read and discard ``n`` bytes with ``readinto``."""
    buffer = memoryview(bytearray(min(max(n, 1), BUFFER)))
    while n:
        got = readinto(buffer[:min(n, len(buffer))])
        if not got:
            raise _Incomplete(f"ended {n} bytes before the position to continue from")
        n -= got


def _reason(exc: BaseException) -> str:
    """A short description of why a try failed."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return str(exc) or type(exc).__name__
