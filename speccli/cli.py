"""The specgen command line. Thin: parse options, build configs, run the engine, render events."""

from __future__ import annotations

import functools
import inspect
import math
import os
import signal
import sys
from dataclasses import dataclass
from typing import Annotated, Callable, Optional

import typer

from speccli import __version__
from speccli.config import AUTO_K, LoadConfig, SamplingConfig, SpecConfig, parse_draft_length
from speccli.ui.chat import command_help as _chat_help
from speccli.ui.plain import print_generation, read_prompt
from speccli.ui.progress import stderr_progress
from speccli.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    ClosedStdout,
    RuntimeFailure,
    UsageError,
    debugging,
    report,
)

app = typer.Typer(
    name="specgen",
    help=(
        "Fast local LLM generation by speculative decoding: a small draft model proposes "
        "tokens, the target model checks them all in one pass, and a rejection rule keeps "
        "the output exactly the target's own (greedy) or distributed exactly as the target's "
        "(sampling).\n\nSet SPECGEN_DEBUG=1 to see full tracebacks."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version() -> int:
    print(f"specgen {__version__}", flush=True)
    return EXIT_OK


def _version(value: bool) -> None:
    if value:
        _run_guarded(_print_version)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    pass


def _default_target() -> str:
    from speccli.models.registry import DEFAULT_TARGET

    return DEFAULT_TARGET


def _default_draft() -> str:
    from speccli.models.drafts import AUTO

    return AUTO


@dataclass
class ModelOptions:
    target: str
    draft: str
    device: str
    dtype: str
    quant: str
    draft_device: Optional[str]
    draft_dtype: Optional[str]
    draft_quant: Optional[str]
    trust_remote_code: bool
    cpu_linear: str = "auto"
    cuda_graphs: str = "auto"
    backend: str = "auto"
    no_cache: bool = False
    compile: str = "auto"
    tp: int = 1

    def configs(self) -> tuple[LoadConfig, LoadConfig]:
        try:
            target = LoadConfig(
                self.device, self.dtype, self.quant, self.trust_remote_code, cpu_linear=self.cpu_linear,
                cuda_graphs=self.cuda_graphs, backend=self.backend, keep_converted=not self.no_cache,
                compile=self.compile, tp=self.tp,
            )
            draft = LoadConfig(
                self.draft_device or self.device,
                self.draft_dtype or self.dtype,
                self.draft_quant or self.quant,
                self.trust_remote_code,
                for_draft=True,
                cpu_linear=self.cpu_linear,
                cuda_graphs=self.cuda_graphs,
                backend=self.backend,
                keep_converted=not self.no_cache,
                compile=self.compile,
            )
        except ValueError as error:
            raise UsageError(str(error)) from None
        return target, draft


def _discard_stdout() -> None:
    """Point stdout at the null device, so that what is still buffered for a reader that went
    away does not fail again when the interpreter exits."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (tests' captured stdout)
        pass


def _run_guarded(body: Callable[[], int]) -> None:
    """Run a command body, turning the errors a user can cause into one line and an exit code."""
    try:
        code = body()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        # What specgen writes lost its reader (`specgen generate ... | head`): stop quietly, as
        # Unix tools that SIGPIPE ends do, with the status a shell gives them.
        _discard_stdout()
        raise typer.Exit(EXIT_BROKEN_PIPE)
    except UsageError as error:  # bad input, prompt files and model names included
        if debugging():
            raise
        report(str(error), error.hint)
        raise typer.Exit(EXIT_USAGE)
    except RuntimeFailure as error:
        if debugging():
            raise
        report(str(error), error.hint)
        raise typer.Exit(EXIT_FAILURE)
    except (RuntimeError, OSError, ValueError) as error:
        if debugging():
            raise
        report(f"{type(error).__name__}: {error}", "rerun with SPECGEN_DEBUG=1 for the traceback")
        raise typer.Exit(EXIT_FAILURE)
    raise typer.Exit(code)


TARGET_HELP = "Target model: an alias (see `specgen models`), a Hugging Face hub id, a local folder, or a .gguf file."
DRAFT_HELP = "auto: on CUDA the target's registered published head (EAGLE-3 first), else the smallest registered model sharing the target's tokenizer (its family first; the default target gets the offline draft), else prompt lookup, said on stderr (`specgen models --drafts-for TARGET` lists the choices). Or a draft model (same forms as --target), `ngram` for prompt lookup or `lookahead` for lookahead decoding (no draft model: guesses from the text and from the target itself), `eagle3:HUB_ID|FOLDER` for a published EAGLE-3 head (`eagle3` alone: the one registered for the target), `eagle:HUB_ID|FOLDER` or `medusa:HUB_ID|FOLDER` for published EAGLE-1/2 or Medusa heads, `medusa[:FILE]` or `eagle[:FILE]` for heads trained here (`specgen train`; found in the cache without FILE), or `none` for plain target decoding."



# Options shared by generate, chat and bench: declared once.
TargetOpt = Annotated[Optional[str], typer.Option("--target", "-t", help=TARGET_HELP, show_default="qwen2.5-coder-1.5b")]
DraftOpt = Annotated[Optional[str], typer.Option("--draft", "-d", help=DRAFT_HELP, show_default="auto")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens (0: off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Sample among the smallest set of tokens with this much mass.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (CUDA when available), cpu, cuda, cuda:N.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bfloat16 on CUDA and on CPUs with native bf16, else float32), float32, bfloat16, float16.")]
QuantOpt = Annotated[str, typer.Option("--quant", help="auto (bitsandbytes NF4 on CUDA; on the CPU none for the target, int8 for the draft), 4bit or nf4, 8bit (bitsandbytes), int4 (torchao weight-only, groups of 128, CUDA, bfloat16), fp8 (torchao weight-only, CUDA with FP8 units), int8 (PyTorch dynamic, CPU only), none. int4 and fp8 need the cuda extra: pip install \"specgen\\[cuda]\".")]
DraftDeviceOpt = Annotated[Optional[str], typer.Option("--draft-device", help="Device for the draft (default: --device).")]
DraftDtypeOpt = Annotated[Optional[str], typer.Option("--draft-dtype", help="dtype for the draft (default: --dtype).")]
DraftQuantOpt = Annotated[Optional[str], typer.Option("--draft-quant", help="Quantization for the draft (default: --quant). int8 halves a CPU draft token's cost; the output stays the target's own.")]
CpuLinearOpt = Annotated[str, typer.Option("--cpu-linear", help="auto: float32 linear layers on the CPU run through oneDNN (same float32 math, passes 1.5-2.5x faster than PyTorch's default there), and in bfloat16 a one-token pass multiplies its row as two rows where that is measured faster (PyTorch's one-row bf16 kernel is the slower on some CPUs); stock: PyTorch's default kernels.")]
CudaGraphsOpt = Annotated[str, typer.Option("--cuda-graphs", help="auto: on CUDA, bfloat16/float16 and 4/8-bit models decode over a static KV cache replayed as CUDA graphs (2-5x faster passes); off: transformers' DynamicCache, as on the CPU.")]
BackendOpt = Annotated[str, typer.Option("--backend", help="auto: GGUF files on the CPU run through llama.cpp when llama-cpp-python is installed (pip install \"specgen\\[llamacpp]\"; several times faster there), everything else through transformers; transformers; llama.cpp (GGUF files on the CPU, at the file's own quantization).")]
TpOpt = Annotated[int, typer.Option("--tp", min=1, help="Split the target over N processes by tensor parallelism (one per GPU; gloo processes on the CPU), launched here through PyTorch's launcher, or join a torchrun launch. Unquantized safetensors targets (--quant none); the draft runs in the first process, which owns the terminal. See README, \"Several GPUs\".")]
CompileOpt = Annotated[str, typer.Option("--compile", help="on: run the passes through torch.compile over the static KV cache (inductor fuses the many small kernels of a pass; on CUDA inside the CUDA graphs; on the CPU the model moves to the static cache too). The first start compiles (seconds for a tiny model, minutes for a large one), later starts mostly read it back from specgen's cache. auto: off until measured faster on a GPU (scripts/gpu_check.py); off.")]
NoCacheOpt = Annotated[bool, typer.Option("--no-cache", help="Neither read nor keep converted weights in specgen's cache (also SPECGEN_NO_CACHE=1): a GGUF is dequantized again on every start. See `specgen models --converted`.")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the hub to run.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress messages on stderr.")]
TreeOpt = Annotated[bool, typer.Option("--tree", help="Draft a tree of candidates k deep instead of one chain: the draft model branches where it is unsure (ngram: several earlier continuations) and one target pass checks every branch; its size follows the measured pass costs. Pays where a pass over many tokens costs little more than one (bfloat16 on CPUs with bf16 units, GPUs).")]
RecalibrateOpt = Annotated[bool, typer.Option("--recalibrate", help="Measure the full table of pass costs for --k auto now (a minute or two on a CPU) instead of using the cached one, or the quick probe a first run starts from.")]

# How the target and the draft are loaded: every generating command takes these, declared
# here once (`with_load_options`), and gets them as one `load` dict of ModelOptions' fields.
LOAD_OPTIONS: tuple[tuple[str, object, object], ...] = (
    ("device", DeviceOpt, "auto"),
    ("dtype", DtypeOpt, "auto"),
    ("quant", QuantOpt, "auto"),
    ("draft_device", DraftDeviceOpt, None),
    ("draft_dtype", DraftDtypeOpt, None),
    ("draft_quant", DraftQuantOpt, None),
    ("trust_remote_code", TrustRemoteCodeOpt, False),
    ("cpu_linear", CpuLinearOpt, "auto"),
    ("cuda_graphs", CudaGraphsOpt, "auto"),
    ("backend", BackendOpt, "auto"),
    ("compile", CompileOpt, "auto"),
    ("tp", TpOpt, 1),
    ("no_cache", NoCacheOpt, False),
)


def with_load_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give `command` the LOAD_OPTIONS: Typer sees them in its signature (after the
    command's own options); the command receives them as `load`."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "load"]
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
        for name, annotation, default in LOAD_OPTIONS
    ]

    @functools.wraps(command)
    def with_load(**kwargs) -> None:
        try:
            _check_model_names(kwargs.get("target"), kwargs.get("draft"))
        except UsageError as error:
            report(str(error), error.hint)
            raise typer.Exit(EXIT_USAGE) from None
        load = {name: kwargs.pop(name) for name, _, _ in LOAD_OPTIONS}
        from speccli.backends import ranks

        # A request sent to a server (`generate --server`) loads nothing here: no ranks to launch.
        if kwargs.get("server") is None and (load["tp"] > 1 or ranks.current().size > 1):
            return _tensor_parallel(command, kwargs, load)
        return command(**kwargs, load=load)

    with_load.__signature__ = signature.replace(parameters=[*own, *shared])
    return with_load


def _check_model_names(target: Optional[str], draft: Optional[str]) -> int:
    """An empty --target or --draft (a forgotten `$MODEL`) is refused, not taken for the default."""
    for option, value in (("--target", target), ("--draft", draft)):
        if value is not None and not value.strip():
            raise UsageError(f"{option} is empty", f"give a model (see `specgen models`), or leave {option} out for the default")
    return 0


def _tensor_parallel(command: Callable[..., None], kwargs: dict, load: dict) -> None:
    """`--tp N`: launch N ranks of this same command (or, started by torchrun, be one). Rank 0
    runs the command; the others load their shard of the target and follow rank 0's passes."""
    from speccli.backends import distributed

    if not distributed.launched():
        # A usage error is said before any process starts; then the ranks' exit code is this one's.
        _run_guarded(lambda: _check_tensor_parallel(kwargs, load) or distributed.launch(load["tp"], sys.argv[1:]))
    rank = distributed.current()
    if load["tp"] not in (1, rank.size):
        _run_guarded(lambda: _refuse(f"--tp {load['tp']} asks for {load['tp']} ranks, and this run has {rank.size}",
                                     "give torchrun --nproc-per-node the same number, or drop --tp"))
    load["tp"] = rank.size
    distributed.announce_rank0()
    distributed.quiet_other_ranks()
    distributed.join(load["device"])
    try:
        if not rank.leads:
            _run_guarded(lambda: _follow(kwargs, load))
            return
        try:
            command(**kwargs, load=load)
        except typer.Exit as done:
            if done.exit_code == 0:
                distributed.stop_followers()
            raise
        distributed.stop_followers()
    finally:
        distributed.leave()


def _check_tensor_parallel(kwargs: dict, load: dict) -> int:
    from speccli.models.loading import check_tensor_parallel

    options = _target_alone(kwargs, load)
    check_tensor_parallel(options.target, options.configs()[0])
    return 0


def _target_alone(kwargs: dict, load: dict) -> ModelOptions:
    """The command's target with no draft: what the ranks other than 0 load."""
    return ModelOptions(kwargs.get("target") or _default_target(), "none", **load)


def _refuse(message: str, hint: str) -> int:
    raise UsageError(message, hint)


def _follow(kwargs: dict, load: dict) -> int:
    """A rank other than 0: its shard of the target, running rank 0's passes until it stops."""
    from speccli.backends import distributed
    from speccli.models.loading import load_model
    from speccli.pipeline import causal_lm

    rank = distributed.current()
    print(f"specgen: rank {rank.index} of {rank.size} (pid {os.getpid()}): loading its shard of the target,"
          " then running rank 0's passes", file=sys.stderr, flush=True)
    options = _target_alone(kwargs, load)
    target_config, _ = options.configs()
    loaded = load_model(options.target, target_config)
    distributed.follow(causal_lm(loaded, target_config.cuda_graphs, target_config.compile))
    return 0


@app.command()
@with_load_options
def generate(
    prompt: Optional[str] = typer.Argument(None, help="The prompt. Piped stdin, if any, comes first."),
    target: TargetOpt = None,
    draft: DraftOpt = None,
    k: str = typer.Option("auto", "--k", "-k", help="Tokens drafted per step (>= 1), or auto: each step picks the k that maximises expected tokens/s from the acceptance and costs measured so far."),
    tree: TreeOpt = False,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Stop after this many new tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy: exactly the target's own greedy output."),
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling: the text --draft none prints with this seed, whatever the draft or --k (the draws are tied to output positions, not to steps). Exact in float32; bfloat16 rounding can split runs at near-ties."),
    stop: list[str] = typer.Option([], "--stop", help="Stop when this text appears (repeatable); it is not printed."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message (with --chat)."),
    load: Optional[dict] = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, token ids, provenance, statistics) instead of the text."),
    stats: bool = typer.Option(False, "--stats", help="Print statistics to stderr when done."),
    recalibrate: RecalibrateOpt = False,
    quiet: QuietOpt = False,
    server: Optional[str] = typer.Option(None, "--server", envvar="SPECGEN_SERVER", show_envvar=True, help="Send the request to a running `specgen serve` at this address (http://HOST:PORT) instead of loading the models here: the same output, without the load. The server's models answer (--target, if given, must be the name it serves)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECGEN_API_KEY", show_envvar=True, help="The key the server asks for (with --server)."),
) -> None:
    """Generate a continuation of PROMPT and write only the text to stdout.

    Exit codes: 0 done, 1 runtime failure, 2 bad usage or input, 130 interrupted, 141 stdout's reader closed it
    (`| head`).
    """
    if server is not None:
        _run_guarded(lambda: _generate_remote(
            server, api_key, target, draft, load, recalibrate, quiet, prompt=prompt, k=k, tree=tree,
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
            chat=chat, system=system, as_json=as_json, stats=stats,
        ))
        return
    options = ModelOptions(target or _default_target(), draft or _default_draft(), **load)

    def body() -> int:
        progress = stderr_progress(quiet)
        from speccli.context import ContextOverflowError
        from speccli.pipeline import load_pipeline
        from speccli.prompts import NoChatTemplateError, Prompt

        sampling, spec = _generation_settings(k, max_new_tokens, temperature, top_k, top_p, seed, stop, tree)
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

    _run_guarded(body)


def _needs_serve_extra(what: str, *modules: str) -> None:
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"{what} needs the serve extra ({', '.join(missing)} not installed)",
                         'pip install "specgen[serve]"')


def _generation_settings(k: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: Optional[int],
                         stop: list[str], tree: bool) -> tuple[SamplingConfig, SpecConfig]:
    try:
        draft_length = parse_draft_length(k)
    except ValueError as error:
        raise UsageError(f"--{error}", "use --draft none for plain target decoding") from None
    try:
        return (SamplingConfig(temperature, top_k, top_p, seed),
                SpecConfig(k=draft_length, max_new_tokens=max_new_tokens, stop_strings=tuple(stop), tree=tree))
    except ValueError as error:
        raise UsageError(str(error)) from None


def _generate_remote(server: str, api_key: Optional[str], target: Optional[str], draft: Optional[str], load: dict,
                     recalibrate: bool, quiet: bool, *, prompt: Optional[str], k: str, tree: bool, max_new_tokens: int,
                     temperature: float, top_k: int, top_p: float, seed: Optional[int], stop: list[str], chat: bool,
                     system: Optional[str], as_json: bool, stats: bool) -> int:
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
        raise UsageError(f"{', '.join(loaded_here)} cannot apply with --server: the server loaded its models",
                         "set them on `specgen serve`, or drop --server to load the models here")
    sampling, spec = _generation_settings(k, max_new_tokens, temperature, top_k, top_p, seed, stop, tree)
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
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", "-n", help="Longest answer, in tokens; /set max_tokens changes it."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy: exactly the target's own answers; /set temperature changes it."),
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling: answer n (/regen included) uses seed + n, so a session replays exactly, whatever the draft or --k."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt (/system changes it; /clear keeps it)."),
    load: Optional[dict] = None,
    no_color: bool = typer.Option(False, "--no-color", help="No colours (also off when NO_COLOR is set or stdout is not a terminal)."),
    recalibrate: RecalibrateOpt = False,
    quiet: QuietOpt = False,
) -> None:
    options = ModelOptions(target or _default_target(), draft or _default_draft(), **load)

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
            k=draft_length, tree=tree, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, system=system, color=False if no_color else None, progress=progress, recalibrate=recalibrate,
        )

    _run_guarded(body)


