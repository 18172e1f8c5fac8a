"""Generated prefix-cache traces in the shapes production shows, for judging eviction away
from the one trace a policy was developed against (issue #33).

Each generator is a frozen dataclass of its parameters with ``records(seed)``: Mooncake-format
requests (:class:`TraceRecord`: ``timestamp`` in ms, ``input_length``, ``output_length``,
``hash_ids``), sorted by time and a pure function of the parameters and the seed (one
``random.Random(seed)``; no clock, no Python ``hash()``). Ids follow Mooncake's convention:
one id per 512-token block, equal ids meaning equal prefixes, and a request's trailing
partial block gets an id of its own that no later request shares (the next turn's block at
that position holds more tokens). Each generator numbers its ids from its own base, so that
traces can be merged without sharing blocks by accident.

- :class:`Sessions`: multi-turn chats. Users arrive at random; each turn sends the whole
  conversation so far (a system prompt picked from a few, earlier turns, the answers) plus a
  new message, waits for the answer, thinks (log-normal) and either sends the next turn or
  abandons the conversation.
- :class:`AgentLoops`: agents re-reading one long context (a repository, a manual) with a
  tail that grows by a tool result each step, at short think times; agents of one task
  share its context.
- :class:`SharedPrompts`: many users, a few long system prompts drawn Zipf-like, each with a
  one-off question (and now and then one follow-up).
- :class:`DocumentScan`: interactive traffic on a few hot prompts, interrupted by batch jobs
  that read many one-off documents once each (a question or two per document, back to back).
- :class:`Mixed`: several of these on one server at once.

:data:`DEVELOP` and :data:`CHECK` are the two sets of issue #33: the same shapes with other
parameters and seeds. Tune on ``DEVELOP`` (plus the shared Mooncake synthetic trace); look at
``CHECK`` only to judge a finished policy.
"""
from __future__ import annotations

import heapq
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple, Protocol, Sequence

from .traces import TRACE_BLOCK, Request


class TraceRecord(NamedTuple):
    """One request, as a line of a Mooncake trace."""

    timestamp: int  # ms since the trace's start
    input_length: int  # tokens
    output_length: int
    hash_ids: tuple[int, ...]


class Workload(Protocol):
    def records(self, seed: int) -> list[TraceRecord]:
        """The trace for ``seed``: the same list for the same parameters and seed."""
        ...


class _Ids:
    """Fresh block ids from ``base`` up."""

    def __init__(self, base: int) -> None:
        self.next = base

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _blocks(tokens: int) -> int:
    return tokens // TRACE_BLOCK


def _record(t_ms: float, full: list[int], tokens: int, output: int, ids: _Ids) -> TraceRecord:
    """A request of ``tokens`` input tokens whose full blocks are ``full`` (already allotted);
    a partial last block gets a fresh id that nothing else will share."""
    assert len(full) == _blocks(tokens)
    tail = ids.take(1) if tokens % TRACE_BLOCK else []
    return TraceRecord(int(t_ms), tokens, output, tuple(full + tail))


def _grow(context: list[int], tokens: int, add: int, ids: _Ids) -> tuple[list[int], int]:
    """Context ``context`` (full blocks of a ``tokens``-token prefix) grown by ``add`` tokens:
    the blocks that became full get fresh ids (the partial block before them is new text)."""
    tokens += add
    return context + ids.take(_blocks(tokens) - len(context)), tokens


@dataclass(frozen=True)
class Sessions:
    """Multi-turn chats. ``sessions`` conversations start at Poisson times over
    ``duration_s``; each uses one of ``prompts`` system prompts (``prompt_tokens`` each,
    drawn uniformly). A turn adds a user message of ~``message_tokens`` (exponential) and,
    after the request, an answer of ~``answer_tokens``; the user then thinks for a
    log-normal time of median ``think_s`` (sigma ``think_sigma``) and abandons the chat with
    probability ``abandon`` before each further turn (at most ``max_turns``)."""

    sessions: int = 1500
    duration_s: float = 3600.0
    prompts: int = 4
    prompt_tokens: int = 2048
    message_tokens: int = 400
    answer_tokens: int = 500
    think_s: float = 60.0
    think_sigma: float = 1.0
    abandon: float = 0.25
    max_turns: int = 30
    id_base: int = 10**8

    def records(self, seed: int) -> list[TraceRecord]:
        rng = random.Random(seed)
        ids = _Ids(self.id_base)
        prompts = [ids.take(_blocks(self.prompt_tokens)) for _ in range(self.prompts)]
        events: list[tuple[float, int]] = []  # (time s, session)
        state: dict[int, tuple[list[int], int, int]] = {}  # session -> (full blocks, tokens, turns)
        for s in range(self.sessions):
            heapq.heappush(events, (rng.uniform(0, self.duration_s), s))
            state[s] = (list(rng.choice(prompts)), self.prompt_tokens, 0)
        out: list[TraceRecord] = []
        while events:
            t, s = heapq.heappop(events)
            full, tokens, turns = state[s]
            full, tokens = _grow(full, tokens, 1 + int(rng.expovariate(1 / self.message_tokens)), ids)
            answer = 1 + int(rng.expovariate(1 / self.answer_tokens))
            out.append(_record(t * 1000, full, tokens, answer, ids))
            full, tokens = _grow(full, tokens, answer, ids)
            state[s] = (full, tokens, turns + 1)
            if turns + 1 < self.max_turns and rng.random() >= self.abandon:
                think = rng.lognormvariate(math.log(self.think_s), self.think_sigma)
                heapq.heappush(events, (t + answer / 50.0 + think, s))  # ~50 tokens/s of decode
        return out


