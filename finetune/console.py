"""Console streams that cannot stop a run: once stdout or stderr is gone (a `| tee` killed by the
Ctrl-C that also stops the run, a closed terminal, a dropped ssh session), writes to it are dropped
instead of raising BrokenPipeError/EIO into the code that printed, which may be writing a
checkpoint (docs/faults.md "Signals"). The run's record (run.json) still says everything.
"""

from __future__ import annotations

import errno
import io
import sys

# write errors that mean "the reader went away", not "the program is wrong"
GONE = (errno.EPIPE, errno.EIO, errno.ECONNRESET, errno.EBADF, errno.ENXIO)


class Guarded(io.TextIOBase):
    """A text stream wrapped so that a write to a vanished reader is dropped (and so are all
    later writes). Everything else is delegated to the wrapped stream."""

    def __init__(self, stream):
        self._stream = stream
        self.gone = False

    def _guard(self, fn, *args):
        if self.gone:
            return None
        try:
            return fn(*args)
        except OSError as e:
            if e.errno not in GONE:
                raise
            self.gone = True
            _to_devnull(self._stream)
            return None

    def write(self, text: str) -> int:
        self._guard(self._stream.write, text)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return not self.gone and self._stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self):
        return self._stream.encoding

    @property
    def errors(self):
        return self._stream.errors

    @property
    def buffer(self):
        return self._stream.buffer

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _to_devnull(stream) -> None:
    """Point the vanished stream's file descriptor at /dev/null: what is still buffered, and writes
    through other references to it (C++ code, a library's own handle), then go nowhere quietly,
    and the interpreter's flush at exit cannot fail (Python exits 120 when it does)."""
    import os

    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
        stream.flush()
    except (OSError, ValueError, AttributeError):
        pass


def guard_streams() -> None:
    """Wrap sys.stdout and sys.stderr (once). Call first thing in a process that must outlive its
    console: the `finetune train` wrapper and every rank."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, Guarded):
            setattr(sys, name, Guarded(stream))


def write_line(text: str, stream=None) -> None:
    """One line to stderr from a signal handler: unbuffered (os.write), never raising."""
    import os

    try:
        os.write((stream or sys.stderr).fileno(), (text.rstrip("\n") + "\n").encode())
    except (OSError, ValueError, AttributeError):
        pass
