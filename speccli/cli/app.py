"""The Typer app: the options every command shares (declared once), `--tp`'s launch, the guard
that turns a user's mistakes into one line and an exit code, and `main`."""

from __future__ import annotations

import functools
import inspect
import os
import signal
import sys
from dataclasses import dataclass
from typing import Annotated, Callable, Optional

import typer

from speccli import __version__
from speccli.config import LoadConfig
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
        run_guarded(_print_version)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    pass


def default_target() -> str:
    from speccli.models.names.registry import DEFAULT_TARGET

    return DEFAULT_TARGET


def default_draft() -> str:
    from speccli.models.pairs.drafts import AUTO

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
                self.device,
                self.dtype,
                self.quant,
                self.trust_remote_code,
                cpu_linear=self.cpu_linear,
                cuda_graphs=self.cuda_graphs,
                backend=self.backend,
                keep_converted=not self.no_cache,
                compile=self.compile,
                tp=self.tp,
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


def run_guarded(body: Callable[[], int]) -> None:
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
DRAFT_HELP = (
    "auto: on CUDA the target's registered published head (EAGLE-3 first), else the smallest registered model "
    "sharing the target's tokenizer (its family first; the default target gets the offline draft), else one of "
    "another tokenizer measured paying here, else prompt lookup, said on stderr (`specgen models --drafts-for "
    "TARGET` lists the choices); a draft model or head takes turns with suffix drafting (its history in memory "
    "only), each step the one k auto expects more of. Or a draft model (same forms as --target; one of another "
    "tokenizer drafts by text), `ngram` "
    "for prompt lookup, `suffix` for suffix drafting (from the text and earlier prompts and answers) or "
    "`lookahead` for lookahead decoding (no draft model: guesses from the text and from the target itself), "
    "`eagle3:HUB_ID|FOLDER` for a published EAGLE-3 head (`eagle3` alone: the "
    "one registered for the target), `eagle:HUB_ID|FOLDER` or `medusa:HUB_ID|FOLDER` for published EAGLE-1/2 or "
    "Medusa heads, `medusa[:FILE]` or `eagle[:FILE]` for heads trained here (`specgen train`; found in the cache "
    "without FILE), or `none` for plain target decoding. `A+ngram`, `A+suffix`: the draft A and prompt lookup or "
    "suffix drafting taking turns."
)


