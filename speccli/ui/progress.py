"""Progress on stderr: one-line messages (the libraries' own logging and bars quieted), and
a bench's progress as a bar when stderr is a terminal, else one line per event."""

from __future__ import annotations

import os
import sys
from typing import Callable


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
