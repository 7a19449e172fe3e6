"""One `tiekit.fit` run per ``checkpoint_dir`` at a time.

Two runs given one folder at once wrote the same ``step-<n>`` names over each other's (the
last writer wins, silently), each run's ``checkpoint_keep`` deleted files the other had
rewritten, and a later ``resume="last"`` took the other run's weights. The run's writer holds an
exclusive ``flock`` on ``<checkpoint_dir>/.tiekit-fit.lock`` from its start to its end, and
removes the file when it ends; the kernel lets go of the lock when the process ends however it
ends, so a killed run leaves the file (naming it) but never a locked folder.

Where the filesystem has no locks (``flock`` failing with anything but "held"), the run goes on
unlocked: the lock is a guard, not something a run needs.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tiekit.errors import TiekitError

LOCK_NAME = ".tiekit-fit.lock"

#: How long a run waits for this process's ended run to let go of the folder (its last
#: background save still writing, which holds the lock until it is written).
ENDED_RUN_WAIT_SECONDS = 300.0

# Folders whose lock an ended run of this process holds until its last background save is
# written: a run started next in this process (a resume right after a failed fit) waits for it
# instead of calling it another run.
_letting_go: dict[str, threading.Event] = {}
_letting_go_lock = threading.Lock()


@dataclass
class FolderLock:
    """A held lock (``file`` None: none could be taken on this filesystem)."""

    folder: Path
    file: IO[str] | None
    made: Path | None = None  # the outermost folder the lock made: removed again if the run wrote nothing

    def release_once_finished(self, handle: Any) -> None:
        """Local: `release` once ``handle`` (the run's last background save) is written or failed;
        a run this process starts meanwhile waits for it (`lock_checkpoint_dir`)."""
        key = os.path.realpath(self.folder)
        gone = threading.Event()
        with _letting_go_lock:
            _letting_go[key] = gone

        def let_go(_: Any) -> None:
            self.release()
            with _letting_go_lock:
                if _letting_go.get(key) is gone:
                    del _letting_go[key]
            gone.set()

        handle._when_finished(let_go)

    def release(self) -> None:
        """Local: remove the lock file (and the folder, if it made it and it is empty) and let the
        next run have the folder (idempotent)."""
        if self.file is not None:
            if _same_file(self.file, self.folder / LOCK_NAME):
                # Removed while held: a run that opened it meanwhile finds, once it holds the lock,
                # that the name is no longer its file, and takes the new one (`lock_checkpoint_dir`).
                (self.folder / LOCK_NAME).unlink(missing_ok=True)
            self.file.close()  # closing the descriptor drops the flock
            self.file = None
            if self.made is not None:
                folder = self.folder
                with contextlib.suppress(OSError):  # only empty ones: a run that failed before its first save
                    while True:
                        folder.rmdir()
                        if folder == self.made:
                            break
                        folder = folder.parent


def lock_checkpoint_dir(folder: Path, run_id: str) -> FolderLock:
    """Local: take ``folder``'s lock for the run ``run_id`` (making the folder); a `TiekitError`
    naming the run that holds it, from its lock file, when another run does."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: nothing to lock with
        return FolderLock(folder, None)
    while True:
        made = None  # asked again on each try: an ended run's release may remove what it made
        for ancestor in (folder, *folder.parents):
            if ancestor.exists():
                break
            made = ancestor
        try:
            folder.mkdir(parents=True, exist_ok=True)
            file = open(folder / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the run
        except OSError:  # a folder that cannot be made or written: the run's first save says so, on every rank
            return FolderLock(folder, None)
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with _letting_go_lock:
                ending = _letting_go.get(os.path.realpath(folder))
            if ending is not None and ending.wait(ENDED_RUN_WAIT_SECONDS):
                file.close()
                continue  # this process's ended run let go once its last save was written
            file.seek(0)
            holder = file.read().strip() or "a run that has not written its name yet"
            file.close()
            raise TiekitError(
                f"{folder}: checkpoint_dir is in use by another tiekit.fit run ({holder}); two runs in one "
                "folder write their step-<n> checkpoints over each other's and delete each other's with "
                "checkpoint_keep: give each run its own checkpoint_dir (a run may resume from another "
                "folder's checkpoint: resume=<path>)"
            ) from None
        except OSError:
            file.close()
            return FolderLock(folder, None)
        if _same_file(file, folder / LOCK_NAME):
            break
        file.close()  # its run removed the file as this one opened it: take the name's new file
    since = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with contextlib.suppress(OSError):  # the name is for the message only: a full disk still locks
        file.seek(0)
        file.truncate()
        file.write(json.dumps({"run": run_id, "host": socket.gethostname(), "pid": os.getpid(), "since": since}))
        file.flush()
    return FolderLock(folder, file, made)


def _same_file(file: IO[str], path: Path) -> bool:
    try:
        held, named = os.fstat(file.fileno()), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
