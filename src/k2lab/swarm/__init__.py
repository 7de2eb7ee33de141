"""K2.5's Agent Swarm: a learned orchestrator with frozen sub-agents (PARL) on wide tasks.

* ``k2lab.swarm.tasks``    wide tasks (sum a product's sales over many shards, one ``query_shard`` per step)
* ``k2lab.swarm.orchestrator``  ``SwarmEnv``: ``create_subagent`` / ``assign_task`` run isolated sub-agents
                           concurrently; CriticalSteps, total tokens, tool calls, unfinished subtasks
* ``k2lab.swarm.parl``     PARL training of the orchestrator only (K1.5 group objective), annealed rewards

The PARL ablation (``k2lab ablate parl``) is ``k2lab.ablations.parl``.
"""

from __future__ import annotations
