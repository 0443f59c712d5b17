"""Files the Python package writes itself (safetensors exports), kept out of reach of other users who can
write the folder, as the C++ library's Folder and AtomicFile do (docs/architecture.md, "Files"): the file is
made in a private folder of this call's own (mode 0700, an unguessable name, reached only through its open
descriptor), then renamed into place within the destination folder opened once, and the name checked to
hold that very file. Nobody can redirect the writes or make zoe overwrite a file of their choosing; if they
swap the name before the rename, the write fails instead."""
from __future__ import annotations

import contextlib
import os
import secrets
import stat


@contextlib.contextmanager
def atomic_path(path: str):
    """Yields a path to write the file at (``/proc/self/fd/N/<name>``, inside the private folder); on a clean
    exit what was written there is fsync'ed and renamed over ``path``. On an exception nothing is left and
    ``path`` stays as it was. The file keeps the mode its writer gave it (0666 less the umask for
    safetensors and ``torch.save``)."""
    folder, name = os.path.split(os.path.abspath(path))
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    private = f".{name}.zoe-{os.getpid()}-{secrets.token_hex(8)}"
    own_fd = -1
    try:
        os.mkdir(private, 0o700, dir_fd=dir_fd)
        own_fd = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        st = os.fstat(own_fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise OSError(f"{os.path.join(folder, private)} was replaced by another user's folder while zoe made it; "
                          "write into a folder no other user can write")
        yield f"/proc/self/fd/{own_fd}/{name}"
        file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=own_fd)
        try:
            os.fsync(file_fd)
            os.replace(name, name, src_dir_fd=own_fd, dst_dir_fd=dir_fd)
            mine, named = os.fstat(file_fd), os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.close(file_fd)
        if (mine.st_ino, mine.st_dev) != (named.st_ino, named.st_dev):
            raise OSError(f"another process replaced {path} as zoe wrote it; write into a folder no other user can "
                          "write")
        os.fsync(dir_fd)
    finally:
        if own_fd >= 0:
            for entry in os.listdir(own_fd):
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=own_fd)
            os.close(own_fd)
        with contextlib.suppress(OSError):
            os.rmdir(private, dir_fd=dir_fd)
        os.close(dir_fd)
