"""The code predictor (MTP / "subtalker"): given the talker's last hidden state and code0, predicts codes
1..G-1 of the frame with G-1 dependent passes over a short sequence of its own.

Pass 1 is a 2-token prefill [h_talker, E_0(code0)]; pass j >= 2 feeds E_{j-1}(code_{j-1}) at position j.
The KV cache spans the G positions of one frame and is reused from frame to frame (positions restart at 0),
so no pass re-reads earlier positions' inputs. Parameter names equal the official
`talker.code_predictor.*` names.
"""

from __future__ import annotations

import torch
from torch import nn

from serving.model.config import TalkerConfig
from serving.model.layers import DecoderStack, KVCache
from serving.model.sampler import SamplingParams, sample


class CodePredictorModel(DecoderStack):
    def __init__(self, talker: TalkerConfig):
        cfg = talker.code_predictor
        super().__init__(cfg, max_positions=talker.num_code_groups)
        # E_1..E_{G-1}: embeddings of codebooks 1..G-1, in the talker's width (projected down on 1.7B)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, talker.transformer.hidden_size) for _ in range(talker.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    def __init__(self, talker: TalkerConfig):
        super().__init__()
        cfg = talker.code_predictor
        self.num_code_groups = talker.num_code_groups
        self.model = CodePredictorModel(talker)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(talker.num_code_groups - 1)
        )
        if talker.has_mtp_projection:
            self.small_to_mtp_projection = nn.Linear(talker.transformer.hidden_size, cfg.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = None

    def new_cache(self, batch: int, dtype, device) -> KVCache:
        return KVCache.for_stack(self.model.cfg, batch, self.num_code_groups, dtype, device)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.small_to_mtp_projection is None else self.small_to_mtp_projection(x)

    def forward(self, talker_hidden: torch.Tensor, code0_embed: torch.Tensor, cache: KVCache,
                params: SamplingParams, generator: torch.Generator | None = None,
                noise: torch.Tensor | None = None) -> torch.Tensor:
        """talker_hidden, code0_embed [B, H_talker] -> codes 1..G-1 [B, G-1] (int64).
        noise [B, G-1, V]: Exp(1) draws per pass instead of `generator` (see sampler.sample).

        Fixed shapes throughout (the pass index is a Python int), so one frame can be graph-captured."""
        batch = talker_hidden.shape[0]
        device = talker_hidden.device
        x = self._project(torch.stack((talker_hidden, code0_embed), dim=1))
        positions = torch.arange(2, device=device).expand(batch, 2)
        hidden = self.model(x, positions, cache, positions, kv_len=2, mask=None)
        codes = []
        for j in range(1, self.num_code_groups):
            logits = self.lm_head[j - 1](hidden[:, -1]).float()
            code = sample(logits, params, generator, None if noise is None else noise[:, j - 1])
            codes.append(code)
            if j == self.num_code_groups - 1:
                break
            x = self._project(self.model.codec_embedding[j - 1](code)[:, None])
            pos = torch.full((batch, 1), j + 1, dtype=torch.int64, device=device)
            hidden = self.model(x, pos, cache, pos, kv_len=j + 2, mask=None)
        return torch.stack(codes, dim=1)
