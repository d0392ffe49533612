"""Agentic RL: multi-turn episodes with tools, token-exact, and an OpenAI-compatible endpoint."""
