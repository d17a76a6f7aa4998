"""The `specgen chat` REPL: prompt-toolkit input with history and multi-line messages, the
model's chat template over the whole conversation, slash commands from one registry, and
answers streamed with their tokens coloured by provenance.

Answers go to stdout; notes, figures and errors to stderr. When stdin is not a terminal,
messages are read from it one per line (a \"\"\" block makes one message of several lines),
so a chat can be scripted.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Protocol, TextIO

from speccli.chat import (
    Answer,
    DEFAULT_BASELINE_BUDGET,
    DEFAULT_BASELINE_TOKENS,
    DEFAULT_MAX_TOKENS,
    SETTING_NAMES,
    ChatError,
    ChatSession,
    ChatSettings,
    SettingError,
)
from speccli.config import AUTO_K
from speccli.errors import UsageError
from speccli.prompts import has_chat_template
from speccli.ui.live import (
    ERROR_STYLE,
    LEGEND,
    STATS_STYLE,
    Printer,
    TokenStream,
    answer_line,
    colour_enabled,
    session_report,
)

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'
NO_HISTORY_ENV = "SPECGEN_NO_HISTORY"


# --------------------------------------------------------------------------- input


def history_path(environ: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """Where the prompt history is kept: $XDG_STATE_HOME/specgen/history, else
    ~/.local/state/specgen/history; None when SPECGEN_NO_HISTORY is set (not 0)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    if env.get(NO_HISTORY_ENV, "") not in ("", "0"):
        return None
    state = env.get("XDG_STATE_HOME") or ""
    base = Path(state) if state and Path(state).is_absolute() else Path.home() / ".local" / "state"
    return base / "specgen" / "history"


class MessageCollector:
    """Turns input lines into messages. A line is one message, except that a line
    starting with \"\"\" opens a block that lasts until a line ending with \"\"\"; the
    block's lines (text after the opening and before the closing quotes included) make
    one message. Pasted text holding newlines arrives as one line and is one message."""

    def __init__(self) -> None:
        self._lines: list[str] | None = None

    @property
    def in_block(self) -> bool:
        return self._lines is not None

    def feed(self, line: str) -> Optional[str]:
        """The finished message, or None while a block is open."""
        if self._lines is None:
            stripped = line.lstrip()
            if not stripped.startswith(BLOCK):
                return line
            rest = stripped[len(BLOCK) :]
            if rest.rstrip().endswith(BLOCK):
                return rest.rstrip()[: -len(BLOCK)]
            self._lines = [rest] if rest.strip() else []
            return None
        if line.rstrip().endswith(BLOCK):
            last = line.rstrip()[: -len(BLOCK)]
            if last.strip():
                self._lines.append(last)
            message, self._lines = "\n".join(self._lines), None
            return message
        self._lines.append(line)
        return None

    def reset(self) -> None:
        self._lines = None


class Reader(Protocol):
    """Where the REPL's lines come from: StreamReader, TerminalReader, AfterWarmUp."""

    def read(self, continuation: bool) -> str: ...


