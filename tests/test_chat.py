"""`specgen chat`: the session (conversation, settings, statistics, baseline), the slash
command registry and its handlers, and the REPL in a real pseudo-terminal."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (
    ENDLESS_CONTEXT,
    ON_CPU,
    char_tokenizer,
    default_sigint,
    isolated_env,
    never_ends,
    perturbed_copy,
    save_model_folder,
    tiny_llama,
)
from speccli.api import Speculator
from speccli.backends.hf import HFCausalLM
from speccli.chat import ChatError, ChatSession, ChatSettings, SettingError
from speccli.drafters.model import ModelDrafter
from speccli.errors import UsageError
from speccli.events import PrefillEvent, TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.prompts import encode_conversation
from speccli.ui.chat import (
    COMMANDS,
    ChatUI,
    MessageCollector,
    StreamReader,
    find_command,
    help_text,
    history_path,
    run_chat,
)

REPO = Path(__file__).resolve().parents[1]
EOS = 2
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def chat_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def models():
    tokenizer = chat_tokenizer()
    target = tiny_llama(len(tokenizer), seed=1, logit_scale=20.0, max_positions=4096)
    draft = perturbed_copy(target, noise=0.3, seed=11)
    return tokenizer, target, draft


def make_session(models, drafter: bool = True, max_tokens: int = 24, **kwargs) -> ChatSession:
    tokenizer, target, draft = models
    target_lm = HFCausalLM(target)
    decoder = SpeculativeDecoder(
        target_lm, tokenizer, [EOS], ModelDrafter(HFCausalLM(draft), target_lm.vocab_size) if drafter else None
    )
    settings = ChatSettings.of(max_tokens=max_tokens, k=kwargs.pop("k", 4))
    return ChatSession(
        Speculator(decoder), settings, kwargs.pop("system", None), model_info={"target": "t", "draft": "d"}, **kwargs
    )


def drain(events) -> list:
    return list(events)


def answer_text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenEvent))


def make_ui(session: ChatSession) -> tuple[ChatUI, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return ChatUI(session, out, err, out_colour=False, err_colour=False), out, err


FIGURES = re.compile(
    (
        r"^(interrupted \| )?\d+ tokens \| [\d.]+ tok/s \| acceptance [\d.]+% \| [\d.]+ tokens/step \| first token "
        r"[\d.]+ s$"
    )
)


# --------------------------------------------------------------------------- input


@pytest.mark.parametrize(
    "lines, messages",
    [
        (["hello"], ["hello"]),
        (['"""', "one", "two", '"""'], ["one\ntwo"]),
        (['"""first', "second", 'third"""'], ["first\nsecond\nthird"]),
        (['  """inline"""'], ["inline"]),
        (['"""', "", "  indented", '"""', "after"], ["\n  indented", "after"]),
        (["pasted\ntext with\nnewlines"], ["pasted\ntext with\nnewlines"]),
    ],
)
def test_message_collector(lines, messages):
    collector = MessageCollector()
    got = [m for m in (collector.feed(line) for line in lines) if m is not None]
    assert got == messages
    assert not collector.in_block


def test_history_path():
    assert history_path({"XDG_STATE_HOME": "/state"}) == Path("/state/specgen/history")
    assert history_path({}) == Path.home() / ".local/state/specgen/history"
    assert history_path({"XDG_STATE_HOME": "relative"}) == Path.home() / ".local/state/specgen/history"
    assert history_path({"SPECGEN_NO_HISTORY": "1", "XDG_STATE_HOME": "/state"}) is None
    assert history_path({"SPECGEN_NO_HISTORY": "0", "XDG_STATE_HOME": "/state"}) == Path("/state/specgen/history")


# --------------------------------------------------------------------------- registry


def test_help_is_generated_from_the_registry():
    lines = help_text().splitlines()
    assert lines[0] == "Commands:"
    assert lines[1 : 1 + len(COMMANDS)] == [
        "  /help            show this help (also /?)",
        "  /exit            end the session and show its statistics (also /bye, /quit)",
        "  /clear           forget the conversation (the system prompt is kept)",
        "  /system TEXT     set the system prompt (without TEXT: show it)",
        "  /set NAME VALUE  change temperature, top_p, top_k, k, max_tokens, seed or tree (no arguments: show them)",
        "  /stats           show the session's statistics",
        "  /save PATH       save the conversation, statistics and settings as JSON",
        "  /regen           regenerate the last answer",
    ]
    names = {c.name for c in COMMANDS}
    assert names >= {"help", "exit", "clear", "system", "set", "stats", "save", "regen"}
    assert find_command("bye").name == "exit" and find_command("QUIT").name == "exit"
    assert find_command("nope") is None


def test_help_command_prints_the_help_and_the_legend(models):
    ui, out, err = make_ui(make_session(models))
    assert ui.handle("/help") is True
    assert err.getvalue().startswith(help_text() + "\n")
    assert "Token colours: green = drafted and accepted" in err.getvalue()
    assert out.getvalue() == ""


def test_set_tree_switches_the_next_answers_to_token_trees():
    name, settings = ChatSettings().changed("Tree", "on")
    assert (name, settings.spec.tree) == ("tree", True)
    assert settings.changed("tree", "off")[1].spec.tree is False
    assert settings.changed("tree", "auto")[1].spec.tree is None  # k auto chooses, as without --tree


@pytest.mark.parametrize(
    "command, line",
    [
        ("/set k 2", "k = 2"),
        ("/set temperature 0.7", "temperature = 0.7"),
        ("/set top-p 0.9", "top_p = 0.9"),
        ("/set top_k 40", "top_k = 40"),
        ("/set max_tokens 64", "max_tokens = 64"),
        ("/set max_new_tokens 65", "max_tokens = 65"),
        ("/set seed 7", "seed = 7"),
        ("/set seed none", "seed = none"),
        ("/set", "settings: temperature 0 (greedy), top_p 1, top_k 0 (off), k 4, max_tokens 24, seed none"),
        ("/set k 0", "error: k must be at least 1, got 0"),
        ("/set k -3", "error: k (draft length) must be >= 0, got -3"),
        ("/set k two", "error: k must be a whole number, got 'two'"),
        ("/set k 2.5", "error: k must be a whole number, got '2.5'"),
        ("/set temperature -1", "error: temperature must be >= 0, got -1.0"),
        ("/set temperature hot", "error: temperature must be a number, got 'hot'"),
        ("/set temperature nan", "error: temperature must be a finite number, got 'nan'"),
        ("/set top_p 0", "error: top_p must be in (0, 1], got 0.0"),
        ("/set top_p 1.5", "error: top_p must be in (0, 1], got 1.5"),
        ("/set top_k -1", "error: top_k must be >= 0 (0 disables it), got -1"),
        ("/set max_tokens 0", "error: max_new_tokens must be >= 1, got 0"),
        (
            "/set colour red",
            "error: unknown setting 'colour'; one of temperature, top_p, top_k, k, max_tokens, seed, tree",
        ),
        ("/set k", "error: usage: /set NAME VALUE, NAME one of temperature, top_p, top_k, k, max_tokens, seed, tree"),
        ("/set tree maybe", "error: tree must be on, off or auto, got 'maybe'"),
        ("/frobnicate", "error: unknown command /frobnicate; /help lists the commands"),
        ("/save", "error: usage: /save PATH"),
        ("/regen", "error: there is no answer to regenerate yet"),
        ("/system", "no system prompt (/system TEXT sets one)"),
        ("/clear", "conversation cleared (there is no system prompt)"),
    ],
)
def test_command_outputs_are_exact(models, command, line):
    session = make_session(models)
    before = session.settings
    ui, out, err = make_ui(session)
    assert ui.handle(command) is True
    assert err.getvalue() == line + "\n"
    assert out.getvalue() == ""
    if line.startswith("error"):
        assert session.settings == before


def test_set_k_without_a_drafter_says_it_has_no_effect(models):
    ui, _, err = make_ui(make_session(models, drafter=False))
    ui.handle("/set k 3")
    assert err.getvalue() == "k = 3 (no effect: there is no drafter)\n"


def test_settings_change_the_next_answer(models):
    session = make_session(models)
    session.set("max_tokens", "5")
    session.set("k", "2")
    events = drain(session.ask("hi"))
    assert sum(isinstance(e, TokenEvent) for e in events) <= 5
    assert len(session.stats.drafted_at) <= 2
    assert session.turns[-1].settings["k"] == 2 and session.turns[-1].settings["max_tokens"] == 5
    with pytest.raises(SettingError):
        session.set("top_p", "7")


def test_exit_and_its_aliases_end_the_session(models):
    ui, _, _ = make_ui(make_session(models))
    assert ui.handle("/exit") is False
    assert ui.handle("/bye") is False
    assert ui.handle("/help") is True


# --------------------------------------------------------------------------- session


def reference_answer(models, messages: list[dict], max_new: int) -> str:
    tokenizer, target, _ = models
    ids = encode_conversation(tokenizer, messages)
    out = target.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_greedy_chat_answers_are_the_targets_own(models):
    session = make_session(models, system="be brief")
    first = answer_text(drain(session.ask("hello")))
    assert first == reference_answer(
        models, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}], 24
    )
    second = answer_text(drain(session.ask("and then?")))
    assert second == reference_answer(models, session.conversation()[:-1], 24)
    assert [m["role"] for m in session.conversation()] == ["system", "user", "assistant", "user", "assistant"]
    assert session.messages[1]["content"] == first


def test_clear_keeps_the_system_prompt_and_the_statistics(models):
    session = make_session(models, system="be brief")
    drain(session.ask("hello"))
    ui, _, err = make_ui(session)
    ui.handle("/clear")
    assert err.getvalue() == "conversation cleared (the system prompt is kept)\n"
    assert session.conversation() == [{"role": "system", "content": "be brief"}]
    assert session.stats.new_tokens > 0 and len(session.turns) == 1
    ui.handle("/system talk like a pirate")
    assert session.conversation() == [{"role": "system", "content": "talk like a pirate"}]


def test_regen_replaces_the_last_answer(models):
    session = make_session(models)
    first = answer_text(drain(session.ask("hello")))
    again = answer_text(drain(session.regenerate()))
    assert again == first  # greedy: the same answer
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.turns[-1].regenerated and len(session.turns) == 2
    session.set("temperature", "1.5")
    session.set("seed", "3")
    drain(session.regenerate())
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.messages[-1]["content"] == session.turns[-1].answer


def test_interrupted_answer_keeps_what_was_said(models):
    session = make_session(models, max_tokens=200)
    events = session.ask("hello")
    said = []
    for event in events:
        if isinstance(event, TokenEvent):
            said.append(event.text)
            if len(said) == 5:
                break
    events.close()  # what the REPL does on Ctrl-C
    turn = session.last_turn
    assert turn.interrupted and turn.finish_reason == "interrupted"
    assert session.messages == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "".join(said)}]
    assert turn.stats.new_tokens >= 5
    assert not session.wants_baseline()  # no slice after an interrupted answer
    drain(session.ask("go on"))  # the session carries on
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]


def test_ctrl_c_inside_the_decoder_keeps_the_session(models):
    session = make_session(models, max_tokens=200)
    original = session.generator.target.forward
    calls = {"n": 0}

    def flaky_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    session.generator.target.forward = flaky_forward
    ui, out, err = make_ui(session)
    ui.handle("hello")
    session.generator.target.forward = original
    lines = err.getvalue().splitlines()
    assert FIGURES.match(lines[0]) and lines[0].startswith("interrupted | ")
    assert lines[1] in (
        "stopped; what was said so far stays in the conversation",
        "stopped before the answer began; the conversation is as it was",
    )
    # The cache was dropped mid-pass; the next answer is still the target's own.
    answer = answer_text(drain(session.ask("again")))
    assert answer == reference_answer(models, session.conversation()[:-1], 200)


def test_interrupted_before_the_first_token_drops_the_question(models):
    session = make_session(models)
    events = session.ask("hello")
    next(events)  # the prefill event, nothing said yet
    events.close()
    assert session.messages == []
    drain(session.ask("hello"))
    events = session.regenerate()
    next(events)
    events.close()
    assert [m["role"] for m in session.messages] == ["user", "assistant"]  # the old answer is back


def test_an_unstarted_answer_changes_nothing(models):
    session = make_session(models)
    session.ask("hello")  # never iterated
    assert session.messages == [] and session.turns == []


def test_context_overflow_is_one_line(models):
    session = make_session(models)
    with pytest.raises(
        ChatError, match=r"^the conversation is \d+ tokens and the model's context holds 4096; /clear starts a new one$"
    ):
        session.ask("x" * 5000)
    assert session.messages == []


def test_baseline_is_bounded_and_costs_no_prefill(models):
    measured = make_session(models, baseline_tokens=8, baseline_budget=12)
    unmeasured = make_session(models, baseline_budget=0)
    prefill = {}
    for name, session in (("on", measured), ("off", unmeasured)):
        texts, reused = [], []
        for question in ("hello", "more", "and more"):
            events = drain(session.ask(question))
            texts.append(answer_text(events))
            reused.append(next(e for e in events if isinstance(e, PrefillEvent)).reused_tokens)
            session.measure_baseline()
        prefill[name] = (texts, reused)
    # The same answers, and the slices cost the next turn no prefill: it reuses as much of
    # the cached conversation as it would without them (one token more, in fact: the slice
    # brought the answer's last token into the cache).
    assert prefill["on"][0] == prefill["off"][0]
    assert all(on >= off for on, off in zip(prefill["on"][1], prefill["off"][1]))
    assert measured.baseline.stats.new_tokens == 12  # 8 + 4, then the budget is spent
    assert measured.baseline.slices == 2
    assert measured.baseline.stats.steps == 12  # one target pass per token
    assert unmeasured.baseline.stats.new_tokens == 0
    report = measured.report()
    assert report.baseline_tokens_per_second and report.speedup == pytest.approx(
        report.tokens_per_second / report.baseline_tokens_per_second
    )
    assert "8 tokens after each finished answer, up to 12 tokens per session" in report.baseline_method
    assert unmeasured.report().speedup is None


def test_warm_up_records_nothing_and_changes_no_answer(models):
    warmed, cold = make_session(models, system="be brief"), make_session(models, system="be brief")
    warmed.warm_up()
    assert warmed.messages == [] and warmed.turns == [] and warmed.stats.new_tokens == 0
    assert warmed.baseline.stats.new_tokens == 0
    events = drain(warmed.ask("hello"))
    assert answer_text(events) == answer_text(drain(cold.ask("hello")))
    # The system prompt and the template's head were cached by the warm-up.
    head = models[0]("<s>system: be brief\n<s>user: ", add_special_tokens=False)["input_ids"]
    assert next(e for e in events if isinstance(e, PrefillEvent)).reused_tokens >= len(head) == 25


def test_no_baseline_without_a_drafter(models):
    session = make_session(models, drafter=False)
    drain(session.ask("hello"))
    assert session.measure_baseline() == 0
    report = session.report()
    assert report.speedup is None and "without a drafter" in report.baseline_method


def test_save_writes_conversation_statistics_and_settings(models, tmp_path):
    session = make_session(models, system="be brief")
    ui, _, err = make_ui(session)
    ui.handle("hello")
    ui.handle("/set temperature 0.5")
    target = tmp_path / "chat.json"
    ui.handle(f"/save {target}")
    assert err.getvalue().splitlines()[-1] == f"saved the conversation, statistics and settings to {target}"
    saved = json.loads(target.read_text())
    assert saved["format"] == "specgen-chat/1"
    assert saved["messages"][0] == {"role": "system", "content": "be brief"}
    assert [m["role"] for m in saved["messages"]] == ["system", "user", "assistant"]
    assert saved["settings"]["temperature"] == 0.5 and saved["settings"]["k"] == 4
    assert saved["turns"][0]["user"] == "hello"
    assert saved["turns"][0]["stats"]["new_tokens"] == saved["stats"]["new_tokens"] > 0
    assert saved["baseline"]["slices"] == 1 and saved["baseline"]["tokens"] == 8
    assert saved["model"] == {"target": "t", "draft": "d"}
    assert "speedup" in saved


def test_save_to_a_bad_path_is_one_line(models, tmp_path):
    ui, _, err = make_ui(make_session(models))
    ui.handle(f"/save {tmp_path}/missing/dir/chat.json")
    assert err.getvalue() == f"error: cannot write {tmp_path}/missing/dir/chat.json: No such file or directory\n"


def test_scripted_session_over_a_stream(models):
    session = make_session(models)
    ui, out, err = make_ui(session)
    script = 'hello\n/set k 2\n"""\nline one\nline two\n"""\n//slash\n\n/stats\n'
    assert ui.run(StreamReader(io.StringIO(script))) == 0
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["hello", "line one\nline two", "/slash"]
    assert out.getvalue() == "".join(t.answer + ("" if t.answer.endswith("\n") else "\n") for t in session.turns)
    lines = err.getvalue().splitlines()
    assert FIGURES.match(lines[0]) and lines[1] == "k = 2"
    assert FIGURES.match(lines[2]) and FIGURES.match(lines[3])
    assert lines[4] == "session: 3 answers, %d tokens generated in %d steps" % (
        session.stats.new_tokens,
        session.stats.steps,
    )
    assert lines[-6] == lines[4]  # the report again at the end
    assert "\x1b" not in out.getvalue() + err.getvalue()


class ScriptedReader:
    """Lines, then Ctrl-C at the prompt."""

    def __init__(self, *lines: str) -> None:
        self.lines = list(lines)

    def read(self, continuation: bool) -> str:
        if not self.lines:
            raise KeyboardInterrupt
        return self.lines.pop(0)


def test_ctrl_c_at_the_prompt_ends_with_the_report(models):
    session = make_session(models)
    ui, _, err = make_ui(session)
    assert ui.run(ScriptedReader("hello", "/system\tbe\nbrief")) == 0
    lines = err.getvalue().splitlines()
    assert FIGURES.match(lines[0])
    assert lines[1] == "system prompt set; it applies to the whole conversation from the next answer"
    assert lines[2] == f"session: 1 answer, {session.stats.new_tokens} tokens generated in {session.stats.steps} steps"
    assert session.system == "be\nbrief"


def test_ctrl_c_in_a_multi_line_block_drops_only_the_block(models):
    class Reader(ScriptedReader):
        def read(self, continuation: bool) -> str:
            if self.lines and self.lines[0] == "^C":
                self.lines.pop(0)
                raise KeyboardInterrupt
            return super().read(continuation)

    session = make_session(models)
    ui, _, err = make_ui(session)
    assert ui.run(Reader('"""', "half a thought", "^C", "/system short")) == 0
    assert err.getvalue().splitlines()[:2] == [
        "multi-line message dropped",
        "system prompt set; it applies to the whole conversation from the next answer",
    ]
    assert session.messages == [] and session.system == "short"


