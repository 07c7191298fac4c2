"""`dgemma sample` / `dgemma eval` refuse diffusion decoding of a shift-trained run (the sampler reads noshift only)."""

from pathlib import Path

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "stage1" / "tiny.yaml")


def test_shift_runs_decode_only_in_ar_mode(tmp_path, capsys):
    from dgemma.cli.main import main

    shift = ["-c", TINY, "diffusion.head_alignment=shift", "--checkpoint", str(tmp_path / "missing")]
    assert main(["sample", *shift, "--prompt", "C12|", "--mode", "diffusion"]) == 2
    assert "head_alignment='shift'" in capsys.readouterr().err
    assert main(["eval", *shift, "--modes", "ar,auto"]) == 2
    assert "mode(s) ['auto'] cannot run; use mode ar" in capsys.readouterr().err
    # AR decoding of a shift run passes the layout check (and then stops at the missing checkpoint)
    assert main(["sample", *shift, "--prompt", "C12|", "--mode", "ar"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
