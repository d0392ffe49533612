"""Reinforcement learning from verifiable rewards: GRPO and PPO over any installed engine,
rollout backend and weight-sync transport."""
