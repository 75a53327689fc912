"""One writer per folder: an advisory ``fcntl.flock`` lock held for a whole run.

``toolkit-train`` locks ``--save-dir`` (the file ``SAVE_DIR/.toolkit.lock``, taken by the
process that launches the ranks, or rank 0 under torchrun, so a multi-rank run is one
writer) and ``toolkit-preprocess`` locks ``--destdir`` (the file ``.NAME.lock`` beside it,
since the data-bin folder itself is renamed into place). A second run on the same folder
stops before touching anything, with one line naming the holder's PID and host, which the
holder writes into the lock file.

A lock file appears only whole: the taker writes itself into a new file under another name,
locks it, and links it to the path (or renames it over a killed run's file), so a second
run never finds the file present but unlocked, nor locked with no holder in it yet.

The kernel releases a ``flock`` when its holder exits, even on ``kill -9``, so a lock never
outlives its run; the file itself is removed on a clean release (a killed run leaves it,
unlocked, and the next run replaces it). Removing a lock file another process may be
waiting on is safe because a taker checks, after locking, that the file it locked is still
the one at the path.

A lock file is never followed: one that is a symbolic link (or anything but a plain file) is
refused, because taking it would truncate and overwrite whatever the link points at.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import stat
import sys
import time
from typing import Iterator, List, Optional, Tuple

from toolkit.core.errors import UserError
from toolkit.core.preflight import describe_os_error

SAVE_DIR_LOCK = ".toolkit.lock"


def beside(folder: str) -> str:
    """The lock file of a folder that is replaced as a whole: ``PARENT/.NAME.lock``."""
    folder = os.path.abspath(folder)
    return os.path.join(os.path.dirname(folder), "." + os.path.basename(folder) + ".lock")


def _holder(fd: int) -> Tuple[str, bool]:
    """Who holds the lock, from what the holder wrote into the file; when that process has exited (a killed
    launcher), the processes that still have the file open: its orphaned ranks, which hold the lock now.

    The second value says whether that answer is settled. A file without a complete holder, or one naming a
    process of this host that has exited, is also what a taker replacing a killed run's file holds for an
    instant, so the caller looks again before it names anyone."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another process (it has not written its PID yet)", False
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    holder = f"{info.get('prog', 'another run')} (pid {info['pid']} on host {info.get('host', '?')}, since {since})"
    if info.get("host") != socket.gethostname() or _alive(info["pid"]):
        return holder, True
    others = [pid for pid in _processes_with_open(fd) if pid != os.getpid()]
    if not others:
        return holder, False
    return (
        f"process {', '.join(map(str, others))} (started by {holder}, which has exited: an orphaned rank; "
        f"stop it with kill {' '.join(map(str, others))})"
    ), False


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, TypeError):
        return True  # another user's process, or a PID we cannot read: assume it runs
    return True


def _processes_with_open(fd: int) -> List[int]:
    """The PIDs on this host with the file of ``fd`` open (Linux ``/proc``; our own user's processes)."""
    try:
        target = os.fstat(fd)
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    except OSError:
        return []
    found = []
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                st = os.stat(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                found.append(pid)
                break
    return found


def _not_a_plain_file(path: str, flag: str) -> UserError:
    return UserError(
        f"{flag}: the lock file {path} is a symbolic link or not a plain file; a lock is never "
        f"followed (taking it would overwrite what it points at): remove it, or choose another "
        f"{flag.split()[0]}"
    )


UNSETTLED_HOLDER_WAIT_S = 1.0  # how long a file without a complete, live holder is looked at again


def _open_lock_file(path: str, flag: str) -> Optional[int]:
    """The lock file at ``path`` opened without following a symbolic link; None when it vanished meanwhile."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise _not_a_plain_file(path, flag) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device put there: never write into it
        os.close(fd)
        raise _not_a_plain_file(path, flag)
    return fd


def _prepared(path: str, prog: str) -> Tuple[str, int]:
    """A new file beside ``path``, locked, with this process written in as its holder: the lock file to be.

    It reaches ``path`` only whole (linked or renamed into place), so nobody ever reads a lock file whose
    holder is missing or half-written, and nobody takes one that exists but is not locked yet."""
    name = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.taking"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "prog": prog, "since": time.time()}
        os.write(fd, json.dumps({**info, "argv": sys.argv[1:]}).encode("utf-8"))
    except BaseException:
        os.close(fd)
        os.unlink(name)
        raise
    return name, fd


def _take(path: str, flag: str, mine: str, deadline: float) -> bool:
    """Whether the prepared file ``mine`` is now the lock file at ``path``; False means look again.

    A file already at ``path`` that nobody locks is a killed run's: ``mine`` is renamed over it. One that is
    locked names its holder, or is looked at again until ``deadline`` while that answer is not settled."""
    with contextlib.suppress(FileExistsError):
        os.link(mine, path)  # fails when any name (a file, a symbolic link) is at the path
        return True
    fd = _open_lock_file(path, flag)
    if fd is None:  # its holder released it between our link and our open
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise
        holder, settled = _holder(fd)
        replaced = not _still_at(fd, path)
        os.close(fd)
        if replaced or (not settled and time.monotonic() < deadline):
            time.sleep(0.01)
            return False
        raise UserError(
            f"{flag}: in use by {holder}; one run writes a folder at a time: wait for it to "
            f"finish, or choose another {flag.split()[0]}"
        ) from None
    try:
        if not _still_at(fd, path):  # its holder removed it between our open and our lock
            return False
        os.rename(mine, path)  # while we lock the old file, nobody else can take it and replace it too
        return True
    finally:
        os.close(fd)


def _still_at(fd: int, path: str) -> bool:
    """Whether ``path`` (not followed) is still the file open as ``fd``."""
    try:
        mine, there = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _acquire(path: str, flag: str, prog: str) -> int:
    mine, fd = _prepared(path, prog)
    deadline = time.monotonic() + UNSETTLED_HOLDER_WAIT_S
    try:
        while not _take(path, flag, mine, deadline):
            pass
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mine)  # linked: the lock file keeps the data; renamed: already gone
    return fd


@contextlib.contextmanager
def hold(path: str, flag: str, prog: str) -> Iterator[None]:
    """Hold the lock file ``path`` for the block; ``flag`` (e.g. ``--save-dir ckpt``) names the folder."""
    try:
        fd = _acquire(path, flag, prog)
    except OSError as e:
        raise UserError(
            f"{flag}: cannot create the lock file {path} ({e.strerror or e}); check that the "
            f"folder is writable, or choose another {flag.split()[0]}"
        ) from None
    try:
        yield
    finally:
        if _still_at(fd, path):  # never remove what someone put at the path meanwhile
            with contextlib.suppress(OSError):
                os.unlink(path)
        os.close(fd)


@contextlib.contextmanager
def hold_folder(folder: str, flag: str, prog: str) -> Iterator[None]:
    """Lock ``folder`` (created if missing, and removed again if the run leaves it empty) for the block."""
    created = not os.path.isdir(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:  # a file, a symlink loop, a read-only filesystem: the same words as the preflight checks
        raise UserError(f"{flag}: {describe_os_error(folder, e)}; choose another {flag.split()[0]}") from None
    try:
        with hold(os.path.join(folder, SAVE_DIR_LOCK), flag, prog):
            yield
    finally:
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only if empty: nothing was written
