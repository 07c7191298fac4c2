"""Evaluation: the held-out evaluator (`evaluator.py`: exact match per task, tokens per forward, steps per block, per
decoding), held-out sets disjoint from training, stage-1 denoising metrics, statistics, plots and study reports."""
