"""float32 linear layers through oneDNN on the CPU: the same modules and weights, float32
results up to rounding, greedy output still exactly the stock target's, and a quiet
fallback wherever oneDNN cannot serve. bfloat16 one-row products as two rows: the first
row of the two-row product, chosen at load only where the measured pair says it pays."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import save_model_folder, tiny_llama, wrap
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.events import TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.models import loading
from speccli.models.kernels import onednn
from speccli.models.loading import load_model
from speccli.models.kernels.onednn import (
    OneDnnLinear,
    TwoRowLinear,
    onednn_problem,
    row_pair_ratio,
    set_onednn_linear,
    set_two_row_linear,
    two_rows_pay,
    uses_onednn_linear,
)

PROMPTS = ["def fib(n):", "hello world", "abcabcabc", "1, 2, 3,", "The quick brown fox"]


def linear_count(model: torch.nn.Module) -> int:
    return sum(isinstance(module, torch.nn.Linear) for module in model.modules())


def test_this_pytorch_runs_float32_linear_through_onednn():
    assert onednn_problem() is None


def test_switching_keeps_modules_and_weights_and_float32_results():
    model = tiny_llama(60, seed=3)
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    with torch.inference_mode():
        stock = model(ids).logits
    weights = {name: param for name, param in model.named_parameters()}
    modules = list(model.modules())

    assert set_onednn_linear(model) == linear_count(model) == 2 * 7 + 1  # 7 per layer, plus the head
    assert type(model.lm_head) is OneDnnLinear and uses_onednn_linear(model)
    assert list(model.modules()) == modules
    assert all(param is weights[name] for name, param in model.named_parameters())
    with torch.inference_mode():
        fast = model(ids).logits
    torch.testing.assert_close(fast, stock, rtol=1e-5, atol=1e-5)

    assert set_onednn_linear(model, enabled=False) == 15
    assert type(model.lm_head) is torch.nn.Linear and not uses_onednn_linear(model)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, stock)  # switching back is exact


def test_autograd_and_other_dtypes_keep_nn_linears_path():
    layer = torch.nn.Linear(8, 4)
    set_onednn_linear(layer)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()  # the oneDNN op has no backward: nn.Linear's path served it
    assert x.grad is not None and layer.weight.grad is not None
    half = torch.nn.Linear(8, 4).to(torch.bfloat16)
    assert set_onednn_linear(half) == 0 and type(half) is torch.nn.Linear


def greedy_tokens(decoder: SpeculativeDecoder, prompt_ids: list[int], n: int) -> list[int]:
    events = decoder.generate(prompt_ids, SamplingConfig(), SpecConfig(k="auto", max_new_tokens=n))
    return [event.token_id for event in events if isinstance(event, TokenEvent)]


@pytest.mark.parametrize("pair_index", [0, 1])
def test_greedy_speculative_output_on_onednn_equals_the_stock_targets_own(pairs, tokenizer, pair_index):
    pair = pairs[pair_index]
    target, draft = copy.deepcopy(pair.target), copy.deepcopy(pair.draft)
    assert set_onednn_linear(target) and set_onednn_linear(draft)
    target_lm = wrap(target)
    decoder = SpeculativeDecoder(target_lm, tokenizer, [2], ModelDrafter(wrap(draft), target_lm.vocab_size))
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            out = pair.target.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
        reference = out[0, len(ids) :].tolist()
        reference = reference[: reference.index(2)] if 2 in reference else reference
        assert greedy_tokens(decoder, ids, 40) == reference, prompt


@pytest.fixture(scope="module")
def folder(tokenizer, tmp_path_factory):
    return str(save_model_folder(tiny_llama(len(tokenizer), seed=4), tokenizer, tmp_path_factory.mktemp("onednn")))


def test_load_model_uses_onednn_for_float32_on_the_cpu_only(folder, monkeypatch):
    loaded = load_model(folder, LoadConfig(device="cpu", dtype="float32", quant="none"))
    assert loaded.linear == "onednn" and uses_onednn_linear(loaded.model)
    assert "float32, oneDNN linear on cpu" in loaded.describe()

    stock = load_model(folder, LoadConfig(device="cpu", dtype="float32", quant="none", cpu_linear="stock"))
    assert stock.linear == "stock" and not uses_onednn_linear(stock.model)
    assert "oneDNN" not in stock.describe()

    monkeypatch.setattr(loading, "two_rows_pay", lambda model, *history: False)
    bf16 = load_model(folder, LoadConfig(device="cpu", dtype="bfloat16", quant="none"))
    assert bf16.linear == "stock"  # bfloat16 already runs through oneDNN in PyTorch itself
    int8 = load_model(folder, LoadConfig(device="cpu", quant="int8"))
    assert int8.linear == "stock"  # every linear layer is a quantized one

    monkeypatch.setattr(loading, "onednn_problem", lambda: "no oneDNN in this build")
    assert load_model(folder, LoadConfig(device="cpu", dtype="float32", quant="none")).linear == "stock"


def test_cpu_linear_must_be_known():
    with pytest.raises(ValueError, match="cpu_linear must be one of auto, stock, got 'mkl'"):
        LoadConfig(cpu_linear="mkl")


def test_a_one_row_bfloat16_product_is_the_first_row_of_the_two_row_one():
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    assert set_two_row_linear(layer) == 1 and type(layer) is TwoRowLinear
    generator = torch.Generator().manual_seed(0)
    row = torch.randn(1, 1, 16, generator=generator).to(torch.bfloat16)
    rows = torch.randn(1, 3, 16, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        doubled = torch.nn.functional.linear(torch.cat([row[0], row[0]]), layer.weight, layer.bias)
        assert layer(row).shape == (1, 1, 8) and torch.equal(layer(row)[0], doubled[:1])
        assert torch.equal(layer(rows), torch.nn.functional.linear(rows, layer.weight, layer.bias))
    x = row.clone().requires_grad_(True)
    layer(x).sum().backward()  # autograd takes nn.Linear's own path
    assert x.grad is not None
    assert set_two_row_linear(torch.nn.Linear(16, 8)) == 0  # float32 layers are oneDNN's


def test_switching_to_two_rows_keeps_modules_and_weights_and_switches_back_exactly():
    model = tiny_llama(60, seed=3).to(torch.bfloat16)
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    with torch.inference_mode():
        stock = model(ids).logits
    weights = {name: param for name, param in model.named_parameters()}
    assert set_two_row_linear(model) == linear_count(model) == 15
    assert all(param is weights[name] for name, param in model.named_parameters())
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, stock)  # six rows: nn.Linear's own path
    assert set_two_row_linear(model, enabled=False) == 15
    assert type(model.lm_head) is torch.nn.Linear


def test_the_row_pair_ratio_is_the_median_of_adjacent_pairs_in_alternating_order():
    # Seconds each timing takes, in the order taken: the warm-ups (one row, two rows),
    # then round 0 one/two, round 1 two/one (a slow spell slows both), round 2 one/two.
    durations = iter([9.0, 9.0, 1.0, 0.8, 1.2, 2.0, 1.0, 0.5])
    now = [0.0]
    ticks = []

    def fake_clock() -> float:
        # Called twice per timing: at its start, then at its end.
        if len(ticks) % 2:
            now[0] += next(durations)
        ticks.append(now[0])
        return now[0]

    weight = torch.randn(4, 8).to(torch.bfloat16)
    # ratios 0.8, 0.6 and 0.5: the median 0.6 (taken in one order throughout: 0.8)
    assert row_pair_ratio(weight, rounds=3, calls=1, clock=fake_clock) == pytest.approx(0.6)


def test_two_rows_are_judged_on_the_shape_that_holds_most_parameters(monkeypatch):
    model = tiny_llama(60, seed=3).to(torch.bfloat16)  # hidden 32: q/o 32x32, gate/up 64x32, down 32x64
    monkeypatch.setattr(onednn, "row_pair_ratio", lambda weight: pytest.fail("timed a product too small to judge"))
    assert not two_rows_pay(model)  # too small to judge: stock, without timing anything
    monkeypatch.setattr(onednn, "MIN_JUDGED_WEIGHT", 0)
    shapes = []
    monkeypatch.setattr(onednn, "row_pair_ratio", lambda weight: shapes.append(tuple(weight.shape)) or 0.8)
    assert two_rows_pay(model) and shapes == [(64, 32)]
    monkeypatch.setattr(onednn, "row_pair_ratio", lambda weight: 0.95)
    assert not two_rows_pay(model)
    assert not two_rows_pay(tiny_llama(60, seed=3))  # float32: no bfloat16 layer to judge


def test_the_latest_loads_ratios_decide_together(monkeypatch, tmp_path):
    model = tiny_llama(60, seed=3).to(torch.bfloat16)
    monkeypatch.setattr(onednn, "MIN_JUDGED_WEIGHT", 0)
    monkeypatch.setattr(onednn, "REMEMBERED_RATIOS", 7)  # the rule for several loads (by default the first decides)
    measured = iter([0.85, 0.86, 0.84, 0.97, 0.99, 0.98, 0.99, 0.80])
    monkeypatch.setattr(onednn, "row_pair_ratio", lambda weight: next(measured))
    decisions = [two_rows_pay(model, tmp_path, "CPU A") for _ in range(8)]
    # A load or two that time above the bar do not flip the choice; once most of them do, it flips.
    assert decisions == [True] * 6 + [False] * 2
    history = onednn.row_pair_history(tmp_path, "CPU A", (64, 32))
    assert json.loads(history.read_text())["row_pair_ratios"] == [0.85, 0.86, 0.84, 0.97, 0.99, 0.98, 0.99]
    assert next(measured) == 0.80  # seven loads decided: the eighth timed nothing
    # Another CPU (or torch build, thread count, shape) starts its own record.
    assert onednn.row_pair_history(tmp_path, "CPU B", (64, 32)) != history
    monkeypatch.setattr(onednn, "row_pair_ratio", lambda weight: 0.95)
    assert not two_rows_pay(model, tmp_path, "CPU B")
    history.write_text("not json")  # unreadable: this load's own timing decides, and starts it again
    monkeypatch.setattr(onednn, "row_pair_ratio", lambda weight: 0.85)
    assert two_rows_pay(model, tmp_path, "CPU A")
    assert json.loads(history.read_text())["row_pair_ratios"] == [0.85]


def test_load_model_keeps_its_row_pair_ratios_in_the_cache(folder, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(loading, "two_rows_pay", lambda model, *history: seen.append(history) or False)
    load_model(folder, LoadConfig(device="cpu", dtype="bfloat16", quant="none"), cache_dir=tmp_path)
    assert seen == [(tmp_path / "kernels", loading.cpu_name())]


def test_load_model_multiplies_one_bfloat16_row_as_two_where_that_pays(folder, monkeypatch):
    monkeypatch.setattr(loading, "two_rows_pay", lambda model, *history: True)
    loaded = load_model(folder, LoadConfig(device="cpu", dtype="bfloat16", quant="none"))
    assert loaded.linear == "two-row" and type(loaded.model.lm_head) is TwoRowLinear
    assert "bfloat16, one-row products as two on cpu" in loaded.describe()
    stock = load_model(folder, LoadConfig(device="cpu", dtype="bfloat16", quant="none", cpu_linear="stock"))
    assert stock.linear == "stock" and type(stock.model.lm_head) is torch.nn.Linear
    assert load_model(folder, LoadConfig(device="cpu", dtype="float32", quant="none")).linear == "onednn"


def test_rows_below_stock_below_take_pytorchs_own_kernel():
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(48, 24)
    set_onednn_linear(layer)
    layer.stock_below = 3
    with torch.inference_mode():
        for rows in (1, 2, 3, 5):
            x = torch.randn(1, rows, 48, generator=generator)
            own = F.linear(x, layer.weight, layer.bias)
            through = onednn._onednn_linear(x, layer.weight, layer.bias)
            assert torch.equal(layer(x), own if rows < 3 else through), rows


class ScriptedKernels:
    """Stands in for the two kernels and the clock: each product takes the scripted seconds
    for its kernel and rows."""

    def __init__(self, stock: dict[int, float], onednn: dict[int, float]) -> None:
        self.seconds = {"stock": stock, "onednn": onednn}
        self.now = 0.0
        self.timed: list[tuple[str, int]] = []

    def clock(self) -> float:
        return self.now

    def run(self, kernel: str, x: torch.Tensor) -> None:
        self.timed.append((kernel, x.shape[0]))
        self.now += self.seconds[kernel][x.shape[0]]

    def install(self, monkeypatch) -> None:
        fake_f = type("F", (), {"linear": staticmethod(lambda x, weight, bias=None: self.run("stock", x))})
        monkeypatch.setattr(onednn, "F", fake_f)
        monkeypatch.setattr(onednn, "_onednn_linear", lambda x, weight, bias: self.run("onednn", x))


def test_stock_rows_are_those_below_the_first_count_where_onednn_is_as_fast(monkeypatch):
    # The Xeon's MLP weight: PyTorch's kernel faster for 1-3 rows, slower at 4.
    kernels = ScriptedKernels(
        {1: 1.10, 2: 1.14, 3: 1.16, 4: 2.60, 5: 2.7}, {1: 1.24, 2: 1.98, 3: 2.06, 4: 2.18, 5: 2.3}
    )
    kernels.install(monkeypatch)
    weights = [torch.zeros(8, 1 << 20), torch.zeros(8, 1 << 20)]  # two layers: one product each per timing
    assert onednn.stock_rows_below(weights, rounds=3, clock=kernels.clock) == 4
    assert max(rows for _, rows in kernels.timed) == 4  # stopped at the first count oneDNN wins
    # Each timing multiplies by both layers (a warm-up and 3 rounds per kernel and row count).
    assert len(kernels.timed) == 4 * 2 * 4 * 2
    # oneDNN faster from one row (the AVX512 machine): nothing for PyTorch's kernel.
    kernels.seconds = {"stock": {1: 6.0}, "onednn": {1: 3.5}}
    assert onednn.stock_rows_below(weights, rounds=3, clock=kernels.clock) == 1
    # PyTorch's faster throughout: every count judged, and one more.
    kernels.seconds = {"stock": {n: 1.0 for n in range(1, 9)}, "onednn": {n: 2.0 for n in range(1, 9)}}
    assert onednn.stock_rows_below(weights, rounds=3, clock=kernels.clock) == onednn.MAX_STOCK_ROWS + 1


def test_each_weight_shape_keeps_its_own_stock_rows_and_the_first_load_decides(monkeypatch, tmp_path):
    model = tiny_llama(60, seed=3)  # q/o 32x32, gate/up 64x32, down 32x64, head 60x32
    set_onednn_linear(model)
    monkeypatch.setattr(onednn, "stock_rows_below", lambda weights: pytest.fail("timed a product too small to judge"))
    said = []
    assert onednn.choose_stock_rows(model, progress=said.append) == {} and said == []  # nothing timed, nothing said
    assert {module.stock_below for module in model.modules() if type(module) is OneDnnLinear} == {1}

    monkeypatch.setattr(onednn, "MIN_TIMED_FLOAT32_WEIGHT", 64 * 32)
    found = iter([4, 2, 3, 5])  # in the order the shapes first appear: gate/up, down; then again
    timed = []
    monkeypatch.setattr(onednn, "stock_rows_below", lambda weights: timed.append(len(weights)) or next(found))
    assert onednn.choose_stock_rows(model, tmp_path, "CPU A", progress=said.append) == {(64, 32): 4, (32, 64): 2}
    assert said == ["timing float32 kernels by rows for 2 weight shapes (PyTorch's or oneDNN's)"]
    assert model.model.layers[0].mlp.up_proj.stock_below == 4 and model.model.layers[1].mlp.down_proj.stock_below == 2
    assert model.model.layers[0].self_attn.q_proj.stock_below == 1  # too small: oneDNN's
    assert timed == [4, 2]  # every layer of the shape: gate and up in both layers; down in both
    # The first load's findings stand: the next load times nothing.
    monkeypatch.setattr(onednn, "stock_rows_below", lambda weights: pytest.fail("timed again"))
    assert onednn.choose_stock_rows(model, tmp_path, "CPU A", progress=said.append) == {(64, 32): 4, (32, 64): 2}
    assert len(said) == 1
    history = onednn.kernel_history(tmp_path, "stock-rows", "CPU A", (64, 32))
    assert json.loads(history.read_text())["stock_below"] == [4]
    assert onednn.kernel_history(tmp_path, "stock-rows", "CPU B", (64, 32)) != history


def test_load_model_gives_float32_rows_to_the_faster_kernel(folder, monkeypatch, tmp_path):
    seen = []

    def choose(model, *history, progress):
        seen.append(history)
        for module in model.modules():
            if type(module) is OneDnnLinear and module.weight.shape[0] > module.weight.shape[1]:
                module.stock_below = 4
        return {(64, 32): 4, (32, 32): 1}

    monkeypatch.setattr(loading, "choose_stock_rows", choose)
    loaded = load_model(folder, LoadConfig(device="cpu", dtype="float32", quant="none"), cache_dir=tmp_path)
    assert seen == [(tmp_path / "kernels", loading.cpu_name())]
    assert loaded.linear == "onednn" and loaded.stock_rows == {"64x32": 4}
    assert "float32, oneDNN linear from 4 rows on cpu" in loaded.describe()


def test_a_full_history_decides_and_later_loads_time_nothing(monkeypatch, tmp_path):
    model = tiny_llama(60, seed=3)
    set_onednn_linear(model)
    monkeypatch.setattr(onednn, "MIN_TIMED_FLOAT32_WEIGHT", 64 * 32)
    monkeypatch.setattr(onednn, "REMEMBERED_STOCK_ROWS", 3)
    found = iter([4, 2, 1, 2, 6, 2])  # gate/up, down; three loads
    monkeypatch.setattr(onednn, "stock_rows_below", lambda weights: next(found))
    for _ in range(3):
        chosen = onednn.choose_stock_rows(model, tmp_path, "CPU A")
    assert chosen == {(64, 32): 4, (32, 64): 2}  # the lower medians of 4, 1, 6 and 2, 2, 2
    monkeypatch.setattr(onednn, "stock_rows_below", lambda weights: pytest.fail("timed a decided shape"))
    said = []
    assert onednn.choose_stock_rows(model, tmp_path, "CPU A", progress=said.append) == chosen and said == []
    assert model.model.layers[0].mlp.up_proj.stock_below == 4
    # Another machine's history is its own: it times again.
    monkeypatch.setattr(onednn, "stock_rows_below", lambda weights: 5)
    assert onednn.choose_stock_rows(model, tmp_path, "CPU B") == {(64, 32): 5, (32, 64): 5}


def test_two_rows_are_timed_until_the_history_is_full(monkeypatch, tmp_path):
    model = tiny_llama(60, seed=3).to(torch.bfloat16)
    monkeypatch.setattr(onednn, "MIN_JUDGED_WEIGHT", 1)
    monkeypatch.setattr(onednn, "REMEMBERED_RATIOS", 3)
    ratios = iter([0.5, 1.5, 0.6])
    monkeypatch.setattr(onednn, "row_pair_ratio", lambda weight: next(ratios))
    assert [onednn.two_rows_pay(model, tmp_path, "CPU A") for _ in range(3)] == [True, False, True]
    monkeypatch.setattr(onednn, "row_pair_ratio", lambda weight: pytest.fail("timed a decided shape"))
    assert onednn.two_rows_pay(model, tmp_path, "CPU A") is True  # the median of 0.5, 1.5, 0.6


def test_a_timing_reads_an_even_spread_of_layers_beyond_the_cache():
    layers = [torch.zeros(256, 1024) for _ in range(28)]  # 1 MiB each
    assert onednn.spread_layers(layers, budget=64 << 20) == layers  # they hold less: all of them
    spread = onednn.spread_layers(layers, budget=7 << 20)
    assert [next(i for i, w in enumerate(layers) if w is s) for s in spread] == [0, 4, 8, 12, 16, 20, 24]
    assert len(onednn.spread_layers(layers, budget=(6 << 20) + 1)) == 7  # at least the budget
    assert len(onednn.spread_layers(layers[:1], budget=1)) == 1
