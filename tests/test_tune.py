"""facodegen tune and the tuning database, on the CPU: candidate enumeration and pruning, the
compile step (monkeypatched, plus one real 2-process compile of small kernels), winner choice,
the database (round trip, key separation, corrupt/foreign files, concurrent writers), the
tuned lookup in resolve_spec (fake device), and the CLI without a GPU."""

from __future__ import annotations

import json
import math
import multiprocessing

import pytest
from click.testing import CliRunner

from facodegen.ops import api
from facodegen import cli
from facodegen.tuning import tune as T, tunedb
from facodegen.spec import KernelSpec, SpecError, seqlen_rule_fields


@pytest.fixture(autouse=True)
def _fresh_db(tmp_path, monkeypatch):
    """Every test gets its own database path and no remembered warnings or cached reads."""
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(tunedb.ENV, str(path))
    tunedb._warned.clear()
    tunedb._cache.clear()
    yield path
    tunedb._cache.clear()


# ---- enumeration and pruning ------------------------------------------------------------------

SM80_SPACE = {"block_m": (64, 128, 256), "num_warps": (4, 8), "stages": (2,)}


def test_enumeration_counts_and_budget_reasons():
    cands = T.enumerate_candidates("sm80", 128, "bf16", False, "a100", max_candidates=48, space=SM80_SPACE)
    assert len(cands) == 6  # 3 x 2 x 1, the default (128, 4 warps, 2 stages) among them
    by = {(c.fields["block_m"], c.fields["num_warps"]): c for c in cands}
    assert cands[0].is_default and cands[0].spec == KernelSpec(arch="sm80", head_dim=128, gpu="a100")
    # 64 rows cannot be split over 8 warps of 16 rows
    assert by[64, 8].dropped == "budget" and "multiple of 16*num_warps=128" in by[64, 8].reason
    # 256 x 128 O accumulator over 128 threads is 256 registers alone
    assert by[256, 4].dropped == "budget" and "registers" in by[256, 4].reason
    # the reason is the budget model's own message
    with pytest.raises(SpecError) as err:
        KernelSpec(arch="sm80", head_dim=128, gpu="a100", block_m=64, num_warps=8, stages=2)
    assert by[64, 8].reason == str(err.value)
    live = [c for c in cands if c.alive]
    assert {(c.spec.block_m, c.spec.num_warps) for c in live} >= {(128, 4), (64, 4), (128, 8)}
    assert all(c.spec is None for c in cands if c.dropped == "budget")
    assert T.summary_counts(cands)["enumerated"] == 6


def test_cap_keeps_the_nearest_and_the_default_first():
    cands = T.enumerate_candidates("sm80", 64, "bf16", False, "a100", max_candidates=5)
    live = [c for c in cands if c.alive]
    capped = [c for c in cands if c.dropped == "cap"]
    assert len(live) == 5 and live[0].is_default and live[0].distance == 0
    assert capped and all("--max-candidates 5" in c.reason for c in capped)
    assert max(c.distance for c in live) <= min(c.distance for c in capped)
    assert [c.distance for c in live] == sorted(c.distance for c in live)
    # live first, then pruned; nothing counted twice
    assert cands[:5] == live
    assert len({c.spec for c in cands if c.spec is not None}) == sum(c.spec is not None for c in cands)


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_space_size(arch, head_dim):
    cands = T.enumerate_candidates(arch, head_dim, "bf16", head_dim == 128, None)
    live = [c for c in cands if c.alive]
    assert 5 <= len(live) <= T.MAX_CANDIDATES
    assert live[0].is_default
    assert all(c.alive or c.dropped in ("budget", "cap") for c in cands)
    assert all(c.reason for c in cands if not c.alive)
    if arch == "sm90":
        assert 30 <= len(live) <= 60