@app.command()
@with_load_options
def bench(
    prompts: str = typer.Argument(..., help="A .txt file (one prompt per line) or .jsonl ({\"prompt\": ...} or {\"messages\": [...]})."),
    target: TargetOpt = None,
    draft: str = typer.Option(None, "--draft", "-d", help=DRAFT_HELP.replace(", or `none` for plain target decoding", ""), show_default="qwen2.5-coder-0.5b"),
    k: str = typer.Option("auto", "--k", "-k", help="Draft length, or a comma-separated sweep such as 1,2,4,8,auto (auto: the adaptive policy)."),
    tree: TreeOpt = False,
    repeat: int = typer.Option(1, "--repeat", "-r", help="Run every prompt this many times; mean and spread are reported."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="New tokens per run."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 (the default) is greedy, and outputs are checked to be identical."),
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling; repeat r uses seed + r, for the plain and the speculative run alike, which then print the same text (in float32; bfloat16 rounding can split them at near-ties)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap .txt prompts in the chat template (.jsonl messages always are)."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for chat prompts."),
    output_format: str = typer.Option("table", "--format", "-f", help="table, json, csv or md."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the report to this file instead of stdout."),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="Also write a PNG of speed-up and acceptance per prompt and per k."),
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
    options = ModelOptions(target or _default_target(), draft or _default_draft(), **load)

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
            settings = BenchSettings(sampling, max_new_tokens, tuple(ks), repeat, chat=chat, system=system, tree=tree)
        except ValueError as error:
            raise UsageError(str(error)) from None
        if options.draft.strip().lower() == NO_DRAFT:
            raise UsageError("bench compares speculative decoding with plain decoding and needs a draft", "use --draft MODEL, --draft ngram or --draft lookahead")
        target_config, draft_config = options.configs()
        pipeline = load_pipeline(options.target, options.draft, target_config, draft_config, progress)
        speculator = pipeline.speculator(progress, recalibrate)
        if AUTO_K in ks:
            speculator.calibrate(SpecConfig().max_k)  # before the progress bar starts
        bench_progress = BenchProgressDisplay(progress, bar=not quiet and sys.stderr.isatty())
        runner = BenchRunner(
            speculator, None, settings, progress=bench_progress.update, metadata=pipeline.model_info(),
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

    _run_guarded(body)


@app.command()
@with_load_options
def serve(
    target: TargetOpt = None,
    draft: DraftOpt = None,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. Loopback by default: only this machine can connect. Another address (0.0.0.0: every interface) lets the network in; give it --api-key."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port, said on stderr)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECGEN_API_KEY", show_envvar=True, help="Ask every /v1 request for `Authorization: Bearer KEY` (401 otherwise). /health stays open."),
    max_queue: int = typer.Option(32, "--max-queue", min=0, help="Requests that may wait while one generates (one generation at a time: batch size 1); past that, 503 with Retry-After."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="The name clients send as `model` (default: --target as given)."),
    k: str = typer.Option("auto", "--k", "-k", help="Tokens drafted per step (>= 1) or auto, for requests that do not set `specgen.k`."),
    tree: TreeOpt = False,
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
    options = ModelOptions(target or _default_target(), draft or _default_draft(), **load)

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
            defaults = SpecConfig(k=parse_draft_length(k), tree=tree)
        except ValueError as error:
            raise UsageError(f"--{error}") from None
        if api_key is not None and not api_key.strip():
            raise UsageError("--api-key is empty", "give a key, or leave --api-key and SPECGEN_API_KEY unset")
        name = model_name if model_name is not None else options.target
        if not name.strip():
            raise UsageError("--model-name is empty", "give the name clients send as `model`")
        sock = bind(host, port)  # a port in use is said before minutes of loading
        if not is_loopback(host) and not api_key:
            print(f"specgen: warning: listening on {host} without --api-key: anyone who can reach this machine can"
                  " use the models", file=sys.stderr, flush=True)
        target_config, draft_config = options.configs()
        pipeline = load_pipeline(options.target, options.draft, target_config, draft_config, progress)
        speculator = pipeline.speculator(progress, recalibrate)
        if pipeline.decoder.drafter is not None:
            speculator.calibrate(defaults.max_k)  # before the first request, not inside it
        served = Served(name, pipeline, speculator, int(time.time()))
        service = GenerationService(speculator, max_queue)
        app = create_app(served, service, defaults, api_key, log=progress)
        print(f"specgen: serving {name} at {url_of(sock)}/v1 (target {pipeline.target.name}, draft"
              f" {pipeline.draft_label}; one generation at a time, up to {max_queue} waiting). Ctrl-C stops.",
              file=sys.stderr, flush=True)
        try:
            run(app, sock, on_stop=lambda: service.stop(timeout=0))
        finally:
            service.stop()
        print("specgen: stopped", file=sys.stderr, flush=True)
        return 0

    _run_guarded(body)


@app.command()
def plan(
    target: TargetOpt = None,
    draft: DraftOpt = None,
    quant: str = typer.Option("4bit", "--quant", help="The target's format on the GPU: none, 8bit, 4bit (NF4, what --quant auto loads on CUDA), int4, fp8. GGUF files are dequantized: none."),
    draft_quant: Optional[str] = typer.Option(None, "--draft-quant", help="The draft's format (default: --quant)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="The compute dtype: bfloat16 or float16 (2 bytes), float32."),
    tp: int = typer.Option(1, "--tp", min=1, help="GPUs the target is split over by tensor parallelism; the draft runs on the first."),
    max_context: int = typer.Option(4096, "--max-context", min=1, help="Tokens of KV cache to plan for (the static cache starts at 4,096)."),
    gpu_memory: Optional[float] = typer.Option(None, "--gpu-memory", metavar="GB", help="Plan for GPUs of this many GB each (default: the free memory of the visible GPUs)."),
    trust_remote_code: TrustRemoteCodeOpt = False,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    quiet: QuietOpt = False,
) -> None:
    """What a target and draft need on GPUs, and whether they fit.

    From the models' configs alone (no weights are read or downloaded): weights, KV cache and
    working memory per GPU, against the visible GPUs' free memory or --gpu-memory, and what
    would fit when they do not. Exit code 2 when they do not."""

    def body() -> int:
        from speccli.models.loading import DTYPES, check_heads_split, load_config
        from speccli.models.plan import QUANT_NAMES, meta_model, plan_pair
        from speccli.ui import plan_table

        progress = stderr_progress(quiet)
        if gpu_memory is not None and not (math.isfinite(gpu_memory) and gpu_memory > 0):
            raise UsageError(f"--gpu-memory must be a positive number of GB, got {gpu_memory}", "e.g. --gpu-memory 80")
        for name, value in (("--quant", quant), ("--draft-quant", draft_quant or quant)):
            if value not in QUANT_NAMES:
                raise UsageError(f"{name} takes {', '.join(QUANT_NAMES)}, not {value!r}")
        if dtype not in ("bfloat16", "float16", "float32"):
            raise UsageError(f"--dtype takes bfloat16, float16 or float32, not {dtype!r}")
        _check_model_names(target, draft)
        target_name, draft_name = target or _default_target(), draft or _default_draft()
        if draft_name.strip().lower() == "auto":
            from speccli.models.drafts import choose_draft

            choice = choose_draft(target_name)
            progress(f"draft: {choice.name} (--draft auto: {choice.reason})")
            draft_name = choice.name
        target_resolved, target_config = load_config(target_name, trust_remote_code=trust_remote_code, progress=progress,
                                                       shapes_only=True)
        if tp > 1:
            from speccli.backends.distributed import TP_QUANTS

            if target_resolved.is_gguf:
                raise UsageError(f"--tp splits safetensors models; {target_name} is a GGUF file",
                                 "plan the model's safetensors release, or drop --tp")
            if quant not in TP_QUANTS:
                raise UsageError(f"--tp {tp} splits unquantized weights; `generate --tp` refuses --quant {quant}",
                                 "plan with --quant none, or drop --tp")
            check_heads_split(target_name, target_config, tp)
        draft_model = None
        if draft_name.strip().lower() not in PLANLESS_DRAFTS:
            draft_resolved, draft_config = load_config(draft_name, trust_remote_code=trust_remote_code, progress=progress,
                                                         shapes_only=True)
            draft_model = meta_model(draft_config)
        else:
            draft_resolved = None
        target_quant = "none" if target_resolved.is_gguf else quant
        chosen_draft_quant = "none" if draft_resolved is not None and draft_resolved.is_gguf else (draft_quant or quant)
        gpus, gpu_bytes = _gpu_memory(gpu_memory)
        result = plan_pair(target_name, meta_model(target_config), draft_name if draft_model is not None else None,
                           draft_model, target_quant, chosen_draft_quant, DTYPES[dtype], tp, max_context, gpu_bytes, gpus)
        (plan_table.print_json if as_json else plan_table.print_table)(result)
        return 2 if result.fits is False else 0

    _run_guarded(body)


# Drafters without a model of their own: nothing to plan for.
PLANLESS_DRAFTS = ("none", "ngram", "lookahead", "medusa", "eagle")


def _gpu_memory(gigabytes: float | None) -> tuple[int, float | None]:
    """(GPUs, bytes each): --gpu-memory for GPUs of that size (as many as visible; with none
    visible, as many as --tp asks: 0), else the least free memory among the visible GPUs;
    (0, None) without either."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gigabytes is not None:
        return visible, gigabytes * 1e9
    if not visible:
        return 0, None
    return visible, float(min(torch.cuda.mem_get_info(i)[0] for i in range(visible)))


@app.command()
def models(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    show_converted: bool = typer.Option(False, "--converted", help="List only the converted weights kept in specgen's cache (GGUF files dequantized once, read by later starts)."),
    remove_converted: Optional[str] = typer.Option(None, "--remove-converted", metavar="NAME|all", help="Remove the converted weights of GGUF files whose name contains NAME, or all of them; the next start converts again."),
    drafts_for: Optional[str] = typer.Option(None, "--drafts-for", metavar="TARGET", help="List the drafts that can serve TARGET (published heads registered for it, registered models sharing its tokenizer, heads trained here, the drafters without a model), marking the ones --draft auto takes on the CPU and on CUDA."),
) -> None:
    """List the model aliases, what each resolves to, and whether each is available offline,
    then the converted weights kept in specgen's cache.

    Available means: an installed offline package, or the local Hugging Face cache.
    """

    def body() -> int:
        from speccli.models import converted
        from speccli.models.offline import default_cache_dir
        from speccli.models.registry import format_size, list_models
        from speccli.ui import models_table

        cache = default_cache_dir()
        for option, value, hint in (
            ("--remove-converted", remove_converted, "give part of a GGUF file's name, or `all` to remove every entry"),
            ("--drafts-for", drafts_for, "give a target: an alias, a Hub id, a folder or a .gguf file"),
        ):
            if value is not None and not value.strip():
                raise UsageError(f"{option} is empty", hint)
        progress = stderr_progress(False)
        if drafts_for is not None:
            from speccli.models.drafts import choose_draft, drafts_for as list_drafts

            options = list_drafts(drafts_for, cache)
            if as_json:
                models_table.print_drafts_json(options)
            else:
                models_table.print_drafts_table(
                    drafts_for, options, choose_draft(drafts_for).reason, choose_draft(drafts_for, cuda=True).reason
                )
            return 0
        if remove_converted is not None:
            removed = converted.remove(cache, None if remove_converted == "all" else remove_converted)
            for entry in removed:
                progress(f"removed {entry.source} ({entry.dtype}, {format_size(entry.size_bytes)}): {entry.folder}")
            if not removed:
                progress(f"no converted weights match {remove_converted!r} in {cache / converted.FOLDER}")
            return 0
        kept = converted.entries(cache)
        if show_converted:
            if as_json:
                models_table.print_converted_json(kept)
            else:
                models_table.print_converted_table(kept, cache / converted.FOLDER)
            return 0
        from dataclasses import replace

        from speccli.models.plan import weight_sizes

        listings = [replace(item, weights=weight_sizes(item.alias, cache)) for item in list_models()]
        if as_json:
            models_table.print_json(listings)
        else:
            models_table.print_table(listings)
            models_table.print_converted_table(kept, cache / converted.FOLDER)
        return 0

    _run_guarded(body)


HEAD_KINDS = ("medusa", "eagle")


@app.command()
def train(
    kind: str = typer.Argument(..., help="medusa (K heads on the target's last hidden state) or eagle (one decoder layer drafting in feature space)."),
    target: TargetOpt = None,
    data: list[str] = typer.Option([], "--data", help="Training text: files or folders of text or code, or .jsonl (messages, prompt/response, instruction/output or text). Repeatable. Default: the Python standard library's sources and chat turns made from them (no network)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Tokens of text to train on (5% held out for accuracy), the target's answers first. The target's pass over them takes about 9 minutes per 64,000 tokens on 2 cores in bfloat16 (5 on a CPU with AMX); it is cached, so a rerun or the other kind skips it. Default: 256 per answer (every answer, then a little stdlib text), or 180,000 without answers or with --data."),
    out: Optional[str] = typer.Option(None, "--out", help="Where to save the heads (a folder or a .safetensors file). Default: the cache, where --draft medusa|eagle finds them."),
    answers: Optional[int] = typer.Option(None, "--answers", help="Requests (made offline: code, explanations, chat, arithmetic, translation) the target answers first, greedily, to train on its own answers, which is the text the heads draft in; they come first in the --tokens. Kept in the cache and resumed if cut short. Default: 250 where they are quick: the target in bfloat16 or float16 (transformers answers 32 at a time; about 17 minutes on 2 cores), on CUDA, or a GGUF file llama.cpp can run; else 0 (float32 on a CPU without llama.cpp)."),
    epochs: Optional[float] = typer.Option(None, "--epochs", help="Passes over the training text. Default: 8 with the target's answers and the default text, else 4."),
    heads: int = typer.Option(4, "--heads", help="Medusa: number of heads (head i guesses the token i+1 past the next)."),
    unroll: Optional[int] = typer.Option(None, "--unroll", help="EAGLE: drafting steps unrolled in training (EAGLE-3's training-time test): step s learns from the features the head itself predicted, as it drafts at depth s, so tokens past the first are guessed better. Each step costs one more pass of the head over the text: 3 steps train in about 3 times as long as 1 (15 minutes against 5 on a 2-core CPU in bfloat16), and lift held-out accuracy at depths 2 and 3 from 51% and 48% to 69% and 77%. Default: 3."),
    vocab: int = typer.Option(8192, "--vocab", help="Draft vocabulary: the heads propose only the most frequent ids of the text (the output layer is most of a head's cost)."),
    batch: int = typer.Option(8, "--batch", help="Segments of 256 tokens per optimizer step."),
    learning_rate: Optional[float] = typer.Option(None, "--lr", help="Learning rate (default: 3e-3 for medusa, 1e-3 for eagle)."),
    seed: int = typer.Option(0, "--seed", help="Seed for initialisation and data order."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    trust_remote_code: TrustRemoteCodeOpt = False,
    as_json: bool = typer.Option(False, "--json", help="Print the training record as JSON on stdout."),
    quiet: QuietOpt = False,
) -> None:
    """Train Medusa heads or an EAGLE head for a target, on this machine.

    The frozen target reads the text once (its features are cached, so a rerun or the other
    kind skips this); the heads learn to predict what the target itself would say. Ctrl-C
    saves a checkpoint: the same command resumes. Prints held-out top-1 accuracy and where
    the heads were saved.
    """
    # Heads learn from the target's hidden states: transformers' backends hand them out.
    options = ModelOptions(
        target or _default_target(), "none", device, dtype, "none", None, None, None, trust_remote_code,
        backend="transformers",
    )

    def body() -> int:
        import json
        from pathlib import Path

        progress = stderr_progress(quiet)
        from speccli.heads.command import (
            TrainEvents,
            TrainRequest,
            accuracy_line,
            autocast_bf16,
            default_answers,
            default_config,
            default_text,
            train_heads,
        )
        from speccli.models import offline
        from speccli.models.loading import load_model
        from speccli.ui.progress import TrainProgressDisplay

        _check_model_names(target, None)
        name = kind.strip().lower()
        if name not in HEAD_KINDS:
            raise UsageError(f"unknown kind of heads {kind!r}", f"use one of: {', '.join(HEAD_KINDS)}")
        for number, value in (("--tokens", tokens), ("--heads", heads), ("--vocab", vocab), ("--batch", batch), ("--unroll", unroll)):
            if value is not None and value < 1:
                raise UsageError(f"{number} must be at least 1, got {value}")
        for number, value in (("--epochs", epochs), ("--lr", learning_rate)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UsageError(f"{number} must be a positive number, got {value}")
        if answers is not None and answers < 0:
            raise UsageError(f"--answers must be 0 or more, got {answers}")
        target_config, _ = options.configs()
        loaded = load_model(options.target, target_config, progress)
        asked = default_answers(loaded) if answers is None else answers
        text_tokens, passes = default_text(asked, own_data=bool(data))
        config = default_config(
            name, heads=heads, vocab=vocab, epochs=epochs or passes, batch_segments=batch,
            learning_rate=learning_rate, seed=seed, bf16=autocast_bf16(loaded), eagle_steps=unroll,
        )
        request = TrainRequest(
            config, tokens or text_tokens, tuple(Path(d) for d in data), Path(out) if out else None, answers=asked,
        )
        display = TrainProgressDisplay(progress, bar=not quiet and sys.stderr.isatty())
        with display:
            outcome = train_heads(
                loaded, request, offline.default_cache_dir(),
                TrainEvents(display.say, display.features, display.steps, display.answers),
            )
        record = outcome.training
        if as_json:
            print(json.dumps({"kind": name, "path": str(outcome.path), "target": loaded.name, **record}, indent=2))
        progress(accuracy_line(name, record["accuracy"]) + f" (draft vocabulary covers {100 * record['vocab_coverage']:.1f}% of held-out tokens)")
        progress(f"saved {outcome.path} in {record['seconds']:.0f} s; use it with --draft {name}" + ("" if out is None else f":{outcome.path}"))
        return 0

    _run_guarded(body)


@app.command(name="heads")
def heads_list(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table."),
) -> None:
    """List the Medusa and EAGLE heads trained on this machine (`specgen train`): the target,
    size, training tokens and held-out accuracy."""

    def body() -> int:
        from speccli.heads.listing import find_heads
        from speccli.models import offline
        from speccli.ui import models_table

        found = find_heads(offline.default_cache_dir())
        if as_json:
            models_table.print_heads_json(found)
        else:
            models_table.print_heads_table(found)
        return 0

    _run_guarded(body)


def _stdout_file() -> tuple[int, int] | None:
    """Which file standard output is (device, inode), or None where it has no descriptor."""
    try:
        status = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return None
    return status.st_dev, status.st_ino


def _reader_went_away(stdout_before: tuple[int, int] | None) -> bool:
    """Whether Rich (Typer's help) met a closed pipe on stdout: it points stdout at the null
    device and exits 1."""
    devnull = os.stat(os.devnull)
    null = (devnull.st_dev, devnull.st_ino)
    return stdout_before not in (None, null) and _stdout_file() == null


def _click_errors():
    """click's exceptions, as the Typer in use raises them (0.28 carries a copy of click)."""
    try:
        from typer._click import exceptions
    except ImportError:  # a Typer that uses click itself
        from click import exceptions
    return exceptions


def _parse_error(error) -> int:
    """An option or argument the parser refuses (a number out of range, an unknown option, a
    missing value): one line and a hint, as every other usage error, not click's box."""
    errors = _click_errors()
    if isinstance(error, errors.NoArgsIsHelpError):
        print(error.ctx.get_help() if error.ctx is not None else error.format_message(), file=sys.stderr)
        return EXIT_USAGE
    command = error.ctx.command_path if getattr(error, "ctx", None) is not None else "specgen"
    report(error.format_message(), f"see `{command} --help`")
    return error.exit_code if isinstance(error, errors.UsageError) else EXIT_USAGE


def main() -> None:
    errors = _click_errors()
    if sys.stdout is None:
        sys.stdout = ClosedStdout()
    stdout_before = _stdout_file()
    try:
        try:
            code = app(standalone_mode=False)
        except errors.ClickException as error:
            code = _parse_error(error)
        except RuntimeFailure as error:  # outside a command's body: its help, say, to a closed stdout
            report(str(error), error.hint)
            code = EXIT_FAILURE
        except typer.Abort:  # Ctrl-C or end of input inside the parser's own prompt
            print("\ninterrupted", file=sys.stderr)
            code = EXIT_INTERRUPTED
        raise SystemExit(code or 0)
    except SystemExit as done:
        # `specgen --help | head -1`: the same exit status as a generation whose reader went away.
        if done.code == EXIT_FAILURE and _reader_went_away(stdout_before):
            raise SystemExit(EXIT_BROKEN_PIPE) from None
        raise
    finally:
        # The command is done (its exit code is set): a Ctrl-C now must not turn the
        # interpreter's shutdown into a traceback from some library's finalizer.
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    main()
