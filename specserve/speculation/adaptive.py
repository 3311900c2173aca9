"""`speculation="adaptive"`: choose each request's chain length every step from what it measures.

The controller keeps, per request, an estimate of the conditional acceptance rate at each draft
depth (a_d: the chance the depth-d token is accepted given depths 1..d-1 were), and for the
engine the time of one target forward and of one draft forward level. A chain of k tokens commits
on average

    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k      tokens per target forward

and costs about T_target + k * (T_draft + T_row), so the controller picks the k in
0..MAX_CHAIN with the most expected tokens per second (k = 0: no speculation this step).
T_target is the time of a recent one-row decode step outside drafting (scheduling, the target
forward, verification and commit: all that a step without a draft costs); T_row what one more query
row adds to it (near 0 on a GPU, where verifying a few dozen rows costs about one; clearly not on
a CPU, where every row is compute). Both come from a least-squares line through the mean step
time of each row count seen lately, each mean weighing as many of its recent steps as back it:
T_row its slope, T_target its value at one row. Each row count keeps its own mean, so a run of
steps without drafts (one row each) refreshes the one-row time and leaves what two-row steps
said of a row. (Two earlier versions fitted a line through the recent steps themselves. The
first read a run of one-row steps as free rows and started chains just after every such run.
The second kept the slope from the last steps whose rows varied enough, a variance over 0.25
rows squared, which steps of one and two rows never reach: a server whose default mode chooses
only between chain:1 and off took rows for free and drafted where chain:1 loses. Replayed at
a 2-vCPU Sapphire Rapids class Xeon's measured costs, 48-token requests whose draft is accepted
30% of the time drafted 40% of their steps and ran 0.92x `off`; now 3% and 0.99x.)

T_draft is measured on the draft stages of steps that draft: a chain of k runs k draft forwards,
the catch-up forward that yields depth 1 among them, and picks between them, except where the
catch-up carries more than the tokens the last step committed (prompt chunks in a batch, or the
tokens of steps without drafts: a probe's cost, which backing off bounds), when only the deeper
levels' forwards are timed.

Each a_d is a request's accepted and tried tokens at depth d, counted with weights that fall by
DECAY at each of its drafting steps (so text that turns predictable, code or quotes, lengthens its
chain and text that wanders shortens it), beside PRIOR_WEIGHT tries at the engine's rate (a
request's first steps follow what the engine has seen lately), plus OPTIMISM standard errors. The
estimate used to be a per-request moving average alone (weight 0.8 per observation): a few
rejections in a row stopped a request whose draft paid. Replayed on the engine's own depth-1
record of 32 held-out chat questions (the default model, where chain:1 gains about 1.10x), that
drafted 15% of the steps and gained 1.02x; these estimates draft 88% of them and gain 1.09x,
still stop a draft accepted 10% of the time (0.99x), and a mix of requests whose draft is never
accepted and requests where it is accepted 60% of the time gains 1.16x against 1.07x
(`tests/speculation/test_adaptive.py` replays such streams). The engine's rates are counted the
same way, each observation weighing ENGINE_DECAY less per newer one, and start as
ENGINE_PRIOR_WEIGHT tries at what was measured of the draft where that was saved beside it
(`acceptance.json`, see `acceptance_prior`), so a weak draft is not tried at length on the first
requests and a strong one is used at once; else at PRIOR_ACCEPTANCE.

A request that stopped speculating learns nothing more of its own until it probes with one token
after PROBE_EVERY steps; each probe rejected doubles its wait (up to MAX_PROBE_EVERY steps), and
one accepted resets it, so a draft that rarely agrees costs next to nothing (a probe's catch-up
draft forward and its extra verified row cost about half a target forward on a small CPU
model).

Suffix drafting beside the draft (`suffix+adaptive`, the default mode) is sized the same way. Its
tree costs no draft forward, only its verified rows, so where a row is cheap (a GPU, a CPU whose
few-row products stay memory-bound) every candidate node is worth verifying; where it is not (a
2-vCPU Sapphire Rapids class Xeon with the default model's weights in its L3: one more row adds
0.5-1 ms to a 3.5-4 ms step), an 8-node tree from a two-token match, about one token accepted,
costs more than it saves. There, on 8 held-out questions x 64 tokens (6 alternated rounds, prompts
included), the default mode ran 0.95-0.98x `off` on first turns with every node verified and
0.98-1.00x sized as below; second turns 1.09-1.15x and 1.12-1.14x. `suffix_nodes` takes the k of
the store's best-first nodes with the most expected tokens per second (`best_chain_length` at the
row's cost alone), from acceptance per depth counted like the engine's for the draft, apart for
each bucket of match length (SUFFIX_BUCKETS: a long match is followed far more often than a short
one), each starting as SUFFIX_PRIOR_WEIGHT tries at SUFFIX_PRIOR_ACCEPTANCE.

The choice is a pure function of state that changes only after verification, so the scheduler
(which reserves KV slots) and the proposer (which drafts) see the same mode within a step.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .modes import OFF, SpecKind, SpecMode

MAX_CHAIN = 8
PRIOR_ACCEPTANCE = 0.6  # before anything is measured: optimistic enough to try drafting
PRIOR_FILE = "acceptance.json"  # in a draft's folder: {"acceptance_per_depth": [a_1, ...]}
DECAY = 0.95  # a request's past observations weigh this much less each drafting step
PRIOR_WEIGHT = 4.0  # a request's estimate starts as this many tries at the engine's rate
OPTIMISM = 0.5  # standard errors added to each estimate
ENGINE_DECAY = 0.99  # the engine's past observations weigh this much less each new one
ENGINE_PRIOR_WEIGHT = 20.0  # the prior counts as this many of the engine's tries
TIME_DECAY = 0.8  # weight of the old timing estimate per step
PROBE_EVERY = 16
MAX_PROBE_EVERY = 256
# Suffix matches by length: bucket i holds matches of SUFFIX_BUCKETS[i] tokens up to the next.
SUFFIX_BUCKETS = (1, 2, 4, 8)
SUFFIX_MAX_NODES = 64  # the largest suffix tree a mode may ask for (suffix:64)
SUFFIX_PRIOR_ACCEPTANCE = 0.5
SUFFIX_PRIOR_WEIGHT = 10.0
MAX_FIT_ROWS = 64  # target forwards with more query rows (large batches) stay out of the fit
FIT_DECAY = 0.95


@dataclass
class _RequestState:
    # Per depth 1..MAX_CHAIN: accepted and tried tokens, weighted by DECAY per drafting step
    # since.
    accepted: list[float] = field(default_factory=lambda: [0.0] * MAX_CHAIN)
    tried: list[float] = field(default_factory=lambda: [0.0] * MAX_CHAIN)
    steps_off: int = 0
    probe_every: int = PROBE_EVERY  # steps off before the next probe


@dataclass
class AdaptiveController:
    target_time_s: float | None = None  # EWMA of a decode step outside drafting
    draft_level_time_s: float | None = None  # EWMA of one draft level (its share of the stage)
    # Per query-row count of decode steps: the EWMA of a step's time outside drafting, and the
    # weight of the steps behind it (each older one FIT_DECAY less).
    _time_by_rows: dict[int, float] = field(default_factory=dict)
    _weight_by_rows: dict[int, float] = field(default_factory=dict)
    _row_time_s: float = 0.0  # the fitted line's slope (0 until two row counts are seen)
    _one_row_time_s: float | None = None  # the line at one row
    engine_acceptance: list[float] = field(  # a_1 .. a_MAX_CHAIN over every request
        default_factory=lambda: [PRIOR_ACCEPTANCE] * MAX_CHAIN)
    _engine_tries: list[float] = field(  # the weight behind each of them
        default_factory=lambda: [ENGINE_PRIOR_WEIGHT] * MAX_CHAIN)
    _requests: dict[str, _RequestState] = field(default_factory=dict)
    # Per SUFFIX_BUCKETS bucket: the store's nodes' acceptance at depth 1..SUFFIX_MAX_NODES and
    # the weight behind each.
    _suffix_acceptance: list[list[float]] = field(default_factory=lambda: [
        [SUFFIX_PRIOR_ACCEPTANCE] * SUFFIX_MAX_NODES for _ in SUFFIX_BUCKETS])
    _suffix_tries: list[list[float]] = field(default_factory=lambda: [
        [SUFFIX_PRIOR_WEIGHT] * SUFFIX_MAX_NODES for _ in SUFFIX_BUCKETS])

    def mode_for(self, request_id: str) -> SpecMode:
        """The mode a request runs this step: `chain:k` or off."""
        state = self._state(request_id)
        k = best_chain_length(self.acceptance(request_id), self._cost_ratio())
        if k == 0 and state.steps_off >= state.probe_every:
            k = 1
        return SpecMode(SpecKind.CHAIN, k) if k else OFF

    def observe_step(self, target_time_s: float, target_rows: int | None,
                     levels_time_s: float, draft_levels: int) -> None:
        """Timing of one engine step: its time outside drafting, with a target forward over
        `target_rows` query rows (None: a step that carries prompt tokens, which says little
        about decode), and its draft levels."""
        if target_rows is not None and target_rows <= MAX_FIT_ROWS:
            self.target_time_s = _ewma(self.target_time_s, target_time_s)
            self._time_by_rows[target_rows] = _ewma(self._time_by_rows.get(target_rows),
                                                    target_time_s)
            self._weight_by_rows[target_rows] = (
                FIT_DECAY * self._weight_by_rows.get(target_rows, 0.0) + 1.0)
            self._fit_rows()
        if draft_levels:
            self.draft_level_time_s = _ewma(self.draft_level_time_s, levels_time_s / draft_levels)

    def acceptance(self, request_id: str) -> list[float]:
        """a_1 .. a_MAX_CHAIN as the request's choice reads them: its own tries beside
        PRIOR_WEIGHT at the engine's rates, plus OPTIMISM standard errors."""
        state = self._state(request_id)
        rates = []
        for accepted, tried, engine in zip(state.accepted, state.tried, self.engine_acceptance):
            weight = tried + PRIOR_WEIGHT
            mean = (accepted + PRIOR_WEIGHT * engine) / weight
            rates.append(min(1.0, mean + OPTIMISM * math.sqrt(mean * (1.0 - mean) / weight)))
        return rates

    def observe_verdict(self, request_id: str, chain_length: int, num_accepted: int) -> None:
        """After a step of the request: depths 1..accepted+1 were tried; the first `accepted`
        passed (chain_length 0: a step without a draft)."""
        state = self._state(request_id)
        if chain_length == 0:
            state.steps_off += 1
            return
        if state.steps_off >= state.probe_every:  # this chain was a probe
            state.probe_every = (PROBE_EVERY if num_accepted
                                 else min(2 * state.probe_every, MAX_PROBE_EVERY))
        state.steps_off = 0
        state.accepted = [DECAY * a for a in state.accepted]
        state.tried = [DECAY * t for t in state.tried]
        tried = min(chain_length, num_accepted + 1)
        for depth in range(tried):
            hit = 1.0 if depth < num_accepted else 0.0
            state.accepted[depth] += hit
            state.tried[depth] += 1.0
        _count_tries(self.engine_acceptance, self._engine_tries, tried, num_accepted)

    def suffix_nodes(self, match_length: int, budget: int) -> int:
        """How many of a suffix match's best-first tree nodes (at most `budget`) to verify this
        step: 0 where not even one pays for its row."""
        step = self.step_time_s()
        if not step:
            return budget  # nothing measured yet: rows are taken as free
        rates = self._suffix_acceptance[_suffix_bucket(match_length)][:budget]
        return best_chain_length(rates, self.row_time_s() / step)

    def observe_suffix(self, match_length: int, depth: int, num_accepted: int) -> None:
        """After a step that drafted a suffix tree `depth` nodes deep from a match of
        `match_length` tokens: depths 1..accepted+1 were tried, the first `accepted` passed."""
        bucket = _suffix_bucket(match_length)
        _count_tries(self._suffix_acceptance[bucket], self._suffix_tries[bucket],
                     min(depth, num_accepted + 1, SUFFIX_MAX_NODES), num_accepted)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _state(self, request_id: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:  # nothing of its own yet: it reads the engine's rates
            state = self._requests[request_id] = _RequestState()
        return state

    def row_time_s(self) -> float:
        """What one more query row adds to a target forward (0 until rows have varied)."""
        return self._row_time_s

    def step_time_s(self) -> float | None:
        """A one-row step outside drafting: the fitted line at one row (the average of recent
        steps includes drafting steps' verified rows); None until measured."""
        return self._one_row_time_s or self.target_time_s

    def _fit_rows(self) -> None:
        """The least-squares line through each row count's mean step time, weighted by the
        steps behind each mean."""
        if len(self._time_by_rows) < 2:
            return
        weights, times = self._weight_by_rows, self._time_by_rows
        total = sum(weights.values())
        mean_x = sum(w * rows for rows, w in weights.items()) / total
        mean_y = sum(w * times[rows] for rows, w in weights.items()) / total
        var = sum(w * (rows - mean_x) ** 2 for rows, w in weights.items()) / total
        cov = sum(w * (rows - mean_x) * (times[rows] - mean_y)
                  for rows, w in weights.items()) / total
        self._row_time_s = max(0.0, cov / var)
        self._one_row_time_s = max(mean_y - self._row_time_s * (mean_x - 1.0), 0.0) or None

    def _cost_ratio(self) -> float:
        """Cost of one more chain token (a draft level and a verified row) relative to a
        step without a draft (0.25 until measured)."""
        step = self.step_time_s()
        if not step or self.draft_level_time_s is None:
            return 0.25
        return (self.draft_level_time_s + self.row_time_s()) / step


def best_chain_length(acceptance: list[float], draft_cost_ratio: float) -> int:
    """The k maximising E(k) / (1 + k * draft_cost_ratio) (see the module docstring; the
    ratio is one chain token's cost over one target forward's)."""
    best_k, best_rate = 0, 1.0
    expected, reach = 1.0, 1.0
    for k, a in enumerate(acceptance, start=1):
        reach *= a
        expected += reach
        rate = expected / (1.0 + k * draft_cost_ratio)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


def acceptance_prior(draft_dir: str | Path | None) -> list[float]:
    """The a_1 .. a_MAX_CHAIN a draft starts from: the rates measured for it (PRIOR_FILE in its
    folder; depths past the list take its last rate), else PRIOR_ACCEPTANCE at every depth."""
    file = Path(draft_dir) / PRIOR_FILE if draft_dir is not None else None
    if file is None or not file.is_file():
        return [PRIOR_ACCEPTANCE] * MAX_CHAIN
    try:
        rates = json.loads(file.read_text())["acceptance_per_depth"]
        ok = (isinstance(rates, list) and rates
              and all(isinstance(a, (int, float)) and 0.0 <= a <= 1.0 for a in rates))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{file}: not an acceptance prior ({exc})") from None
    if not ok:
        raise ValueError(f"{file}: acceptance_per_depth must be a non-empty list of rates in "
                         f"[0, 1], got {rates!r}")
    rates = [float(a) for a in rates[:MAX_CHAIN]]
    return rates + [rates[-1]] * (MAX_CHAIN - len(rates))


def _count_tries(rates: list[float], tries: list[float], tried: int, accepted: int) -> None:
    """Depths 1..tried were tried and the first `accepted` passed: each depth's rate moves by
    one observation, its older ones weighing ENGINE_DECAY less."""
    for depth in range(tried):
        weight = ENGINE_DECAY * tries[depth]
        hit = 1.0 if depth < accepted else 0.0
        rates[depth] = (weight * rates[depth] + hit) / (weight + 1.0)
        tries[depth] = weight + 1.0


def _suffix_bucket(match_length: int) -> int:
    return max(0, bisect.bisect_right(SUFFIX_BUCKETS, match_length) - 1)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else TIME_DECAY * old + (1 - TIME_DECAY) * new