def test_run_chat_refuses_bad_settings_and_models_without_a_template(models):
    tokenizer, target, draft = models

    def Fake(tok):
        from speccli.pipeline import Pipeline

        loaded = type(
            "T",
            (),
            {
                "name": "tiny",
                "dtype": torch.float32,
                "device": "cpu",
                "quant": "none",
                "linear": "stock",
                "tokenizer": tok,
            },
        )()
        return Pipeline(loaded, None, "none", SpeculativeDecoder(HFCausalLM(target), tok, [EOS]))

    with pytest.raises(UsageError, match="^tiny has no chat template, so it cannot chat$"):
        run_chat(Fake(char_tokenizer()), stdin=io.StringIO(""))
    with pytest.raises(UsageError, match=r"^top_p must be in \(0, 1\], got 2.0$"):
        run_chat(lambda: pytest.fail("a bad setting must be refused before the models load"), top_p=2.0)
    with pytest.raises(UsageError, match="^k must be at least 1, got 0$"):
        run_chat(Fake(tokenizer), k=0, stdin=io.StringIO(""))
    err = io.StringIO()
    assert run_chat(lambda: Fake(tokenizer), stdin=io.StringIO("/exit\n"), stdout=io.StringIO(), stderr=err) == 0
    assert err.getvalue().startswith("session: 0 answers, 0 tokens generated in 0 steps\n")


