"""The compiled prefill (TalkerRunner._compile: the talker's whole stack as one dynamic-shape region) gives the
eager prefill's hidden states and keys, traces into whole graphs (a graph break would bring back the per-layer
host overhead it exists to remove), and takes new prompt lengths and counts without recompiling."""

import torch
import torch._dynamo

from serving.engine.checkpoint import resolve_model
from serving.engine.engine import EngineConfig
from serving.engine.loader import load_stages
from serving.engine.request import GenerationRequest

CONFIG = dict(max_batch_size=4, max_model_len=128, chunk_frames=4, first_chunk_frames=2, left_context_frames=4)
TEXTS = ("Hello there.", "A much longer sentence for the prefill to chew on, really.", "Short again, but not 1.")


def prefill_rows(runner, texts):
    """Hidden state and keys of each prompt, prefilled together into slots 0.. (fresh slots)."""
    for slot in range(len(texts)):
        runner.release(slot)
    requests = [(slot, GenerationRequest(task="CustomVoice", text=t, speaker="vivian", max_new_tokens=20))
                for slot, t in enumerate(texts)]
    runner.kv.k.zero_()
    results = runner.prefill_many(requests)
    assert not any(isinstance(r, Exception) for r in results)
    return [(runner.hidden[slot].clone(), runner.kv.k[:, slot].clone()) for slot in range(len(texts))]


def test_compiled_prefill_equals_eager_without_graph_breaks_or_recompiles():
    runner, _codec, _info = load_stages(EngineConfig(model=str(resolve_model("tiny-random")), compile=False, **CONFIG))
    eager = [prefill_rows(runner, TEXTS[:1]), prefill_rows(runner, TEXTS)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runner._prefill_stack = torch.compile(runner.talker.model.forward, dynamic=True)  # what _compile installs
    with torch.inference_mode():
        runner._trace_prefill_shapes()  # what warmup() does before serving
    traced = dict(torch._dynamo.utils.counters["stats"])
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    compiled = [prefill_rows(runner, TEXTS[:1]), prefill_rows(runner, TEXTS)]  # new lengths, 1 and 3 rows
    assert dict(torch._dynamo.utils.counters["stats"]) == traced, "a new prompt shape recompiled the stack"
    for want_rows, got_rows in zip(eager, compiled):
        for (h_want, k_want), (h_got, k_got) in zip(want_rows, got_rows):
            torch.testing.assert_close(h_got, h_want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(k_got, k_want, atol=1e-5, rtol=1e-5)
