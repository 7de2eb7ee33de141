"""K2's joint RL: environments with programmatic verifiers, rubric rewards and the RL trainer.

* ``envs``     RL environments (arithmetic, instruction following, coding, open QA), ``GuardedEnv`` and the
               weighted ``EnvMixture`` (``build_env`` also reaches the factory's tool tasks);
* ``critic``   the self-critique rubric critic: pairwise rewards for open-ended prompts;
* ``trainer``  ``RLConfig``, ``RLTrainer`` and ``run_rl`` (``k2lab rl``): K1.5's objective, budget penalty,
               partial rollouts, MuonClip, exact resume on ``k2lab.posttrain.base``.
"""
