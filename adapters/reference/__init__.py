"""The plain-PyTorch reference (`framework=torch`): SFT, RM and PPO with no RLHF framework, the yardstick."""
