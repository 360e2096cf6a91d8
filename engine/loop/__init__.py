"""The RL loop: the pipeline's stages and the messages between them, the policy-version
board, scoring, the RL arithmetic of a step, held-out evaluation, and what a step hands
back."""
