"""The two versions of each group's state in the optimizer state file, and the order of
the operations on them: which version holds the committed state, whether the other holds
a staged one (a step's result awaiting the iteration's verdict), and the staged writes and
corrections asked for and done, so that a read waits for those asked for before it and a
verdict waits for the write in flight. One condition guards it all; the file's threads
share it (disk_states.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class _GroupVersions:
    def __init__(self) -> None:
        self.committed = 0  # the version that holds the committed state
        self.staged = False  # the other version holds a step's result awaiting the verdict
        # Staged writes and corrections asked for / finished: a read waits for those asked
        # for before it (not for its own stage's write, asked for later).
        self.writes_asked = self.writes_done = 0
        self.corrections_asked = self.corrections_done = 0
        self.verdict: Callable[[], None] | None = None  # commit/discard once written


class VersionBook:
    """`cond` guards every field and wakes waiters; `closed` set by close() ends every wait."""

    def __init__(self, groups: int) -> None:
        self.cond = threading.Condition()
        self.closed = False
        self._groups = [_GroupVersions() for _ in range(groups)]

    def __len__(self) -> int:
        return len(self._groups)

    def committed(self, group: int) -> int:
        """The version (0 or 1) that holds the group's committed state."""
        return self._groups[group].committed

    def staged(self, group: int) -> bool:
        return self._groups[group].staged

    def set_staged(self, group: int, staged: bool) -> None:
        """The other version now holds a state to keep (True) or nothing (False)."""
        self._groups[group].staged = staged

    # --- the verdict ---------------------------------------------------------------------

    def commit(self, group: int) -> None:
        """The staged state (if any) becomes the committed one: now, or once the staged
        write in flight is done."""
        state = self._groups[group]

        def flip() -> None:
            if state.staged:
                state.committed, state.staged = 1 - state.committed, False
        self._when_written(state, flip)

    def discard(self, group: int) -> None:
        """Drop the staged state: the committed one stays (a rollback)."""
        state = self._groups[group]

        def drop() -> None:
            state.staged = False
        self._when_written(state, drop)

    def _when_written(self, state: _GroupVersions, verdict: Callable[[], None]) -> None:
        with self.cond:
            if state.writes_done < state.writes_asked:
                state.verdict = verdict
            else:
                verdict()

    # --- writes and corrections in order ---------------------------------------------------

    def write_asked(self, group: int) -> None:
        with self.cond:
            self._groups[group].writes_asked += 1

    def write_done(self, group: int) -> None:
        """A staged write is over: the verdict that waited for it applies now."""
        state = self._groups[group]
        with self.cond:
            state.writes_done += 1
            verdict, state.verdict = state.verdict, None
            if verdict is not None:
                verdict()
            self.cond.notify_all()

    def wait_written(self, group: int) -> None:
        """Wait for the group's staged write (a correction rewrites the same bytes)."""
        state = self._groups[group]
        with self.cond:
            asked = state.writes_asked
            self.cond.wait_for(lambda: state.writes_done >= asked)

    def reserve(self, group: int) -> None:
        """A correction of `group` will run: reads of it wait until `release`."""
        with self.cond:
            self._groups[group].corrections_asked += 1

    def release(self, group: int) -> None:
        with self.cond:
            self._groups[group].corrections_done += 1
            self.cond.notify_all()

    def asked(self, group: int) -> tuple[int, int]:
        """The group's writes and corrections asked for so far (what `settle` waits for)."""
        state = self._groups[group]
        with self.cond:
            return state.writes_asked, state.corrections_asked

    def settle(self, group: int, asked: tuple[int, int] | None = None) -> None:
        """Wait until the writes and corrections of `group` asked for by then (`asked`,
        default now) are done, or the book is closed."""
        asked = self.asked(group) if asked is None else asked
        state = self._groups[group]
        with self.cond:
            self.cond.wait_for(lambda: self.closed or (state.writes_done >= asked[0]
                                                       and state.corrections_done >= asked[1]))

    def close(self) -> None:
        """End every wait (the file is closing)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
