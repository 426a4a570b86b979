"""Helpers shared by the tests: the workflow runner, synthetic shards, fake vLLM classes."""
