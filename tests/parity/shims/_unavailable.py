"""Shared helper of the import shims: a module whose every attribute raises when used.

The official qwen-tts package imports torchaudio, sox and onnxruntime at module level for its 25 Hz
tokenizer only. The parity tests exercise the 12 Hz path, so these names must import but never run.
"""

import types


class UnavailableModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(
            f"{self.__name__}.{name} is a parity-test shim: the real package is not installed in the "
            "reference environment (only the 25 Hz tokenizer path uses it)"
        )
