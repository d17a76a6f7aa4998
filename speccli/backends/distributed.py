"""Tensor parallelism: one target split over several processes (ranks), one per GPU (or CPU
process on gloo), through PyTorch distributed and transformers' tensor-parallel plan.

`specgen generate|chat|bench --tp N` started by a person launches N copies of itself through
PyTorch's own launcher (torch.distributed's elastic agent, what `torchrun` runs); a copy
started by `torchrun` (one node or several: torchrun's own --nnodes and --rdzv-* options)
joins its process group instead. Every rank loads the target with `tp_plan="auto"`
(transformers shards each layer's matrices and all-reduces their outputs: every rank ends
each pass with the same full logits). Rank 0 runs the command as it runs alone: the draft,
the decode loop and every decision (drafts, acceptance, sampling, k auto's timings) are its
own, and its target (`LeaderLM`) sends each cache operation to the other ranks, which only
run those on their shards (`follow`). So every rank holds the same tokens and cache length
by construction. Rank 0 owns the terminal: the other ranks write to a log in specgen's cache.

If a rank dies, the launcher stops the others (its monitor looks every second) and the
command exits 1 with one line naming the rank.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, ParamSpec, Sequence, TypeVar

import torch

from speccli.backends.base import Chain, ChainPicker, FeatureLM
from speccli.backends.ranks import Rank, current, launched  # noqa: F401 - this module's API

P = ParamSpec("P")
R = TypeVar("R")

# Rank 0's exit code where another rank went away during an operation they shared: it says
# nothing, and the launcher's one line names the rank that died (exit code 1).
EXIT_RANK_LOST = 86
# Quantizations transformers' tensor-parallel plan shards (bitsandbytes' and torchao's are not).
TP_QUANTS = ("none",)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Run `specgen argv` as `nproc` ranks on this machine; their exit code (rank 0's, or 1
    with one line on stderr when a rank failed)."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The elastic agent's own lines are not for a person at a terminal (a failure is said below).
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The ranks run in sessions of their own, out of the terminal's reach: a Ctrl-C here goes
    # to rank 0 alone, which decides what it stops (a chat turn, a generation), instead of the
    # agent tearing every rank down.
    pid_file = Path(tempfile.mkdtemp(prefix="specgen-tp-")) / "rank0.pid"
    os.environ[PID_FILE_VARIABLE] = str(pid_file)

    def to_rank0(signum, frame) -> None:
        try:
            os.kill(int(pid_file.read_text()), signal.SIGINT)
        except (OSError, ValueError):  # rank 0 not started yet: stop everything
            raise KeyboardInterrupt from None

    previous = signal.signal(signal.SIGINT, to_rank0)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"specgen-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"localhost:{_free_port()}",
        max_restarts=0,
        monitor_interval=1,
        signals_to_handle="SIGTERM,SIGHUP,SIGQUIT",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "speccli.cli", *argv)
    except ChildFailedError as failed:
        return _exit_code(failed.failures)
    finally:
        signal.signal(signal.SIGINT, previous)
        shutil.rmtree(pid_file.parent, ignore_errors=True)
    return 0


PID_FILE_VARIABLE = "SPECGEN_RANK0_PID_FILE"


def announce_rank0() -> None:
    """Rank 0 of specgen's own launch: tell the launcher where to send a Ctrl-C."""
    path = os.environ.get(PID_FILE_VARIABLE)
    if path and current().leads:
        Path(path).write_text(str(os.getpid()))


def _peer_gone(error: RuntimeError) -> bool:
    """Whether a collective failed because another rank went away (gloo says the peer closed
    the connection; NCCL raises its backend error)."""
    return isinstance(error, getattr(torch.distributed, "DistBackendError", ())) or "by peer" in str(error)


def _exit_code(failures: dict[int, Any]) -> int:
    """Rank 0's own exit code where it failed (it said why, and the launcher stopped the
    others); else 1, with one line naming the rank that failed first (also where rank 0
    stopped because a peer went away: EXIT_RANK_LOST, said nothing)."""
    rank0 = failures.get(0)
    if rank0 is not None and rank0.exitcode > 0 and rank0.exitcode != EXIT_RANK_LOST:
        return rank0.exitcode
    followers = {rank: f for rank, f in failures.items() if rank != 0} or failures
    rank, first = min(followers.items(), key=lambda item: getattr(item[1], "timestamp", 0))
    how = f"was killed by signal {-first.exitcode}" if first.exitcode < 0 else f"exited with {first.exitcode}"
    log = "" if rank == 0 else f" (its log: {log_path(rank)})"  # rank 0 wrote to the terminal
    print(f"error: rank {rank} of the tensor-parallel run {how}; the other ranks were stopped{log}", file=sys.stderr)
    return 1


def log_path(rank: int) -> Path:
    from speccli.config import default_cache_dir

    return default_cache_dir() / "logs" / f"rank-{rank}.log"


def quiet_other_ranks() -> None:
    """On ranks other than 0: stdout and stderr into this rank's log (rank 0 owns the terminal)."""
    rank = current()
    if rank.leads:
        return
    path = log_path(rank.index)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the terminal's input is rank 0's
    os.close(devnull)


def device_for(rank: Rank, device: str = "auto") -> torch.device:
    """Each rank's device: its local GPU, or the CPU (gloo) without GPUs or with `--device cpu`."""
    if device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", rank.local)
    return torch.device("cpu")


