"""The JSON report: the Session itself, strict JSON, loadable by ``Session.load``.

Reports are written atomically (a temporary file in the same folder, then
``os.replace``), so a run killed or interrupted while writing leaves either the
previous file or the complete new one, never half a report.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from amp_doctor.records import Session

__all__ = ["write_json", "write_text_atomic"]


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one.

    Through a symlink, to the file it names (replacing the link would leave the target
    as it was); and straight into what is not a regular file (``--json /dev/stdout``, a
    FIFO), which a rename would replace (``/dev/stdout`` itself, for root).
    """
    if os.path.exists(path) and not os.path.isfile(path):  # both follow symlinks
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return Path(path)
    p = Path(os.path.realpath(path))
    p.parent.mkdir(parents=True, exist_ok=True)
    # Same folder as the target: os.replace is atomic only within one file system.
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        # mkstemp creates the file 0600; a report is an ordinary file (umask applies).
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return Path(path)


def _umask() -> int:
    # Reading it from /proc avoids os.umask's set-and-restore, which races with other
    # threads (the user's data loaders) creating files at that moment.
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(session: Session, path: str | Path) -> Path:
    return write_text_atomic(path, session.to_json())
