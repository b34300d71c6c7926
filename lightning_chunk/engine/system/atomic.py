"""Directory operations that a kill at any instant cannot leave half done.

[Note: replacing a checkpoint directory]
A sharded checkpoint is a directory, and POSIX has no call that renames a directory over a non-empty
one. The obvious two renames (old aside, new in) leave an instant with no checkpoint at the name: a
job killed there finds nothing for ``ckpt_path="last"`` although a complete checkpoint is on disk.

- Linux has ``renameat2(RENAME_EXCHANGE)`` (3.15; ext4, xfs, btrfs, tmpfs, f2fs, overlayfs), which swaps
  two names in one step. The finished ``.NAME.partial`` and ``NAME`` are exchanged, so ``NAME`` holds
  the old checkpoint until the instant it holds the new one; the old one then sits under the hidden
  partial name and is deleted (a kill during that deletion leaves a hidden directory that the next
  save of ``NAME`` clears).
- Where the exchange is refused (another OS, or a filesystem such as NFS that does not implement it),
  the old checkpoint is renamed to ``STEM.prev.SUFFIX`` (``last.ckpt`` -> ``last.prev.ckpt``) before
  the new one goes in, and deleted after. That name is still a checkpoint to Lightning (its
  ``last*.ckpt`` pattern matches it), so a kill between the renames leaves it found by
  ``ckpt_path="last"``; after the second rename the new directory is the newer of the two. The next
  save of ``NAME`` removes a ``.prev`` left behind.

Deleting a checkpoint (``remove_dir``) first renames it to a hidden ``.NAME.deleting`` name: a kill
during the deletion never leaves a half-deleted directory under a checkpoint's name. The next save in
the same directory clears what such a kill left (``clear_leftovers``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import shutil
from pathlib import Path

from .libc import libc as load_libc

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_SYSCALL_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}


def exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` (both must exist) in one step; False where the OS or filesystem cannot."""
    libc = load_libc() if platform.system() == "Linux" else None
    if libc is None:
        return False
    args = (_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        rc = fn(
            ctypes.c_int(args[0]),
            ctypes.c_char_p(args[1]),
            ctypes.c_int(args[2]),
            ctypes.c_char_p(args[3]),
            ctypes.c_uint(args[4]),
        )
    else:  # glibc before 2.28 has the system call but no wrapper
        number = _SYSCALL_RENAMEAT2.get(platform.machine())
        if number is None:
            return False
        rc = libc.syscall(
            ctypes.c_long(number),
            ctypes.c_int(args[0]),
            ctypes.c_char_p(args[1]),
            ctypes.c_int(args[2]),
            ctypes.c_char_p(args[3]),
            ctypes.c_uint(args[4]),
        )
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False  # not supported here: the caller falls back to two renames
    raise OSError(err, f"renameat2({str(a)!r}, {str(b)!r}, RENAME_EXCHANGE) failed: {os.strerror(err)}")


def backup_path(path: Path) -> Path:
    """Where the fallback keeps the old checkpoint while the new one goes in (``last.ckpt`` -> ``last.prev.ckpt``)."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def deleting_path(path: Path) -> Path:
    return path.parent / f".{path.name}.deleting"


def _remove_any(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def replace_dir(new: Path, path: Path) -> None:
    """Put the finished directory ``new`` at ``path`` (which may hold a directory, a file or a link); see
    [Note: replacing a checkpoint directory]."""
    if not os.path.lexists(path):
        os.replace(new, path)
    elif exchange(new, path):
        _remove_any(new)  # the old checkpoint, now under the hidden name
    else:
        prev = backup_path(path)
        _remove_any(prev)
        os.replace(path, prev)
        os.replace(new, path)
        _remove_any(prev)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make the renames in ``path`` survive a crash of the machine, not only of the process."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the renames are still atomic
    finally:
        os.close(fd)


def remove_dir(path: Path) -> None:
    """Delete a checkpoint directory so that a kill midway leaves no half-deleted one under its name."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    doomed = deleting_path(path)
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def clear_leftovers(path: Path) -> None:
    """Remove what a killed save of ``path`` or a killed deletion in its directory left behind."""
    prev = backup_path(path)
    if prev.is_dir() and path.is_dir():  # both complete: the new one went in, the old one was not yet deleted
        shutil.rmtree(prev, ignore_errors=True)
    for p in path.parent.glob(".*.deleting"):
        shutil.rmtree(p, ignore_errors=True)
