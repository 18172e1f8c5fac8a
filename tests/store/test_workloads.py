"""tierkv/workloads.py: the generated traces are deterministic, in Mooncake's format and shaped
as their docstrings say."""
from __future__ import annotations

from collections import Counter

from tierkv.traces import TRACE_BLOCK, read_trace
from tierkv.workloads import (CHECK, DEVELOP, AgentLoops, DocumentScan, Mixed, Sessions, SharedPrompts, TraceRecord,
                              requests, write_trace)


def _well_formed(records: list[TraceRecord]) -> None:
    assert records and [r.timestamp for r in records] == sorted(r.timestamp for r in records)
    for r in records:
        assert len(r.hash_ids) == -(-r.input_length // TRACE_BLOCK), "one id per started 512-token block"
        assert r.output_length > 0
    # A partial last block belongs to its request alone.
    uses = Counter(x for r in records for x in r.hash_ids)
    assert all(uses[r.hash_ids[-1]] == 1 for r in records if r.input_length % TRACE_BLOCK)


def test_same_seed_same_trace_other_seed_other_trace():
    for w in (Sessions(sessions=40), AgentLoops(tasks=5), SharedPrompts(requests=100), DocumentScan(100, jobs=1,
                                                                                                   documents=10)):
        a, b = w.records(1), w.records(1)
        assert a == b and a != w.records(2)
        _well_formed(a)


def test_sessions_grow_turn_by_turn_and_end():
    w = Sessions(sessions=30, prompts=2, message_tokens=3000, abandon=0.5, max_turns=6)
    records = w.records(3)
    prompts = {r.hash_ids[: 2048 // TRACE_BLOCK] for r in records}
    assert len(prompts) <= 2, "every conversation starts with one of the system prompts"
    # Each turn's full blocks extend an earlier turn's (the conversation so far): counted
    # where that earlier turn has a block beyond the prompt (most, with long messages).
    full = [r.hash_ids[: r.input_length // TRACE_BLOCK] for r in records]
    extends = sum(any(len(p) < len(f) and f[: len(p)] == p and len(p) > 4 for p in full[:i]) for i, f in enumerate(full))
    turns = len(records) - 30
    assert turns > 10 and extends >= 0.7 * turns, "later turns resend the conversation"
    assert len(records) <= 30 * 6, "at most max_turns turns"


def test_agents_reread_a_long_context():
    records = AgentLoops(tasks=4, context_tokens=20000, agents_per_task=3, steps=6).records(4)
    starts = Counter(r.hash_ids[:19] for r in records)  # the context: at least 10,000 tokens
    assert len(starts) == 4, "agents of one task share its context"
    assert max(starts.values()) >= 6, "each step re-reads it"


def test_shared_prompts_are_few_and_questions_one_off():
    records = SharedPrompts(requests=300, prompts=5, prompt_tokens=4096, follow_up=0.0).records(5)
    assert len({r.hash_ids[0] for r in records}) <= 5
    uses = Counter(x for r in records for x in r.hash_ids)
    assert all(uses[r.hash_ids[-1]] == 1 for r in records), "each question is its own"


def test_document_scan_reads_documents_once():
    w = DocumentScan(interactive=50, prompts=2, jobs=2, documents=20, questions=1)
    records = w.records(6)
    docs = [r for r in records if r.hash_ids[0] >= w.id_base + 5 * 10**7]
    assert len(docs) == 40
    uses = Counter(x for r in records for x in r.hash_ids)
    assert all(uses[x] == 1 for r in docs for x in r.hash_ids), "one question each: no document block reused"


def test_mixed_merges_without_shared_blocks():
    parts = (Sessions(sessions=10), SharedPrompts(requests=40))
    records = Mixed(parts).records(7)
    assert sum(r.hash_ids[0] >= SharedPrompts().id_base for r in records) >= 40  # every prompt request (and follow-ups)
    _well_formed(records)
    low = {x for r in records for x in r.hash_ids if x < SharedPrompts().id_base}
    high = {x for r in records for x in r.hash_ids if x >= SharedPrompts().id_base}
    assert low and high


def test_written_trace_reads_back(tmp_path):
    records = SharedPrompts(requests=30).records(8)
    write_trace(tmp_path / "t.jsonl", records)
    assert read_trace(tmp_path / "t.jsonl") == requests(records)


def test_develop_and_check_differ_in_parameters_and_seeds():
    assert set(DEVELOP) == set(CHECK) == {"sessions", "agents", "prompts", "scan", "mixed"}
    for name in DEVELOP:
        (dw, ds), (cw, cs) = DEVELOP[name], CHECK[name]
        assert dw != cw and ds != cs


def test_a_reseeded_set_draws_the_same_shapes_afresh():
    # trace_set(name, reseed): every seed moved by ``reseed``, parameters kept (the fresh
    # traces docs/eviction.md judges the default policy on); reseed 0 is the set itself.
    from tierkv.workloads import trace_set

    base, fresh = trace_set("check"), trace_set("check", reseed=1000)
    assert trace_set("check", reseed=0) == base and set(fresh) == set(base)
    for name, (workload, seed) in CHECK.items():
        assert fresh[name] == requests(workload.records(seed + 1000)) != base[name]
