"""OpenAI- and vllm-omni-compatible HTTP API over the engine."""
