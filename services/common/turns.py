"""Taking turns at one lock: both services share an engine between a loop and other threads.

`CountedLock` wraps a lock and counts the threads blocked in `acquire()`. The rollout's engine loop reads
the count to let every waiting submitter and weight push in between two engine steps; the learner's
scoring calls take the lock with `acquire_behind()`, which first waits until no counted thread (a
training step) is waiting, so training goes first and scoring fills the gaps.
"""
from __future__ import annotations

import contextlib
import threading


class CountedLock:
    def __init__(self, lock):
        self.lock = lock
        self._cond = threading.Condition()
        self.waiting = 0  # threads blocked in acquire()

    def acquire(self) -> None:
        """Take the lock, counted in `waiting` while blocked."""
        with self._cond:
            self.waiting += 1
        try:
            self.lock.acquire()
        finally:
            with self._cond:
                self.waiting -= 1
                self._cond.notify_all()

    def acquire_behind(self) -> None:
        """Take the lock once no thread is blocked in acquire() (best effort: one may start waiting just after)."""
        with self._cond:
            self._cond.wait_for(lambda: not self.waiting)
        self.lock.acquire()

    def release(self) -> None:
        self.lock.release()

    @contextlib.contextmanager
    def held(self):
        self.acquire()
        try:
            yield
        finally:
            self.lock.release()
