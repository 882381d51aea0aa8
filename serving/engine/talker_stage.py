"""Stage 0 on its device: prefill one request into a KV slot, then decode every running slot one frame per step.

All per-request state lives in preallocated tensors indexed by slot (KV cache, positions, last hidden state,
code-0 history for the repetition penalty, trailing text, sampling parameters, seeds), so a decode step over
the first `bucket` slots has fixed shapes and no host synchronisation until its codes are read back: the
same function is captured as one CUDA graph per (batch bucket, KV-length bucket) on a GPU (cuda_graphs.py)
and runs eagerly on a CPU, beyond the largest graph, and for sampling options the graph's sampler does not take.
New requests are prefilled together in one forward pass per admission (bounded by a token budget), so a burst
of arrivals stalls the running streams for one batched pass instead of one pass per request; those admitted while a
step is in flight beside running requests ride the next step instead (stage), which stalls no one.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from serving.engine.cuda_graphs import (CacheView, FrameGraphs, PrefillGraphs, greatest_priority, make_graph_buckets,
                                       make_kv_buckets, prefill_shapes, sleep_until, smallest_cover, wait_sleeping)
from serving.engine.length_policy import frame_limit
from serving.engine.lru import LRU
from serving.engine.request import GenerationRequest
from serving.engine.rng import exponential_noise
from serving.engine.topk_sampling import eligible, sample_top_candidates
from serving.model.layers import KVCache, attention_mask
from serving.model.sampler import SamplingParams, mask_code0, penalize_repeats, sample
from serving.model.transfer import upload

PREFILL_TOKEN_BUDGET = 8192  # prompt positions per batched prefill pass (bounds the stall and its memory)
PREFILL_GRAPH_MAX_LEN = 1024  # longest prompt bucket with a prefill graph (its scratch cache is that long)
# Which layers a step of b rows runs (H100, decode_bench.py, docs/performance.md twenty-seventh pass): the code
# predictor's fused layers up to FUSED_CP_ROWS (at 6-8 rows their input-norm products trail cuBLAS's and the wide
# layers' frame is 4.5% shorter; at 1-4 rows the fused layers' is), the talker's fused layers up to
# FUSED_TALKER_ROWS (wide at 1-2 rows: 0.6B 8-12% slower; fused at 4 rows: 1.7B 13% slower), its wide layers from
# there on (at 3-24 rows a frame 5-7% shorter, 1.7B 3-7%, than through the compiled modules over the KV bucket)
FUSED_CP_ROWS = 4
FUSED_TALKER_ROWS = 2
WIDE_TALKER_ROWS = FUSED_TALKER_ROWS + 1
# Prompt positions a step of the wide talker layers carries as rows of its own (TalkerRunner.stage): one graph per
# batch bucket and size, up to STAGE_MAX_POSITIONS, so every staged admission fits one step (where a step cannot carry
# it, fewer rows than the wide layers take, its passes follow the step). A voice clone's prompt holds its reference's
# codes (~65 positions for a 4 s clip and short text): at 128 streams of short text an admission of ~11 clones (~700
# positions) outgrew the 256 rows of before, and its new rows sat the step out (H100: 632 -> 681 audio s/s with these)
STEP_PROMPT_ROWS = (32, 64, 128, 256, 384, 512, 768, 1024)
# Prompt positions beyond which an admission beside a running step (a burst: a level's first wave) is prefilled at
# once, before that step, rather than staged (TalkerRunner.stage)
STAGE_MAX_POSITIONS = 1024


class _HostBuffer:
    """Pinned landing place of one step's codes, and the event that says they have arrived."""

    def __init__(self, slots: int, groups: int):
        self.codes = torch.empty(slots, groups, dtype=torch.int64, pin_memory=True)
        self.ended = torch.empty(slots, dtype=torch.bool, pin_memory=True)
        self.event = torch.cuda.Event()
        self.busy = False


@dataclass
class StepHandle:
    """A launched decode step over slots [0, bucket): its codes on the host (CPU) or on their way (GPU)."""

    bucket: int
    codes: np.ndarray | None = None
    ended: np.ndarray | None = None
    buffer: _HostBuffer | None = None
    sat_out: tuple[int, ...] = ()  # slots set up after the step (their prompts' passes followed it): not their rows


def _triton_module(name: str, device: torch.device, force: bool = False):
    """serving.engine.<name>, a module of Triton kernels, on CUDA (or where forced: tests, in Triton's
    interpreter); None elsewhere and where Triton is missing."""
    if device.type != "cuda" and not force:
        return None
    try:
        return importlib.import_module(f"serving.engine.{name}")
    except ImportError:
        return None


def candidate_sampler(device: torch.device):
    """The candidate sampler for a device: one fused Triton kernel per draw on CUDA (triton_sampling), the torch
    version elsewhere (and where Triton is missing)."""
    module = _triton_module("triton_sampling", device)
    return module.sample_top_candidates if module is not None else _torch_candidates


def fused_stack(stack, device: torch.device, force: bool = False, wide: bool = False):
    """A decoder stack's decode passes of a few rows as Triton kernels (triton_layers.FusedStack; wide: of many
    rows, triton_layers.WideStack), on CUDA or where forced; None without Triton or for a stack it does not
    support."""
    module = _triton_module("triton_layers", device, force)
    kind = None if module is None else module.WideStack if wide else module.FusedStack
    return kind(stack) if kind is not None and kind.supports(stack) else None


def _torch_candidates(logits, params, seed, frame, group):
    return sample_top_candidates(logits.float(), params, seed, frame, group)


def _rows(params: SamplingParams, n: int) -> SamplingParams:
    return SamplingParams(params.do_sample[:n], params.temperature[:n], params.top_k[:n], params.top_p[:n])


