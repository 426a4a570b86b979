"""Evaluation of an exported draft: acceptance length on held-out prompts, and the check that
vLLM speculates with it."""