def join(device: str = "auto") -> None:
    """Join the launcher's process group (NCCL on CUDA, gloo on the CPU) if not joined yet."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    rank = current()
    if device_for(rank, device).type == "cuda":
        torch.cuda.set_device(rank.local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank.local))
    else:
        dist.init_process_group("gloo")


def leave() -> None:
    """Leave the process group before the interpreter exits. Left to the interpreter's exit,
    gloo's threads can be torn down while a peer closes its end, and the process aborts
    ('terminate called without an active exception', signal 6) after its work is done."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError:  # a peer already gone: nothing is left to close cleanly
            pass


def share(value: Any) -> Any:
    """Rank 0's `value` on every rank: one broadcast."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class LeaderLM:
    """Rank 0's target: every operation on the cache (a pass, a tree pass, a rollback, a
    keep) and every gathering of a split weight is sent to the other ranks before it runs
    here, so that their shards run the same pass at the same time (`follow`). Everything else
    is the wrapped model's. A Ctrl-C during an operation is held until it is done on this
    rank: leaving a pass half-way would leave the other ranks waiting in its collectives."""

    # Besides the cache's operations, those that gather what a drafter needs whole: the
    # methods below that `_mirrored` sends to the other ranks, by these names.
    OPERATIONS = ("forward", "forward_tree", "rollback", "keep", "capture_hidden", "input_embedding", "output_rows")

    def __init__(self, lm: FeatureLM) -> None:
        self._lm = lm

    @property
    def wrapped(self) -> FeatureLM:
        """The model this rank runs (what reports describe)."""
        return self._lm

    def _mirrored(self, name: str, operation: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`operation` (the wrapped model's `name`) here, once the other ranks were told to run it."""
        with _held_interrupt():
            try:
                share((name, _portable(args), kwargs))
                return operation(*args, **kwargs)
            except RuntimeError as error:
                if _peer_gone(error):  # SystemExit: past every handler that would print it, cleanups run
                    raise SystemExit(EXIT_RANK_LOST) from None
                raise

    # ------------------------------------------------------------------ mirrored on every rank

    def forward(self, token_ids: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        return self._mirrored("forward", self._lm.forward, token_ids, all_logits)

    def forward_tree(
        self, token_ids: Sequence[int], positions: Sequence[int], visible: torch.Tensor, window_start: int
    ) -> torch.Tensor:
        return self._mirrored("forward_tree", self._lm.forward_tree, token_ids, positions, visible, window_start)

    def rollback(self, length: int) -> None:
        self._mirrored("rollback", self._lm.rollback, length)

    def keep(self, start: int, offsets: Sequence[int]) -> None:
        self._mirrored("keep", self._lm.keep, start, offsets)

    def capture_hidden(self, layers: Sequence[int] | None = None) -> None:
        self._mirrored("capture_hidden", self._lm.capture_hidden, layers)

    def input_embedding(self) -> torch.nn.Module:
        return self._mirrored("input_embedding", self._lm.input_embedding)

    def output_rows(self) -> torch.Tensor:
        return self._mirrored("output_rows", self._lm.output_rows)

    # ------------------------------------------------------------------ this rank's own

    @property
    def chains(self) -> bool:
        """A chain's passes would run on this rank alone: drafts are driven from the host here."""
        return False

    def chain(self, logits: torch.Tensor, steps: int, picker: ChainPicker) -> Chain:
        raise NotImplementedError("a split target runs no draft chains on the device (its `chains` is False)")

    @property
    def setup_seconds(self) -> float:
        return self._lm.setup_seconds

    @property
    def vocab_size(self) -> int:
        return self._lm.vocab_size

    @property
    def device(self) -> torch.device:
        return self._lm.device

    @property
    def cached_tokens(self) -> Sequence[int]:
        return self._lm.cached_tokens

    @property
    def max_length(self) -> int | None:
        return self._lm.max_length

    @property
    def last_hidden(self) -> torch.Tensor:
        return self._lm.last_hidden

    def stop_followers(self) -> None:
        share(("stop", (), {}))


_leaders: list[LeaderLM] = []


def lead(lm: FeatureLM) -> LeaderLM:
    """Rank 0's target, mirrored on the other ranks (`stop_followers` ends them)."""
    leader = LeaderLM(lm)
    _leaders.append(leader)
    return leader


def stop_followers() -> None:
    """Tell the other ranks the command is done (they exit 0). Nothing to do where rank 0
    never got as far as its target."""
    while _leaders:
        _leaders.pop().stop_followers()


def _portable(args: tuple) -> tuple:
    """Tensors go to the other ranks on the CPU (each moves them to its own device)."""
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)


def follow(lm) -> None:
    """Ranks other than 0: run rank 0's operations on this rank's shard until it stops."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides what a Ctrl-C stops
    while True:
        name, args, kwargs = share(None)
        if name == "stop":
            return
        getattr(lm, name)(*args, **kwargs)


class _held_interrupt:
    """Hold SIGINT for the duration, raising KeyboardInterrupt after it if one came."""

    def __enter__(self):
        import signal
        import threading

        self._active = threading.current_thread() is threading.main_thread()
        if self._active:
            self._caught = False
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self._caught = True

    def __exit__(self, *exc) -> None:
        import signal

        if self._active:
            signal.signal(signal.SIGINT, self._previous)
            if self._caught and exc[0] is None:
                raise KeyboardInterrupt