# Options shared by generate, chat and bench: declared once.
TargetOpt = Annotated[
    Optional[str], typer.Option("--target", "-t", help=TARGET_HELP, show_default="qwen2.5-coder-1.5b")
]
DraftOpt = Annotated[Optional[str], typer.Option("--draft", "-d", help=DRAFT_HELP, show_default="auto")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens (0: off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Sample among the smallest set of tokens with this much mass.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (CUDA when available), cpu, cuda, cuda:N.")]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="auto (bfloat16 on CUDA and on CPUs with native bf16, else float32), float32, bfloat16, float16.",
    ),
]
QuantOpt = Annotated[
    str,
    typer.Option(
        "--quant",
        help=(
            "auto (bitsandbytes NF4 on CUDA; on the CPU none for the target, int8 for the draft), 4bit or nf4, 8bit "
            "(bitsandbytes), int4 (torchao weight-only, groups of 128, CUDA, bfloat16), fp8 (torchao weight-only, "
            "CUDA with FP8 units), int8 (PyTorch dynamic, CPU only), none. int4 and fp8 need the cuda extra: pip "
            'install "specgen\\[cuda]".'
        ),
    ),
]
DraftDeviceOpt = Annotated[
    Optional[str], typer.Option("--draft-device", help="Device for the draft (default: --device).")
]
DraftDtypeOpt = Annotated[Optional[str], typer.Option("--draft-dtype", help="dtype for the draft (default: --dtype).")]
DraftQuantOpt = Annotated[
    Optional[str],
    typer.Option(
        "--draft-quant",
        help=(
            "Quantization for the draft (default: --quant). int8 halves a CPU draft token's cost; the output stays "
            "the target's own."
        ),
    ),
]
CpuLinearOpt = Annotated[
    str,
    typer.Option(
        "--cpu-linear",
        help=(
            "auto: float32 linear layers on the CPU run through oneDNN (same float32 math, faster passes than "
            "PyTorch's default there), and in bfloat16 a one-token pass multiplies its row as two rows where "
            "that is measured faster (PyTorch's one-row bf16 kernel is the slower on some CPUs); stock: PyTorch's "
            "default kernels."
        ),
    ),
]
CudaGraphsOpt = Annotated[
    str,
    typer.Option(
        "--cuda-graphs",
        help=(
            "auto: on CUDA, bfloat16/float16 and 4/8-bit models decode over a static KV cache replayed as CUDA "
            "graphs (faster passes); off: transformers' DynamicCache, as on the CPU."
        ),
    ),
]
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        help=(
            "auto: GGUF files on the CPU run through llama.cpp when llama-cpp-python is installed (pip install "
            '"specgen\\[llamacpp]"; several times faster there), everything else through transformers; '
            "transformers; llama.cpp (GGUF files on the CPU, at the file's own quantization)."
        ),
    ),
]
TpOpt = Annotated[
    int,
    typer.Option(
        "--tp",
        min=1,
        help=(
            "Split the target over N processes by tensor parallelism (one per GPU; gloo processes on the CPU), "
            "launched here through PyTorch's launcher, or join a torchrun launch. Unquantized safetensors targets "
            '(--quant none); the draft runs in the first process, which owns the terminal. See README, "Several '
            'GPUs".'
        ),
    ),
]
CompileOpt = Annotated[
    str,
    typer.Option(
        "--compile",
        help=(
            "on: run the passes through torch.compile over the static KV cache (inductor fuses the many small "
            "kernels of a pass; on CUDA inside the CUDA graphs; on the CPU the model moves to the static cache "
            "too). The first start compiles (seconds for a tiny model, minutes for a large one), later starts "
            "mostly read it back from specgen's cache. auto: off until measured faster on a GPU "
            "(scripts/gpu_check.py); off."
        ),
    ),
]
NoCacheOpt = Annotated[
    bool,
    typer.Option(
        "--no-cache",
        help=(
            "Neither read nor keep converted weights in specgen's cache (also SPECGEN_NO_CACHE=1): a GGUF is "
            "dequantized again on every start. See `specgen models --converted`. Suffix drafting's history of "
            "earlier texts is not kept either."
        ),
    ),
]
TrustRemoteCodeOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the hub to run.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress messages on stderr.")]
TreeOpt = Annotated[
    bool,
    typer.Option(
        "--tree",
        help=(
            "Draft a tree of candidates k deep instead of one chain: the draft model branches where it is unsure "
            "(ngram: several earlier continuations) and one target pass checks every branch; its size follows the "
            "measured pass costs. Without --tree or --no-tree, k auto drafts whichever of the two has given more "
            "tokens per second here (a fixed --k drafts chains)."
        ),
    ),
]
NoTreeOpt = Annotated[bool, typer.Option("--no-tree", help="Draft one chain, never a tree (see --tree).")]


def tree_choice(tree: bool, no_tree: bool) -> bool | None:
    """--tree and --no-tree as SpecConfig.tree: True, False, or None (auto) when neither is given."""
    if tree and no_tree:
        raise UsageError("--tree and --no-tree contradict each other: give one, or neither for auto")
    return True if tree else False if no_tree else None


