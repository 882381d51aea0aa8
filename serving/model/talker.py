"""The talker: a Qwen3-style decoder over summed text + codec embeddings that predicts code0 of each frame.

Parameter names equal the official `talker.*` names. The caller owns the KV cache and the positions, so a
batch can be left-padded (offline generate) or hold independent rows at different lengths (the engine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.model.code_predictor import CodePredictor
from serving.model.config import TalkerConfig
from serving.model.layers import DecoderStack


class TalkerModel(DecoderStack):
    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.transformer, max_positions=cfg.transformer.max_position_embeddings)
        self.codec_embedding = nn.Embedding(cfg.transformer.vocab_size, cfg.transformer.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class TextProjection(nn.Module):
    """Text embedding width -> talker width: Linear, SiLU, Linear (both with bias)."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.transformer.hidden_size)
        self.codec_head = nn.Linear(cfg.transformer.hidden_size, cfg.transformer.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg)

    def embed_text(self, token_ids: torch.Tensor) -> torch.Tensor:
        """P(x): text token ids [..., L] -> [..., L, H]."""
        return self.text_projection(self.model.text_embedding(token_ids))

    def embed_codec(self, codec_ids: torch.Tensor) -> torch.Tensor:
        """C(x) = E_0(x): talker codec ids (codes, control tags, speaker ids) -> [..., H]."""
        return self.model.codec_embedding(codec_ids)

    def embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """sum_g E_g(codes[..., g]) for frames codes [..., G] -> [..., H] (stack-then-sum, the official order)."""
        parts = [self.model.codec_embedding(codes[..., 0])]
        parts += [emb(codes[..., g + 1]) for g, emb in enumerate(self.code_predictor.model.codec_embedding)]
        return torch.stack(parts, dim=-2).sum(-2)

    def codec_logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden [B, H] -> code0 logits [B, V] in float32."""
        return self.codec_head(hidden_last).float()
