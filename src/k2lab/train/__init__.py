"""Pre-training: recipe, loop, checkpoints with resume, metrics and dashboard.

Submodules are imported where they are used (``k2lab.train.run_checkpoints``, ``k2lab.train.metrics``,
``k2lab.train.dashboard``, ``k2lab.train.trainer``) so that importing one does not pull in the others.
"""
