"""`SDRLConfig` lives in `dgemma.diffusion.sdrl_config` (jax-free, below the config layer, next to the SD·RL objective);
re-exported here for the stage-2 package."""

from dgemma.diffusion.sdrl_config import ARMS, SDRLConfig, TermWeights  # noqa: F401

__all__ = ["ARMS", "SDRLConfig", "TermWeights"]
