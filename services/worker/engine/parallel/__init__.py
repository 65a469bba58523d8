"""Tensor and pipeline parallelism, applied from outside the plain model: rank layout, sharding
rules, pipeline stages, the step channel and the follower ranks' loop."""
