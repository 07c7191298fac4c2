"""Model-independent diffusion math for dgemma (docs/stage1.md §1–§4).

Terminology: a *canvas* (block) is L consecutive response tokens denoised jointly; the *prompt* has block id −1;
padding/unused slots have block id −2. The *clean stream* is the causal (encoder) path, the *noisy stream* the
bidirectional (decoder) canvas path. The *denoiser* p(x0 | x_t) is what a CE-trained network outputs; the
*leave-one-out* (LOO) posterior excludes the position's own noisy token.

Modules:
  schedule        α_t schedules and per-(example, block) time sampling
  corruption      uniform-noise forward process q(x_t | x0), coupled noise
  posterior       bridge posterior q(z_s | z_t, x), denoiser ↔ LOO logits, exact three-way ancestral step
  elbo            UDLM continuous-time NELBO: reference (1.6), folded fp32 form (1.8), evaluator, L_prior
  masks           the one-pass [clean ; noisy] block-diffusion attention mask (docs/stage1.md §4), stream concat
  split_streams   the one-pass layout as separate stream passes sharing the clean stream's keys and values
  losses          chunked cross-entropy from hidden states
  ar              the `ar` objective's loss (next-token CE on the clean stream)
  stage1          the stage-1 loss: uniform-noise block diffusion + clean-stream AR loss in one forward pass
  stage1_config   `Stage1Config`, the stage-1 settings (the run config's `diffusion` section)
  sdrl_objective  the SD·RL objective on plain arrays: advantages, PPO surrogate, gated SD, KL (docs/sdrl.md §2)
"""

from typing import TYPE_CHECKING

from dgemma._lazy import lazy_exports

# Names re-exported lazily (PEP 562), so that importing a jax-free submodule such as `stage1_config` (which the config
# system reads) does not import jax through this package.
_EXPORTS = {
    "ar": ("ar_loss_fn",),
    "corruption": ("apply_noise", "corrupt", "corrupt_coupled", "draw_noise"),
    "elbo": ("nelbo_integrand", "prior_loss", "udlm_integrand_folded", "udlm_integrand_reference"),
    "losses": ("ce_from_hidden", "per_example_mean", "token_nll_from_hidden"),
    "masks": ("Streams", "TokenInfo", "block_diffusion_mask", "block_starts", "concat_streams"),
    "posterior": ("ancestral_step", "ancestral_step_from_logits", "ancestral_step_probs", "bridge_posterior",
                  "denoiser_to_loo_logits", "loo_delta", "loo_to_denoiser_logits"),
    "schedule": ("Schedule", "alpha_linear", "dalpha_linear", "expand_per_block", "get_schedule", "sample_t"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the type checker sees the lazily exported names' own types
    from dgemma.diffusion.corruption import apply_noise, corrupt, corrupt_coupled, draw_noise
    from dgemma.diffusion.elbo import nelbo_integrand, prior_loss, udlm_integrand_folded, udlm_integrand_reference
    from dgemma.diffusion.losses import ce_from_hidden, per_example_mean, token_nll_from_hidden
    from dgemma.diffusion.masks import Streams, TokenInfo, block_diffusion_mask, block_starts, concat_streams
    from dgemma.diffusion.posterior import (
        ancestral_step, ancestral_step_from_logits, ancestral_step_probs, bridge_posterior, denoiser_to_loo_logits,
        loo_delta, loo_to_denoiser_logits,
    )
    from dgemma.diffusion.schedule import (
        Schedule, alpha_linear, dalpha_linear, expand_per_block, get_schedule, sample_t,
    )