@dataclass(frozen=True)
class AgentLoops:
    """Agent loops. ``tasks`` tasks start at Poisson times over ``duration_s``, each with a
    context of ~``context_tokens`` (uniform 0.5x-1.5x) and ``agents_per_task`` agents (1 to
    that many, uniformly) started within a minute of it. An agent runs ~``steps`` steps
    (geometric); each step sends its whole context and appends the model's action and a
    tool result of ~``tool_tokens`` (exponential), then waits ~``step_s`` seconds
    (exponential) for the tool."""

    tasks: int = 80
    duration_s: float = 3600.0
    context_tokens: int = 16000
    agents_per_task: int = 3
    steps: int = 15
    tool_tokens: int = 900
    step_s: float = 8.0
    id_base: int = 2 * 10**8

    def records(self, seed: int) -> list[TraceRecord]:
        rng = random.Random(seed)
        ids = _Ids(self.id_base)
        events: list[tuple[float, int]] = []
        state: dict[int, tuple[list[int], int, int]] = {}  # agent -> (full blocks, tokens, steps left)
        agent = 0
        for _ in range(self.tasks):
            start = rng.uniform(0, self.duration_s)
            tokens = int(self.context_tokens * rng.uniform(0.5, 1.5))
            context = ids.take(_blocks(tokens))
            for _ in range(rng.randint(1, self.agents_per_task)):
                steps = 1 + int(rng.expovariate(1 / max(1, self.steps - 1)))
                state[agent] = (list(context), tokens, steps)
                heapq.heappush(events, (start + rng.uniform(0, 60), agent))
                agent += 1
        out: list[TraceRecord] = []
        while events:
            t, a = heapq.heappop(events)
            full, tokens, left = state[a]
            action = 20 + int(rng.expovariate(1 / 150))
            out.append(_record(t * 1000, full, tokens, action, ids))
            full, tokens = _grow(full, tokens, action + 1 + int(rng.expovariate(1 / self.tool_tokens)), ids)
            state[a] = (full, tokens, left - 1)
            if left > 1:
                heapq.heappush(events, (t + rng.expovariate(1 / self.step_s), a))
        return out


@dataclass(frozen=True)
class SharedPrompts:
    """``requests`` requests at Poisson times over ``duration_s``, each a system prompt drawn
    from ``prompts`` with Zipf(``zipf_s``) popularity (lengths uniform in ``prompt_tokens``
    0.5x-1.5x) and a one-off question of ~``question_tokens`` (exponential); with
    probability ``follow_up`` the user asks once more ~30 s later, on top of the answer."""

    requests: int = 5000
    duration_s: float = 3600.0
    prompts: int = 12
    zipf_s: float = 1.0
    prompt_tokens: int = 6000
    question_tokens: int = 600
    follow_up: float = 0.2
    id_base: int = 3 * 10**8

    def records(self, seed: int) -> list[TraceRecord]:
        rng = random.Random(seed)
        ids = _Ids(self.id_base)
        lengths = [int(self.prompt_tokens * rng.uniform(0.5, 1.5)) for _ in range(self.prompts)]
        prompts = [(ids.take(_blocks(n)), n) for n in lengths]
        weights = [1 / (i + 1) ** self.zipf_s for i in range(self.prompts)]
        pending: list[tuple[float, int, list[int], int]] = []  # follow-ups: (time, order, blocks, tokens)
        out: list[TraceRecord] = []
        order = 0
        for _ in range(self.requests):
            t = rng.uniform(0, self.duration_s)
            full, tokens = rng.choices(prompts, weights)[0]
            full, tokens = _grow(list(full), tokens, 1 + int(rng.expovariate(1 / self.question_tokens)), ids)
            answer = 1 + int(rng.expovariate(1 / 300))
            out.append(_record(t * 1000, full, tokens, answer, ids))
            if rng.random() < self.follow_up:
                full, tokens = _grow(full, tokens, answer + 1 + int(rng.expovariate(1 / self.question_tokens)), ids)
                pending.append((t + rng.expovariate(1 / 30.0), order, full, tokens))
                order += 1
        for t, _, full, tokens in pending:
            out.append(_record(t * 1000, full, tokens, 1 + int(rng.expovariate(1 / 300)), ids))
        out.sort(key=lambda r: r.timestamp)  # stable: equal times keep their order
        return out


