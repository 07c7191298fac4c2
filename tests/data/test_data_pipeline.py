"""Grain pipeline: determinism, process sharding, resume from state and from the step alone."""

import json

import numpy as np
import pytest

from dgemma.data.layout import EXAMPLE_KEYS
from dgemma.data.config import LayoutConfig, DataConfig, TaskConfig
from dgemma.data.pipeline import DataPipeline, to_global_batch
from dgemma.data.tasks import MixtureSource

LAYOUT = LayoutConfig(prompt_len=16, canvas_length=8, n_blocks=2)


def _cfg(**kw):
    base = dict(
        tasks=(TaskConfig(name="copy"), TaskConfig(name="sort"), TaskConfig(name="add", weight=2.0),
               TaskConfig(name="mul")),
        layout=LAYOUT, batch_size=4, num_examples=10_000, seed=3, num_threads=0,
    )
    base.update(kw)
    return DataConfig(**base)


def _pipe(cfg=None, pi=0, pc=1, **kw):
    return DataPipeline(cfg or _cfg(**kw), process_index=pi, process_count=pc)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_batch_contents_match_source_and_layout_contract():
    pipe = _pipe()
    b = pipe.batch(0)
    assert set(b) == set(EXAMPLE_KEYS) | {"index"}
    assert b["tokens"].shape == (4, 32) and b["diffusion_weight"].shape == (4, 16) and b["block_used"].shape == (4, 2)
    assert b["index"].dtype == np.int32 and b["tokens"].dtype == np.int32
    tok = pipe.tokenizer
    for row in range(4):
        ex = pipe.source[int(b["index"][row])]
        assert isinstance(pipe.source, MixtureSource)
        valid = b["valid"][row]
        text = tok.decode(b["tokens"][row][valid])
        assert text.startswith("<bos>" + ex.prompt + ex.response + "<eos>")
        assert b["tokens"][row][16 + len(ex.response)] == tok.eos_id


def test_same_seed_same_batches_different_seed_different():
    a = _take(iter(_pipe()), 3)
    b = _take(iter(_pipe(num_threads=2, prefetch_buffer_size=4)), 3)  # threads do not change the stream
    for x, y in zip(a, b):
        _assert_batches_equal(x, y)
    c = _take(iter(_pipe(seed=4)), 3)
    assert not all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, c))
    # shuffle on vs off is a different order of the same source
    d = _pipe(shuffle=False).batch(0)
    np.testing.assert_array_equal(d["index"], [0, 1, 2, 3])
    assert not np.array_equal(a[0]["index"], d["index"])


def test_processes_read_disjoint_slices_of_the_global_batch():
    cfg = _cfg(batch_size=6)  # the global batch: 3 rows per process
    single = DataPipeline(cfg, process_index=0, process_count=1)
    p0 = DataPipeline(cfg, process_index=0, process_count=2)
    p1 = DataPipeline(cfg, process_index=1, process_count=2)
    seen0, seen1 = set(), set()
    for step in range(5):
        b0, b1, g = p0.batch(step), p1.batch(step), single.batch(step)
        seen0 |= set(b0["index"].tolist())
        seen1 |= set(b1["index"].tolist())
        # step s of every layout reads global positions [s*G, (s+1)*G), process p taking p, p+2, ...
        for k in b0:
            np.testing.assert_array_equal(b0[k], g[k][0::2], err_msg=k)
            np.testing.assert_array_equal(b1[k], g[k][1::2], err_msg=k)
    assert seen0.isdisjoint(seen1) and len(seen0) == len(seen1) == 15
    assert p0.fingerprint() == p1.fingerprint() == single.fingerprint()  # same global batch, same stream
    assert len(b0["index"]) == 3 and p0.global_batch_size == single.global_batch_size == 6
    with pytest.raises(ValueError, match=r"data.batch_size=6 \(the global batch\) is not divisible by the 4 processes"):
        DataPipeline(cfg, process_index=0, process_count=4)


