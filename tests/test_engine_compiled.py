"""The talker stage with torch.compile on (the GPU default) decodes the codes of the eager stage.

Compiled here means Inductor's CPU code for the pieces a GPU compiles too (decoder layers, rotary tables, final
norms, code-0 logits with their penalties, the next input with its mask), with dynamic shapes: two batch sizes
and prompt lengths run through the same compiled code.
"""

import numpy as np
import pytest

from serving.engine.checkpoint import resolve_model
from serving.engine.engine import EngineConfig
from serving.engine.loader import load_stages
from serving.engine.request import GenerationRequest, SamplingParams

CONFIG = dict(max_batch_size=8, max_model_len=256, chunk_frames=4, first_chunk_frames=2, left_context_frames=4)
TEXTS = ["Hello there.", "A longer one, with a few more words.", "Short."]


def decode(runner, count, frames=5):
    reqs = [GenerationRequest(task="CustomVoice", text=t, speaker=s, max_new_tokens=20,
                              sampling=SamplingParams(seed=i + 1, repetition_penalty=1.3))
            for i, (t, s) in enumerate(zip(TEXTS[:count], ["vivian", "ryan", "dylan"]))]
    for result in runner.prefill_many(list(enumerate(reqs))):
        assert not isinstance(result, Exception)
    out = np.stack([runner.decode_step(count)[0] for _ in range(frames)])
    for slot in range(count):
        runner.release(slot)
    return out


@pytest.mark.slow
def test_compiled_stage_decodes_the_eager_codes():
    runner, _codec, _info = load_stages(EngineConfig(model=str(resolve_model("tiny-random")), compile=False, **CONFIG))
    runner.warmup()
    expected = {n: decode(runner, n) for n in (1, 3)}
    runner._compile()
    runner.compile_layers = True
    runner.warmup()
    assert runner.describe()["compiled_layers"]
    for n in (3, 1):
        np.testing.assert_array_equal(decode(runner, n), expected[n])