@dataclass(frozen=True)
class DocumentScan:
    """Interactive traffic (``SharedPrompts`` of ``interactive`` requests over ``duration_s``
    on ``prompts`` prompts) with ``jobs`` batch jobs at Poisson times, each reading
    ``documents`` one-off documents (~``document_tokens``, exponential) back to back, one
    request every ``gap_s`` seconds, asking 1 to ``questions`` questions per document (each
    its own request on top of the document)."""

    interactive: int = 3000
    prompts: int = 10
    duration_s: float = 3600.0
    jobs: int = 6
    documents: int = 150
    document_tokens: int = 12000
    questions: int = 2
    gap_s: float = 0.5
    id_base: int = 4 * 10**8

    def records(self, seed: int) -> list[TraceRecord]:
        rng = random.Random(seed)
        base = SharedPrompts(self.interactive, self.duration_s, self.prompts, id_base=self.id_base)
        out = base.records(rng.randrange(1 << 30))
        ids = _Ids(self.id_base + 5 * 10**7)
        for _ in range(self.jobs):
            t = rng.uniform(0, self.duration_s)
            for _ in range(self.documents):
                tokens = TRACE_BLOCK + int(rng.expovariate(1 / self.document_tokens))
                doc = ids.take(_blocks(tokens))
                for _ in range(rng.randint(1, self.questions)):
                    full, n = _grow(doc, tokens, 1 + int(rng.expovariate(1 / 200)), ids)
                    out.append(_record(t * 1000, full, n, 1 + int(rng.expovariate(1 / 100)), ids))
                    t += self.gap_s
        out.sort(key=lambda r: r.timestamp)
        return out


@dataclass(frozen=True)
class Mixed:
    """Several workloads on one server at once: their records merged by time (each keeps its
    own ids, so they share no block), each generated from its own seed drawn from ``seed``."""

    parts: tuple[Workload, ...]

    def records(self, seed: int) -> list[TraceRecord]:
        rng = random.Random(seed)
        out = [r for w in self.parts for r in w.records(rng.randrange(1 << 30))]
        out.sort(key=lambda r: r.timestamp)
        return out


def requests(records: Iterable[TraceRecord]) -> list[Request]:
    """The records as :class:`tierkv.traces.Request` (what the simulators replay)."""
    return [Request(r.hash_ids, r.input_length) for r in records]


def write_trace(path: str | Path, records: Sequence[TraceRecord]) -> None:
    """Write ``records`` as a Mooncake-format .jsonl (read back by
    :func:`tierkv.traces.read_trace`)."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")


# The two sets of issue #33: name -> (workload, seed). The check set differs in every
# parameter that shapes reuse (think times, abandonment, context sizes, prompt counts, scan
# sizes) as well as in the seed, so that a policy tuned to the develop set's numbers shows it.
DEVELOP: dict[str, tuple[Workload, int]] = {
    "sessions": (Sessions(), 11),
    "agents": (AgentLoops(), 12),
    "prompts": (SharedPrompts(), 13),
    "scan": (DocumentScan(), 14),
    "mixed": (Mixed((Sessions(sessions=600), AgentLoops(tasks=25), SharedPrompts(requests=1500),
                     DocumentScan(interactive=500, jobs=3))), 15),
}
CHECK: dict[str, tuple[Workload, int]] = {
    "sessions": (Sessions(sessions=2000, prompts=8, prompt_tokens=1500, message_tokens=250, answer_tokens=700,
                          think_s=120.0, think_sigma=1.3, abandon=0.35, max_turns=40), 101),
    "agents": (AgentLoops(tasks=50, context_tokens=30000, agents_per_task=5, steps=20, tool_tokens=600,
                          step_s=4.0), 102),
    "prompts": (SharedPrompts(requests=6000, prompts=30, zipf_s=1.2, prompt_tokens=3000, question_tokens=900,
                              follow_up=0.35), 103),
    "scan": (DocumentScan(interactive=4000, prompts=6, jobs=10, documents=100, document_tokens=20000,
                          questions=3, gap_s=1.0), 104),
    "mixed": (Mixed((Sessions(sessions=800, abandon=0.4, think_s=200.0), AgentLoops(tasks=20, steps=30),
                     SharedPrompts(requests=2000, prompts=40), DocumentScan(interactive=300, jobs=4, documents=120))),
              105),
}


def trace_set(name: str, reseed: int = 0) -> dict[str, list[Request]]:
    """The requests of ``"develop"`` or ``"check"``, by trace name. ``reseed`` adds to every
    seed: the same shapes and parameters drawn afresh, traces no policy has been run on (a
    judge of a policy chosen on the sets as they are)."""
    sets = {"develop": DEVELOP, "check": CHECK}
    if name not in sets:
        raise ValueError(f"unknown trace set {name!r}; choose develop or check")
    return {k: requests(w.records(seed + reseed)) for k, (w, seed) in sets[name].items()}
