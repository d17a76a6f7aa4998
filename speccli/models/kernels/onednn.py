"""Faster CPU kernels for the few rows a decode step feeds its linear layers, chosen at load
time: float32 through oneDNN, but for the fewest rows where PyTorch's own kernel is the
faster on this CPU (see choose_stock_rows); bfloat16 one-row products as two rows where
that is faster (see TwoRowLinear).

For float32 on the CPU, nn.Linear multiplies with MKL's sgemm, which on many CPUs is slow
for the few rows that decoding feeds, and grows steeply from one row to a few. oneDNN's
linear kernel (the one PyTorch already uses for bfloat16, and that torch.compile's CPU
backend uses for float32) costs about the same for 1 to 9 rows, so a pass over several new
tokens costs little more than a pass over one. A flat verify cost is what speculative
decoding lives on, and plain decoding gains too (measured: BENCHMARKS.md, section
"2-core AMD EPYC, AVX512-BF16, no AMX").

The arithmetic is float32 either way; only the summation order differs, so results
differ by float32 rounding (as a pass over k+1 tokens already does from k+1 one-token
passes). The same weight tensors are used: nothing is copied or re-packed.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from speccli.models.names.offline import identity_digest, write_json


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # A private op (torch.compile's CPU backend calls it); its availability is probed
    # once by onednn_problem(), and any model it cannot serve keeps nn.Linear.
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def onednn_problem() -> str | None:
    """None when this PyTorch computes float32 linear layers with oneDNN correctly, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch was built without oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this PyTorch has no torch.ops.mkldnn._linear_pointwise"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=generator)
    bias = torch.randn(24, generator=generator)
    x = torch.randn(2, 3, 40, generator=generator)
    try:
        with torch.inference_mode():
            got = _onednn_linear(x, weight, bias)
    except Exception as exc:  # an op that exists but fails on this CPU
        return f"oneDNN's linear failed here ({type(exc).__name__}: {exc})"
    if got.shape != (2, 3, 24) or not torch.allclose(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4):
        return "oneDNN's linear disagreed with nn.Linear on a probe"
    return None


class OneDnnLinear(torch.nn.Linear):
    """nn.Linear whose float32 CPU inference goes through oneDNN; anything else (autograd,
    other dtypes or devices), and fewer rows than `stock_below` (see choose_stock_rows),
    takes nn.Linear's own path."""

    stock_below = 1  # rows fewer than this are PyTorch's own kernel's (1: none)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        weight = self.weight
        if (
            input.numel() < self.stock_below * self.in_features
            or input.dtype != torch.float32
            or weight.dtype != torch.float32
            or input.device.type != "cpu"
            or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))
        ):
            return F.linear(input, weight, self.bias)
        return _onednn_linear(input, weight, self.bias)


def set_onednn_linear(model: torch.nn.Module, enabled: bool = True) -> int:
    """Switch every float32 CPU nn.Linear of `model` to OneDnnLinear (or back, with
    enabled=False). Returns how many layers are switched.

    The layers change class in place rather than being replaced: the module objects,
    their parameters (tied embeddings included), hooks and state_dict stay as they are,
    and switching back is exact.
    """
    switched = 0
    for module in model.modules():
        if type(module) not in (torch.nn.Linear, OneDnnLinear):
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        module.__class__ = OneDnnLinear if enabled else torch.nn.Linear
        switched += 1
    return switched


def uses_onednn_linear(model: torch.nn.Module) -> bool:
    return any(type(module) is OneDnnLinear for module in model.modules())


# bfloat16 one-row products as two rows.
#
# PyTorch multiplies a bfloat16 matrix by one row with a matrix-vector kernel, by two or
# more rows with oneDNN's matrix-matrix one; on some CPUs the first is the slower, so that
# one row costs more than two, and a one-token pass more than a pass over a few tokens.
# That makes plain decoding and every plain step of speculative decoding pay for nothing;
# feeding the row twice makes a one-token pass cost what a two-token pass does. Where the
# one-row kernel is the faster (other CPUs), nothing changes: the choice is measured on the
# model's own shape (measured: BENCHMARKS.md, section "2-core AMD EPYC, AVX512-BF16, no
# AMX", one-row bfloat16 products as two).

