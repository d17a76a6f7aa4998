"""The generating commands: generate (also as a client of `specgen serve`), chat, bench, serve."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from speccli.cli.app import (
    DRAFT_HELP,
    LOAD_OPTIONS,
    DraftOpt,
    ModelOptions,
    QuietOpt,
    RecalibrateOpt,
    TargetOpt,
    TopKOpt,
    TopPOpt,
    NoTreeOpt,
    TreeOpt,
    app,
    default_draft,
    default_target,
    run_guarded,
    tree_choice,
    with_load_options,
)
from speccli.config import AUTO_K, SamplingConfig, SpecConfig, parse_draft_length
from speccli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, UsageError
from speccli.ui.chat import command_help as _chat_help
from speccli.ui.plain import print_generation, read_prompt
from speccli.ui.progress import stderr_progress


@app.command()
@with_load_options
def generate(
    prompt: Optional[str] = typer.Argument(None, help="The prompt. Piped stdin, if any, comes first."),
    target: TargetOpt = None,
    draft: DraftOpt = None,
    k: str = typer.Option(
        "auto",
        "--k",
        "-k",
        help=(
            "Tokens drafted per step (>= 1), or auto: each step picks the k that maximises expected tokens/s from "
            "the acceptance and costs measured so far."
        ),
    ),
    tree: TreeOpt = False,
    no_tree: NoTreeOpt = False,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Stop after this many new tokens."),
    temperature: float = typer.Option(
        0.0, "--temperature", help="0 is greedy: exactly the target's own greedy output."
    ),
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: Optional[int] = typer.Option(
        None,
        "--seed",
        help=(
            "Seed for sampling: the text --draft none prints with this seed, whatever the draft or --k (the draws "
            "are tied to output positions, not to steps). Exact in float32; bfloat16 rounding can split runs at "
            "near-ties."
        ),
    ),
    stop: list[str] = typer.Option([], "--stop", help="Stop when this text appears (repeatable); it is not printed."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message (with --chat)."),
    load: Optional[dict] = None,
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (text, token ids, provenance, statistics) instead of the text."
    ),
    stats: bool = typer.Option(False, "--stats", help="Print statistics to stderr when done."),
    recalibrate: RecalibrateOpt = False,
    quiet: QuietOpt = False,
    server: Optional[str] = typer.Option(
        None,
        "--server",
        envvar="SPECGEN_SERVER",
        show_envvar=True,
        help=(
            "Send the request to a running `specgen serve` at this address (http://HOST:PORT) instead of loading "
            "the models here: the same output, without the load. The server's models answer (--target, if given, "
            "must be the name it serves)."
        ),
    ),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        envvar="SPECGEN_API_KEY",
        show_envvar=True,
        help="The key the server asks for (with --server).",
    ),
) -> None:
    """Generate a continuation of PROMPT and write only the text to stdout.

    Exit codes: 0 done, 1 runtime failure, 2 bad usage or input, 130 interrupted, 141 stdout's reader closed it
    (`| head`).
    """
    assert load is not None  # with_load_options (speccli.cli.app) passes it
    if server is not None:
        run_guarded(
            lambda: _generate_remote(
                server,
                api_key,
                target,
                draft,
                load,
                recalibrate,
                quiet,
                prompt=prompt,
                k=k,
                tree=tree,
                no_tree=no_tree,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                stop=stop,
                chat=chat,
                system=system,
                as_json=as_json,
                stats=stats,
            )
        )
        return
    options = ModelOptions(target or default_target(), draft or default_draft(), **load)

    def body() -> int:
        progress = stderr_progress(quiet)
        from speccli.context import ContextOverflowError
        from speccli.pipeline import load_pipeline
        from speccli.prompts import NoChatTemplateError, Prompt

        sampling, spec = _generation_settings(k, max_new_tokens, temperature, top_k, top_p, seed, stop, tree, no_tree)
        text = read_prompt(prompt)
        target_config, draft_config = options.configs()
        pipeline = load_pipeline(options.target, options.draft, target_config, draft_config, progress)
        speculator = pipeline.speculator(progress, recalibrate)
        try:
            generation = speculator.stream(Prompt.of(text, chat, system), sampling, spec)
        except NoChatTemplateError:
            raise UsageError("this model has no chat template", "run without --chat") from None
        except ContextOverflowError as error:
            raise UsageError(
                f"the prompt is {error.prompt_tokens} tokens long and {options.target}'s context holds {error.context}",
                "shorten the prompt",
            ) from None
        finished = print_generation(pipeline, generation, sampling, spec, as_json, stats)
        for notice in speculator.take_notices():
            progress(notice)
        return 0 if finished else EXIT_INTERRUPTED

    run_guarded(body)


def _needs_serve_extra(what: str, *modules: str) -> None:
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"{what} needs the serve extra ({', '.join(missing)} not installed)", 'pip install "specgen[serve]"'
        )


def _generation_settings(
    k: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: Optional[int],
    stop: list[str],
    tree: bool,
    no_tree: bool,
) -> tuple[SamplingConfig, SpecConfig]:
    chosen = tree_choice(tree, no_tree)
    try:
        draft_length = parse_draft_length(k)
    except ValueError as error:
        raise UsageError(f"--{error}", "use --draft none for plain target decoding") from None
    try:
        return (
            SamplingConfig(temperature, top_k, top_p, seed),
            SpecConfig(k=draft_length, max_new_tokens=max_new_tokens, stop_strings=tuple(stop), tree=chosen),
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


def _generate_remote(
    server: str,
    api_key: Optional[str],
    target: Optional[str],
    draft: Optional[str],
    load: dict,
    recalibrate: bool,
    quiet: bool,
    *,
    prompt: Optional[str],
    k: str,
    tree: bool,
    no_tree: bool,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: Optional[int],
    stop: list[str],
    chat: bool,
    system: Optional[str],
    as_json: bool,
    stats: bool,
) -> int:
    """`generate --server`: the request to a running `specgen serve`, printed as a local one is."""
    _needs_serve_extra("generate --server", "httpx", "httpx_sse")
    from speccli.serve.client import RemoteRequest, ServerClient
    from speccli.ui.plain import print_remote_generation

    loaded_here = [f"--{name.replace('_', '-')}" for name, _, default in LOAD_OPTIONS if load[name] != default]
    if draft is not None:
        loaded_here.insert(0, "--draft")
    if recalibrate:
        loaded_here.append("--recalibrate")
    if loaded_here:
        raise UsageError(
            f"{', '.join(loaded_here)} cannot apply with --server: the server loaded its models",
            "set them on `specgen serve`, or drop --server to load the models here",
        )
    sampling, spec = _generation_settings(k, max_new_tokens, temperature, top_k, top_p, seed, stop, tree, no_tree)
    text = read_prompt(prompt)

    def progress(message: str) -> None:
        if not quiet:
            print(f"specgen: {message}", file=sys.stderr, flush=True)

    client = ServerClient(server, api_key, progress)
    try:
        model = target if target is not None else client.served_model()
        remote = client.generate(RemoteRequest(text, chat, system, sampling, spec, with_tokens=as_json), model)
        finished = print_remote_generation(remote, as_json, stats)
    finally:
        client.close()
    return 0 if finished else EXIT_INTERRUPTED


@app.command(help=_chat_help())
@with_load_options
def chat(
    target: TargetOpt = None,
    draft: DraftOpt = None,
    k: str = typer.Option("auto", "--k", "-k", help="Tokens drafted per step (>= 1) or auto; /set k changes it."),
    tree: TreeOpt = False,
    no_tree: NoTreeOpt = False,
    max_new_tokens: int = typer.Option(
        512, "--max-new-tokens", "-n", help="Longest answer, in tokens; /set max_tokens changes it."
    ),
    temperature: float = typer.Option(
        0.0, "--temperature", help="0 is greedy: exactly the target's own answers; /set temperature changes it."
    ),
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: Optional[int] = typer.Option(
        None,
        "--seed",
        help=(
            "Seed for sampling: answer n (/regen included) uses seed + n, so a session replays exactly, whatever "
            "the draft or --k."
        ),
    ),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt (/system changes it; /clear keeps it)."),
    load: Optional[dict] = None,
    no_color: bool = typer.Option(
        False, "--no-color", help="No colours (also off when NO_COLOR is set or stdout is not a terminal)."
    ),
    recalibrate: RecalibrateOpt = False,
    quiet: QuietOpt = False,
) -> None:
    assert load is not None  # with_load_options (speccli.cli.app) passes it
    options = ModelOptions(target or default_target(), draft or default_draft(), **load)

    def body() -> int:
        progress = stderr_progress(quiet)
        from speccli.pipeline import load_pipeline
        from speccli.ui.chat import run_chat

        target_config, draft_config = options.configs()
        try:
            draft_length = parse_draft_length(k)
        except ValueError as error:
            raise UsageError(f"--{error}") from None
        return run_chat(
            lambda: load_pipeline(options.target, options.draft, target_config, draft_config, progress),
            k=draft_length,
            tree=tree_choice(tree, no_tree),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            system=system,
            color=False if no_color else None,
            progress=progress,
            recalibrate=recalibrate,
        )

    run_guarded(body)


@app.command()
@with_load_options
def bench(
    prompts: str = typer.Argument(
        ..., help='A .txt file (one prompt per line) or .jsonl ({"prompt": ...} or {"messages": [...]}).'
    ),
    target: TargetOpt = None,
    draft: str = typer.Option(
        None,
        "--draft",
        "-d",
        help=DRAFT_HELP.replace(", or `none` for plain target decoding", ""),
        show_default="qwen2.5-coder-0.5b",
    ),
    k: str = typer.Option(
        "auto",
        "--k",
        "-k",
        help="Draft length, or a comma-separated sweep such as 1,2,4,8,auto (auto: the adaptive policy).",
    ),
    tree: TreeOpt = False,
    no_tree: NoTreeOpt = False,
    repeat: int = typer.Option(
        1, "--repeat", "-r", help="Run every prompt this many times; mean and spread are reported."
    ),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="New tokens per run."),
    temperature: float = typer.Option(
        0.0, "--temperature", help="0 (the default) is greedy, and outputs are checked to be identical."
    ),
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: Optional[int] = typer.Option(
        None,
        "--seed",
        help=(
            "Seed for sampling; repeat r uses seed + r, for the plain and the speculative run alike, which then "
            "print the same text (in float32; bfloat16 rounding can split them at near-ties)."
        ),
    ),
    chat: bool = typer.Option(
        False, "--chat", help="Wrap .txt prompts in the chat template (.jsonl messages always are)."
    ),
    system: Optional[str] = typer.Option(None, "--system", help="System message for chat prompts."),
    output_format: str = typer.Option("table", "--format", "-f", help="table, json, csv or md."),
    output: Optional[str] = typer.Option(
        None, "--output", "-o", help="Write the report to this file instead of stdout."
    ),
    plot_path: Optional[str] = typer.Option(
        None, "--plot", help="Also write a PNG of speed-up and acceptance per prompt and per k."
    ),
    load: Optional[dict] = None,
    recalibrate: RecalibrateOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run each prompt through plain target decoding and speculative decoding, side by side.

    Reports tokens/s of each, the speed-up, acceptance and tokens per step per prompt, per k
    and overall. In greedy mode every pair is checked: identical; a near-tie (the outputs part
    where the target's two best logits lie within the rounding of its dtype: in bfloat16 or
    float16 a pass over several tokens and a pass over one round differently, so a near-tie may
    go either way); or a mismatch, an error (exit code 1). With --dtype float32 the outputs are
    identical token for token, and any difference is a mismatch. The report goes to stdout,
    progress to stderr.
    """
    assert load is not None  # with_load_options (speccli.cli.app) passes it
    options = ModelOptions(target or default_target(), draft or default_draft(), **load)

    def body() -> int:
        from pathlib import Path

        progress = stderr_progress(quiet)
        from speccli.bench.prompts import load_prompts, parse_k_list
        from speccli.bench.results import BenchSettings
        from speccli.bench.runner import BenchRunner
        from speccli.pipeline import NO_DRAFT, load_pipeline
        from speccli.ui import bench_report
        from speccli.ui.progress import BenchProgressDisplay

        prompt_set = load_prompts(Path(prompts))
        ks = parse_k_list(k)
        if output_format not in bench_report.FORMATS:
            raise UsageError(f"--format must be one of {', '.join(bench_report.FORMATS)}, got {output_format!r}")
        try:
            sampling = SamplingConfig(temperature, top_k, top_p, seed)
            form = tree_choice(tree, no_tree)
            settings = BenchSettings(sampling, max_new_tokens, tuple(ks), repeat, chat=chat, system=system, tree=form)
        except ValueError as error:
            raise UsageError(str(error)) from None
        if options.draft.strip().lower() == NO_DRAFT:
            raise UsageError(
                "bench compares speculative decoding with plain decoding and needs a draft",
                "use --draft MODEL, --draft ngram or --draft lookahead",
            )
        target_config, draft_config = options.configs()
        pipeline = load_pipeline(options.target, options.draft, target_config, draft_config, progress)
        speculator = pipeline.speculator(progress, recalibrate)
        if AUTO_K in ks:
            speculator.calibrate(SpecConfig().max_k)  # before the progress bar starts
        bench_progress = BenchProgressDisplay(progress, bar=not quiet and sys.stderr.isatty())
        runner = BenchRunner(
            speculator,
            None,
            settings,
            progress=bench_progress.update,
            metadata=pipeline.model_info(),
            dtype=pipeline.target.dtype,
        )
        interrupted = False
        try:
            with bench_progress:
                results = runner.run(prompt_set)
        except KeyboardInterrupt:
            interrupted = True
            results = runner.results(complete=False)
        bench_report.write(results, output_format, output)
        if plot_path:
            bench_report.plot(results, Path(plot_path))
        print(bench_report.headline(results), file=sys.stderr)
        for line in bench_report.error_lines(results):
            print(line, file=sys.stderr)
        if interrupted:
            print("interrupted: the report holds the rows finished so far", file=sys.stderr)
            return EXIT_INTERRUPTED
        return EXIT_FAILURE if results.errors else 0

    run_guarded(body)


