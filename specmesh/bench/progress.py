"""A progress bar with an ETA over a benchmark run's measurements (`specmesh bench report`).

The run's plan says how many rows each phase will measure; one tqdm bar on stderr counts them all
(the ETA is the whole run's, at the average pace so far), names the running phase and shows the last
row. At the end, one line per phase: its rows and how long it took. Notes go above the bar.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from tqdm import tqdm

BAR_FORMAT = (
    "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rows [{elapsed}, ETA {remaining}{postfix}]"
)


def duration(seconds: float) -> str:
    """1h 02m, 3m 05s, 12s."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """One bar over the rows of `plan` (phase -> rows it will measure, in run order)."""

    def __init__(
        self, plan: Mapping[str, int], file: TextIO | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.plan = dict(plan)
        self.file = file if file is not None else sys.stderr
        self.done = dict.fromkeys(self.plan, 0)
        self.seconds = dict.fromkeys(self.plan, 0.0)
        self._clock = clock
        self._phase: str | None = None
        self._since = clock()
        tty = bool(getattr(self.file, "isatty", lambda: False)())
        self.bar = tqdm(
            total=sum(self.plan.values()),
            file=self.file,
            desc="starting",
            bar_format=BAR_FORMAT,
            dynamic_ncols=tty,
            ncols=None if tty else 100,
            mininterval=0.5 if tty else 60.0,  # in a log file: a line a minute, not one per row
            smoothing=0.0,  # the average pace of the whole run: its phases' rows differ a lot
        )

    def phase(self, name: str) -> None:
        """`name` runs from now on (its model loads and stack start-ups count towards it)."""
        if name == self._phase:
            return
        now = self._clock()
        if self._phase is not None:
            self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) + now - self._since
        self._phase, self._since = name, now
        self.bar.set_description_str(name, refresh=False)
        self.bar.refresh()

    def advance(self, phase: str, text: str = "") -> None:
        """One row of `phase` measured; `text` sums it up beside the bar."""
        self.phase(phase)
        self.done[phase] = self.done.get(phase, 0) + 1
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.update(1)

    def note(self, text: str) -> None:
        """A line above the bar (the bar is redrawn below it)."""
        self.bar.write(text, file=self.file)

    def close(self) -> list[str]:
        """Stop the bar; -> and print the summary, one line per phase that ran."""
        if self._phase is not None:
            self.phase("done")
        self.bar.set_postfix_str("", refresh=False)
        self.bar.close()
        lines = [
            f"{phase}: {self.done.get(phase, 0)}/{planned} rows in {duration(self.seconds.get(phase, 0.0))}"
            for phase, planned in self.plan.items()
        ]
        lines += [f"{p}: {n} rows (not planned)" for p, n in self.done.items() if p not in self.plan and n]
        total = sum(self.seconds.values())
        lines.append(f"{sum(self.done.values())} rows in {duration(total)}")
        for line in lines:
            print(line, file=self.file, flush=True)
        return lines
