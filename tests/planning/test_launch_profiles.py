"""What every packaged launch profile does with both shipped 26B configs: the claim made in
launch/README.md ("Packaged profiles and the 26B configs"), checked with `dgemma launch --dry-run` (render + planner,
nothing written or submitted). A new profile fails `test_every_profile_has_a_claim` until its row is added here and
there."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgemma.cli.main import main
from dgemma.planning.launch_spec import PROFILES_DIR

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"stage1": REPO / "configs/stage1/gemma4_26b_a4b.yaml", "stage2": REPO / "configs/stage2/gemma4_26b_a4b.yaml"}
NOT_DIVISIBLE = "is not divisible by the"
# (profile, config) -> (exit code of the shipped config, what stderr says; overrides that make it launch)
CLAIMS = {
    ("local_cpu", "stage1"): (1, "DOES NOT FIT", None),  # for the tiny configs: 26B does not fit a CPU host
    ("local_cpu", "stage2"): (1, "DOES NOT FIT", None),
    ("slurm_h100", "stage1"): (0, "FITS", None),
    ("slurm_h100", "stage2"): (0, "FITS", None),
    ("xpk_h100", "stage1"): (0, "FITS", None),
    ("xpk_h100", "stage2"): (1, NOT_DIVISIBLE, ["data.batch_size=16"]),  # 8 prompts over 16 GPUs
    ("xpk_v5p64", "stage1"): (0, "FITS", None),
    ("xpk_v5p64", "stage2"): (1, NOT_DIVISIBLE, ["data.batch_size=32"]),  # 8 prompts over 32 chips
    ("tpu_vm_v5p64", "stage1"): (0, "FITS", None),
    ("tpu_vm_v5p64", "stage2"): (1, NOT_DIVISIBLE, ["data.batch_size=32"]),
}


def test_every_profile_has_a_claim():
    profiles = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
    assert sorted({p for p, _ in CLAIMS}) == profiles
    assert {c for _, c in CLAIMS} == set(CONFIGS)


@pytest.mark.parametrize("profile,stage", sorted(CLAIMS))
def test_profile_with_a_26b_config(profile, stage, capsys):
    code, needle, fix = CLAIMS[profile, stage]
    argv = ["launch", "--profile", profile, str(CONFIGS[stage]), "--dry-run"]
    assert main(argv) == code
    err = capsys.readouterr().err
    assert needle in err, err[-2000:]
    if fix is not None:
        assert main([*argv, *fix]) == 0
        assert "FITS" in capsys.readouterr().err