class TalkerRunner:
    def __init__(self, model, prompts, *, num_slots: int, max_model_len: int, buckets: tuple[int, ...],
                 device: torch.device, dtype: torch.dtype, voice_cache_size: int = 64, cuda_graphs: bool = False,
                 max_graph_batch: int = 128, compile_layers: bool = False, ignore_eos: bool = False,
                 length_policy: str = "text"):
        self.model = model  # serving.model.model.Qwen3TTSModel
        self.talker = model.talker
        self.prompts = prompts  # serving.engine.prompts.PromptBuilder
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.buckets = buckets
        self.device = device
        self.dtype = dtype
        cfg = model.cfg.talker
        tc = cfg.transformer
        self.num_groups = cfg.num_code_groups
        self.vocab = tc.vocab_size
        self.cp_vocab = cfg.code_predictor.vocab_size
        self.eos_id = cfg.codec_eos_token_id
        self.kv = KVCache.for_stack(tc, num_slots, max_model_len, dtype, device)
        self.cp_kv = self.talker.code_predictor.new_cache(num_slots, dtype, device)
        # [G + 1, slots, 1]: position j of every slot, for the code predictor's passes (no fill kernel per pass)
        self.cp_positions = torch.arange(self.num_groups + 1, device=device)[:, None, None].repeat(1, num_slots, 1)
        s, h = num_slots, tc.hidden_size
        zeros = lambda *shape, dt=torch.float32: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
        self.hidden = zeros(s, h, dt=dtype)  # post-norm talker hidden each slot's last frame was drawn from
        self.next_x = zeros(s, 1, h, dt=dtype)  # each slot's next talker input: its last frame and next text
        self.fresh = zeros(s, dt=torch.bool)  # set up since the last step: its first frame comes from `hidden`
        self.prompt_src = torch.full((s,), -1, dtype=torch.int64, device=device)  # or from this prompt row's output
        self.pos = zeros(s, dt=torch.int64)  # cache position of each slot's next token
        self.active = zeros(s, dt=torch.int64)  # 1 for occupied slots (their positions advance)
        self.generated = zeros(s, dt=torch.int64)  # frames sampled so far
        self.seen = zeros(s, self.vocab, dt=torch.bool)  # code-0 history (repetition penalty)
        self.trailing = zeros(s, max_model_len, h, dt=dtype)
        self.trailing_len = zeros(s, dt=torch.int64)
        self.seed = zeros(s, dt=torch.int64)
        self.rep_penalty = torch.ones(s, dtype=torch.float32, device=device)
        self.talker_params = SamplingParams.build(s, device, True, 0.9, 50, 1.0)
        self.cp_params = SamplingParams.build(s, device, True, 0.9, 50, 1.0)
        self.suppress = torch.zeros(self.vocab, dtype=torch.bool, device=device)
        self.suppress[list(cfg.suppressed_code0_ids)] = True
        self.suppress[self.eos_id] = ignore_eos  # ignoring eos: never sample it (it is no codec code)
        self.ignore_eos = ignore_eos
        self.length_policy = length_policy
        frame_limit(length_policy, "", 1)  # an unknown policy fails at start-up
        self.candidate_ok = [True] * s  # host mirror: slot's sampling fits topk_sampling (empty slots do)
        self._sample_candidates = candidate_sampler(device)
        # steps of up to fused_cp_rows / fused_talker_rows rows run the code predictor's / the talker's decoder
        # layers as fused Triton kernels (on CUDA); larger steps' code predictor passes take the wide layers
        self.fused_cp = fused_stack(self.talker.code_predictor.model, device)
        self.fused_cp_rows = FUSED_CP_ROWS if self.fused_cp is not None else 0
        self.wide_cp = fused_stack(self.talker.code_predictor.model, device, wide=True)
        self.fused_talker = fused_stack(self.talker.model, device)
        self.fused_talker_rows = FUSED_TALKER_ROWS if self.fused_talker is not None else 0
        # steps of wide_talker_rows rows or more run the talker's layers wide: each row's attention reads its own
        # keys, not the whole KV bucket's
        self.wide_talker = fused_stack(self.talker.model, device, wide=True)
        self.wide_talker_rows = WIDE_TALKER_ROWS if self.wide_talker is not None else None
        self._staged: list = []  # requests admitted while a step is in flight (stage): they ride the next launch
        self.set_up_prompt_rows()
        self.kv_buckets = make_kv_buckets(max_model_len)
        if cuda_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.graph_buckets = make_graph_buckets(num_slots, max_graph_batch) if cuda_graphs else ()
        # The talker's own CUDA stream, at the most urgent priority, as are its graphs' captures: its frames never
        # queue behind the codec's kernels on the default stream, and where both stages have blocks waiting for
        # SMs, the talker's go first (a frame is ~1,000 small dependent kernels; a codec call, whose listeners have
        # audio in hand, fills the SMs they leave idle)
        self.priority = greatest_priority() if device.type == "cuda" else 0
        self.graphs = FrameGraphs(lambda b, kv: self._step(b, kv, True), device, self.priority) if cuda_graphs else None
        # wide steps that carry an admission's prompt rows, keyed by (batch bucket, prompt rows)
        self.prompt_graphs = FrameGraphs(lambda b, rows: self._step(b, 0, True, rows), device, self.priority) \
            if cuda_graphs and self.step_prompt_rows else None
        self.stream = torch.cuda.Stream(device, priority=self.priority) if device.type == "cuda" else None
        if self.stream is not None:  # pinned landing buffers for the codes of two outstanding steps (launch)
            self._buffers = [_HostBuffer(s, self.num_groups) for _ in range(2)]
            self._next_buffer = 0
            self._copied = torch.cuda.Event()
        self.compile_layers = compile_layers
        if compile_layers:
            self._compile()
        prefill_lengths = make_kv_buckets(min(max_model_len, PREFILL_GRAPH_MAX_LEN), 32)
        self.prefill_graphs = PrefillGraphs(self.talker.model, self.kv,
                                            prefill_shapes(prefill_lengths, num_slots, PREFILL_TOKEN_BUDGET), device,
                                            dtype, self.priority) if cuda_graphs else None
        self.pad_embed = self.prompts.tts_pad_embed().to(device=device, dtype=dtype)  # [H]
        self.lengths = [0] * s  # host mirror of self.pos: how far each slot's keys reach, without a sync
        self._joining: set[int] = set()  # slots set up since the last launch: its step does not advance them
        self._voice_cache = LRU(voice_cache_size)
        self._voice_lock = threading.Lock()  # the engine's voice threads fill the cache the talker's thread reads
        # each voice thread's own CUDA stream (made on its first encoding): a new voice's encoders run beside the
        # talker's steps, not between them, and one thread's copies to the host wait for its own kernels only
        self._voice_streams = threading.local()
        self.warmup_s: dict[str, float] = {}  # seconds of warmup() by part, once it has run

    def set_up_prompt_rows(self) -> None:
        """The sizes of prompt rows a wide step carries (those a slot holds: STEP_PROMPT_ROWS up to
        max_model_len; none without the wide talker layers) and their inputs and output, which the steps' graphs
        read and write (tests that switch the wide layers on call this again)."""
        self.step_prompt_rows = tuple(r for r in STEP_PROMPT_ROWS if r <= self.max_model_len) \
            if self.wide_talker is not None else ()
        self._prompt_x = self._prompt_slots = self._prompt_pos = self._prompt_hidden = None
        if self.step_prompt_rows:
            rows, hidden = self.step_prompt_rows[-1], self.talker.cfg.transformer.hidden_size
            self._prompt_x = torch.zeros(rows, hidden, dtype=self.dtype, device=self.device)
            self._prompt_slots = torch.zeros(rows, dtype=torch.int64, device=self.device)
            self._prompt_pos = torch.arange(rows, device=self.device)[:, None]
            self._prompt_hidden = torch.zeros(rows, hidden, dtype=self.dtype, device=self.device)

    def _compile(self) -> None:
        """torch.compile every decoder layer in place (names unchanged), and the pieces of a frame around them:
        the code predictor's rotary lookup and final norm (15 stack calls per frame), the code-0 logits with
        their penalties, the next talker input, and the step's mask. Fused elementwise kernels before graph capture
        keep kernels, not gaps: eager, those pieces were ~12 kernels per stack call and ~40 per frame more. The
        talker stack's own rotary and norm stay eager: they run once per frame, and prefill runs them too, which
        keeps the prefill path as it was measured (docs/performance.md: its run-to-run spread is large).
        Everything compiles with dynamic shapes; warmup() traces the prefill shapes once (one request, and
        several of different lengths), so prompts of any length and count run compiled without recompiling."""
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        cp = self.talker.code_predictor.model
        for module in (*self.talker.model.layers, *cp.layers, cp.norm, cp.rotary):
            module.compile(dynamic=True)
        self._code0_logits = torch.compile(self._code0_logits, dynamic=True)
        self._next_input = torch.compile(self._next_input, dynamic=True)
        self._step_mask = torch.compile(self._step_mask, dynamic=True)
        for wide in (self.wide_cp, self.wide_talker):
            if wide is not None:
                wide.compile()

    def _on_stream(self):
        """Work on the talker's stream. Everything the talker reads is made on it (prompts included) or
        before warmup's synchronisation, so it never waits on the default stream, where the codec works."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def describe(self) -> dict:
        return {"num_slots": self.num_slots, "buckets": list(self.buckets), "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."), "kv_cache_bytes": self.kv_bytes(),
                "graph_buckets": list(self.graph_buckets), "kv_buckets": list(self.kv_buckets),
                "graphs_captured": len(self.graphs.graphs) if self.graphs else 0, "warmup_s": self.warmup_s,
                "graph_memory_bytes": self.graphs.memory_bytes if self.graphs else 0,
                "prefill_graph_shapes": [list(shape) for shape in self.prefill_graphs.shapes] if self.prefill_graphs else [],
                "prefill_graph_memory_bytes": self.prefill_graphs.graphs.memory_bytes
                if self.prefill_graphs and self.prefill_graphs.graphs else 0,
                "step_prompt_rows": list(self.step_prompt_rows),
                "prompt_graphs_captured": len(self.prompt_graphs.graphs) if self.prompt_graphs else 0,
                "prompt_graph_memory_bytes": self.prompt_graphs.memory_bytes if self.prompt_graphs else 0,
                "compiled_layers": self.compile_layers, "fused_code_predictor_rows": self.fused_cp_rows,
                "fused_talker_rows": self.fused_talker_rows, "wide_code_predictor": self.wide_cp is not None,
                "wide_talker_rows": self.wide_talker_rows, "text_table_bytes": self.prompts.builder.text_table_bytes,
                "ignore_eos": self.ignore_eos,
                "length_policy": self.length_policy if self.ignore_eos else None}

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv.k, self.kv.v, self.trailing))

    # --- prefill -----------------------------------------------------------------------------------------
    def prefill(self, slot: int, request: GenerationRequest) -> tuple[np.ndarray, int]:
        """Run one request's prompt into `slot` (see prefill_many); raises its ValueError."""
        result = self.prefill_many([(slot, request)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    @torch.inference_mode()
    def prefill_many(self, items: list[tuple[int, GenerationRequest]]) -> list:
        """Run the prompts of new requests into their slots, batched (right-padded, causal: a row never sees
        its padding). One result per item: (reference codes as codec left context, frame limit), or the
        ValueError that makes the request unservable (prompt too long, bad reference audio)."""
        with self._on_stream():
            results, built = self._build(items)
            self._init_slots(self._prefill_groups(built))
        self._wait()  # the slots are ready before the next step is scheduled
        return results

    @torch.inference_mode()
    def stage(self, items: list[tuple[int, GenerationRequest]]) -> tuple[list, bool]:
        """(prefill_many's results, whether staged) for requests admitted while a step is in flight: their prompts
        are built here, and their prefill rides the next launch. A step of the wide talker layers carries their
        positions as rows of its own, through the same products as its rows' (STEP_PROMPT_ROWS), and draws their
        first frame from their prompts' last hidden states (_step); else their passes follow it, and they sit its
        frame out and join the step after. Served at 32 streams of short text
        on an H100, an admission's own prefill (~2 ms, before every second step of ~4.4) was the talker's largest
        cost after the steps themselves (docs/performance.md, thirty-first pass). A burst (more than
        STAGE_MAX_POSITIONS positions) is prefilled here instead, before the step, as prefill_many would, and joins
        it: staged, a first wave of 31 long prompts (~3,100 positions) beside 1 stream had its first audio at
        119 ms against 80 (H100, thirty-second pass). Smaller admissions that no step carries keep their passes
        after it: a first wave of 31 short prompts (~560) had its first audio at 38 ms, against 44 at once."""
        with self._on_stream():
            results, built = self._build(items)
            staged = sum(prompt.prefill.shape[0] for _, _, prompt in built) <= STAGE_MAX_POSITIONS
            if staged:
                self._staged += built
            else:
                self._init_slots(self._prefill_groups(built))
        if not staged:
            self._wait()
        return results, staged

    def _build(self, items: list[tuple[int, GenerationRequest]]) -> tuple[list, list]:
        """(results as prefill_many's, (slot, request, prompt) of each request whose prompt fits)."""
        results: list = self.prompts.build_many([request for _, request in items], self._voice_cache_lookup)
        built = []
        for i, ((slot, request), result) in enumerate(zip(items, results)):
            if isinstance(result, ValueError):
                continue
            prompt, ref_codes = result
            length = prompt.prefill.shape[0]
            # one position to spare: the engine launches a step before it reads the previous one, so a request
            # that has just ended runs one more frame (discarded), which writes one more key
            room = self.max_model_len - length - 1
            if room < 1:
                results[i] = ValueError(f"the prompt takes {length} positions, more than --max-model-len "
                                        f"{self.max_model_len} allows; shorten the input or the reference")
                continue
            if prompt.trailing.shape[0] > self.max_model_len:
                results[i] = ValueError("the input text is longer than --max-model-len allows")
                continue
            limit = min(request.max_new_tokens, room)
            if self.ignore_eos:
                limit = frame_limit(self.length_policy, request.text, limit)
            results[i] = (ref_codes, limit)
            built.append((slot, request, prompt))
        return results, built

    def _prefill_groups(self, built: list) -> list:
        """The admitted prompts in groups of similar length (sorted), each through the prefill graph of its
        (prompts, length) bucket, or, where none holds it (a prompt longer than every bucket, no graphs), in a
        batched pass within PREFILL_TOKEN_BUDGET positions. Returns the entries of _init_slots, which sets the
        slots up once for all after the passes, so the host never waits between them. An uncaptured pass costs
        ~1 ms of host per compiled layer call, ~20 ms for a burst of 31 long prompts (more in a busy server),
        where a graph's replay costs its GPU time."""
        def held(count: int, longest: int) -> bool:
            return self.prefill_graphs is not None and self.prefill_graphs.bucket(count, longest) is not None

        done, group, tokens = [], [], 0
        for entry in sorted(built, key=lambda e: e[2].prefill.shape[0]):  # similar lengths together: less padding
            length = entry[2].prefill.shape[0]  # the longest yet: sorted
            if group and not held(len(group) + 1, length):  # a group a graph holds stays one; else the budget
                if held(len(group), group[-1][2].prefill.shape[0]) or tokens + length > PREFILL_TOKEN_BUDGET:
                    done += self._prefill_group(group)
                    group, tokens = [], 0
            group.append(entry)
            tokens += length
        if group:
            done += self._prefill_group(group)
        return done

    def _prefill_group(self, group: list) -> list:
        """One pass over a group's prompts, written straight into their slots: its graph's, else a batched pass
        over them right-padded. Returns the entries of _init_slots."""
        slots, prompts = [slot for slot, _, _ in group], [prompt.prefill for _, _, prompt in group]
        hidden = self.prefill_graphs.run(prompts, slots) if self.prefill_graphs is not None else None
        if hidden is None:
            out = self._prefill_pass(pad_sequence(prompts, batch_first=True).to(self.device, self.dtype), slots)
            hidden = [out[i, p.shape[0] - 1] for i, p in enumerate(prompts)]
        return [(slot, request, prompt, hidden[i]) for i, (slot, request, prompt) in enumerate(group)]

    def _prefill_pass(self, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """The talker over prompts x [n, L, H] from position 0, keys and values into positions [0, L) of `slots`:
        a row's positions past its own prompt take its padding's keys, which no step reads (a step's mask stops
        at each row's position, and decoding overwrites them in order). No scratch cache, no copies."""
        n, length, _ = x.shape
        positions = torch.arange(length, device=self.device).expand(n, length)
        rows = torch.tensor(slots, device=self.device)[:, None]
        return self.talker.model(x, positions, self.kv, positions, kv_len=length, mask=None, rows=rows)

    def _init_slots(self, entries: list) -> None:
        """Set up the slots of prefilled requests, (slot, request, prompt, last hidden) each, the last hidden
        state or, for prompts the next step carries, the index of its prompt row: each per-slot tensor gets one
        write for all of them, from two uploads (one of integers, one of floats) and one write of all
        their trailing text. A burst of 127 took ~16 small writes per slot, 30-40 ms; then an upload and an indexed
        assignment per tensor were ~2.3 ms of the talker thread's host time per admission at 128 streams of short
        text (py-spy, H100, docs/performance.md twenty-eighth pass)."""
        if not entries:
            return
        slots = [e[0] for e in entries]
        idx = upload(slots, torch.int64, self.device)
        sps = [e[1].sampling for e in entries]
        lengths = [e[2].prefill.shape[0] for e in entries]
        trailing = [e[2].trailing.shape[0] for e in entries]
        for (slot, _, _, _), length, sp in zip(entries, lengths, sps):
            self.lengths[slot] = length
            self.candidate_ok[slot] = (eligible(sp.do_sample, sp.top_k, sp.top_p)
                                       and eligible(sp.subtalker_do_sample, sp.subtalker_top_k, sp.subtalker_top_p))
        if any(trailing):
            width = self.trailing.shape[1]
            rows = upload([slot * width + i for slot, t in zip(slots, trailing) for i in range(t)], torch.int64,
                          self.device)
            text = torch.cat([e[2].trailing for e in entries])  # [0, H] where a prompt has none
            self.trailing.view(-1, self.trailing.shape[-1]).index_copy_(0, rows, text.to(self.dtype))
        tp, cp = self.talker_params, self.cp_params
        integers = ((self.pos, lengths), (self.trailing_len, trailing), (self.seed, [sp.seed for sp in sps]),
                    (tp.do_sample, [sp.do_sample for sp in sps]), (tp.top_k, [sp.top_k for sp in sps]),
                    (cp.do_sample, [sp.subtalker_do_sample for sp in sps]),
                    (cp.top_k, [sp.subtalker_top_k for sp in sps]))
        floats = ((self.rep_penalty, [sp.repetition_penalty for sp in sps]),
                  (tp.temperature, [sp.temperature for sp in sps]), (tp.top_p, [sp.top_p for sp in sps]),
                  (cp.temperature, [sp.subtalker_temperature for sp in sps]),
                  (cp.top_p, [sp.subtalker_top_p for sp in sps]))
        for columns, dtype in ((integers, torch.int64), (floats, torch.float32)):
            values = upload([v for _, column in columns for v in column], dtype, self.device).view(len(columns), -1)
            for (target, _), row in zip(columns, values):
                target.index_copy_(0, idx, row.to(target.dtype))
        if isinstance(entries[0][3], int):  # the next step carries their prompts
            self.prompt_src.index_copy_(0, idx, upload([e[3] for e in entries], torch.int64, self.device))
        else:
            self.hidden.index_copy_(0, idx, torch.stack([e[3] for e in entries]).to(self.hidden.dtype))
        for target, value in ((self.active, 1), (self.generated, 0), (self.seen, False), (self.fresh, True)):
            target.index_fill_(0, idx, value)  # a kernel: `target[idx] = value` would wait for the step in flight
        self._joining.update(slots)

    def needs_voice(self, request: GenerationRequest) -> bool:
        """Whether a request's reference audio waits to be encoded (a voice clone whose voice is not cached)."""
        if request.task != "Base" or request.speaker_embedding is not None or request.encoded_voice is not None:
            return False
        with self._voice_lock:
            return request.voice_key is None or request.voice_key not in self._voice_cache

    @torch.inference_mode()
    def encode_voice(self, request: GenerationRequest) -> tuple:
        """A request's voice, (x-vector, reference codes) on the host, through the cache; called from one of the
        engine's voice threads, whose own CUDA stream runs the encoders while the talker's stream keeps stepping (on
        an H100 a new voice took ~40 ms inside an admission's prefill, a pause for every running stream). Raises the
        ValueError that makes the request unservable."""
        with self._on_voice_stream():
            return self._voice_cache_lookup(request.voice_key,
                                            lambda: self.prompts.encode_reference(request.ref_audio))

    def _on_voice_stream(self):
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        stream = getattr(self._voice_streams, "stream", None)
        if stream is None:
            stream = self._voice_streams.stream = torch.cuda.Stream(self.device)
        return torch.cuda.stream(stream)

    def _voice_cache_lookup(self, key: str | None, compute):
        """Speaker embedding and reference codes of uploaded voices are computed once per voice."""
        if key is None:
            return compute()
        with self._voice_lock:
            value = self._voice_cache.get(key)
        if value is None:
            value = compute()
            with self._voice_lock:
                self._voice_cache.put(key, value)
        return value

    def release(self, *slots: int) -> None:
        """Free slots, all with one upload and two kernels (the engine frees every request that ended at a step
        at once). The device writes go on the talker's stream: on the caller's (default) stream they would
        queue behind the codec's kernels and could land after a slot's next prefill, zeroing the new request's
        position (the talker stream never waits for the default one). They are kernels that only queue:
        `self.active[slot] = 0` copies its 0 from the host, which first waits for the stream, i.e. for the step
        in flight, and this runs on the engine's loop (H100: 2.8 ms between a request's last frame and its last
        codec call at batch 1; benchmarks/host_write_sync.py, docs/performance.md)."""
        if not slots:
            return
        self._staged = [entry for entry in self._staged if entry[0] not in slots]  # a client that left meanwhile
        self._joining.difference_update(slots)
        for slot in slots:
            self.candidate_ok[slot] = True
            self.lengths[slot] = 0
        with self._on_stream():
            idx = upload(list(slots), torch.int64, self.device)
            self.active.index_fill_(0, idx, 0)
            self.pos.index_fill_(0, idx, 0)

    @torch.inference_mode()
    def move(self, moves: list[tuple[int, int]]) -> None:
        """Move running requests between slots, (from, to) pairs into free slots (Scheduler.compact): each slot
        tensor's rows copied in one gather and one indexed copy, keys and values only up to the longest moved
        row's keys, then the old slots freed. Queued on the talker's stream after the step in flight, whose
        frame the copies include; the sampler's draws hang on a request's seed and frame, not its slot, so a
        moved request's codes are the ones it would have had in place."""
        if not moves:
            return
        keys = max(self.lengths[s] for s, _ in moves)
        with self._on_stream():
            src = upload([s for s, _ in moves], torch.int64, self.device)
            dst = upload([d for _, d in moves], torch.int64, self.device)
            for tensor, dim in self._slot_tensors(keys):
                tensor.index_copy_(dim, dst, tensor.index_select(dim, src))
            for tensor in (self.active, self.pos):
                tensor.index_fill_(0, src, 0)
        for s, d in moves:
            self.lengths[d], self.lengths[s] = self.lengths[s], 0
            if s in self._joining:
                self._joining.remove(s)
                self._joining.add(d)
            self.candidate_ok[d], self.candidate_ok[s] = self.candidate_ok[s], True

    def _slot_tensors(self, keys: int) -> list[tuple[torch.Tensor, int]]:
        """Every tensor that holds a request's state by slot, with its slot dimension (the caches' first `keys`
        positions). The code predictor's cache is not one: each frame rewrites it before reading it."""
        params = [getattr(p, f.name) for p in (self.talker_params, self.cp_params) for f in fields(p)]
        per_slot = (self.hidden, self.next_x, self.fresh, self.pos, self.active, self.generated, self.seen,
                    self.trailing, self.trailing_len, self.seed, self.rep_penalty, *params)
        return [(self.kv.k[:, :, :, :keys], 1), (self.kv.v[:, :, :, :keys], 1)] + [(t, 0) for t in per_slot]

    # --- decode ------------------------------------------------------------------------------------------
    def decode_step(self, bucket: int) -> tuple[np.ndarray, np.ndarray]:
        """One frame for slots [0, bucket): (codes [bucket, Q] int64, ended [bucket] bool: end of speech)."""
        return self.collect(self.launch(bucket))

    @torch.inference_mode()
    def launch(self, bucket: int) -> StepHandle:
        """Queue one frame for slots [0, bucket) and return at once (on a GPU; a CPU computes it here): the
        graph of (bucket, KV bucket) when there is one, else the eager step, then an asynchronous copy of its
        codes into a pinned buffer. The engine launches step N+1 before it collects step N, so the GPU
        computes while the host hands out step N's codes; two steps may be outstanding (two buffers).
        Requests staged since the last launch are prefilled with this step (see stage): where it carries their
        prompts they are set up before it and draw their first frame from it; else their passes follow it, they
        are set up after it, and their rows in this frame are not theirs (the handle's sat_out)."""
        with self._on_stream():
            staged, self._staged = self._staged, []
            prompt_rows = self._stage_prompt_rows(staged, bucket) if staged else 0
            if prompt_rows:
                self._init_slots(self._prompt_entries(staged))
            joining, self._joining = self._joining, set()
            codes, ended = self.step_tensors(bucket, prompt_rows)
            sat_out = () if prompt_rows else tuple(slot for slot, _, _ in staged)
            if self.stream is None:
                handle = StepHandle(bucket, codes.numpy(), ended.numpy())
            else:
                buf = self._buffers[self._next_buffer]
                self._next_buffer ^= 1
                if buf.busy:
                    raise RuntimeError("two decode steps are already outstanding: collect one first")
                buf.busy = True
                buf.codes[:bucket].copy_(codes, non_blocking=True)
                buf.ended[:bucket].copy_(ended, non_blocking=True)
                buf.event.record(self.stream)
                handle = StepHandle(bucket, buffer=buf)
            handle.sat_out = sat_out
            for i in range(bucket):
                if self.lengths[i] and i not in joining:
                    self.lengths[i] += 1
            if sat_out:
                self._init_slots(self._prefill_groups(staged))
        return handle

    def collect(self, handle: StepHandle) -> tuple[np.ndarray, np.ndarray]:
        """The launched step's (codes, ended) on the host. On a GPU a polling wait that sleeps, so this thread
        never sits in a blocking CUDA call while the codec thread (same process, same GPU) wants to launch
        its kernels: measured, a blocking wait here made the codec's calls up to 9x slower."""
        buf = handle.buffer
        if buf is None:
            return handle.codes, handle.ended
        sleep_until(buf.event)
        b = handle.bucket
        codes, ended = buf.codes[:b].numpy().copy(), buf.ended[:b].numpy().copy()
        buf.busy = False
        return codes, ended

    def _wait(self) -> None:
        """Until the talker's stream is done, polling with sleeps (see collect)."""
        if self.stream is None:
            return
        wait_sleeping(self._copied, self.stream)

    def step_tensors(self, bucket: int, prompt_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The frame on the device, by the path decode_step takes (no host bookkeeping; benchmarks time this).
        A graph of a larger batch serves a smaller step (the extra rows are empty slots); rows [0, bucket)
        come back. prompt_rows: the step carries that many rows of the staged prompts (_stage_prompt_rows)."""
        kv_len = max(self.lengths[:bucket]) + 1
        candidates = all(self.candidate_ok[:bucket])
        if candidates and self.graphs is not None:
            batch = smallest_cover(bucket, self.graph_buckets)
            graphs, key = (self.prompt_graphs, prompt_rows) if prompt_rows else \
                (self.graphs, None if batch is None else self.graph_kv(batch, kv_len))
            if batch is not None and graphs is not None and graphs.covers(batch, key):
                codes, ended = graphs.replay(batch, key)
                return codes[:bucket], ended[:bucket]
        return self._step(bucket, kv_len, candidates, prompt_rows)

    def takes_prompts(self, b: int) -> bool:
        """Whether a step of b rows can carry prompt rows: one through the wide talker layers."""
        return bool(self.step_prompt_rows) and b >= self.wide_talker_rows

    def _stage_prompt_rows(self, staged: list, bucket: int) -> int:
        """The staged prompts' positions into the prompt rows' inputs; returns the rows the step carries (the
        positions padded up to a STEP_PROMPT_ROWS size), or 0 where it cannot carry them (a step of fewer rows
        than the wide layers take, more positions than the largest size): then they are prefilled after it. The
        padding rows continue the last prompt's positions in its slot, where no step reads before it writes."""
        lengths = [prompt.prefill.shape[0] for _, _, prompt in staged]
        total = sum(lengths)
        rows = smallest_cover(total, self.step_prompt_rows)
        last_slot, last_len = staged[-1][0], lengths[-1]
        if rows is None or not self.takes_prompts(bucket) or last_len + rows - total > self.max_model_len:
            return 0
        self._prompt_x[:total] = torch.cat([prompt.prefill for _, _, prompt in staged]).to(self._prompt_x.dtype)
        self._prompt_x[total:rows].zero_()
        slots = [slot for (slot, _, _), n in zip(staged, lengths) for _ in range(n)] + [last_slot] * (rows - total)
        positions = [i for n in lengths for i in range(n)] + list(range(last_len, last_len + rows - total))
        self._prompt_slots[:rows] = upload(slots, torch.int64, self.device)
        self._prompt_pos[:rows, 0] = upload(positions, torch.int64, self.device)
        return rows

    def _prompt_entries(self, staged: list) -> list:
        """_init_slots' entries of prompts the next step carries: each with its last position's prompt row, whose
        hidden state that step draws the request's first frame from."""
        ends = np.cumsum([prompt.prefill.shape[0] for _, _, prompt in staged]) - 1
        return [(slot, request, prompt, int(end)) for (slot, request, prompt), end in zip(staged, ends)]

    def reads_own_keys(self, b: int) -> bool:
        """Whether a step of b rows attends over each row's own positions (the fused or the wide talker layers)
        rather than a KV bucket's under a mask: its frame is the same for every KV length, so one graph, keyed
        by KV length 0, serves them all."""
        return b <= self.fused_talker_rows or (self.wide_talker_rows is not None and b >= self.wide_talker_rows)

    def graph_kv_buckets(self, b: int) -> tuple[int, ...]:
        """The KV lengths of the graphs a batch bucket gets: those graph_kv gives over every KV bucket."""
        return tuple(sorted({self.graph_kv(b, n) for n in self.kv_buckets}))

    def graph_kv(self, b: int, kv_len: int) -> int | None:
        """The KV length of the graph of batch bucket b that serves steps whose longest row reaches kv_len keys."""
        return 0 if self.reads_own_keys(b) else smallest_cover(kv_len, self.kv_buckets)

    def _draw(self, logits: torch.Tensor, params: SamplingParams, b: int, group: int, candidates: bool) -> torch.Tensor:
        """logits [b, V] in the model's dtype or float32 (the samplers compute in float32)."""
        seed, frame = self.seed[:b], self.generated[:b]
        if candidates:
            return self._sample_candidates(logits, _rows(params, b), seed, frame, group)
        return sample(logits.float(), _rows(params, b), noise=exponential_noise(seed, frame, group, logits.shape[-1]))

    def _step(self, b: int, kv_len: int, candidates: bool, prompt_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-shape frame: the talker takes each row's last frame, then code 0 is sampled from its hidden
        state and the code predictor runs. In that order a prompt the step carries (prompt_rows: the first that
        many rows of the prompt inputs go through the talker's pass too, a step of the wide layers, their keys
        and values into their slots) yields its request's first frame in the same step: its row's hidden state
        is its prompt's last (prompt_src); a row set up by a prefill before the step takes the prefill's
        (fresh). Either way the row's own talker input is no frame of its, and its position does not advance.
        Attends over cache positions [0, kv_len) with a mask, so any kv_len >= the longest row's gives the
        same frame (graphs use a KV bucket). `candidates`: every row's sampling fits topk_sampling."""
        out = self._talker(b, kv_len, prompt_rows)
        fresh = self.fresh[:b]
        hidden = torch.where(fresh[:, None], self.hidden[:b], out[:, 0])
        if prompt_rows:
            src = self.prompt_src[:b]
            hidden = torch.where((src >= 0)[:, None], self._prompt_hidden[src.clamp(min=0)], hidden)
            src.fill_(-1)
        self.pos[:b] += self.active[:b] * (~fresh)
        fresh.fill_(False)
        self.hidden[:b] = hidden
        code0 = self._draw(self._code0_logits(hidden), self.talker_params, b, 0, candidates)
        rest = self._code_predictor(hidden, code0, b, candidates)
        codes = torch.cat([code0[:, None], rest], dim=1)
        self.seen[:b].scatter_(1, code0[:, None], True)
        self.generated[:b] += 1
        self.next_x[:b] = self._next_input(codes, b)
        return codes, code0 == self.eos_id

    def _talker(self, b: int, kv_len: int, prompt_rows: int = 0) -> torch.Tensor:
        """The talker's pass of a step (see _step): the normed hidden states [b, 1, H] of the rows' last frames;
        with prompt_rows, the prompt rows' go to _prompt_hidden. Its own method so that benchmarks time it alone."""
        x = self.next_x[:b]
        pos = self.pos[:b, None]
        view = CacheView(self.kv.k[:, :b], self.kv.v[:, :b])
        if not self.reads_own_keys(b):
            return self.talker.model(x, pos, view, pos, kv_len=kv_len, mask=self._step_mask(b, kv_len))
        if b <= self.fused_talker_rows:  # each row attends to its positions <= pos: what the mask would say
            return self.talker.model.norm(self.fused_talker(x, pos, view.k, view.v))
        if not prompt_rows:
            return self.talker.model.norm(self.wide_talker(x, pos, view.k, view.v))
        from serving.engine.triton_layers import Prompts  # the wide layers are there: so is Triton
        n = prompt_rows
        prompts = Prompts(self._prompt_x[:n], self._prompt_slots[:n], self._prompt_pos[:n], self.kv.k, self.kv.v)
        out, prompt_out = self.wide_talker(x, pos, view.k, view.v, prompts)
        self._prompt_hidden[:n] = self.talker.model.norm(prompt_out)[:, 0]
        return self.talker.model.norm(out)

    def _code0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Code-0 logits [b, V] (float32) of the rows' hidden states, with the repetition penalty, the eos ban
        of the first frames and the suppressed ids applied."""
        b = hidden.shape[0]
        frame = self.generated[:b]
        logits = self.talker.codec_logits(hidden)
        logits = penalize_repeats(logits, self.seen[:b], self.rep_penalty[:b])
        return mask_code0(logits, frame, self.eos_id, self.suppress)

    def _next_input(self, codes: torch.Tensor, b: int) -> torch.Tensor:
        """The talker's next input [b, 1, H]: the frame's summed embeddings plus each row's next trailing text
        token, else tts_pad. Frame k (`generated` already counts it) goes in with trailing token k - 1: the
        first frame comes from the prompt alone, and the text streams in from the second, as the official
        generate feeds it (Qwen3TTS.iter_frames)."""
        last = self.generated[:b] - 1
        text_idx = last.clamp(min=0, max=self.trailing.shape[1] - 1)
        rows = torch.arange(b, device=self.device)
        text = torch.where((last < self.trailing_len[:b])[:, None], self.trailing[rows, text_idx],
                           self.pad_embed[None, :])
        return (self.talker.embed_frame(codes) + text)[:, None]

    def _step_mask(self, b: int, kv_len: int) -> torch.Tensor:
        """The step's attention mask over kv_len keys: each row sees its positions up to its new one."""
        pos = self.pos[:b, None]
        return attention_mask(pos, torch.arange(kv_len, device=self.device)[None, :] <= pos)

    def _code_predictor(self, hidden: torch.Tensor, code0: torch.Tensor, b: int, candidates: bool) -> torch.Tensor:
        """Codes 1..G-1 [b, G-1]: CodePredictor.forward's passes, drawing each code with the step's sampler; for a
        step of at most fused_cp_rows rows, through the fused layers (its heads take the final norm), for a
        larger one through the wide layers where there are some, else through the modules."""
        cp = self.talker.code_predictor
        project = cp.small_to_mtp_projection if cp.small_to_mtp_projection is not None else (lambda t: t)
        cache = CacheView(self.cp_kv.k[:, :b], self.cp_kv.v[:, :b])
        if b <= self.fused_cp_rows:
            def run(x, pos, kv_len):
                return self.fused_cp(x, pos, cache.k, cache.v)[:, -1]

            def logits(h, head):
                return self.fused_cp.head(h, head.weight)
        elif self.wide_cp is not None:
            def run(x, pos, kv_len):
                return self.wide_cp(x, pos, cache.k, cache.v)[:, -1]

            def logits(h, head):
                return head(cp.model.norm(h))
        else:
            def run(x, pos, kv_len):
                return cp.model(x, pos, cache, pos, kv_len=kv_len, mask=None)[:, -1]

            def logits(h, head):
                return head(h)
        x = project(torch.stack((hidden, self.talker.embed_codec(code0)), dim=1))
        out = run(x, torch.arange(2, device=self.device).expand(b, 2), 2)
        codes = []
        for j in range(1, self.num_groups):
            code = self._draw(logits(out, cp.lm_head[j - 1]), self.cp_params, b, j, candidates)
            codes.append(code)
            if j == self.num_groups - 1:
                break
            x = project(cp.model.codec_embedding[j - 1](code)[:, None])
            out = run(x, self.cp_positions[j + 1, :b], j + 2)
        return torch.stack(codes, dim=1)

    def _trace_prefill_shapes(self) -> None:
        """Prefill passes of one 17-position prompt, three 19-position ones and two 23-position ones (random
        inputs, into the first slots; warmup then clears their state): compiles the dynamic-shape prefill graphs
        before any request arrives."""
        for n, length in ((1, 17), (3, 19), (2, 23)):
            x = torch.randn(n, length, self.talker.cfg.transformer.hidden_size, dtype=self.dtype, device=self.device)
            self._prefill_pass(x, list(range(n)))

    def _warm_up_admission(self) -> None:
        """Admit a full burst of requests into every slot once (prefill_many, as a closed-loop level's first wave
        is admitted), then free the slots: what a process's first burst pays once beyond the shapes themselves
        (the prompt pieces each speaker and language share, first allocations of each size) is paid here. On an
        H100 a first burst of 31 long prompts took 57 ms against 24.5 for the same burst again
        (benchmarks/burst_prefill.py), and a served c=32 level's first wave, its server's first, 80 ms. Requests
        whose prompt --max-model-len cannot hold are left out, as the server would refuse them."""
        requests = self.prompts.warm_up_requests(self.num_slots)
        results = self.prefill_many(list(enumerate(requests)))
        if all(isinstance(result, ValueError) for result in results):
            raise RuntimeError(f"start-up admission: no warm-up prompt fits ({results[0]})")
        self.release(*range(len(requests)))

    def warmup(self) -> None:
        """Run every bucket's step once on empty slots (allocations, kernel selection, compilation), and capture
        the graphs of every graph bucket (one per KV bucket where its steps read a KV bucket: graph_kv_buckets);
        then clear the slots' state the passes touched."""
        t0 = time.monotonic()
        with torch.inference_mode(), self._on_stream():
            for b in self.buckets:
                self._step(b, 1, True)
            if self.compile_layers:
                self._trace_prefill_shapes()
            t1 = time.monotonic()
            if self.graphs is not None:
                for b in self.graph_buckets:
                    for kv in self.graph_kv_buckets(b):
                        self.graphs.capture(b, kv)
                    for rows in self.step_prompt_rows if self.takes_prompts(b) else ():
                        self.prompt_graphs.capture(b, rows)
            t2 = time.monotonic()
            if self.prefill_graphs is not None:
                self.prefill_graphs.capture_all()
            t3 = time.monotonic()
            self._warm_up_admission()
            t4 = time.monotonic()
            with self._on_voice_stream():
                self.prompts.warm_up_encoders()
            self.hidden.zero_()
            self.next_x.zero_()
            self.fresh.zero_()
            self.prompt_src.fill_(-1)
            self.generated.zero_()
            self.seen.zero_()
            self.pos.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # where start-up goes (the engine logs it; /health lists it): steps (compilation included), graph captures
        self.warmup_s = {"steps": round(t1 - t0, 1), "frame_graphs": round(t2 - t1, 1),
                         "prefill_graphs": round(t3 - t2, 1), "admission": round(t4 - t3, 1),
                         "voice_encoders": round(time.monotonic() - t4, 1)}
