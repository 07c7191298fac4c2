"""Evaluation: task exact match (AR and, with the sampler, diffusion) and stage-1 denoising metrics."""
