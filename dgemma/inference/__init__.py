"""dgemma.inference: decoding on one set of weights (AR and block diffusion) and the rollouts stage 2 trains on.

Modules:
  ar             autoregressive decoding (the AR model and DiffusionGemma's AR fallback): one compiled loop
  sampler        the block sampler: compiled entropy-bounded renoise loop, exact ancestral option, AR fallback
  sampler_types  `SamplerConfig` (the `sampler` config section) and the sampler's result types
  eb_accept      per-step pieces: temperature schedule, token entropy, accept rules, stop test (`eb_step`)
  ancestral      the exact ancestral sampler step for one block (docs/sampler.md §5)
  eos            end-of-sequence processing of a committed canvas, as transformers' `generate` does it
  draws          injected randomness: replay another implementation's draws (parity tests)
  metrics        sampler metrics: summaries of a `SampleResult` (docs/sampler.md §7)
  batches        combining the `SampleResult`s of several batches
  record         state recording inside the denoising loop (what SD·RL replays)
  rollout        rollouts that record their states, for SD·RL (its docstring is the contract)
  replay         recorded states replayed through the training forward, with gradient (docs/sdrl.md §1)
  replay_shared  replay with each rollout's clean stream computed once, not once per state row
"""
