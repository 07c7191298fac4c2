"""Evaluation: held-out evaluation, stage-1 denoising metrics, sampler frontiers, statistics, plots and study reports.

Modules:
  evaluator     the held-out evaluator: exact match per task, tokens per forward, steps per block, per decoding
  heldout       held-out prompts provably disjoint from the training stream
  denoise       stage-1 denoising metrics at fixed noise levels (loss by noise level, one-step accuracy)
  frontier      the sampler frontier of a checkpoint: steps per block against exact match over sampler settings
  genppl        generative perplexity: NLL of generated answers under a causal (stage-0 AR) model
  diversity     do a decoding's answers keep the data's choices, or does it buy steps with collapse?
  room          room for fewer steps: drafts already final that the accept rule still waited on
  stats         mean and 95 % bootstrap confidence intervals over seeds and prompts
  plots         training curves and metrics by noise level (matplotlib, Agg, PNG)
  study_report  a study's summaries, retention and machine description (reusable by every study)
"""
