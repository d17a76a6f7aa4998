"""The specgen command line. Thin: parse options, build configs, run the engine, render events.

app.py holds the Typer app, the options every command shares (declared once), the guard that
turns a user's mistakes into one line and an exit code, and `main`; generating.py and models.py
hold the commands, which register on the app when this package is imported.
"""

from speccli.cli import generating, models  # noqa: F401 - their commands register on the app
from speccli.cli.app import app, main

__all__ = ["app", "main"]
