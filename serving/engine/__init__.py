"""Two-stage engine: talker + code predictor with continuous batching, then the codec decoder."""
