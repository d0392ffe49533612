"""A rollout backend in a server process of its own Python environment."""
