"""ttsbench: benchmark and evaluation harness for text-to-speech servers."""

__version__ = "0.1.0"
