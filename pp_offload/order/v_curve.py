"""The V search itself: candidates scored, shortlisted, compacted and polished, grown one cap at a time.

Why a module of its own: `_Curve` is the one stateful piece of the V search (its ranked candidates,
finalists and compaction memo are kept between requests for one (d, m, costs)); the entry points
(`pp_offload.order.vshape`) only pick a cap, consult the disk cache and ask the curve for its best order.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from functools import partial

from pp_offload.order.actions import Costs, Order
from pp_offload.order.compact import compact_measured
from pp_offload.order.cooldown import diagonal_cooldown
from pp_offload.order.extend import extend_order
from pp_offload.order.polish import polish_order
from pp_offload.order.replay import replay
from pp_offload.order.spread import Gather, PackedOrder, spread_map
from pp_offload.order.v_candidates import _DEEP, _Generator, _generators, _with_cooldown
from pp_offload.order.v_caps import makespan_lower_bound, v_min_cap
from pp_offload.order.warmup import warmup_rewrite
from pp_offload.sim import OrderDeadlockError

_COMPACTED_CANDIDATES = 5
_BELOW = 2
_ROUNDS = 3  # compaction rounds of a cap's fastest candidates (the others get one)
_LEADS = 3  # how many of a cap's candidates are the fastest
_DEEP_LEADS = 2  # beyond d=8
_WARM_QUOTA = 2  # warm-up rewritten candidates shortlisted per cap, besides the others
_ADMIT_WEIGHT = 5.0  # a greedy candidate costs about this many cap-free ones to build (d=16 profile)


@dataclass(eq=False)  # compared by identity: the search never holds two items of one name
class _Scored:
    makespan: float
    peak: int
    name: str
    gen: _Generator
    stored: Order | PackedOrder | None  # None: not kept (rebuilt from ``gen`` when needed)
    cap: int = 0  # the cap it was compacted under (0: not compacted)
    polished: bool = False  # made by `polish_order` from another finalist (always stored)

    @property
    def order(self) -> Order | None:
        if isinstance(self.stored, PackedOrder):  # received from another rank: unpacked when used
            self.stored = self.stored.unpack()
        return self.stored


# A candidate's variants: (warm-up rewritten, drain rewritten), in the order they are scored.
_VARIANTS = ((False, False), (True, False), (False, True), (True, True))


def _variant_records(gen: _Generator, num_microbatches: int, costs: Costs) -> list[tuple]:
    """``(variant, makespan, peak, order)`` of each variant of ``gen`` that exists and runs: the
    candidate, with its warm-up rewritten, with its drain rewritten, and with both (the real costs decide
    which is better). Plain data, so that ranks searching together can send it."""
    order = gen.build(num_microbatches)
    if order is None:
        return []
    bases = [(0, order)]
    warmed = warmup_rewrite(order)
    if warmed is not None and warmed != order:
        bases.append((1, warmed))
    found = list(bases)
    for variant, base_order in bases:
        cooled = diagonal_cooldown(base_order)
        if cooled is not None:
            found.append((variant + 2, cooled))
    records = []
    for variant, variant_order in found:
        try:
            makespan, peak = replay(variant_order, costs)
        except OrderDeadlockError:
            continue  # a family member that cannot run at this size
        records.append((variant, makespan, peak, variant_order))
    return records


def _pack(order: Order | None) -> PackedOrder | None:
    return None if order is None else PackedOrder(order)


def _same(order: Order | None) -> Order | None:
    return order


def _without_orders(task: Callable[[_Generator], list[tuple]], gen: _Generator) -> list[tuple]:
    return [(variant, makespan, peak, None) for variant, makespan, peak, _ in task(gen)]


def _variants_scored(gen: _Generator, records: list[tuple]) -> list[_Scored]:
    out = []
    for variant, makespan, peak, order in records:
        variant_gen = _variant_gen(gen, *_VARIANTS[variant])
        out.append(_Scored(makespan, peak, variant_gen.name, variant_gen, order))
    return out


def _variant_gen(gen: _Generator, warm: bool, cool: bool) -> _Generator:
    if warm:
        gen = _Generator(
            f"warmup({gen.name})", gen.canonical, partial(_with_warmup, gen.build), gen.extra, gen.cap, True
        )
    if cool:
        gen = _Generator(
            f"cooldown({gen.name})",
            gen.canonical,
            partial(_with_cooldown, gen.build),
            gen.extra,
            gen.cap,
            gen.warm,
        )
    return gen


def _with_warmup(build: Callable[[int], Order | None], num_microbatches: int) -> Order | None:
    order = build(num_microbatches)
    return None if order is None else warmup_rewrite(order)


def _score(gen: _Generator, num_microbatches: int, costs: Costs) -> _Scored | None:
    order = gen.build(num_microbatches)
    return None if order is None else _measure(gen, order, costs)


def _measure(gen: _Generator, order: Order, costs: Costs) -> _Scored | None:
    try:
        makespan, peak = replay(order, costs)
    except OrderDeadlockError:
        return None  # a family member that cannot run at this size
    return _Scored(makespan, peak, gen.name, gen, order)


def _compacted(
    item: _Scored, costs: Costs, cap: int, rounds: int = 3, memo: MutableMapping | None = None, tag: str = ""
) -> _Scored:
    """``item`` with its gaps filled, its peak kept within ``cap``.

    ``memo`` (one per search) remembers each order's compaction; one the cap never constrained is reused
    as is for any larger cap (`compact_bound`: the same decisions would be taken), which is what the
    search does when it compacts a candidate again at the next cap on the same horizon (once the
    compaction horizon reaches ``m``).
    """
    key = (tag, item.name, len(item.order[0]), rounds)
    if memo is not None and key in memo:
        source, under, bound, order, makespan, peak = memo[key]
        if isinstance(source, PackedOrder):
            source = source.unpack()
        if not bound and under <= cap and source == item.order:
            return _Scored(makespan, peak, item.name, item.gen, order, cap)
    order, bound, makespan, peak = compact_measured(
        item.order, costs, makespan=item.makespan, peak=item.peak, memory_cap=cap, rounds=rounds
    )
    if memo is not None:
        # A bound compaction is never reused (see above): its orders are left out, which keeps what the
        # spread search sends between ranks small.
        memo[key] = (
            (None, cap, True, None, makespan, peak)
            if bound
            else (item.order, cap, False, order, makespan, peak)
        )
    return _Scored(makespan, peak, item.name, item.gen, order, cap)


class _Curve:
    """The search for one (d, m, costs), grown one cap at a time and kept for later requests.

    Monotone in the limit by construction: what is done for cap ``c`` (which candidates are compacted,
    under which cap, which become finalists) depends only on the candidates and on caps ``<= c``, never
    on the requested limit; the answer for a limit is the fastest item of all caps up to it. A larger
    limit only adds items. Lazy, so V-Min's small cap does not pay for V-ZB's.

    Per cap ``c``: the ``_COMPACTED_CANDIDATES`` fastest candidates whose peak is ``c`` and the
    ``_BELOW`` fastest with a smaller peak (compaction may spend the spare memory to fill gaps) are
    compacted under ``c``. Staged so that large d and m stay fast: candidates are ranked by a replay on a
    short horizon (``3d`` microbatches, ``2d`` beyond d=8); the shortlist is built for
    `compaction_horizon` microbatches and compacted one round, its ``_LEADS`` fastest two more, and each is
    lengthened to all ``m`` by repeating its steady phase (`extend_order`), rebuilt and compacted for all
    ``m`` only when a lead has none.
    """

    def __init__(self, num_ranks: int, num_microbatches: int, costs: Costs) -> None:
        self.d, self.m, self.costs = num_ranks, num_microbatches, costs
        self.horizon = min(num_microbatches, (3 if num_ranks <= _DEEP else 2) * num_ranks)
        gens = _generators(num_ranks, num_microbatches, costs)
        # Greedy orders are the costliest to build: each joins when the search reaches its cap (and
        # only then, whatever its peak), so a small limit never pays for the large caps' greedy runs.
        self.pending: dict[int, list[_Generator]] = {}
        for g in gens:
            self.pending.setdefault(g.cap, []).append(g)
        self.ranked: list[_Scored] = []
        self.admitted = False  # the cap-free candidates (cap 0) join on the first growth
        self.done_cap = 1
        self.final: list[_Scored] = []  # for all m microbatches
        self.seen: set[tuple[str, int]] = set()
        self.memo: dict = {}  # compactions, for reuse at larger caps (see `_compacted`)
        self.polish_of: dict[int, tuple[_Scored, bool]] = {}  # cap -> (its polish base, refused by cap)
        self.batches = 0  # batches of tasks so far: spreads each batch from a different rank on

    def _next_batch(self) -> int:
        self.batches += 1
        return self.batches

    def best(self, cap: int, gather: Gather | None = None) -> _Scored | None:
        """Fastest finalist within ``cap``; grows the curve up to ``cap`` first, its independent tasks
        spread over ``gather``'s ranks when given (every rank of the group must call this together)."""
        if gather is not None and gather.size > 1 and self.done_cap < cap:
            caps = list(range(self.done_cap + 1, cap + 1))
            self._grow_together(caps, gather)
            self._polish(caps, gather)
            self.done_cap = cap
        if not self.admitted and self.done_cap < cap:
            self._admit(0, None)
            self.admitted = True
        while self.done_cap < cap:
            self.done_cap += 1
            self._grow(self.done_cap)
            self._polish([self.done_cap], None)
        fitting = [i for i in self.final if i.peak <= cap]
        return min(fitting, key=lambda i: (i.makespan, i.peak, i.name), default=None)

    def _admit(self, cap: int, gather: Gather | None) -> None:
        gens = self.pending.pop(cap, [])
        task = partial(_variant_records, num_microbatches=self.horizon, costs=self.costs)
        if gather is not None and gather.size > 1:
            # Only the scores travel: the few candidates shortlisted later are rebuilt where needed
            # (the same order: builds are deterministic), most are never looked at again.
            task = partial(_without_orders, task)
        found = spread_map(gather, task, gens, first=self._next_batch())
        fresh = [s for g, records in zip(gens, found, strict=True) for s in _variants_scored(g, records)]
        self.ranked = sorted(self.ranked + fresh, key=lambda i: (i.makespan, i.name))

    def _grow(self, cap: int) -> None:
        """One cap, in this process: its candidates join, its shortlist is compacted, its finalists made."""
        self._admit(cap, None)
        shortlist = self._shortlist(cap)
        shorts = self._spread(None, partial(self._short, cap=cap), shortlist, shortlist, None)
        fresh = [short for short in shorts if short is not None]
        if not fresh:
            return
        is_lead = self._leads(fresh)
        entries = list(zip(fresh, is_lead, strict=True))
        self.final += [
            f for f in self._spread(None, partial(self._finished, cap=cap), entries, fresh, None) if f
        ]

    def _grow_together(self, caps: list[int], gather: Gather) -> None:
        """``caps`` at once, spread over ``gather``'s ranks, in three exchanges instead of three per cap.

        Each cap's tasks need only earlier stages of the same cap (its shortlist needs the candidates
        joined up to it, its finalists its shortlist), so every cap's candidates are scored in one batch,
        every cap's shortlist compacted in the next and every cap's finalists made in the last: many
        tasks per exchange, so the ranks stay busy. The one thing `_grow` has that this has not is the
        reuse, within the caps of one call, of a compaction an earlier cap left unconstrained
        (`compact_bound`): each is compacted afresh instead, which gives the same order (that is the
        condition of the reuse), so every decision and every result are the serial search's."""
        joining = [(c, g) for c in ([] if self.admitted else [0]) + caps for g in self.pending.pop(c, [])]
        self.admitted = True
        task = partial(
            _without_orders, partial(_variant_records, num_microbatches=self.horizon, costs=self.costs)
        )
        gens = [g for _, g in joining]
        found = spread_map(
            gather, task, gens, [_ADMIT_WEIGHT if g.cap else 1.0 for g in gens], self._next_batch()
        )
        by_cap: dict[int, list[_Scored]] = {}
        for (c, g), records in zip(joining, found, strict=True):
            by_cap.setdefault(c, []).extend(_variants_scored(g, records))
        self.ranked = sorted(self.ranked + by_cap.pop(0, []), key=lambda i: (i.makespan, i.name))
        jobs: list[tuple[int, _Scored]] = []
        for c in caps:
            self.ranked = sorted(self.ranked + by_cap.get(c, []), key=lambda i: (i.makespan, i.name))
            jobs += [(c, item) for item in self._shortlist(c)]
        shorts = self._spread(
            gather,
            lambda job, memo: self._short(job[1], memo, job[0]),
            jobs,
            [item for _, item in jobs],
            [float(self.compaction_horizon(c)) for c, _ in jobs],
        )
        entries: list[tuple[int, _Scored, bool]] = []
        for c in caps:
            fresh = [
                short for (jc, _), short in zip(jobs, shorts, strict=True) if jc == c and short is not None
            ]
            if fresh:
                entries += [(c, short, lead) for short, lead in zip(fresh, self._leads(fresh), strict=True)]
        finals = self._spread(
            gather,
            lambda entry, memo: self._finished(entry[1:], memo, entry[0]),
            entries,
            [short for _, short, _ in entries],
            [3.0 * self.m if lead else 1.0 * self.m for _, _, lead in entries],
        )
        self.final += [final for final in finals if final is not None]

    def _polish(self, caps: list[int], gather: Gather | None) -> None:
        """Per cap, the fastest finalist made at or below it, polished under it (`polish_order`); kept as a
        finalist of that cap when faster.

        A cap's polish depends only on finalists made at caps up to it, never on polished ones, so each
        cap's polish is independent of the others' and the caps of one call can be spread. A base already
        polished under the cap below, with no move refused there by the cap, is skipped: the polish would
        take the same steps (`Polished.bound`). Ranks searching together cannot know that before the
        exchange and polish it anyway, which gives the same order."""
        jobs: list[tuple[int, _Scored]] = []
        for c in caps:
            made = [f for f in self.final if not f.polished and f.cap <= c and f.peak <= c]
            if not made:
                continue
            base = min(made, key=lambda i: (i.makespan, i.peak, i.name))
            if base.makespan <= makespan_lower_bound(self.d, self.m, self.costs, c) + 1e-9:
                continue  # provably optimal under this cap already
            earlier = self.polish_of.get(c - 1)
            if gather is None and earlier is not None and earlier[0] is base and not earlier[1]:
                self.polish_of[c] = earlier
                continue
            jobs.append((c, base))
        pack = _pack if gather is not None and gather.size > 1 else _same

        def run(job: tuple[int, _Scored]) -> tuple:
            c, base = job
            found = polish_order(base.order, self.costs, c, max_trials=_polish_trials(self.d, self.m))
            return found.makespan, found.peak, pack(found.order), found.bound

        results = spread_map(gather, run, jobs, first=self._next_batch())
        for (c, base), (makespan, peak, order, bound) in zip(jobs, results, strict=True):
            self.polish_of[c] = (base, bound)
            if makespan < base.makespan - 1e-9:
                name = f"polish({base.name})@cap{c}"
                self.final.append(_Scored(makespan, peak, name, base.gen, order, c, polished=True))

    def _shortlist(self, cap: int) -> list[_Scored]:
        """The candidates compacted under ``cap`` (see the class doc), each once per cap."""
        # Below V-Min's memory only the greedy family fits and the bubble is large whatever is done:
        # two candidates per cap keep every limit >= 2 feasible at a fraction of the cost.
        low = cap < v_min_cap(self.d)
        # Each compaction costs ~d * m: deeper pipelines compact fewer candidates per cap.
        keep_at, keep_below = (_COMPACTED_CANDIDATES, _BELOW) if self.d <= 8 else (2, 1)
        at = _quota([i for i in self.ranked if i.peak == cap], 2 if low else keep_at)
        below = [] if low else _quota([i for i in self.ranked if i.peak < cap], keep_below)
        canonical = [i for i in self.ranked if i.gen.canonical and i.peak == cap]
        shortlist = []
        for item in at + below + canonical:
            if (item.name, cap) not in self.seen:
                self.seen.add((item.name, cap))
                shortlist.append(item)
        return shortlist

    def _leads(self, fresh: list[_Scored]) -> list[bool]:
        """Which of a cap's compacted shortlist get all three compaction rounds.

        One round of compaction ranks this cap's shortlist; only its fastest few get the full three (the
        rounds continue where the first stopped, so that is exactly a three-round compaction). Warm-up
        rewrites lead on a quota of their own, so that the other candidates are treated exactly as
        without them (every order found without the rewrite is still found)."""
        keep = _LEADS if self.d <= _DEEP else _DEEP_LEADS
        ranked = sorted(fresh, key=lambda i: (i.makespan, i.name))
        leads = [i for i in ranked if not i.gen.warm][:keep] + [i for i in ranked if i.gen.warm][:1]
        return [short in leads for short in fresh]

    def _spread(
        self, gather, task, items: list, sources: list[_Scored], weights: list[float] | None
    ) -> list[_Scored | None]:
        """``task(item, memo)`` for every item, spread over ``gather``'s ranks: results come back as plain
        data (the generator of the item's ``source`` candidate is attached here), and each task's new
        compactions are added to this rank's memo in the items' order, so every rank's memo stays the
        same."""

        pack = _pack if gather is not None and gather.size > 1 else _same

        def run(index: int) -> tuple:
            writes: dict = {}
            item = items[index]
            found = task(item, ChainMap(writes, self.memo))
            plain = None if found is None else (found.makespan, found.peak, pack(found.order), found.cap)
            for key, (source, under, bound, order, makespan, peak) in writes.items():
                writes[key] = (pack(source), under, bound, pack(order), makespan, peak)
            return plain, writes

        out = []
        found = spread_map(gather, run, range(len(items)), weights, first=self._next_batch())
        for source, (plain, writes) in zip(sources, found, strict=True):
            self.memo.update(writes)
            out.append(
                None if plain is None else _Scored(plain[0], plain[1], source.name, source.gen, *plain[2:])
            )
        return out

    def _finished(self, entry: tuple[_Scored, bool], memo: MutableMapping, cap: int) -> _Scored | None:
        """A shortlisted candidate's finalist for ``cap``: two more compaction rounds for a lead, then
        lengthened to all ``m``."""
        short, lead = entry
        if lead:
            short = _compacted(short, self.costs, cap, _ROUNDS - 1, memo, tag="more")
        return self._lengthened(short, cap, fallback=lead, memo=memo)

    def _short(self, item: _Scored, memo: MutableMapping, cap: int) -> _Scored | None:
        """``item`` on the compaction horizon of ``cap``, compacted under ``cap`` (one round)."""
        horizon = self.compaction_horizon(cap)
        ready = item.order is not None and len(item.order[0]) == 6 * horizon
        built = item if ready else _score(item.gen, horizon, self.costs)
        if built is None:
            return None
        return _compacted(built, self.costs, cap, 1, memo)

    def _lengthened(self, short: _Scored, cap: int, fallback: bool, memo: MutableMapping) -> _Scored | None:
        """``short`` lengthened to all ``m`` microbatches by repeating its steady phase (`extend_order`);
        with ``fallback``, rebuilt and compacted for all ``m`` when it shows no steady phase."""
        horizon = len(short.order[0]) // 6
        if horizon == self.m:
            return short
        longer = extend_order(short.order, self.m - horizon)
        if longer is not None:
            try:
                makespan, peak = replay(longer, self.costs)
            except OrderDeadlockError:
                peak = cap + 1
            if peak <= cap:
                return _Scored(makespan, peak, short.name, short.gen, longer, cap)
        if not fallback:
            return None
        full = _score(short.gen, self.m, self.costs)
        if full is None or full.peak > cap:
            return None
        return _compacted(full, self.costs, cap, _ROUNDS, memo)

    def compaction_horizon(self, cap: int) -> int:
        """Microbatches an order is compacted on under ``cap``: enough for its warm-up, a steady phase of
        a few periods and its drain (about cap / 2 microbatches each); `extend_order` does the rest.
        Deeper pipelines settle later (d=16, m=64, 3:4:2: cap 25 needs cap + 16 to reach the bubble a
        full-length compaction finds)."""
        return min(self.m, cap + max(8, self.d))


def _polish_trials(num_ranks: int, num_microbatches: int) -> int:
    """Replays a cap's polish may spend: ``12 d`` for small pipelines, and beyond d x m = 2048 passes per
    kind a budget that keeps one polish's replay work constant (a replay costs about d x m), so the
    polish stays about a fifth of the search's time at d=8 and d=16 rather than growing with d."""
    d, m = num_ranks, num_microbatches
    return max(8, min(12 * d, 96 * 256 // (d * m)))


def _quota(ranked: list[_Scored], keep: int) -> list[_Scored]:
    """The ``keep`` fastest ordinary items, the fastest wide-offset block and the ``_WARM_QUOTA`` fastest
    warm-up rewrites (if any), in rank order. Warm-up rewrites rank well before compaction and often lose
    after it: mixed in, they crowded better candidates out (d=8, m=32, 3:4:2, limit 9: 23.3% for 22.1%)."""
    ordinary = [i for i in ranked if not i.gen.extra and not i.gen.warm][:keep]
    wide = [i for i in ranked if i.gen.extra and not i.gen.warm][:1]
    return ordinary + wide + [i for i in ranked if i.gen.warm][:_WARM_QUOTA]
