"""Serving: one core (schedule -> runner -> sample -> scheduler update) behind `Engine` (a thread, streams, the
OpenAI server) and `LLM` (offline), with metrics, tokenizers and model loading."""
