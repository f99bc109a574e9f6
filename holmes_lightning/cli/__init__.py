"""The command-line tools and their Hydra configs: `holmes-plan` (`plan`), `holmes-launch` (`launch`), the lab's
bandwidth probe (`probe`), the GPU machine check (`gpu_check`), and what `train.py` checks before any rank starts
(`validate`)."""