class StreamReader:
    """Lines from a stream (stdin that is not a terminal). EOFError at its end."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def read(self, continuation: bool) -> str:
        line = self.stream.readline()
        if line == "":
            raise EOFError
        return line.rstrip("\r\n")


class AfterWarmUp:
    """A reader whose first line waits until the warm-up running beside it is done: the
    prompt shows while the models warm up, and the first question is answered after."""

    def __init__(self, reader: Reader, warming: threading.Thread) -> None:
        self.reader = reader
        self.warming = warming

    def read(self, continuation: bool) -> str:
        line = self.reader.read(continuation)
        self.warming.join()
        return line


def _warm_up_quietly(session: ChatSession) -> None:
    try:
        session.warm_up()
    except ChatError:
        pass  # the first answer will say what is wrong, if anything


class TerminalReader:
    """prompt-toolkit input: history (in a file unless turned off), bracketed paste (a
    paste is one message, newlines and all), Esc Enter for a newline inside a message.
    Ctrl-C raises KeyboardInterrupt and Ctrl-D EOFError, as input() does."""

    def __init__(self, history: Optional[Path], output_stream: Optional[TextIO] = None) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, History, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        store: History = InMemoryHistory()
        if history is not None:
            try:
                history.parent.mkdir(parents=True, exist_ok=True)
                store = FileHistory(str(history))
            except OSError:
                pass
        bindings = KeyBindings()

        @bindings.add("escape", "enter")
        def _newline(event) -> None:
            event.current_buffer.insert_text("\n")

        output = None
        if output_stream is not None:
            from prompt_toolkit.output import create_output

            output = create_output(stdout=output_stream)
        self.session: PromptSession[str] = PromptSession(history=store, key_bindings=bindings, output=output)

    def read(self, continuation: bool) -> str:
        return self.session.prompt(CONTINUATION if continuation else PROMPT)


# --------------------------------------------------------------------------- commands


EXIT = True  # what a handler returns to end the session

Handler = Callable[["ChatUI", str], Optional[bool]]


@dataclass(frozen=True)
class Command:
    name: str
    args: str
    help: str
    handler: Handler
    aliases: tuple[str, ...] = ()

    @property
    def usage(self) -> str:
        return f"/{self.name} {self.args}".rstrip()


def _help(ui: "ChatUI", arg: str) -> None:
    ui.notes.line(help_text())
    ui.notes.legend()


def _exit(ui: "ChatUI", arg: str) -> bool:
    return EXIT


def _clear(ui: "ChatUI", arg: str) -> None:
    ui.session.clear()
    kept = "the system prompt is kept" if ui.session.system else "there is no system prompt"
    ui.note(f"conversation cleared ({kept})")


def _system(ui: "ChatUI", arg: str) -> None:
    if not arg.strip():
        system = ui.session.system
        ui.note(f"system prompt: {system}" if system else "no system prompt (/system TEXT sets one)")
        return
    ui.session.set_system(arg)
    ui.note("system prompt set; it applies to the whole conversation from the next answer")


def _set(ui: "ChatUI", arg: str) -> None:
    words = arg.split(None, 1)
    if not words:
        ui.note(f"settings: {ui.session.settings.describe()}")
        return
    if len(words) == 1:
        raise SettingError(f"usage: /set NAME VALUE, NAME one of {', '.join(SETTING_NAMES)}")
    name = ui.session.set(words[0], words[1])
    value = ui.session.settings.value(name)
    shown = "none" if value is None else format(value, "g") if isinstance(value, float) else str(value)
    extra = " (no effect: there is no drafter)" if name == "k" and not ui.session.has_drafter else ""
    ui.note(f"{name} = {shown}{extra}")


def _stats(ui: "ChatUI", arg: str) -> None:
    ui.notes.line(session_report(ui.session.report()))


def _save(ui: "ChatUI", arg: str) -> None:
    if not arg.strip():
        raise ChatError("usage: /save PATH")
    path = Path(arg.strip()).expanduser()
    payload = json.dumps(ui.session.as_dict(), ensure_ascii=False, indent=2) + "\n"
    try:
        path.write_text(payload, encoding="utf-8")
    except OSError as error:
        raise ChatError(f"cannot write {path}: {error.strerror or error}") from None
    ui.note(f"saved the conversation, statistics and settings to {path}")


def _regen(ui: "ChatUI", arg: str) -> None:
    ui.stream_answer(ui.session.regenerate())


COMMANDS: tuple[Command, ...] = (
    Command("help", "", "show this help", _help, ("?",)),
    Command("exit", "", "end the session and show its statistics", _exit, ("bye", "quit")),
    Command("clear", "", "forget the conversation (the system prompt is kept)", _clear),
    Command("system", "TEXT", "set the system prompt (without TEXT: show it)", _system),
    Command(
        "set",
        "NAME VALUE",
        f"change {', '.join(SETTING_NAMES[:-1])} or {SETTING_NAMES[-1]} (no arguments: show them)",
        _set,
    ),
    Command("stats", "", "show the session's statistics", _stats),
    Command("save", "PATH", "save the conversation, statistics and settings as JSON", _save),
    Command("regen", "", "regenerate the last answer", _regen),
)


def find_command(name: str) -> Optional[Command]:
    name = name.lower()
    for command in COMMANDS:
        if name == command.name or name in command.aliases:
            return command
    return None


INPUT_HELP = (
    'Input: one line is one message; """ opens a multi-line message and a line ending'
    ' with """ closes it; pasted text is one message; Esc Enter inserts a newline;'
    " // at the start sends a message that begins with /."
)
KEYS_HELP = (
    "Keys: Ctrl-C stops an answer (what was said so far stays in the conversation);"
    " Ctrl-C or Ctrl-D at the prompt ends the session with its statistics."
)