def test_the_baseline_of_a_length_is_its_rule_spec():
    """With the call's lengths the default candidate is what that call runs without a tuned entry
    (the head_dim 64 causal rule up to 4k: three one-warpgroup CTAs per SM), and the rest rank by
    their distance from it; without lengths, the head_dim default."""
    space = {"block_m": (64, 192), "block_n": (64, 96, 128), "ctas_per_sm": (1, 3)}
    short = T.enumerate_candidates("sm90", 64, "bf16", True, None, max_candidates=4, space=space,
                                   seqlen=(1024, 1024))
    assert short[0].is_default and short[0].spec == KernelSpec(arch="sm90", head_dim=64, causal=True,
                                                               consumer_warpgroups=1, ctas_per_sm=3, block_n=64)
    live = [c for c in short if c.alive]
    assert len(live) == 4 and all(c.spec.block_m == 64 for c in live)       # the 192-row tiles are far
    assert (live[1].spec.ctas_per_sm, live[1].spec.block_n) == (3, 96)
    plain = T.enumerate_candidates("sm90", 64, "bf16", True, None, space=space)
    assert plain[0].spec == KernelSpec(arch="sm90", head_dim=64, causal=True)
    long = T.enumerate_candidates("sm90", 64, "bf16", True, None, space=space, seqlen=(8192, 8192))
    assert long[0].spec == plain[0].spec


def test_fp8_space_has_no_bf16_only_knobs():
    assert "separate_o" in T.search_space("sm90") and "separate_o" not in T.search_space("sm90", "fp8")
    cands = T.enumerate_candidates("sm90", 128, "fp8", False, None)
    assert not any("separate_o" in c.reason for c in cands)
    live = [c for c in cands if c.alive]
    assert live[0].is_default and len(live) >= 20 and all(c.spec.dtype == "fp8" for c in live)


def test_distance():
    d = KernelSpec(arch="sm80", head_dim=128)
    assert T.distance(d, d) == 0
    assert T.distance(d.replace(block_n=32, stages=3), d) == 2
    d64 = KernelSpec(arch="sm80", head_dim=64)
    assert T.distance(KernelSpec(arch="sm80", head_dim=64, block_n=64, q_in_regs=True), d64) == 2


# ---- compile step -----------------------------------------------------------------------------

def _fake_worker(spec_fields, sm):
    bn = spec_fields["block_n"]
    if bn == 32:
        return {"ok": False, "error": "CompileError: boom", "seconds": 0.0}
    res = {"registers": 200, "spill_stores": 8 if spec_fields["stages"] == 1 else 0, "spill_loads": 0}
    warns = ["ptxas warning : C7510 wgmma serialized"] if spec_fields["q_in_regs"] else []
    return {"ok": True, "resources": res, "warnings": warns, "from_cache": False, "seconds": 0.0}


def test_compile_step_drops_errors_spills_and_c75_warnings():
    cands = T.enumerate_candidates("sm80", 64, "bf16", False, "a100", max_candidates=48)
    seen = []
    T.compile_candidates(cands, jobs=1, worker=_fake_worker, on_done=seen.append)
    assert len(seen) == 48
    for c in seen:
        f = c.spec
        if c.is_default:
            assert c.alive
        elif f.block_n == 32:
            assert c.dropped == "compile" and "boom" in c.reason
        elif f.stages == 1:
            assert c.dropped == "spill" and "8 B stores" in c.reason
        elif f.q_in_regs:
            assert c.dropped == "ptxas" and "C7510" in c.reason
        else:
            assert c.alive and c.resources["registers"] == 200


def test_compile_verdict():
    assert T.compile_verdict({"spill_stores": 0, "spill_loads": 0}, ["ptxas info: fine"]) is None
    assert T.compile_verdict({"spill_stores": 0, "spill_loads": 4}, [])[0] == "spill"
    assert T.compile_verdict({}, ["ptxas warning : (C7508) setmaxnreg ignored"])[0] == "ptxas"


@pytest.mark.slow
def test_real_compile_in_two_processes(fresh_cache):
    """Two small sm80 kernels through the spawn pool: resources come back, the cache is filled."""
    cands = T.enumerate_candidates("sm80", 64, "fp16", False, "a100", max_candidates=2)
    T.compile_candidates(cands, jobs=2)
    live = [c for c in cands if c.alive]
    assert len(live) == 2
    for c in live:
        assert c.resources["registers"] > 0 and c.compile_s is not None
    assert len(list(fresh_cache.glob("*.cubin"))) == 2


# ---- winner choice ----------------------------------------------------------------------------

