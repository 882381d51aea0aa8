"""Qwen3-TTS 12Hz model in plain PyTorch: config, weights, talker, code predictor, codec, speaker encoder."""