@app.command()
@with_load_options
def serve(
    target: TargetOpt = None,
    draft: DraftOpt = None,
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help=(
            "Address to listen on. Loopback by default: only this machine can connect. Another address (0.0.0.0: "
            "every interface) lets the network in; give it --api-key."
        ),
    ),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port, said on stderr)."),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        envvar="SPECGEN_API_KEY",
        show_envvar=True,
        help="Ask every /v1 request for `Authorization: Bearer KEY` (401 otherwise). /health stays open.",
    ),
    max_queue: int = typer.Option(
        32,
        "--max-queue",
        min=0,
        help=(
            "Requests that may wait while one generates (one generation at a time: batch size 1); past that, 503 "
            "with Retry-After."
        ),
    ),
    model_name: Optional[str] = typer.Option(
        None, "--model-name", help="The name clients send as `model` (default: --target as given)."
    ),
    k: str = typer.Option(
        "auto", "--k", "-k", help="Tokens drafted per step (>= 1) or auto, for requests that do not set `specgen.k`."
    ),
    tree: TreeOpt = False,
    no_tree: NoTreeOpt = False,
    load: Optional[dict] = None,
    recalibrate: RecalibrateOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Serve the target and its draft behind an OpenAI-compatible HTTP API, loaded once.

    POST /v1/chat/completions (messages through the target's chat template) and
    /v1/completions (a raw prompt), streamed as server-sent events with "stream": true;
    GET /v1/models and /health. Greedy with "temperature": 0 (OpenAI's default is 1),
    exactly the target's own text; "seed" gives what `specgen generate --seed` gives. Each
    answer carries a `specgen` object: drafted, accepted, acceptance rate, tokens per step,
    estimated speed-up. One generation runs at a time; others wait in arrival order.
    `specgen generate --server URL` sends its request here. SIGINT or SIGTERM stops it
    (exit 0). See docs/serve.md.
    """
    assert load is not None  # with_load_options (speccli.cli.app) passes it
    options = ModelOptions(target or default_target(), draft or default_draft(), **load)

    def body() -> int:
        import time

        progress = stderr_progress(quiet)
        _needs_serve_extra("specgen serve", "starlette", "uvicorn", "sse_starlette", "pydantic")
        from speccli.pipeline import load_pipeline
        from speccli.serve.app import create_app
        from speccli.serve.responses import Served
        from speccli.serve.server import bind, is_loopback, run, url_of
        from speccli.serve.service import GenerationService

        try:
            defaults = SpecConfig(k=parse_draft_length(k), tree=tree_choice(tree, no_tree))
        except ValueError as error:
            raise UsageError(f"--{error}") from None
        if api_key is not None and not api_key.strip():
            raise UsageError("--api-key is empty", "give a key, or leave --api-key and SPECGEN_API_KEY unset")
        name = model_name if model_name is not None else options.target
        if not name.strip():
            raise UsageError("--model-name is empty", "give the name clients send as `model`")
        sock = bind(host, port)  # a port in use is said before minutes of loading
        if not is_loopback(host) and not api_key:
            print(
                f"specgen: warning: listening on {host} without --api-key: anyone who can reach this machine can"
                " use the models",
                file=sys.stderr,
                flush=True,
            )
        target_config, draft_config = options.configs()
        pipeline = load_pipeline(options.target, options.draft, target_config, draft_config, progress)
        speculator = pipeline.speculator(progress, recalibrate)
        if pipeline.decoder.drafter is not None:
            speculator.calibrate(defaults.max_k)  # before the first request, not inside it
        served = Served(name, pipeline, speculator, int(time.time()))
        service = GenerationService(speculator, max_queue)
        app = create_app(served, service, defaults, api_key, log=progress)
        print(
            f"specgen: serving {name} at {url_of(sock)}/v1 (target {pipeline.target.name}, draft"
            f" {pipeline.draft_label}; one generation at a time, up to {max_queue} waiting). Ctrl-C stops.",
            file=sys.stderr,
            flush=True,
        )
        try:
            run(app, sock, on_stop=lambda: service.stop(timeout=0))
        finally:
            service.stop()
        print("specgen: stopped", file=sys.stderr, flush=True)
        return 0

    run_guarded(body)