ROW_PAIR_GAIN = 0.92  # two rows must take at most this share of one row's time to be used
# Smaller weights are not judged (kept stock): their products are the call's overhead, and
# timing them would only decide by noise.
MIN_JUDGED_WEIGHT = 1 << 20


class TwoRowLinear(torch.nn.Linear):
    """nn.Linear that multiplies one bfloat16 CPU row as two (the row twice, the first
    result kept); anything else takes nn.Linear's own path."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        if (
            input.numel() != self.in_features
            or input.dtype != torch.bfloat16
            or self.weight.dtype != torch.bfloat16
            or input.device.type != "cpu"
            or (torch.is_grad_enabled() and (input.requires_grad or self.weight.requires_grad))
        ):
            return F.linear(input, self.weight, self.bias)
        row = input.reshape(1, self.in_features)
        out = F.linear(torch.cat([row, row]), self.weight, self.bias)[:1]
        return out.reshape(*input.shape[:-1], self.out_features)


def _weight_shape(module: torch.nn.Linear) -> tuple[int, int]:
    """The (out_features, in_features) shape of a linear layer's 2-D weight."""
    rows, cols = module.weight.shape
    return rows, cols


def _bfloat16_cpu_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [
        module
        for module in model.modules()
        if isinstance(module, torch.nn.Linear)
        and type(module) in (torch.nn.Linear, TwoRowLinear)
        and module.weight.dtype == torch.bfloat16
        and module.weight.device.type == "cpu"
    ]


def set_two_row_linear(model: torch.nn.Module, enabled: bool = True) -> int:
    """Switch every bfloat16 CPU nn.Linear of `model` to TwoRowLinear (or back), in place as
    set_onednn_linear does. Returns how many layers are switched."""
    layers = _bfloat16_cpu_linears(model)
    for module in layers:
        module.__class__ = TwoRowLinear if enabled else torch.nn.Linear
    return len(layers)


def alternating_pairs(first, second, rounds: int) -> list[tuple[float, float]]:
    """(first's, second's) seconds from `rounds` adjacent timings of two zero-argument timers,
    after one warm-up call of each; the order alternates from round to round, so that a
    shared machine's drift hits both alike and neither always runs first."""
    first(), second()
    pairs = []
    for round_ in range(rounds):
        if round_ % 2:
            b, a = second(), first()
        else:
            a, b = first(), second()
        pairs.append((a, b))
    return pairs


def row_pair_ratio(weight: torch.Tensor, rounds: int = 9, calls: int = 4, clock=time.perf_counter) -> float:
    """What multiplying two rows by `weight` costs as a share of one row: the median over
    `rounds` alternating adjacent timings (each of `calls` products)."""
    # Not zeros: PyTorch's one-row kernel is faster on a row of zeros than on real ones.
    rows = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)

    def seconds(rows: torch.Tensor) -> float:
        started = clock()
        for _ in range(calls):
            F.linear(rows, weight)
        return clock() - started

    with torch.inference_mode():
        pairs = alternating_pairs(lambda: seconds(rows[:1]), lambda: seconds(rows), rounds)
    return statistics.median(two / one if one > 0 else 1.0 for one, two in pairs)


# How many loads' row-pair ratios decide together. One: the first load's timing stands, so no
# later start times anything (with seven, each of the first seven bfloat16 starts timed), and
# a decision never flips between runs; the cost is that an unlucky first timing stays until
# the kernels folder of the cache is removed.
REMEMBERED_RATIOS = 1


