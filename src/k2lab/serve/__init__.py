"""Serving: a continuous-batching engine and an OpenAI-compatible HTTP server over it."""

from k2lab.serve.engine import Engine, Request, SamplingParams

__all__ = ["Engine", "Request", "SamplingParams"]
