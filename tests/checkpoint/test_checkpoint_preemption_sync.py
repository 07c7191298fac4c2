"""`CheckpointManager.reached_preemption` catches only the "preemption service off" error; others surface."""

import pytest


class _Raising:
    def __init__(self, error):
        self.error = error

    def reached_preemption(self, step):
        raise self.error


def test_only_the_disabled_preemption_service_is_tolerated(tmp_path, monkeypatch):
    import jax

    from dgemma.checkpoint.manager import CheckpointManager

    mgr = CheckpointManager(tmp_path / "ckpt")
    try:
        assert mgr.reached_preemption(3) is False  # one process: the loop's SIGTERM handler is the mechanism
        # Several processes: the sync point is asked. The multi-host runtime cannot run in one test process, so the
        # orbax call is replaced by one that raises what jax raises.
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        monkeypatch.setattr(mgr, "_mgr", _Raising(RuntimeError(
            "Preemption sync manager has not been initialized. Make sure the 'jax_enable_preemption_service' "
            "config is enabled.")))
        assert mgr.reached_preemption(3) is False
        for error in (RuntimeError("coordination service: barrier timed out"), ValueError("bad step"),
                      OSError("connection reset")):
            monkeypatch.setattr(mgr, "_mgr", _Raising(error))
            with pytest.raises(type(error), match=str(error)):
                mgr.reached_preemption(3)
    finally:
        monkeypatch.undo()
        mgr.close()
