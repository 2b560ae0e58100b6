"""The analytic model: pure functions of configs, no torch.distributed."""
