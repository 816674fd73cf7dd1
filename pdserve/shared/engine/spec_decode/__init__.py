"""Speculative decoding: a proposer guesses k tokens, the target verifies them in one step.

``config``: ``SpeculativeConfig`` (vLLM's ``speculative_config`` dict); ``ngram_proposer``: prompt lookup;
``rejection_sampler``: the exact accept/reject rule; ``policy``: how many tokens to propose per step.
"""