def test_resume_from_state_reproduces_the_rest():
    pipe = _pipe(num_threads=2)
    it = iter(pipe)
    _take(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # JSON-serializable
    assert state["step"] == 3 and state["grain"] == {"next_index": 3}
    expected = _take(it, 3)
    fresh = iter(_pipe(num_threads=2))
    fresh.set_state(state)
    assert fresh.step == 3
    for x, y in zip(expected, _take(fresh, 3)):
        _assert_batches_equal(x, y)
    it.close()
    fresh.close()


def test_iterator_from_step_equals_the_kth_batch():
    pipe = _pipe()
    seq = _take(iter(pipe), 6)
    for k in (0, 2, 5):
        it = _pipe().iterator_from_step(k)
        assert it.step == k
        _assert_batches_equal(next(it), seq[k])
        _assert_batches_equal(pipe.batch(k), seq[k])
    # a far step is O(1): no iteration through earlier steps
    far = pipe.iterator_from_step(10**9)
    _assert_batches_equal(next(far), pipe.batch(10**9))


def test_state_is_checked_against_the_stream():
    it = iter(_pipe())
    next(it)
    state = it.get_state()
    with pytest.raises(ValueError, match="fingerprint"):
        iter(_pipe(seed=9)).set_state(state)
    with pytest.raises(ValueError, match="global batch 4, now 8"):
        iter(_pipe(batch_size=8)).set_state(state)
    with pytest.raises(ValueError, match="inconsistent"):
        iter(_pipe()).set_state({**state, "step": 5})
    other = iter(_pipe(seed=9))
    other.set_state(state, check_fingerprint=False)
    assert other.step == 1
    # per-process knobs are not part of the stream
    assert _pipe(num_threads=3).fingerprint() == _pipe().fingerprint()


def test_the_fingerprint_is_the_one_from_before_the_layout_rename():
    """A data-iterator state checkpointed while the section was `data.canvas` still matches the same stream under
    `data.layout`: this config's fingerprint as computed before the rename."""
    assert _pipe().fingerprint() == "7fcaadd9ad473496"


def test_finite_epochs_reshuffle_and_cover_the_source():
    src_len = 12
    pipe = _pipe(num_examples=src_len, num_epochs=2, batch_size=4)
    assert len(pipe) == 6
    batches = list(iter(pipe))
    assert len(batches) == 6
    idx = np.concatenate([b["index"] for b in batches])
    epoch1, epoch2 = idx[:src_len], idx[src_len:]
    assert sorted(epoch1) == sorted(epoch2) == list(range(src_len))
    assert not np.array_equal(epoch1, epoch2)  # grain reseeds the permutation per epoch
    with pytest.raises(IndexError):
        pipe.batch(6)


def test_drop_policy_keeps_batches_fixed_shape():
    cfg = _cfg(tasks=(TaskConfig(name="copy", min_len=4, max_len=20),),
               layout=LayoutConfig(prompt_len=24, canvas_length=4, n_blocks=3, response_overflow="drop"))
    b = _pipe(cfg).batch(0)
    lengths = np.array([len(_pipe(cfg).source[int(i)].response) for i in b["index"]])
    np.testing.assert_array_equal(b["example_mask"], lengths + 1 <= 12)
    assert b["tokens"].shape == (4, 36)
    strict = _cfg(tasks=cfg.tasks, layout=LayoutConfig(prompt_len=24, canvas_length=4, n_blocks=3))
    with pytest.raises(ValueError, match="response has"):
        for step in range(10):
            _pipe(strict).batch(step)


def test_pipeline_with_local_jsonl_and_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["what", "is", "one", "plus", "two", "three", "?"]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    ).save_pretrained(str(tmp_path / "tok"))
    rows = [{"prompt": "what is one plus two ?", "response": "three"}] * 3 + [{"prompt": "two", "response": "one"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(source="json", paths=[str(tmp_path / "d.jsonl")], tokenizer=dict(kind="hf", path=str(tmp_path / "tok")),
                     layout=dict(prompt_len=8, canvas_length=2, n_blocks=2), batch_size=2, shuffle=False,
                     num_threads=0, cache_dir=str(tmp_path / "cache"))
    pipe = DataPipeline(cfg, process_index=0, process_count=1)
    b = pipe.batch(0)
    np.testing.assert_array_equal(b["tokens"][0], [0, 2, 4, 5, 6, 7, 8, 10, 9, 1, 0, 0])
    np.testing.assert_array_equal(b["block_used"][0], [True, False])


def test_global_batch_on_simulated_devices():
    import jax

    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    pipe = _pipe(batch_size=len(devices))
    local = pipe.batch(0)
    arrays = to_global_batch(local, sharding)
    assert arrays["tokens"].shape == local["tokens"].shape
    np.testing.assert_array_equal(np.asarray(arrays["ar_weight"]), local["ar_weight"])


def test_data_config_validation_and_yaml_style_construction():
    cfg = DataConfig(tasks=[{"name": "copy", "weight": 2}], layout={"prompt_len": 8}, paths=["x"])
    assert isinstance(cfg.tasks, tuple) and cfg.tasks[0] == TaskConfig(name="copy", weight=2)
    assert cfg.layout == LayoutConfig(prompt_len=8) and cfg.paths == ("x",)
    for kw, field in (
        (dict(batch_size=0), "DataConfig.batch_size"),
        (dict(seed=-1), "DataConfig.seed"),
        (dict(source="csv"), "DataConfig.source"),
        (dict(tasks=()), "DataConfig.tasks"),
        (dict(tasks=[{"name": "copy"}, {"name": "copy"}]), "DataConfig.tasks"),
        (dict(num_epochs=0), "DataConfig.num_epochs"),
        (dict(num_examples=2**31), "DataConfig.num_examples"),
        (dict(prompt_template="Q:"), "DataConfig.prompt_template"),
    ):
        with pytest.raises(ValueError, match=field):
            DataConfig(**kw)
    with pytest.raises(ValueError, match="process_index=2"):
        DataPipeline(_cfg(), process_index=2, process_count=2)