def two_rows_pay(model: torch.nn.Module, history_dir: Path | None = None, machine: str = "") -> bool:
    """Whether one-row bfloat16 products of `model` run faster as two rows on this CPU,
    measured on the weight shape that holds most of its linear parameters.

    With `history_dir`, the ratio joins those of the latest loads on this `machine` (its
    CPU's name), torch build, thread count and weight shape, and the median of the latest
    REMEMBERED_RATIOS decides; once that many loads have timed it, it stands and later loads
    do not time it again: a flip would change both the speed and bfloat16's rounding from
    one run to the next."""
    layers = _bfloat16_cpu_linears(model)
    if not layers:
        return False
    by_shape: dict[tuple[int, int], int] = {}
    for module in layers:
        shape = _weight_shape(module)
        by_shape[shape] = by_shape.get(shape, 0) + module.weight.numel()
    shape = max(by_shape, key=lambda judged: by_shape[judged])
    if shape[0] * shape[1] < MIN_JUDGED_WEIGHT:
        return False
    history = None if history_dir is None else row_pair_history(history_dir, machine, shape)
    ratios = [] if history is None else _read_numbers(history, "row_pair_ratios")
    if len(ratios) < REMEMBERED_RATIOS:  # decided once the history is full: later loads time nothing
        weight = next(module.weight for module in layers if _weight_shape(module) == shape)
        ratios = (ratios + [row_pair_ratio(weight.detach())])[-REMEMBERED_RATIOS:]
        if history is not None:
            write_json(history, {"row_pair_ratios": ratios})
    return statistics.median(ratios[-REMEMBERED_RATIOS:]) <= ROW_PAIR_GAIN


def row_pair_history(history_dir: Path, machine: str, shape: tuple[int, ...]) -> Path:
    """The file of the latest row-pair ratios for `machine`, this torch build and thread count, and `shape`."""
    return kernel_history(history_dir, "row-pairs", machine, shape)


def kernel_history(history_dir: Path, kind: str, machine: str, shape: tuple[int, ...]) -> Path:
    """The file of the latest loads' kernel timings of `kind` for `machine`, this torch build
    and thread count, and `shape`."""
    key = [machine, torch.__version__, torch.get_num_threads(), list(shape)]
    return history_dir / f"{kind}-{identity_digest(key)}.json"


def _read_numbers(path: Path, key: str) -> list[float]:
    try:
        numbers = json.loads(path.read_text(encoding="utf-8"))[key]
        return [float(n) for n in numbers if isinstance(n, (int, float)) and n > 0]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # none yet, or unreadable: this load's own timing decides


# float32: PyTorch's own kernel for the fewest rows, where it is the faster.
#
# Which kernel multiplies a few float32 rows faster depends on the CPU: on some, oneDNN's
# from one row on; on others, MKL's sgemm for the fewest rows and oneDNN's from a few more.
# So each weight shape keeps PyTorch's kernel below the first row count at which oneDNN's
# is as fast, timed at load (measured: BENCHMARKS.md, section "2-core Intel Xeon with AMX",
# float32 kernels by rows).

MAX_STOCK_ROWS = 8  # row counts judged: a decode step's passes; prompts go to oneDNN
# Smaller float32 weights keep oneDNN's kernel untimed. Lower than MIN_JUDGED_WEIGHT: small
# weights such as a 1.5B model's key and value projections (256 x 1536) can still be clearly
# faster with PyTorch's kernel for the fewest rows, and a pass runs dozens of them.
MIN_TIMED_FLOAT32_WEIGHT = 1 << 18
# How many loads' findings decide together (their lower median). One, as for REMEMBERED_RATIOS:
# with more, each of the first starts spends seconds timing (BENCHMARKS.md, "Figures behind options").
REMEMBERED_STOCK_ROWS = 1
# Bytes of weights one timing multiplies by: far beyond a CPU's last-level cache, so that each
# timing reads its weights from memory as a pass does, without reading all of a large
# model's layers 8 times for each row count (the 1.5B's gate and up projections: 3 GB).
TIMED_WEIGHT_BYTES = 256 << 20


