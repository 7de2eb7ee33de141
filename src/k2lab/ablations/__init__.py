"""Studies that train several runs on the same tokens and compare them (``k2lab ablate ...``).

| module | study | outputs |
|---|---|---|
| ``optimizer`` | AdamW vs Muon vs MuonClip: lr sweep, equal-token losses, max logits, QK-Clip stress | ``ablation.*`` |
| ``balancing`` | router bias: none vs the DeepSeek-V3 sign rule vs Quantile Balancing | ``balancing.*`` |
| ``vision_injection`` | K2.5's early 10:90 vs mid 20:80 vs late 50:50 fusion at one visual budget | ``vision_injection.*`` |
| ``rephrase`` | K2's K rephrasings × 1 epoch vs the raw text × K epochs | ``rephrase.*`` |
| ``parl`` | PARL's reward terms: full vs no r_parallel vs no r_finish vs a single agent | ``parl.*`` |

Shared machinery: ``common`` (the settings base with the study's base recipe, ``load_settings`` for a
profile overlay + recipe + overrides, training or reusing the runs, the common tail ``StudyRun.finish``)
and ``report`` (``Report``: OUT/{stem}.md|json|png and the console summary; table and figure helpers).
"""
