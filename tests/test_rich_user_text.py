"""Rich output: user text in the progress bars of `specgen bench` and `specgen train` and the heads table;
a reader that goes away."""

import io

import pytest

from speccli.bench.runner import BenchProgress
from speccli.ui.progress import BenchProgressDisplay, TrainProgressDisplay


def test_bracketed_text_in_a_prompt_or_message_is_shown_as_text_not_read_as_markup(monkeypatch, capsys):
    monkeypatch.setenv("FORCE_COLOR", "1")  # Rich draws the bar as on a terminal
    monkeypatch.setenv("COLUMNS", "200")
    prompt = "close the tag [/i] of list[int]"
    with BenchProgressDisplay(lambda line: None, bar=True) as display:
        assert display.bar is not None
        display.update(BenchProgress("start", 0, 1, prompt, 2, 0))
        display.bar.refresh()
        display.update(BenchProgress("done", 0, 1, prompt, 2, 0))
    with TrainProgressDisplay(lambda line: None, bar=True) as display:
        display.say("wrote heads to /tmp/[run 1]/medusa.pt")
    err = capsys.readouterr().err
    assert "[1/1] close the tag [/i] of list[int] k=2 repeat 1: n/a" in err
    assert "specgen: wrote heads to /tmp/[run 1]/medusa.pt" in err


def test_the_heads_table_shows_bracketed_paths_as_text():
    from speccli.heads.listing import HeadsListing
    from speccli.ui.models_table import print_heads_table

    listing = HeadsListing("/models/[v2]/medusa.safetensors", "medusa", "/models/[/v2]", 1000, 5, [0.5], 8192, None)
    out = io.StringIO()
    print_heads_table([listing], out)
    assert "/models/[v2]/medusa.safetensors" in out.getvalue() and "/models/[/v2]" in out.getvalue()


class GoneReader(io.StringIO):
    """A stream whose reader went away: every write fails as a closed pipe does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_lost_reader_of_a_rich_table_raises_broken_pipe_for_the_cli_not_rich_s_exit_1():
    from speccli.models.names.registry import ModelListing
    from speccli.ui.models_table import print_table

    listing = ModelListing("alias", "owner/name", "family", "1B", "download", None, "a model")
    with pytest.raises(BrokenPipeError):  # the CLI's exit 141; Rich's own console raises SystemExit(1)
        print_table([listing], GoneReader())