def _timed(cands, times):
    live = [c for c in cands if c.alive]
    for c, t in zip(live, times):
        c.times_ms = list(t)
    return live


def test_pick_winner_keeps_the_default_unless_clearly_faster():
    cands = T.enumerate_candidates("sm80", 64, "bf16", False, "a100", max_candidates=3)
    live = _timed(cands, [[1.00, 1.00, 1.00], [0.995, 0.995, 0.995], [0.90]])
    winner, default = T.pick_winner(cands)
    # live[2] ran once only (not in the final round): it does not compete; live[1] is < 1% faster
    assert default is live[0] and winner is live[0]
    live[1].times_ms = [0.95, 0.96, 0.94]
    winner, _ = T.pick_winner(cands)
    assert winner is live[1]
    flops = 1e12
    table = T.format_results(cands, flops, top=5, winner=winner)
    assert "stored" in table and "default" in table and "1.053x" in table
    # the once-timed live[2] (0.90 ms) is listed after the final round, marked as screened only
    lines = [line for line in table.splitlines()[2:]]
    assert live[2].label in lines[-1] and "screen only" in lines[-1]
    assert "screen only" not in "".join(lines[:-1])


# ---- database ---------------------------------------------------------------------------------

def _key(**changes):
    args = dict(gpu_name="NVIDIA H200", compute_capability=(9, 0), nvrtc="13.0", arch="sm90", head_dim=128,
                dtype="bf16", causal=False, seqlen_q=4096, seqlen_k=4096, batch=4, heads_q=16)
    args.update(changes)
    return tunedb.make_key(**args)


def _entry(key, epoch=1.0, **spec):
    return tunedb.make_entry(key, {"block_n": 128, **spec}, variant="v", tflops=500.0, default_tflops=450.0,
                             tuned_at_epoch=epoch)


def test_buckets():
    assert tunedb.pow2_bucket(4096) == 4096 and tunedb.pow2_bucket(3000) == 4096
    assert tunedb.pow2_bucket(2500) == 2048 and tunedb.pow2_bucket(1) == 1
    assert _key(seqlen_q=3500, seqlen_k=5000) == _key()
    assert _key(batch=2, heads_q=32) == _key()
    assert _key(batch=8) != _key()


def test_round_trip(_fresh_db):
    key = _key()
    entry = _entry(key, stages=3)
    counts = tunedb.put(entry)
    assert counts == {"added": 1, "replaced": 0, "kept": 0}
    got = tunedb.lookup(key)
    assert got["spec"] == {"block_n": 128, "stages": 3} and got["tflops"] == 500.0
    data = json.loads(_fresh_db.read_text())
    assert data["format"] == tunedb.FORMAT and data["version"] == tunedb.VERSION
    # family and gpu fields are never stored in the spec
    e2 = tunedb.make_entry(key, KernelSpec(arch="sm90", head_dim=128).as_dict())
    assert not set(e2["spec"]) & set(tunedb.NOT_STORED)


@pytest.mark.parametrize("change", [dict(gpu_name="NVIDIA H100 80GB HBM3"), dict(compute_capability=(8, 0)),
                                    dict(nvrtc="13.1"), dict(arch="sm80"), dict(head_dim=64), dict(dtype="fp16"),
                                    dict(causal=True), dict(seqlen_q=8192, seqlen_k=8192), dict(seqlen_k=1024),
                                    dict(batch=64)])
def test_keys_do_not_collide(change):
    base, other = _key(), _key(**change)
    assert base != other and str(base) != str(other)
    tunedb.put(_entry(base, block_n=64))
    tunedb.put(_entry(other, block_n=32))      # (32: valid for every key here, sm80 included)
    assert tunedb.lookup(base)["spec"]["block_n"] == 64
    assert tunedb.lookup(other)["spec"]["block_n"] == 32


def test_merge_newer_wins(_fresh_db):
    key = _key()
    tunedb.put(_entry(key, epoch=10.0, stages=3))
    assert tunedb.put(_entry(key, epoch=5.0, stages=1)) == {"added": 0, "replaced": 0, "kept": 1}
    assert tunedb.lookup(key)["spec"]["stages"] == 3
    assert tunedb.put(_entry(key, epoch=20.0, stages=2))["replaced"] == 1
    assert tunedb.lookup(key)["spec"]["stages"] == 2


