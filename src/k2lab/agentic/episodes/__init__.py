"""What every agentic environment and trainer shares: the interface, rollouts and evaluation.

* ``env``       ``Environment`` / ``Episode`` / ``Outcome``: one interface for factory tool tasks, RL
                environments, the swarm and evaluations (and ``tool_call_parts``, the parse of one tool call);
* ``rollout``   policies (``LocalPolicy``, ``EndpointPolicy``) playing episodes, every assistant turn as exact
                token ids (``run_episode``, batched ``run_episodes``, partial rollouts and their persistence);
* ``evaluate``  batched greedy evaluation of a local model on an environment, with confidence intervals and
                paired comparisons.

RL (``k2lab.agentic.rl``), distillation (``k2lab.agentic.distill``), PARL (``k2lab.swarm``) and the shared
post-training base (``k2lab.posttrain``) build on these; nothing here imports them.
"""
