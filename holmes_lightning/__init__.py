"""holmes-lightning: LLM training across GPU clusters with mixed NICs, as a Lightning strategy."""

__version__ = "0.1.0"