@pytest.mark.parametrize("text", ["{not json", json.dumps([1, 2]), json.dumps({"format": "other", "version": 1}),
                                  json.dumps({"format": tunedb.FORMAT, "version": 99, "entries": {}})])
def test_corrupt_or_foreign_file_is_ignored_with_a_warning(_fresh_db, text):
    _fresh_db.write_text(text)
    with pytest.warns(tunedb.TuneDBWarning, match="ignoring"):
        assert tunedb.lookup(_key()) is None
    # a write moves it aside and starts a new database
    tunedb.put(_entry(_key()))
    assert tunedb.lookup(_key()) is not None
    assert list(_fresh_db.parent.glob("tuned.json.bad-*"))


def test_lookup_caches_by_mtime(_fresh_db, monkeypatch):
    tunedb.put(_entry(_key()))
    calls = []
    real = tunedb.read
    monkeypatch.setattr(tunedb, "read", lambda p=None: calls.append(p) or real(p))
    for _ in range(5):
        assert tunedb.lookup(_key()) is not None
    assert len(calls) == 1
    tunedb.put(_entry(_key(batch=64)))
    assert tunedb.lookup(_key(batch=64)) is not None and len(calls) == 2


def test_turned_off(monkeypatch):
    monkeypatch.setenv(tunedb.ENV, "off")
    assert tunedb.default_path() is None and tunedb.lookup(_key()) is None


def _writer(path, i, n):
    for j in range(n):
        key = _key(batch=2 ** (i + 1), heads_q=1, seqlen_q=2 ** (j + 4), seqlen_k=2 ** (j + 4))
        tunedb.put(_entry(key, epoch=float(j)), path)


def test_concurrent_writers_lose_nothing(_fresh_db):
    procs, n = 4, 6
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_writer, args=(str(_fresh_db), i, n)) for i in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    assert len(tunedb.read(_fresh_db)) == procs * n
    assert not list(_fresh_db.parent.glob(".tuned.json.*.tmp"))


def test_export_import(tmp_path, _fresh_db):
    tunedb.put(_entry(_key()))
    tunedb.put(_entry(_key(causal=True)))
    dest = tmp_path / "team.json"
    assert tunedb.export(dest) == 2
    other = tmp_path / "other.json"
    assert tunedb.import_file(dest, other) == {"added": 2, "replaced": 0, "kept": 0, "refused": 0}
    assert tunedb.read(other) == tunedb.read(_fresh_db)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.warns(tunedb.TuneDBWarning), pytest.raises(ValueError):
        tunedb.import_file(bad, other)


@pytest.mark.parametrize("spec, words", [
    ({"block_n": 999}, "block_n"), ({"stages": -3}, "stages"), ({"frobnicate": 1}, "'frobnicate' is not a knob"),
    ({"pingpong": "no"}, "pingpong: must be True or False"), ({"arch": "sm80"}, "'arch' is not a knob"),
    ({"gpu": "h200\n#error"}, "'gpu' is not a knob"), ({"v_layout": "row\n#error"}, "v_layout"),
])
def test_an_invalid_entry_is_refused_on_import_and_ignored_on_read(tmp_path, _fresh_db, spec, words):
    good, bad = _key(), _key(causal=True)
    text = tunedb.dumps({str(good): _entry(good), str(bad): {**_entry(bad), "spec": spec}})
    src = tmp_path / "team.json"
    src.write_text(text)
    with pytest.warns(tunedb.TuneDBWarning, match=words):
        counts = tunedb.import_file(src)
    assert counts == {"added": 1, "replaced": 0, "kept": 0, "refused": 1}
    assert list(tunedb.read()) == [str(good)]
    # a file written by hand (or by an older facodegen) is read the same way: the entry is ignored
    # with the warning, never silently, and the lookup finds nothing for its key
    _fresh_db.write_text(text)
    tunedb._warned.clear()
    tunedb.reload()
    with pytest.warns(tunedb.TuneDBWarning, match="refusing the entry"):
        assert tunedb.lookup(bad) is None
    assert tunedb.lookup(good) is not None


