"""K2's agentic data factory: tools -> agents -> tasks -> rollouts -> judge -> JSONL conversations.

* ``tools``      the tool repository: synthetic tools evolved from the domains' base tools, harvested MCP specs;
* ``simulator``  the stateful tool simulator, with deterministic injected failures;
* ``tasks``      agents, tool-matched tasks with rubrics, user simulators and ``ToolTaskEnvironment``
                 (``tool_env``: the ``tools[:DOMAIN]`` / ``mini-tools[:DOMAIN]`` environments);
* ``experts``    expert agents that solve the tasks (procedural, optionally imperfect; or an LLM);
* ``judge``      the rubric judge (kept trajectories, reasons for the rest) and solution progress;
* ``pipeline``   ``FactoryConfig`` and ``generate``: the whole factory (``k2lab factory generate``).

Domain content (tools, task templates, checks) lives in ``k2lab.agentic.domains``, one file per domain.
"""
