"""K3's multi-effort RL and multi-teacher on-policy distillation (MOPD).

* ``effort``  ``EffortEnv`` (reasoning effort through the system prompt, a token budget per effort) and
              ``train_experts``: the nine domain x effort experts, one RL run each (``k2lab mopd experts``);
* ``mopd``    ``MOPDConfig`` and ``run_mopd``: the student distilled on-policy from the experts
              (``k2lab mopd distill``), and ``mopd_report`` (``k2lab mopd report``).
"""
