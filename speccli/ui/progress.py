"""Progress of a long command on stderr: a bar when stderr is a terminal, else one line per event."""

from __future__ import annotations

from typing import Callable


class BenchProgressDisplay:
    """Shows speccli.commands.bench_runner.BenchProgress events: a Rich progress bar on a
    terminal, otherwise one line per event through `say`."""

    def __init__(self, say: Callable[[str], None], bar: bool) -> None:
        self.say = say
        self.bar = None
        if bar:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=Console(stderr=True), transient=True,
            )
            self.task = self.bar.add_task("bench", total=None)

    def __enter__(self) -> "BenchProgressDisplay":
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, state) -> None:
        if self.bar is None:
            self.say(state.describe())
            return
        self.bar.update(self.task, total=state.total or None, completed=state.completed, description=state.describe())
        if state.phase == "done":
            self.bar.console.print(state.describe(), highlight=False)
