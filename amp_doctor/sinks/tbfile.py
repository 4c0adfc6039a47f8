"""A TensorBoard ``SummaryWriter`` whose event file is written without a thread.

torch's ``SummaryWriter`` hands every event to tensorboard's ``EventFileWriter``,
which starts a background writer thread. Under ``amp-doctor diagnose`` that thread
would run from the script's ``import torch`` on: the script would see it
(``threading.active_count()``, a loop waiting for its own workers to finish would
wait forever) and its own threads would be numbered one further (``Thread-2``).
Here the records are framed as tensorboard frames them (length, CRC, data, CRC) into
a buffer on the calling thread, and written with one ``os.write`` when the buffer is
large or :data:`FLUSH_SECS`-old, and at ``flush``/``close``: the serialisation and the
CRCs cost what they cost before (they ran on the caller or under the same GIL), and
no thread exists.

A forked child (a DataLoader worker) inherits the buffer: it never writes, so the
parent's events are not written twice.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from tensorboard.compat.proto import event_pb2
from tensorboard.summary.writer.event_file_writer import _global_uid
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.writer import FileWriter

__all__ = ["ThreadlessSummaryWriter", "WRITE_BYTES"]

# Buffered bytes that trigger a write (a recorded step of a 16-layer model is ~30 KB).
WRITE_BYTES = 1 << 20


class _EventFile:
    """An event file: tensorboard's name and framing, buffered writes, no thread. A write
    that fails (a full disk, the folder deleted) is kept in :attr:`error`; the events
    after it are dropped."""

    def __init__(self, logdir: str, flush_secs: float, filename_suffix: str = "") -> None:
        self._logdir = logdir
        os.makedirs(logdir, exist_ok=True)
        name = "events.out.tfevents.%010d.%s.%s.%s" % (  # noqa: UP031 - tensorboard's own
            time.time(), socket.gethostname(), os.getpid(), _global_uid.get())
        self.path = os.path.join(logdir, name) + filename_suffix
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                       0o644)
        self._pid = os.getpid()
        self._buf = bytearray()
        self._flush_secs = flush_secs
        self._last_write = time.monotonic()
        self._records = RecordWriter(self)  # frames each record into self.write
        self.error: str | None = None
        self.add_event(event_pb2.Event(
            wall_time=time.time(), file_version="brain.Event:2",
            source_metadata=event_pb2.SourceMetadata(
                writer="tensorboard.summary.writer.event_file_writer")))
        self.flush()

    def get_logdir(self) -> str:
        return self._logdir

    def add_event(self, event: Any) -> None:
        if not isinstance(event, event_pb2.Event):
            raise TypeError(f"Expected an event_pb2.Event proto, but got {type(event)}")
        self._records.write(event.SerializeToString())
        if (len(self._buf) >= WRITE_BYTES
                or time.monotonic() - self._last_write >= self._flush_secs):
            self.flush()

    def write(self, record: bytes) -> None:  # RecordWriter's file
        self._buf += record

    def flush(self) -> None:
        if self._fd is None or os.getpid() != self._pid:
            self._buf.clear()  # closed, failed, or a forked child: the parent writes
            return
        data, self._buf = bytes(self._buf), bytearray()
        self._last_write = time.monotonic()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as e:
            self.error = self.error or f"{type(e).__name__}: {e}"
            self._close_fd()

    def close(self) -> None:
        self.flush()
        self._close_fd()

    def reopen(self) -> None:
        """torch's ``FileWriter.reopen``: a closed file stays closed (one file per run)."""

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None and os.getpid() == self._pid:
            try:
                os.close(fd)
            except OSError as e:
                self.error = self.error or f"{type(e).__name__}: {e}"


class _FileWriter(FileWriter):
    """torch's ``FileWriter`` on an :class:`_EventFile` (its own ``__init__`` would make
    tensorboard's threaded writer)."""

    def __init__(self, log_dir: str, flush_secs: float, filename_suffix: str = "") -> None:
        self.event_writer = _EventFile(str(log_dir), flush_secs, filename_suffix)


class ThreadlessSummaryWriter(SummaryWriter):
    """``torch.utils.tensorboard.SummaryWriter`` (every ``add_*`` as documented) whose
    event file is written on the calling thread: see the module docstring."""

    def _get_file_writer(self) -> FileWriter:
        fw: FileWriter | None = self.file_writer
        if self.all_writers is None or fw is None:
            fw = _FileWriter(self.log_dir, self.flush_secs, self.filename_suffix)
            self._event_file = fw.event_writer  # kept past close(), for its error
            # torch annotates both as None (what its __init__ sets them to first).
            self.file_writer = fw  # type: ignore[assignment]
            self.all_writers = {fw.get_logdir(): fw}  # type: ignore[assignment]
        return fw

    @property
    def error(self) -> str | None:
        """Why the event file could not be written, if it could not."""
        f: _EventFile | None = getattr(self, "_event_file", None)
        return f.error if f is not None else None