def test_template_without_system_support_gets_the_system_text_in_the_first_message():
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + TEMPLATE
    )
    ids = encode_conversation(tokenizer, [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert tokenizer.decode(ids) == "<s>user: S\n\nU\n<s>assistant: "


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tokenizer = chat_tokenizer()
    target = tiny_llama(len(tokenizer), seed=1, logit_scale=20.0, max_positions=4096)
    draft = perturbed_copy(target, noise=0.3, seed=11)
    root = tmp_path_factory.mktemp("chat-models")
    return {
        "root": root,
        "target": str(save_model_folder(target, tokenizer, root / "target")),
        "draft": str(save_model_folder(draft, tokenizer, root / "draft")),
    }


@pytest.fixture(scope="module")
def endless_folders(tmp_path_factory):
    """A pair whose answers never end by </s> and whose context holds 100000 tokens and
    more: a long answer outlasts whatever the terminal buffers before Ctrl-C arrives."""
    tokenizer = chat_tokenizer()
    target = never_ends(tiny_llama(len(tokenizer), seed=1, logit_scale=20.0, max_positions=ENDLESS_CONTEXT))
    draft = perturbed_copy(target, noise=0.3, seed=11)
    root = tmp_path_factory.mktemp("chat-endless")
    return {
        "root": root,
        "target": str(save_model_folder(target, tokenizer, root / "target")),
        "draft": str(save_model_folder(draft, tokenizer, root / "draft")),
    }


LAUNCHER = """\
# Stand-in for `specgen chat` until the CLI command is wired.
import sys
from speccli.config import LoadConfig
from speccli.pipeline import load_pipeline
from speccli.ui.chat import run_chat

target, draft, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = LoadConfig("cpu", "float32", "none")
pipeline = load_pipeline(target, draft, config, config)
sys.exit(run_chat(pipeline, max_new_tokens=max_tokens, system=sys.argv[4] if len(sys.argv) > 4 else None))
"""


def cli_has_chat() -> bool:
    from speccli.cli import app

    return any((c.name or c.callback.__name__) == "chat" for c in app.registered_commands)


def chat_argv(folders, max_tokens: int, system: str = "be brief", where: tuple[str, ...] = ON_CPU) -> list[str]:
    """`specgen chat` once cli.py has it; a launcher calling run_chat until then."""
    if cli_has_chat():
        return [
            sys.executable,
            "-m",
            "speccli.cli",
            "chat",
            "--target",
            folders["target"],
            "--draft",
            folders["draft"],
            *where,
            "--dtype",
            "float32",
            "--max-new-tokens",
            str(max_tokens),
            "--system",
            system,
        ]
    launcher = folders["root"] / "launch_chat.py"
    launcher.write_text(LAUNCHER)
    return [sys.executable, str(launcher), folders["target"], folders["draft"], str(max_tokens), system]


def child_env(tmp_path: Path, **extra) -> dict:
    """HOME, caches (the --k auto calibration) and history under tmp_path: nothing shared
    with the user's folders, other tests or other runs."""
    env = isolated_env(tmp_path, TERM="xterm-256color")
    env.pop("NO_COLOR", None)
    env.pop("SPECGEN_NO_HISTORY", None)
    env["PROMPT_TOOLKIT_NO_CPR"] = "1"  # nobody answers cursor position requests here
    return {**env, **extra}


def test_scripted_chat_reads_stdin_line_by_line(folders, tmp_path):
    script = "hello\n/set k 2\nagain\n/stats\n"
    result = subprocess.run(
        chat_argv(folders, 16),
        input=script.encode(),
        capture_output=True,
        cwd=REPO,
        env=child_env(tmp_path),
        timeout=120,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert b"\x1b" not in result.stdout  # not a terminal: no colour
    assert len(result.stdout.decode().splitlines()) >= 2
    assert "k = 2" in stderr
    assert stderr.count("session: 2 answers") == 2  # /stats, then the report at the end


@pytest.mark.cuda
def test_chat_starts_and_answers_on_cuda(folders, tmp_path):
    # --device auto and --quant auto: CUDA and 4-bit weights there, as a user gets them.
    result = subprocess.run(
        chat_argv(folders, 16, where=()),
        input=b"hello\n",
        capture_output=True,
        cwd=REPO,
        env=child_env(tmp_path),
        timeout=300,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert "Traceback" not in stderr and "error:" not in stderr
    assert result.stdout.strip()
    assert "session: 1 answer, " in stderr


def test_set_k_auto_after_a_fixed_k_starts_calibrated(folders, tmp_path):
    argv = chat_argv(folders, 8) + ["--k", "4"]
    script = "hello\n/set k auto\nagain\n"
    cache = tmp_path / "cache"
    result = subprocess.run(
        argv,
        input=script.encode(),
        capture_output=True,
        cwd=REPO,
        env=child_env(tmp_path, SPECGEN_CACHE=str(cache)),
        timeout=120,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert stderr.index("k = auto") < stderr.index("calibrating: timing target passes")
    assert len(list((cache / "calibration").glob("*.json"))) == 1


def test_chat_in_a_real_terminal(endless_folders, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    # A fixed k: with k auto the first answer's draft lengths follow timings, and on a loaded
    # machine the calibration can make plain decoding look best (no coloured token to see).
    argv = chat_argv(endless_folders, 40) + ["--k", "4"]
    child = pexpect.spawn(
        argv[0],
        argv[1:],
        cwd=str(REPO),
        env=child_env(tmp_path),
        encoding="utf-8",
        timeout=90,
        dimensions=(50, 200),
        preexec_fn=default_sigint,
    )
    try:
        child.expect_exact("/help for commands")
        child.expect_exact(">>>")
        # A question: the answer streams with its tokens coloured by provenance.
        child.send("hello there\r")
        child.expect(r"\d+ tokens \| [\d.]+ tok/s \| acceptance")
        answer = child.before
        assert re.search(r"\x1b\[(32|33|36)m", answer), answer
        child.expect_exact(">>>")

        child.send("/set k 2\r")
        child.expect_exact("k = 2")
        child.expect_exact(">>>")
        child.send("/set k zero\r")
        child.expect_exact("error: k must be a whole number, got 'zero'")
        child.expect_exact(">>>")

        child.send("/stats\r")
        child.expect_exact("session: 1 answer, ")
        child.expect(r"speed-up: [\d.]+x over the target alone")
        child.expect_exact(">>>")

        # Ctrl-C in the middle of a long answer stops it; the session goes on.
        # The answer cannot end before Ctrl-C: the target never says </s>, and 100000
        # tokens (a character each at least) are more than the terminal buffers while we
        # stop reading, so the child is still answering when the interrupt comes.
        child.send("/set max_tokens 100000\r")
        child.expect_exact("max_tokens = 100000")  # not the prompt echoed with the input
        child.expect_exact(">>>")
        child.send("\x1b[200~tell me\neverything\x1b[201~\r")  # a bracketed paste: one message
        for _ in range(5):
            child.expect(r"\x1b\[(32|33|36)m")  # tokens are streaming
        child.sendintr()
        child.expect(r"interrupted \| \d+ tokens")
        child.expect_exact("stopped; what was said so far stays in the conversation")
        child.expect_exact(">>>")

        saved = tmp_path / "session.json"
        child.send(f"/save {saved}\r")
        child.expect_exact("saved the conversation, statistics and settings to")
        child.expect_exact(">>>")

        # Ctrl-D at the prompt ends the session with the report.
        child.sendeof()
        child.expect_exact("session: 2 answers (1 interrupted)")
        child.expect(r"speed-up: [\d.]+x over the target alone")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    data = json.loads(saved.read_text())
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert data["messages"][-1]["content"]  # the partial answer was kept
    assert data["messages"][-2] == {"role": "user", "content": "tell me\neverything"}
    assert [t["finish_reason"] for t in data["turns"]][-1] == "interrupted"
    assert data["settings"]["k"] == 2 and data["settings"]["max_tokens"] == 100000
    history = (tmp_path / "state" / "specgen" / "history").read_text()
    assert "hello there" in history and "/set k 2" in history


def test_the_first_line_read_waits_for_the_warm_up_beside_it():
    import threading

    from speccli.ui.chat import AfterWarmUp, StreamReader

    release, order = threading.Event(), []

    def warm_up():
        release.wait(5)
        order.append("warmed up")

    warming = threading.Thread(target=warm_up)
    warming.start()
    reader = AfterWarmUp(StreamReader(io.StringIO("first\nsecond\n")), warming)
    threading.Timer(0.2, release.set).start()
    order.append(reader.read(False))  # read at once, handed out only after the warm-up
    assert order == ["warmed up", "first"]
    assert reader.read(False) == "second"
    with pytest.raises(EOFError):
        reader.read(False)