def spread_layers(weights: Sequence[torch.Tensor], budget: int = TIMED_WEIGHT_BYTES) -> list[torch.Tensor]:
    """Layers of one shape, evenly spread over the model, holding at least `budget` bytes
    (all of them if they hold less)."""
    each = weights[0].numel() * weights[0].element_size()
    count = min(len(weights), max(1, -(-budget // each)))
    return [weights[index * len(weights) // count] for index in range(count)]


def stock_rows_below(
    weights: Sequence[torch.Tensor], max_rows: int = MAX_STOCK_ROWS, rounds: int = 3, clock=time.perf_counter
) -> int:
    """The first row count (1 to max_rows) at which oneDNN multiplies by float32 `weights`
    (the layers of one shape, each once per timing, as a pass does) as fast as PyTorch's own
    kernel: the median over `rounds` adjacent pairs in alternating order. max_rows + 1 where
    PyTorch's is the faster throughout.

    Every layer, not one weight again and again: a weight multiplied repeatedly stays in the
    CPU's cache, while a pass reads each from memory. One weight timed alone can put
    PyTorch's kernel ahead at row counts where, in real passes, it is clearly the slower."""
    calls = max(1, (1 << 24) // sum(weight.numel() for weight in weights))  # enough work per timing for the clock
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(max_rows, weights[0].shape[1], generator=generator)

    def timer(multiply, x: torch.Tensor):
        def seconds() -> float:
            started = clock()
            for _ in range(calls):
                for weight in weights:
                    multiply(x, weight)
            return clock() - started

        return seconds

    with torch.inference_mode():
        for count in range(1, max_rows + 1):
            x = rows[:count]
            stock = timer(lambda x, weight: F.linear(x, weight), x)
            onednn = timer(lambda x, weight: _onednn_linear(x, weight, None), x)
            pairs = alternating_pairs(stock, onednn, rounds)
            if statistics.median(a / b if b > 0 else 1.0 for a, b in pairs) >= 1.0:
                return count
    return max_rows + 1


def choose_stock_rows(
    model: torch.nn.Module,
    history_dir: Path | None = None,
    machine: str = "",
    progress: Callable[[str], None] | None = None,
) -> dict[tuple[int, int], int]:
    """Time, for each weight shape of `model`'s OneDnnLinear layers, the rows below which
    PyTorch's own kernel is the faster (stock_rows_below), and set each layer's
    `stock_below` to it. Shapes too small to judge (MIN_TIMED_FLOAT32_WEIGHT) stay oneDNN's.

    With `history_dir`, each shape's finding joins those of the latest loads on this
    `machine`, torch build and thread count, and the lower median of the latest
    REMEMBERED_STOCK_ROWS decides; once that many loads have timed a shape, it stands and
    later loads do not time it again: a shape near the crossing (two kernels even at 4 rows)
    must not flip from load to load, each flip changing float32's rounding in passes of that
    size. `progress` hears of the timing before it starts (nothing where no shape is large
    enough to time). Returns {shape: rows}."""
    layers = [module for module in model.modules() if type(module) is OneDnnLinear]
    weights: dict[tuple[int, int], list[torch.Tensor]] = {}
    for module in layers:
        weights.setdefault(_weight_shape(module), []).append(module.weight.detach())
    judged = {shape: same for shape, same in weights.items() if shape[0] * shape[1] >= MIN_TIMED_FLOAT32_WEIGHT}
    chosen: dict[tuple[int, int], int] = {}
    remembered: dict[tuple[int, int], list[int]] = {}
    for shape in judged:
        found = (
            []
            if history_dir is None
            else [
                int(n) for n in _read_numbers(kernel_history(history_dir, "stock-rows", machine, shape), "stock_below")
            ]
        )
        if len(found) >= REMEMBERED_STOCK_ROWS:  # decided: later loads time nothing
            chosen[shape] = statistics.median_low(found[-REMEMBERED_STOCK_ROWS:])
        remembered[shape] = found
    timed = {shape: same for shape, same in judged.items() if shape not in chosen}
    if timed and progress is not None:
        progress(f"timing float32 kernels by rows for {len(timed)} weight shapes (PyTorch's or oneDNN's)")
    for shape, same_shape in timed.items():
        rows = stock_rows_below(spread_layers(same_shape))
        if history_dir is not None:
            found = (remembered[shape] + [rows])[-REMEMBERED_STOCK_ROWS:]
            write_json(kernel_history(history_dir, "stock-rows", machine, shape), {"stock_below": found})
            rows = statistics.median_low(found)
        chosen[shape] = rows
    for module in layers:
        module.stock_below = chosen.get(_weight_shape(module), 1)
    return chosen


def set_cpu_linear(model: torch.nn.Module, linear: str, enabled: bool = True) -> None:
    """Switch `model`'s layers to the kernels a load chose (LoadedModel.linear), or back to
    PyTorch's stock ones (to time transformers' own methods on the same model)."""
    if linear == "onednn":
        set_onednn_linear(model, enabled)
    elif linear == "two-row":
        set_two_row_linear(model, enabled)
