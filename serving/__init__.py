"""Reference serving stack for Qwen3-TTS 12Hz. Never imports the harness (ttsbench)."""
