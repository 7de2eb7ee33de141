"""Agentic post-training (K2, K3): tool domains, the data factory, agentic SFT, RL and distillation.

Sub-packages, in the order a run uses them (each depends only on the ones above it):

* ``episodes``  the ``Environment`` / ``Episode`` interface every environment implements, rollouts (a policy
                playing episodes, turns recorded as token ids) and batched greedy evaluation;
* ``domains``   the seven tool domains, one file each (world section, base tools, task templates, checks);
* ``factory``   K2's agentic data factory: tool repository, tool simulator, tasks and their environment,
                expert agents, the rubric judge, and ``pipeline.generate`` (``k2lab factory generate``);
* ``sft``       agentic supervised fine-tuning on the factory's conversations (``k2lab sft``);
* ``rl``        RL environments with verifiers, the self-critique rubric critic and the joint RL trainer
                (``k2lab rl``);
* ``distill``   K3's effort experts and multi-teacher on-policy distillation (``k2lab mopd``);
* ``recipe``    the end-to-end agentic-mini recipe (``k2lab recipe agentic-mini``).

Adding a domain
---------------
Write one file ``domains/<name>.py`` (tools, task templates, checks; ``domains/files.py`` is the shortest) and
register it in ``domains/__init__.py``; nothing else changes. The steps are in the ``k2lab.agentic.domains``
docstring and ``docs/agentic-domains.md``.
"""

from k2lab.agentic.episodes.env import Environment, Episode, Outcome

__all__ = ["Environment", "Episode", "Outcome"]