def help_text() -> str:
    """The command list, generated from COMMANDS, then input and keys."""
    width = max(len(c.usage) for c in COMMANDS) + 2
    lines = ["Commands:"]
    for command in COMMANDS:
        aliases = f" (also {', '.join('/' + a for a in command.aliases)})" if command.aliases else ""
        lines.append(f"  {command.usage.ljust(width)}{command.help}{aliases}")
    lines += [INPUT_HELP, KEYS_HELP]
    return "\n".join(lines)


def command_help() -> str:
    """Help for `specgen chat --help`: Click keeps \\b paragraphs as they are."""
    return "\n\n".join(
        [
            "Chat with the target model, its answers sped up by speculative decoding.",
            "Each answer streams with its tokens coloured by where they came from, followed by one"
            " line of figures; /stats and the end of the session report acceptance (overall and"
            " per draft position), tokens per step beside the formula's prediction, tokens/s and"
            " the speed-up over the target alone, measured in the session.",
            "\b\n" + help_text().replace(INPUT_HELP, "").replace(KEYS_HELP, "").rstrip(),
            INPUT_HELP,
            KEYS_HELP,
            LEGEND,
            "When stdin is not a terminal, messages are read from it one per line. History is kept"
            " in $XDG_STATE_HOME/specgen/history (~/.local/state/specgen/history);"
            " SPECGEN_NO_HISTORY=1 turns it off. NO_COLOR turns colour off.",
        ]
    )


# --------------------------------------------------------------------------- the loop


class ChatUI:
    """Reads messages, dispatches slash commands, streams answers."""

    def __init__(self, session: ChatSession, out: TextIO, err: TextIO, out_colour: bool, err_colour: bool) -> None:
        self.session = session
        self.tokens = TokenStream(out, out_colour)
        self.notes = Printer(err, err_colour)

    def note(self, text: str) -> None:
        self.notes.line(text)

    def error(self, text: str) -> None:
        self.notes.line(f"error: {text}", ERROR_STYLE)

    def handle(self, message: str) -> bool:
        """Act on one message or command; False when the session should end."""
        stripped = message.strip()
        if not stripped:
            return True
        if stripped.startswith("//"):
            message = message.lstrip()[1:]
        elif stripped.startswith("/"):
            words = stripped[1:].split(None, 1)
            name, arg = (words[0] if words else ""), (words[1] if len(words) > 1 else "")
            command = find_command(name)
            if command is None:
                self.error(f"unknown command /{name}; /help lists the commands")
                return True
            try:
                return command.handler(self, arg.strip()) is not EXIT
            except ChatError as error:
                self.error(str(error))
                return True
        try:
            events = self.session.ask(message)
        except ChatError as error:
            self.error(str(error))
            return True
        self.stream_answer(events)
        return True

    def stream_answer(self, events: Answer) -> None:
        """Print an answer as it streams. Ctrl-C stops it; what was said stays. Then the
        figures line, then (when due) a baseline slice of the plain target."""
        self.tokens.begin()
        interrupted = False
        try:
            for event in events:
                self.tokens.on_event(event)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            for event in events.close():  # the session settles the answer
                self.tokens.on_event(event)  # held back until now (an incomplete character)
            self.tokens.end()
        turn = self.session.last_turn
        if turn is not None:
            self.notes.line(answer_line(turn.stats, turn.interrupted, self.session.has_drafter), STATS_STYLE)
            if interrupted:
                if turn.answer:
                    self.note("stopped; what was said so far stays in the conversation")
                else:
                    self.note("stopped before the answer began; the conversation is as it was")
        try:
            self.session.measure_baseline()
        except KeyboardInterrupt:
            pass

    def banner(self) -> None:
        info = self.session.model_info
        draft = info.get("draft") or "none"
        settings = self.session.settings
        temperature = settings.sampling.temperature
        mode = "greedy" if temperature == 0 else f"temperature {temperature:g}"
        k = f" (k {settings.spec.k})" if self.session.has_drafter else ""
        self.note(f"specgen chat | target {info.get('target', '?')} | draft {draft}{k} | {mode}")
        self.note("/help for commands, Ctrl-D to exit.")
        if self.tokens.colour and self.session.has_drafter:
            self.notes.legend()

    def run(self, reader: Reader) -> int:
        """The loop. Ctrl-C or Ctrl-D at the prompt (or the end of piped input) ends it
        with the session report; Ctrl-C inside an open multi-line block drops the block.
        Returns the exit code (0)."""
        collector = MessageCollector()
        while True:
            try:
                line = reader.read(collector.in_block)
            except KeyboardInterrupt:
                if not collector.in_block:
                    break
                collector.reset()
                self.note("multi-line message dropped")
                continue
            except EOFError:
                break
            message = collector.feed(line)
            if message is None:
                continue
            try:
                if not self.handle(message):
                    break
            except KeyboardInterrupt:
                self.note("interrupted")
        self.notes.line(session_report(self.session.report()))
        return 0


