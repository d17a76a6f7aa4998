"""Progress on stderr: one-line messages (the libraries' own logging and bars quieted), and
a bench's progress as a bar when stderr is a terminal, else one line per event."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from rich.progress import TaskID


def stderr_progress(quiet: bool) -> Callable[[str], None]:
    """Progress messages on stderr; also quiets the libraries' own logging, and their
    progress bars unless stderr is a terminal that wants them. Call it before importing
    the engine: tqdm reads TQDM_* from the environment when it is first imported, and
    transformers' GGUF loader calls tqdm directly."""
    bars = not quiet and sys.stderr.isatty()
    if not bars:
        os.environ["TQDM_DISABLE"] = "1"
    import transformers
    from huggingface_hub.utils import disable_progress_bars

    transformers.logging.set_verbosity_error()
    if not bars:
        transformers.logging.disable_progress_bar()
        disable_progress_bars()

    def progress(message: str) -> None:
        if not quiet:
            print(f"specgen: {message}", file=sys.stderr, flush=True)

    return progress


class _BarDisplay:
    """A Rich progress bar on stderr while entered (None when not on a terminal)."""

    def __init__(self, bar: bool, remaining: bool = False) -> None:
        self.bar = None
        if bar:
            from speccli.ui.consoles import PipeAwareConsole
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            # Descriptions carry prompts and paths: "[...]" in them is text, not Rich markup.
            columns = [
                TextColumn("{task.description}", markup=False),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            ]
            if remaining:
                columns.append(TimeRemainingColumn())
            self.bar = Progress(*columns, console=PipeAwareConsole(stderr=True), transient=True)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


class BenchProgressDisplay(_BarDisplay):
    """Shows speccli.bench.runner.BenchProgress events: a Rich progress bar on a
    terminal, otherwise one line per event through `say`."""

    def __init__(self, say: Callable[[str], None], bar: bool) -> None:
        super().__init__(bar)
        self.say = say
        if self.bar is not None:
            self.task = self.bar.add_task("bench", total=None)

    def update(self, state) -> None:
        if self.bar is None:
            self.say(state.describe())
            return
        self.bar.update(self.task, total=state.total or None, completed=state.completed, description=state.describe())
        if state.phase == "done":
            self.bar.console.print(state.describe(), highlight=False, markup=False)


class TrainProgressDisplay(_BarDisplay):
    """`specgen train`'s progress: the target's answers, its pass over the text, then the training steps;
    a Rich bar on a terminal, otherwise a line every 10%."""

    def __init__(self, say: Callable[[str], None], bar: bool) -> None:
        super().__init__(bar, remaining=True)
        self._say = say
        self._task: TaskID | None = None
        self._phase: str | None = None  # the phase the bar shows
        self._shown: dict[str, int] = {}  # per phase, the last tenth printed (no bar)

    def say(self, message: str) -> None:
        if self.bar is not None:
            self.bar.console.print(f"specgen: {message}", highlight=False, markup=False)
        else:
            self._say(message)

    def _update(self, phase: str, done: int, total: int, detail: str = "") -> None:
        if self.bar is not None:
            if self._task is None or self._phase != phase:
                if self._task is not None:
                    self.bar.remove_task(self._task)
                self._task = self.bar.add_task(phase, total=total)
                self._phase = phase
            self.bar.update(self._task, total=total, completed=done, description=f"{phase}{detail}")
            return
        tenth = (10 * done) // max(1, total)
        if self._shown.get(phase, -1) < tenth:
            self._shown[phase] = tenth
            self._say(f"{phase}: {done}/{total}{detail}")

    def answers(self, done: int, total: int) -> None:
        self._update("the target's answers", done, total)

    def features(self, done: int, total: int) -> None:
        self._update("target features (tokens)", done, total)

    def steps(self, state) -> None:
        loss = "" if state.loss is None else f", loss {state.loss:.3f}"
        self._update("training (steps)", state.step, state.steps, loss)