def test_cli_import_counts_refused_entries(tmp_path, _fresh_db):
    bad = _key()
    src = tmp_path / "team.json"
    src.write_text(tunedb.dumps({str(bad): {**_entry(bad), "spec": {"block_n": 999, "stages": -3, "frobnicate": 1}}}))
    result = CliRunner().invoke(cli.main, ["tune", "--import", str(src)])
    assert result.exit_code == 0 and "0 added" in result.output and "1 refused (invalid)" in result.output


# ---- attention's lookup (resolve_spec on a fake device) ---------------------------------------

H200 = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
SHAPE = (4, 4096, 4096, 16)   # batch, seqlen_q, seqlen_k, heads_q


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.setattr(api, "device_info", lambda ordinal: H200)
    monkeypatch.setattr(api.compile_mod, "nvrtc_identity", lambda: "13.0 (test)")


def _store_tuned(**spec):
    key = tunedb.make_key(H200.name, H200.compute_capability, "13.0 (test)", "sm90", 128, "bf16", False,
                          4096, 4096, 4, 16)
    tunedb.put(tunedb.make_entry(key, spec, variant="tuned"))


def test_resolve_spec_prefers_a_tuned_entry(fake_device):
    default = api.resolve_spec(128, "bf16", False, 0, shape=SHAPE)     # the sequence-length rule's spec
    assert default == KernelSpec(arch="sm90", head_dim=128, gpu="h200", **seqlen_rule_fields(
        "sm90", 128, "bf16", False, SHAPE[1], SHAPE[2]))
    _store_tuned(block_n=112, pingpong=False, stages=2)
    tuned = api.resolve_spec(128, "bf16", False, 0, shape=SHAPE)
    assert (tuned.block_n, tuned.pingpong) == (112, False)
    # same bucket: a nearby shape gets it; other buckets, families and no shape do not
    assert api.resolve_spec(128, "bf16", False, 0, shape=(2, 3500, 3500, 32)).block_n == 112
    assert api.resolve_spec(128, "bf16", False, 0, shape=(4, 2048, 2048, 16)) == default
    assert api.resolve_spec(128, "bf16", True, 0, shape=SHAPE) == KernelSpec(   # its own rule
        arch="sm90", head_dim=128, causal=True, gpu="h200", block_n=128, pingpong=True, uniform_wg=True, p_buffers=2)
    assert api.resolve_spec(128, "bf16", False, 0) == KernelSpec(arch="sm90", head_dim=128, gpu="h200")


def test_resolve_spec_user_fields_win(fake_device):
    _store_tuned(block_n=112, pingpong=False, stages=2)
    spec = api.resolve_spec(128, "bf16", False, 0, shape=SHAPE, pingpong=True)
    assert spec.pingpong is True and spec.block_n == 112
    # a user field that does not fit with the tuned ones: the defaults + the user's field
    _store_tuned(consumer_warpgroups=1, block_n=192)
    assert api.resolve_spec(128, "bf16", False, 0, shape=SHAPE).block_m == 64
    spec = api.resolve_spec(128, "bf16", False, 0, shape=SHAPE, pingpong=True)
    assert spec == KernelSpec(arch="sm90", head_dim=128, gpu="h200", pingpong=True)