def run_chat(
    pipeline,
    *,
    k: int | str = "auto",
    tree: bool | None = None,
    max_new_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    system: Optional[str] = None,
    color: Optional[bool] = None,
    baseline_tokens: int = DEFAULT_BASELINE_TOKENS,
    baseline_budget: int = DEFAULT_BASELINE_BUDGET,
    warm_up: bool = True,
    progress: Optional[Callable[[str], None]] = None,
    recalibrate: bool = False,
    stdin: Optional[TextIO] = None,
    stdout: Optional[TextIO] = None,
    stderr: Optional[TextIO] = None,
) -> int:
    """Chat until the user leaves; returns the exit code (0).

    pipeline: a loaded speccli.pipeline.Pipeline, or a function of no arguments that loads
    one; given a function, the settings are checked before the (slow) load.
    color: None (or True) = automatic: a terminal and NO_COLOR unset; False = never (--no-color).
    progress, recalibrate: for the calibration of `k auto` (see Pipeline.speculator).
    Raises UsageError (one line, exit 2) for a bad setting or a model without a chat
    template, before anything is read."""
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    try:
        settings = ChatSettings.of(
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, k=k, max_tokens=max_new_tokens, tree=tree
        )
    except SettingError as error:
        raise UsageError(str(error)) from None
    if callable(pipeline):
        pipeline = pipeline()
    if not has_chat_template(pipeline.tokenizer):
        raise UsageError(
            f"{pipeline.target.name} has no chat template, so it cannot chat",
            "use an instruction-tuned (chat) model, or `specgen generate` for plain continuation",
        )
    speculator = pipeline.speculator(progress, recalibrate)
    if settings.spec.k == AUTO_K:
        speculator.calibrate(settings.spec.max_k)  # now, rather than after the first question
    session = ChatSession(
        speculator,
        settings,
        system,
        baseline_tokens=baseline_tokens,
        baseline_budget=baseline_budget,
        model_info=pipeline.model_info(),
    )
    off = False if color is False else None
    ui = ChatUI(session, stdout, stderr, colour_enabled(stdout, off), colour_enabled(stderr, off))
    interactive = _isatty(stdin)
    reader: Reader
    if interactive:
        reader = TerminalReader(history_path(), None if _isatty(stdout) else stderr)
        ui.banner()
    else:
        if hasattr(stdin, "reconfigure"):
            stdin.reconfigure(errors="replace")  # a stray byte must not end a scripted chat
        reader = StreamReader(stdin)
    if not warm_up:
        return ui.run(reader)
    if not interactive:
        try:
            _warm_up_quietly(session)
        except KeyboardInterrupt:
            pass
        return ui.run(reader)
    # At a terminal the prompt shows at once; the user types while the models warm up.
    warming = threading.Thread(target=_warm_up_quietly, args=(session,), name="specgen-warm-up", daemon=True)
    warming.start()
    try:
        return ui.run(AfterWarmUp(reader, warming))
    finally:
        warming.join()  # leaving at the prompt: let the passes finish before the interpreter ends


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
