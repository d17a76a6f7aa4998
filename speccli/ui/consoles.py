"""Rich consoles that leave a lost reader to the CLI."""

from __future__ import annotations

from rich.console import Console


class PipeAwareConsole(Console):
    """A Rich console that raises BrokenPipeError when its reader goes away (`specgen models |
    head -1`), which the CLI turns into a quiet exit 141 as for everything else it writes.
    Rich's own console exits 1 there."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more reaches that reader
        raise BrokenPipeError(32, "Broken pipe")
