"""scripts/gpu_check.py, the GPU driver, in its --smoke form on the CPU: every stage runs and
lands in the JSON and the markdown, and what it checks holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))


def run_driver(out: Path, *args: str) -> subprocess.CompletedProcess:
    # The smoke run takes about 12 s alone; its default budget (100 s) is cut when the rest of
    # the suite shares the cores (seen: 100 s), and a stage cut short is an error by design.
    return subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--smoke", "--budget", "400", "--out", str(out), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )


@pytest.mark.slow
def test_the_smoke_run_measures_every_stage(tmp_path):
    result = run_driver(tmp_path / "out")
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert "errors" not in data
    assert all(c["equal"] == c["prompts"] == 2 for c in data["correctness"]["float32_greedy"])
    assert {c["tree"] for c in data["correctness"]["float32_greedy"]} == {False, True}
    assert {c["fused"] for c in data["correctness"]["float32_greedy"]} == {False, True}
    fusion = data["fusion"]  # q/k/v and gate/up fused on the bf16 target, timed before and after
    assert fusion["layers"] == 4 and list(fusion["unfused"]) == list(fusion["fused"]) == ["1", "8"]
    assert data["correctness"]["sampled"]["passed"]
    assert data["profile"]["bf16"]["pass"]["cpu_ops"] > 0 and data["profile"]["bf16"]["loop_step"]["wall_ms"] > 0
    costs = data["pass_costs"]["bf16"]
    assert list(costs["contexts"]) == ["64", "300"] and list(costs["contexts"]["64"]["ms"]) == ["1", "2", "4", "8"]
    assert set(costs["draft_token_ms"]) == set(costs["draft_chain_ms"]) == {"self", "0.5b"}
    assert all(c["device"] > 0 and c["host"] > 0 and not c["host_chains"] for c in costs["draft_chain_ms"].values())
    runs = data["speed"]["bf16"]
    assert runs["specgen-draft-self-k4"]["acceptance"] > 0.5 > runs["specgen-draft-0.5b-k4"]["acceptance"]
    assert runs["specgen-plain"]["tokens"] == 2 * 16 and runs["specgen-plain"]["predicted_tokens_per_s"] > 0
    assert set(data["peers"]) == {"hf-eager", "hf-static-compile"}
    projected = data["projection"]["bf16"]
    assert projected["tokens"] == 1278 and projected["k"]["4"]["speedup"] > 0  # the committed traces
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "## tokens/s, bf16" in table and "| specgen-tree-self |" in table
    heads = data["eagle3"]  # the EAGLE-3 stage: features of three layers kept, a head step timed
    assert heads["features_width"] == 3 * 64 and list(heads["verify_ms"]) == ["1", "8", "16"]
    # A step is the difference of two medians: on a loaded CPU it can come out below zero.
    assert heads["head_first_token_ms"] > 0 and all(
        isinstance(heads[k], float) for k in ("head_step_ms", "head_step_ms_host_picks")
    )
    assert "## EAGLE-3 head on a smoke target" in table
    assert result.stdout == table + "\n"


def test_unknown_formats_are_refused(tmp_path):
    result = run_driver(tmp_path / "out", "--formats", "bf16,int3")
    assert (
        result.returncode == 2
        and "--formats takes bf16, int4, int4-hqq, nf4, fp8, bf16+compile; not int3" in result.stderr
    )


def test_the_prediction_counts_each_pass_and_draft_token():
    from gpu_check import predicted

    run = {"tokens": 10, "fed": [5, 1, 3], "drafted": [4, 0, 2]}
    # 5 -> the 6-token cost, 1 -> 1, 3 -> 4; six draft tokens at 1 ms.
    assert predicted(run, {1: 10.0, 4: 12.0, 6: 14.0}, 1.0) == round(10 / ((14 + 10 + 12 + 6) / 1e3), 2)
    assert predicted(run, {1: 10.0, 4: 12.0}, 1.0) is None  # a pass larger than any measured


def test_acceptance_traces_replay_fixed_k_steps():
    from acceptance_traces import accepted_runs, project, replay_steps

    matches = [True, True, False, True, True, True, False, False]
    assert accepted_runs(matches) == [2, 1, 0, 3, 2, 1, 0, 0]
    # k 2: at 0 two accepted and the bonus; at 3 two more and the bonus; at 6 one drafted and
    # rejected (the target's token); at 7, the last, nothing is left to draft.
    assert replay_steps(matches, 2) == [(2, 2), (2, 2), (1, 0), (0, 0)]
    assert replay_steps(matches, 4) == [(4, 2), (4, 3), (0, 0)]  # nothing drafted past the answer's end
    # Every step costs a 1-token pass of 10 ms plus 1 ms a draft token; k 1 on "all match" doubles speed.
    result = project([[True] * 9 + [False]], {1: 10.0, 2: 10.0, 3: 10.0}, 1.0)
    assert result["plain_tokens_per_s"] == 100.0 and result["tokens"] == 10
    assert result["k"][1]["speedup"] == round((10 * 10) / (5 * 11), 3)