RecalibrateOpt = Annotated[
    bool,
    typer.Option(
        "--recalibrate",
        help=(
            "Measure the full table of pass costs for --k auto now (a minute or two on a CPU) instead of using the "
            "cached one, or the quick probe a first run starts from."
        ),
    ),
]

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
            check_model_names(kwargs.get("target"), kwargs.get("draft"))
        except UsageError as error:
            report(str(error), error.hint)
            raise typer.Exit(EXIT_USAGE) from None
        load = {name: kwargs.pop(name) for name, _, _ in LOAD_OPTIONS}
        from speccli.backends import ranks

        # A request sent to a server (`generate --server`) loads nothing here: no ranks to launch.
        if kwargs.get("server") is None and (load["tp"] > 1 or ranks.current().size > 1):
            return _tensor_parallel(command, kwargs, load)
        return command(**kwargs, load=load)

    setattr(with_load, "__signature__", signature.replace(parameters=[*own, *shared]))  # what Typer reads
    return with_load


def check_model_names(target: Optional[str], draft: Optional[str]) -> int:
    """An empty --target or --draft (a forgotten `$MODEL`) is refused, not taken for the default."""
    for option, value in (("--target", target), ("--draft", draft)):
        if value is not None and not value.strip():
            raise UsageError(
                f"{option} is empty", f"give a model (see `specgen models`), or leave {option} out for the default"
            )
    return 0


def _tensor_parallel(command: Callable[..., None], kwargs: dict, load: dict) -> None:
    """`--tp N`: launch N ranks of this same command (or, started by torchrun, be one). Rank 0
    runs the command; the others load their shard of the target and follow rank 0's passes."""
    from speccli.backends import distributed

    if not distributed.launched():
        # A usage error is said before any process starts; then the ranks' exit code is this one's.
        run_guarded(lambda: _check_tensor_parallel(kwargs, load) or distributed.launch(load["tp"], sys.argv[1:]))
    rank = distributed.current()
    if load["tp"] not in (1, rank.size):
        run_guarded(
            lambda: _refuse(
                f"--tp {load['tp']} asks for {load['tp']} ranks, and this run has {rank.size}",
                "give torchrun --nproc-per-node the same number, or drop --tp",
            )
        )
    load["tp"] = rank.size
    distributed.announce_rank0()
    distributed.quiet_other_ranks()
    distributed.join(load["device"])
    code = 0
    try:
        if not rank.leads:
            run_guarded(lambda: _follow(kwargs, load))
        else:
            try:
                command(**kwargs, load=load)
            except typer.Exit as done:
                if done.exit_code == 0:
                    distributed.stop_followers()
                raise
            distributed.stop_followers()
    except typer.Exit as done:
        code = done.exit_code
    finally:
        distributed.leave()
    _exit_rank(code)


def _exit_rank(code: int) -> None:
    """End a rank once its work is done and its process group left: at once, past the
    interpreter's teardown, where gloo's threads could still abort the process ('terminate
    called without an active exception', signal 6) after a clean run."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a reader gone, a closed stream
            pass
    os._exit(code)


def _check_tensor_parallel(kwargs: dict, load: dict) -> int:
    from speccli.models.loading import check_tensor_parallel

    options = _target_alone(kwargs, load)
    check_tensor_parallel(options.target, options.configs()[0])
    return 0


def _target_alone(kwargs: dict, load: dict) -> ModelOptions:
    """The command's target with no draft: what the ranks other than 0 load."""
    return ModelOptions(kwargs.get("target") or default_target(), "none", **load)


def _refuse(message: str, hint: str) -> int:
    raise UsageError(message, hint)


def _follow(kwargs: dict, load: dict) -> int:
    """A rank other than 0: its shard of the target, running rank 0's passes until it stops."""
    from speccli.backends import distributed
    from speccli.models.loading import load_model
    from speccli.pipeline import causal_lm

    rank = distributed.current()
    print(
        f"specgen: rank {rank.index} of {rank.size} (pid {os.getpid()}): loading its shard of the target,"
        " then running rank 0's passes",
        file=sys.stderr,
        flush=True,
    )
    options = _target_alone(kwargs, load)
    target_config, _ = options.configs()
    loaded = load_model(options.target, target_config)
    distributed.follow(causal_lm(loaded, target_config.cuda_graphs, target_config.compile))
    return 0


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
