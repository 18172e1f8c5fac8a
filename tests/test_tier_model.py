"""The two-tier model (tierkv/tier_model.py): known answers for promotion, write-back and
the disk admission rules, and the invariants it shares with the store (the disk holds
whole prefixes; ``adaptive`` equals ``all`` where it cannot lose to it)."""
from __future__ import annotations

import random

import pytest

from tierkv.disk_admission import ADMISSIONS, AdmitEither, make_admission
from tierkv.tier_model import TwoTiers, simulate_tiers
from tierkv.traces import Request, _tree
from store.kit import random_tree_trace


def _trace(*reqs: tuple[int, ...]) -> list[Request]:
    return [Request(tuple(r), len(r) * 512) for r in reqs]


def _hot_between_one_offs(n: int) -> list[Request]:
    """Block 1 every third request, fresh one-block requests between."""
    return _trace(*[(1,) if i % 3 == 0 else (100 + i,) for i in range(n)])


def test_promotion_known_answer():
    trace = _trace((1,), (2,), (1,), (1,))
    promoted = simulate_tiers(trace, 1, 10, "lru", promote=True)
    assert (promoted.host_hits, promoted.disk_hits) == (1, 1)  # r2 from disk, promoted; r3 from host
    through = simulate_tiers(trace, 1, 10, "lru", promote=False)
    assert (through.host_hits, through.disk_hits) == (0, 2)


def test_write_back_writes_only_what_leaves_memory():
    trace = _trace((1, 2), (1, 2, 3), (1,))
    through = simulate_tiers(trace, 10, 10, "lru")
    back = simulate_tiers(trace, 10, 10, "lru", write_back=True)
    assert through.disk_writes == 3 and back.disk_writes == 0  # nothing ever left memory
    assert through.hit_rate == back.hit_rate == 3 / 6


def test_reused_keeps_the_hot_block_that_all_lets_one_offs_push_out():
    # Memory 1 block, disk 2, LRU, write-through. Under "all" every one-off is written and
    # two of them push block 1 off the disk before it comes back: no hits. Under "reused"
    # block 1 is let go once (never served while in memory), comes back from the ghost at
    # r3 and is written; the one-offs never are, so r6 and r9 find it on disk.
    trace = _hot_between_one_offs(12)
    everything = simulate_tiers(trace, 1, 2, "lru", admission="all")
    reused = simulate_tiers(trace, 1, 2, "lru", admission="reused")
    assert everything.host_hits + everything.disk_hits == 0 and everything.disk_writes == 12
    assert (reused.host_hits, reused.disk_hits) == (0, 2) and reused.disk_writes == 1


@pytest.mark.parametrize("admission", [*ADMISSIONS, "either"])
@pytest.mark.parametrize("write_back", [False, True])
def test_the_disk_holds_whole_prefixes(admission, write_back):
    """Every block on the model's disk has its parent on disk (the store's flush_to_disk
    promise): a block whose prefix left both tiers is never written (an orphan)."""
    for seed in range(6):
        trace = random_tree_trace(random.Random(seed), 80)
        parent = _tree(trace)
        adm = AdmitEither[int](6, 3) if admission == "either" else make_admission(admission, 6, 3)
        tiers = TwoTiers(parent, 3, 6, "lru", adm, write_back=write_back)
        for i, r in enumerate(trace):
            if isinstance(adm, AdmitEither):
                adm.choice = "reused" if i % 20 < 10 else "all"  # switching leaves no orphan either
            tiers.request(r.hash_ids)
            on_disk = tiers.d.cache.resident
            assert all(parent[x] is None or parent[x] in on_disk for x in on_disk), (seed, r)
            assert len(on_disk) <= 6 and len(tiers.h.cache.resident) <= 3
            adm.check_integrity()


def test_adaptive_equals_all_where_the_disk_holds_everything():
    """With a disk larger than the trace, "all" serves every block ever stored: the
    shadows can never score "reused" higher, so the rule never leaves "all"."""
    for seed in range(4):
        trace = random_tree_trace(random.Random(seed), 120)
        distinct = len({x for r in trace for x in r.hash_ids})
        for wb in (False, True):
            base = simulate_tiers(trace, 3, distinct, "lru", write_back=wb)
            assert simulate_tiers(trace, 3, distinct, "lru", write_back=wb, admission="adaptive") == base


def test_adaptive_follows_reused_where_it_wins():
    trace = _hot_between_one_offs(300)
    reused = simulate_tiers(trace, 1, 2, "lru", admission="reused")
    adaptive = simulate_tiers(trace, 1, 2, "lru", admission="adaptive")
    everything = simulate_tiers(trace, 1, 2, "lru")
    assert reused.hit_rate > everything.hit_rate
    # It follows "all" until the shadows disagree (the first hot block found on disk).
    assert everything.hit_rate < adaptive.hit_rate <= reused.hit_rate
    assert adaptive.disk_writes < everything.disk_writes


def test_unknown_admission_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of"):
        make_admission("some", 4, 2)
    with pytest.raises(ValueError, match="choose one of"):
        simulate_tiers(_trace((1,)), 1, 2, "lru", admission="some")


def test_replay_script_tiers_rows(capsys):
    """scripts/replay_trace.py --tiers with --admission: sizes as percentages of the
    trace's distinct blocks, one row per rule and write mode, each equal to the model."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "replay_trace.py"
    spec = importlib.util.spec_from_file_location("replay_trace", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    assert mod.main(["--generated", "zipf-scan", "--limit", "300", "--tiers", "5%:20%", "--policy", "lru",
                     "--admission", "all", "--admission", "adaptive", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    trace = mod.generated("zipf-scan")[:300]
    host, disk = out["distinct_blocks"] * 5 // 100, out["distinct_blocks"] * 20 // 100
    rows = {r["variant"]: r for r in out["tiers"]}
    assert sorted(rows) == ["adaptive, write-back", "adaptive, write-through", "all, write-back", "all, write-through"]
    for label, r in rows.items():
        adm, mode = label.split(", ")
        want = simulate_tiers(trace, host, disk, "lru", write_back=mode == "write-back", admission=adm)
        assert (r["host"], r["disk"]) == (host, disk)
        assert (r["hit_rate"], r["disk_writes"]) == (round(want.hit_rate, 4), want.disk_writes)
