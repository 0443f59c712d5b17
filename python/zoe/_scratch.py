"""Where a state_dict()'s engine checkpoint passes through a file (the engine writes and reads files, a
state_dict is bytes in memory): a folder of this call's own under one zoe-named folder per user in the
system's temporary folder. A process killed during such a save (kill -9, the OOM killer) cannot remove its
folder — hundreds of megabytes — so every later one removes the folders of writers of this host that are no
longer running before it makes its own (a new optimizer does too)."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import tempfile


def _base() -> str:
    return os.path.join(tempfile.gettempdir(), f"zoe-scratch-{os.getuid()}")


def _host() -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:32] or "host"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _own_base() -> str | None:
    """The per-user folder, made private; None where a folder of that name is not this user's own (someone
    else made it, or it is a link): then the system's temporary folder is used as it is."""
    base = _base()
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return None
    return base


def remove_abandoned() -> list[str]:
    """Removes the folders of this host's writers that are gone; returns what it removed. Other hosts'
    (a temporary folder shared over the network) are never judged."""
    base = _own_base()
    removed = []
    if base is None:
        return removed
    prefix = _host() + "."
    for name in os.listdir(base):
        parts = name[len(prefix):].split(".", 1) if name.startswith(prefix) else []
        if len(parts) == 2 and parts[0].isdigit() and not _running(int(parts[0])):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            removed.append(name)
    return removed


@contextlib.contextmanager
def scratch_file(name: str = "optimizer.zoe"):
    """A path in a new folder of this call's own (``<host>.<pid>.<random>``, mode 0700), removed with it on
    exit. The path goes through the folder's open descriptor (``/proc/self/fd/N/<name>``): a folder above it
    renamed or replaced by a link meanwhile (a temporary folder other users can write) redirects nothing."""
    remove_abandoned()
    base = _own_base()
    folder = tempfile.mkdtemp(prefix=f"{_host()}.{os.getpid()}.", dir=base) if base else \
        tempfile.mkdtemp(prefix="zoe-state-")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise OSError(f"zoe's scratch folder {folder} was replaced by someone else's (owner uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):04o}): set TMPDIR to a folder no other user can write")
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        for entry in os.listdir(fd):
            with contextlib.suppress(OSError):
                os.unlink(entry, dir_fd=fd)
        os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(folder)
