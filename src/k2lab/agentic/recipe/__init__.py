"""End-to-end agentic recipes that chain the stages.

* ``mini``  ``k2lab recipe agentic-mini``: pre-trained mini model -> factory data -> SFT -> RL -> held-out
            evaluation on CPU, each stage resumable, with its report and plot.
"""
