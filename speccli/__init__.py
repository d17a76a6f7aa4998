"""specgen: fast local LLM generation by lossless speculative decoding."""

__version__ = "0.1.0"
