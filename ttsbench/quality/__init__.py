"""Quality of a run's saved audio: WER/CER by ASR, speaker similarity, and model-free sanity checks.

Nothing heavy is imported here or at `ttsbench` import time: torch, whisper and the speaker encoders
load only when a backend is chosen (the `quality` extra).
"""
