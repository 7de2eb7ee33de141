"""Post-training machinery shared by RL (``k2lab.agentic.rl.trainer``), MOPD (``k2lab.agentic.distill.mopd``)
and PARL (``k2lab.swarm.parl``).

* ``k2lab.posttrain.base``       ``IterativeTrainer``: the loop's state, resume with the settings check,
                                 checkpoint cadence and metrics log; ``rounded_mean`` for metrics lines
* ``k2lab.posttrain.scoring``    log π of a policy's sampled turns (``turn_logprobs``), the off-policy mask
                                 and the sequence log-ratio
* ``k2lab.posttrain.objective``  K1.5's group loss and the budget penalty

Run persistence that is not specific to post-training (derived seeds, RNG capture, resume state) lives in
``k2lab.train.persistence``.
"""
