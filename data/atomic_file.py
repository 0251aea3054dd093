"""Write a file so that readers see either the old file or the complete new one, never a mix."""

import contextlib
import os
import secrets
from pathlib import Path


@contextlib.contextmanager
def atomic_write(path):
    """Yield a binary file object; on success it replaces `path`, on any error it is deleted.

    The temporary file sits in the destination folder so the final os.replace is a rename
    within one file system, which is atomic.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666 honours the umask (tempfile.mkstemp would force 0600 on the result).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