def test_resolve_spec_seqlen_rules(fake_device):
    """spec.seqlen_rule_fields: head_dim 128 non-causal up to 1k keys takes block_n 128, from 2k two P
    buffers with the descriptors in uniform registers (128 keys up to 4k, 144 beyond); head_dim 64
    causal up to 4k queries three one-warpgroup CTAs per SM (64 keys up to 1k, 96 beyond); head_dim
    128 causal up to 8k pingpong with uniform_wg (from 2k also 128 keys and two P buffers), from 16k
    the non-causal long tile (144 keys, two P buffers); head_dim 256 O over the V ring, uniform_wg, two
    P buffers and Q descriptors rebuilt per step at every length, with 64 keys up to 1k (causal) or
    512 (non-causal); fp8 has none (its defaults); tuned entries and the caller's fields win."""
    short = api.resolve_spec(128, "bf16", False, 0, shape=(32, 512, 512, 16))
    assert short == KernelSpec(arch="sm90", head_dim=128, gpu="h200", block_n=128)
    mid = api.resolve_spec(128, "bf16", False, 0, shape=(8, 2048, 2048, 16))
    assert (mid.block_n, mid.uniform_wg, mid.p_buffers) == (128, True, 2)
    assert api.resolve_spec(128, "bf16", True, 0, shape=(32, 512, 512, 16)) == \
        KernelSpec(arch="sm90", head_dim=128, causal=True, gpu="h200", pingpong=True, uniform_wg=True)
    assert [api.resolve_spec(128, "bf16", True, 0, shape=(16384 // s, s, s, 16)).p_buffers
            for s in (1024, 2048, 8192, 16384)] == [1, 2, 2, 2]
    assert [api.resolve_spec(128, "bf16", True, 0, shape=(16384 // s, s, s, 16)).pingpong
            for s in (2048, 8192, 16384)] == [True, True, False]
    assert not api.resolve_spec(128, "bf16", True, 0, shape=(32, 512, 512, 16), pingpong=False).pingpong
    assert api.resolve_spec(256, "bf16", True, 0, shape=(32, 512, 512, 8)).block_n == 64
    assert api.resolve_spec(256, "bf16", True, 0, shape=(16, 1024, 1024, 8)).block_n == 64
    assert api.resolve_spec(256, "bf16", True, 0, shape=(8, 2048, 2048, 8)).block_n == 80
    assert api.resolve_spec(256, "bf16", True, 0, shape=(2, 8192, 8192, 8)).block_n == 80
    assert [api.resolve_spec(256, "bf16", True, 0, shape=(16384 // s, s, s, 8)).p_buffers
            for s in (512, 4096, 8192)] == [2, 2, 2]
    assert all(api.resolve_spec(256, "bf16", c, 0, shape=(16384 // s, s, s, 8)).rebuild_q_desc
               for c in (False, True) for s in (512, 2048, 16384))
    assert not api.resolve_spec(128, "bf16", True, 0, shape=(2, 8192, 8192, 16)).rebuild_q_desc
    assert api.resolve_spec(256, "bf16", False, 0, shape=(32, 512, 512, 8)).block_n == 64
    assert api.resolve_spec(256, "bf16", False, 0, shape=(16, 1024, 1024, 8)).block_n == 80
    # head_dim 256 up to 1k keys: O's staging tile over the V ring
    assert [api.resolve_spec(256, "bf16", c, 0, shape=(16384 // s, s, s, 8)).o_in_v
            for c in (False, True) for s in (512, 1024, 2048)] == [True, True, True, True, True, True]
    # and at every length (with uniform_wg)
    assert [api.resolve_spec(256, "bf16", c, 0, shape=(1, 16384, 16384, 8)).o_in_v for c in (False, True)] == [True, True]
    assert [api.resolve_spec(256, "bf16", c, 0, shape=(1, 16384, 16384, 8)).uniform_wg for c in (False, True)] == [True, True]
    assert not api.resolve_spec(256, "bf16", False, 0, shape=(32, 512, 512, 8), block_n=80).o_in_v
    # head_dim 128 long sequences: 144 keys with two P buffers, non-causal from 8k keys, causal from 16k
    long = [api.resolve_spec(128, "bf16", c, 0, shape=(16384 // s, s, s, 16)) for c in (False, True) for s in (4096, 8192, 16384)]
    assert [(x.block_n, x.o_in_v, x.p_buffers) for x in long] == [(128, False, 2), (144, False, 2), (144, False, 2),
                                                                   (128, False, 2), (128, False, 2), (144, False, 2)]
    d64 = [api.resolve_spec(64, "bf16", True, 0, shape=(16384 // s, s, s, 32)) for s in (512, 1024, 2048, 4096, 8192)]
    assert [(x.block_m, x.block_n, x.ctas_per_sm, x.q_stages) for x in d64] == [
        (64, 64, 3, 2), (64, 64, 3, 2), (64, 96, 3, 2), (64, 96, 3, 2), (192, 128, 1, 2)]
    assert api.resolve_spec(64, "bf16", False, 0, shape=(16, 1024, 1024, 32)).block_m == 192
    assert api.resolve_spec(128, "bf16", False, 0, shape=(32, 512, 512, 16), block_n=96).block_n == 96
    assert api.resolve_spec(128, "fp8", False, 0, shape=(32, 512, 512, 16)).block_n == 192
    short_fp8 = api.resolve_spec(128, "fp8", True, 0, shape=(8, 2048, 2048, 16))   # no rule: the anchored exact step
    assert (short_fp8.block_n, short_fp8.anchor_softmax, short_fp8.optimistic_max) == (192, True, False)
    assert api.resolve_spec(128, "fp8", True, 0, shape=(2, 8192, 8192, 16)).block_n == 192
    assert api.resolve_spec(64, "fp8", True, 0, shape=(8, 2048, 2048, 32)) == \
        KernelSpec(arch="sm90", head_dim=64, dtype="fp8", causal=True, gpu="h200")
    assert api.resolve_spec(128, "bf16", False, 0, shape=(32, 512, 512, 16), arch="sm80").block_n == 64
    # a caller's field that does not fit the rule's (p_buffers=2 needs optimistic_max): defaults + it
    assert api.resolve_spec(128, "bf16", False, 0, shape=SHAPE, optimistic_max=False) == \
        KernelSpec(arch="sm90", head_dim=128, gpu="h200", optimistic_max=False)


def test_resolve_spec_survives_a_bad_entry(fake_device, _fresh_db):
    """A bad entry is refused with a warning naming it, and the call gets what it gets without
    one: the sequence-length rule for its shape (not the bare defaults)."""
    key = tunedb.make_key(H200.name, H200.compute_capability, "13.0 (test)", "sm90", 128, "bf16", False,
                          4096, 4096, 4, 16)
    _fresh_db.write_text(tunedb.dumps({str(key): tunedb.make_entry(key, {"no_such_field": 1})}))
    with pytest.warns(tunedb.TuneDBWarning, match="'no_such_field' is not a knob"):
        spec = api.resolve_spec(128, "bf16", False, 0, shape=SHAPE)
    assert spec == api.spec_for_shape("sm90", 128, "bf16", False, SHAPE, gpu="h200")


# ---- CLI without a GPU ------------------------------------------------------------------------

def _no_gpu(monkeypatch):
    from facodegen.runtime import compiler
    monkeypatch.setattr(compiler, "gpu_available", lambda: (False, "no CUDA GPU (test)"))


def test_cli_tune_dry_run():
    result = CliRunner().invoke(cli.main, ["tune", "--dry-run", "--arch", "sm80", "--head-dim", "128"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    space = math.prod(len(v) for v in T.search_space("sm80").values())
    assert f"{space} points in the space" in first and "enumerated nearest the default" in first
    assert "budget" in first
    assert "(default)" in result.output and "pruned (" in result.output and "registers" in result.output
    assert "--verbose lists every pruned candidate" in result.output
    verbose = CliRunner().invoke(cli.main, ["tune", "--dry-run", "--verbose", "--arch", "sm80", "--head-dim", "128"],
                                 catch_exceptions=False)
    pruned = [c for c in T.enumerate_candidates("sm80", 128, "bf16", False, None) if not c.alive]
    assert all(c.label in verbose.output for c in pruned)


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_dry_run_is_fast_and_small(arch):
    """The search takes the points nearest the default lazily: the sm90 space has millions of
    points, the dry run builds a few hundred specs (the issue's bound: 10 s, 1 GB). Run in a process of its
    own, which reports its peak memory (VmHWM: a fresh exec's own, unlike ru_maxrss, which keeps the forking
    worker's peak: 1.05 GB after session 47's SASS tests, with the dry run itself at ~50 MB)."""
    import subprocess
    import sys
    import time
    run = ("import sys; from click.testing import CliRunner; from facodegen import cli; "
           "r = CliRunner().invoke(cli.main, sys.argv[1:], catch_exceptions=False); sys.stdout.write(r.output); "
           "print('exit', r.exit_code); "
           "print('VmHWM', next((l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')), 0))")
    start = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", run, "tune", "--dry-run", "--arch", arch, "--head-dim", "128"],
                           capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - start < 10
    *lines, exit_line, peak_line = child.stdout.splitlines()
    output = "\n".join(lines)
    assert child.returncode == 0 and exit_line == "exit 0", child.stdout + child.stderr
    assert int(peak_line.split()[1]) < 1 << 20      # KB: under 1 GB
    assert len(output) < 20000


def test_neighbourhood_walks_out_from_the_default_in_distance_order():
    axes = {"block_n": (32, 64, 128), "stages": (1, 2, 3), "q_in_regs": (False, True)}
    default = {"block_n": 64, "stages": 2, "q_in_regs": False}
    points = list(T.neighbourhood(axes, default))
    assert len(points) == 18 and points[0] == default
    assert len({tuple(p.values()) for p in points}) == 18                     # each point once
    costs = [sum(T._axis_cost(n, p[n], default[n]) for n in axes) for p in points]
    assert costs == sorted(costs)


def test_the_lazy_space_reaches_the_defaults_rules_and_shipped_winners():
    """Every default spec and every sequence-length rule spec is a search's default candidate,
    and the tuning-database winner shipped in docs/results is among the first points the lazy
    walk reaches from its default."""
    import gzip
    from pathlib import Path
    from facodegen.spec import default_specs
    for spec in default_specs():
        cands = T.enumerate_candidates(spec.arch, spec.head_dim, spec.dtype, spec.causal, spec.gpu,
                                       max_candidates=2)
        assert cands[0].is_default and cands[0].spec == spec
    for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
        for arch, hd, causal in (("sm90", 64, True), ("sm90", 128, False), ("sm90", 256, True)):
            rule = seqlen_rule_fields(arch, hd, "bf16", causal, seqlen, seqlen)
            cands = T.enumerate_candidates(arch, hd, "bf16", causal, None, max_candidates=2, seqlen=(seqlen, seqlen))
            assert cands[0].spec == KernelSpec(arch=arch, head_dim=hd, causal=causal, **rule)
    shipped = Path(__file__).resolve().parents[1] / "docs/results/tune-sm90-hd128-s4096.json.gz"
    entry = json.loads(gzip.decompress(shipped.read_bytes()))["entry"]
    winner = {k: v for k, v in entry["spec"].items() if k in T.search_space("sm90")}
    default = KernelSpec(arch="sm90", head_dim=128)
    start = {n: getattr(default, n) for n in T.search_space("sm90")}
    walk = T.neighbourhood(T.search_space("sm90"), start)
    reached = any(all(p[k] == v for k, v in winner.items()) for _, p in zip(range(T.MAX_EXAMINED), walk))
    assert reached, winner


def test_cli_tune_dry_run_compile(monkeypatch, tmp_path):
    monkeypatch.setattr(T, "compile_worker", _fake_worker)
    report = tmp_path / "r.json"
    result = CliRunner().invoke(cli.main, ["tune", "--dry-run", "--compile", "-j", "1", "--arch", "sm80",
                                           "--head-dim", "64", "--report", str(report)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "spill" in result.output and "C7510" in result.output
    rows = json.loads(report.read_text())["candidates"]
    assert {r["dropped"] for r in rows} >= {None, "budget", "compile", "spill", "ptxas"}


def test_cli_tune_needs_a_gpu(monkeypatch):
    _no_gpu(monkeypatch)
    result = CliRunner().invoke(cli.main, ["tune", "--arch", "sm90"])
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output and "--dry-run" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cli_bench_suite_needs_a_gpu(monkeypatch):
    _no_gpu(monkeypatch)
    result = CliRunner().invoke(cli.main, ["bench", "--suite", "quick"])
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output
    assert len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(cli.main, ["bench", "--arch", "both"])
    assert result.exit_code == 2


def test_cli_show_export_import(tmp_path, _fresh_db):
    tunedb.put(_entry(_key()))
    runner = CliRunner()
    result = runner.invoke(cli.main, ["tune", "--show"], catch_exceptions=False)
    assert result.exit_code == 0 and "1 entries" in result.output and "sm90-hd128-bf16-full" in result.output
    dest = tmp_path / "x.json"
    assert runner.invoke(cli.main, ["tune", "--export", str(dest)]).exit_code == 0
    other = tmp_path / "o.json"
    result = runner.invoke(cli.main, ["tune", "--db", str(other), "--import", str(dest), "--show"])
    assert result.exit_code == 0 and "1 added" in result.output and "1 entries" in result.output
