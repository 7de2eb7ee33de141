"""Agentic post-training (K2): environments, the data factory, agentic SFT and joint RL."""

from k2lab.agentic.env import Environment, Episode, Outcome

__all__ = ["Environment", "Episode", "Outcome"]
