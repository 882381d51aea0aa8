"""benchmarks/decode_bench.py's prompt rows on a CPU (its timing needs CUDA): stage_prompts lays prompts out as the
engine stages an admission, through the engine's own layout, so --prompt-rows times the rows a served step carries."""

import pytest
import torch

from benchmarks.decode_bench import stage_prompts
from serving.engine.checkpoint import resolve_model
from serving.engine.engine import EngineConfig
from serving.engine.loader import load_stages
from serving.engine.talker_stage import fused_stack


@pytest.fixture(scope="module")
def runner():
    pytest.importorskip("triton", reason="triton is a test dependency (scripts/setup.sh --test installs it)")
    runner, _codec, _info = load_stages(EngineConfig(model=str(resolve_model("tiny-random")), max_batch_size=8,
                                                     max_model_len=512, ignore_eos=True))
    # the wide talker layers, which carry prompt rows, exist on CUDA only unless forced (nothing runs them here)
    runner.wide_talker = fused_stack(runner.talker.model, runner.device, force=True, wide=True)
    runner.wide_talker_rows = 3
    runner.set_up_prompt_rows()
    return runner


def test_prompts_fill_the_rows_whole_and_the_padding_continues_the_last_prompt(runner):
    rows = stage_prompts(runner, 8, 64, 18)  # 3 prompts of 18 positions: 54, padded to the 64-row graph
    assert rows == 64
    slots = runner._prompt_slots[:rows].tolist()
    positions = runner._prompt_pos[:rows, 0].tolist()
    assert slots == [0] * 18 + [1] * 18 + [2] * 18 + [2] * 10
    assert positions == list(range(18)) * 3 + list(range(18, 28))
    assert torch.count_nonzero(runner._prompt_x[54:64]) == 0 and torch.count_nonzero(runner._prompt_x[:54]) > 0


def test_more_prompts_than_the_batch_has_slots_take_them_in_turn_and_rows_past_the_largest_are_not_carried(runner):
    rows = stage_prompts(runner, 4, 128, 20)  # 6 prompts in 4 slots: 120 positions, the 128-row graph
    assert rows == 128
    slots = runner._prompt_slots[:120].tolist()
    assert slots == [s for s in (0, 1, 2, 3, 0, 1) for _ in range(20)]
    assert stage_prompts(runner, 8, 4096, 64) == 0  # more than the largest prompt rows: the step carries none
    assert stage_prompts(runner, 2, 64, 18) == 0  # a step of fewer rows than the wide layers take: none either
