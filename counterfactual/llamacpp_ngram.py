"""llama.cpp's n-gram proposers ``ngram-mod`` and ``ngram-map-k``, ported, and a llama.cpp server
replayed along recorded requests (slots, slot choice, per-step draft caps).

Ported from the llama.cpp that PyPI ``xllamacpp`` 2026.10.11549 is built from (llama.cpp build
~11549; the wheel reports ``b0-unknown``): ``common/ngram-mod.cpp``, ``common/ngram-map.cpp``,
``common/speculative.cpp`` (``common_speculative_impl_ngram_mod``, ``…_ngram_map_k``) and the
server's slot loop (``tools/server/server-context.cpp``). What they do:

**ngram-mod** (``--spec-type ngram-mod``; ``--spec-ngram-mod-n-match`` 24, ``-n-min`` 48,
``-n-max`` 64 by default). One hash pool of 4·2²⁰ entries **shared by every slot of the server**:
an entry is the token that last followed an ``n_match``-gram whose LCG hash
(``h = h·6364136223846793005 + token`` over 64 bits) lands there — no key is kept, so colliding
n-grams overwrite each other. A request's prompt is added when it starts (every ``n_match + 1``
window inside it); the tokens it generates are added in chunks, at a draft call that finds more
than 32 new tokens since the last addition (so the pool at a step depends on where the earlier
steps landed). A draft chains lookups: the key is the last ``n_match − 1`` context tokens and the
sampled token; each hit is appended and the key slides, up to ``n_max`` tokens, and a chain that
stops before ``n_min`` drafts nothing. Two resets wipe the whole pool: five drafts in a row on
one slot accepting under a quarter of their (untruncated) length, and a request start that
finds the pool's "used" count — overwrites of non-empty entries, as the source counts them —
above a quarter of its size.

**ngram-map-k** (``--spec-type ngram-map-k``; ``--spec-ngram-map-k-size-n`` 12, ``-size-m`` 48,
``-min-hits`` 1). One map **per slot**, kept across that slot's requests: the last ``size_n``
tokens (the key, ending with the sampled token) are looked up among earlier positions — a
262,144-entry hash of positions (first writer wins; 32-bit LCG ``h·2654435761 + token``), then a
descending scan — and the ``size_m`` tokens that followed the match are drafted, capped by how
many the previous draft from the same key had accepted (a key's draft only shrinks). A new
request on the slot keeps the keys and hash entries at positions below the previous prompt's
length: they are matched against whatever the new context holds there.

**The server** (:class:`LlamaServer`): a request takes the slot whose cached tokens share the
longest prefix with its prompt, as a fraction of the prompt, above ``slot_prompt_similarity``
(0.1; the first slot wins a tie), else the least recently used slot (the last one wins a tie).
Prefill emits output token 0; then with ``j`` tokens emitted the slot's context is the prompt and
``output[:j−1]``, the sampled token is ``output[j−1]``, and the draft is cut to
``min(n_ctx − context − 2, n_remaining − 1)`` (no draft call at all when that is not positive);
the target accepts the longest prefix equal to the output's next tokens and the proposer hears
the accepted count. ``timings.draft_n`` and ``draft_n_accepted`` are the sums.

Nothing here is vLLM's step contract apart from the shape of :class:`counterfactual.replay.Replay`,
which each configuration's walk fills. Pure Python; the pool is a dict of the entries written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from counterfactual.replay import FIRST_TOKENS, Replay

__all__ = [
    "MAP_HASH_SIZE",
    "MOD_POOL_SIZE",
    "SPEC_TYPES",
    "LlamaKnobs",
    "LlamaServer",
    "NgramMap",
    "NgramModPool",
    "NgramModProposer",
]

MOD_POOL_SIZE = 4 * 1024 * 1024  # common_speculative_impl_ngram_mod: mod(n_match, 4*1024*1024)
MOD_LCG = 6364136223846793005  # common_ngram_mod::idx
MOD_CHUNK = 32  # draft_one: "add new ngrams in chunks" when i_last + 32 < cur_len
MOD_OCCUPANCY_RESET = 0.25  # begin(): f_thold
MOD_LOW_ACCEPT = 0.25  # accept(): f_acc < 0.25 is a low round
MOD_LOW_STREAK = 5  # accept(): n_low >= 5 resets the pool
MAP_HASH_SIZE = 262144  # COMMON_NGRAM_HASH_MAP_SIZE
MAP_LCG = 2654435761  # LCG_FACTOR in ngram-map.cpp
MAP_MAX_VALUE_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT
MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1
EMPTY = -1  # common_ngram_mod::EMPTY


class NgramModPool:
    """``common_ngram_mod``: a keyless hash pool of the token after each ``n``-gram."""

    __slots__ = ("entries", "n", "size", "used")

    def __init__(self, n: int, size: int = MOD_POOL_SIZE) -> None:
        if n < 1 or size < 1:
            raise ValueError(f"ngram-mod needs n_match >= 1 and a pool size >= 1, got {n}, {size}")
        self.n = n
        self.size = size
        self.entries: dict[int, int] = {}  # index → token; absent is EMPTY
        self.used = 0

    def idx(self, tokens: Sequence[int], start: int) -> int:
        h = 0
        for i in range(start, start + self.n):
            h = (h * MOD_LCG + tokens[i]) & MASK64
        return h % self.size

    def add(self, tokens: Sequence[int], start: int) -> None:
        """Key ``tokens[start : start + n]``, value ``tokens[start + n]``."""
        i = self.idx(tokens, start)
        if i in self.entries:  # as the source counts "used": overwrites of a non-empty entry
            self.used += 1
        self.entries[i] = tokens[start + self.n]

    def get(self, tokens: Sequence[int], start: int) -> int:
        return self.entries.get(self.idx(tokens, start), EMPTY)

    def reset(self) -> None:
        self.entries.clear()
        self.used = 0


@dataclass(slots=True)
class _ModSeq:
    i_last: int = 0  # context positions below it are in the pool
    n_draft_last: int = 0  # the last draft's length before the server cut it
    n_low: int = 0  # consecutive low-acceptance rounds (kept across the slot's requests)


class NgramModProposer:
    """``common_speculative_impl_ngram_mod``: one pool, a little state per slot."""

    def __init__(self, n_match: int, n_min: int, n_max: int, slots: int, size: int = MOD_POOL_SIZE):
        self.pool = NgramModPool(n_match, size)
        self.n_min, self.n_max = n_min, n_max
        self.seqs = [_ModSeq() for _ in range(slots)]
        self.resets = 0  # pool wipes (low-acceptance streaks and occupancy), for tests and notes

    def begin(self, slot: int, prompt: Sequence[int]) -> None:
        s = self.seqs[slot]
        s.i_last = 0
        s.n_draft_last = 0
        n = self.pool.n
        if len(prompt) < n:
            return
        for i in range(len(prompt) - n):
            self.pool.add(prompt, i)
        s.i_last = len(prompt) - n
        if self.pool.used / self.pool.size > MOD_OCCUPANCY_RESET:
            self.pool.reset()
            self.resets += 1

    def draft(self, slot: int, context: Sequence[int], sampled: int) -> list[int]:
        """``draft_one``: ``context`` is the slot's tokens (without ``sampled``)."""
        s = self.seqs[slot]
        s.n_draft_last = 0
        n = self.pool.n
        cur = len(context)
        if cur < n:
            return []
        if s.i_last + MOD_CHUNK < cur:
            for i in range(s.i_last, cur - n):
                self.pool.add(context, i)
            s.i_last = cur - n
        key = [*context[cur - n + 1 :], sampled]
        out: list[int] = []
        for i in range(self.n_max):
            token = self.pool.get(key, i)
            if token == EMPTY:
                if i < self.n_min:
                    return []
                break
            key.append(token)
            out.append(token)
        s.n_draft_last = len(out)
        return out

    def accept(self, slot: int, n_accepted: int) -> None:
        s = self.seqs[slot]
        if s.n_draft_last > 0:
            if n_accepted / s.n_draft_last < MOD_LOW_ACCEPT:
                s.n_low += 1
                if s.n_low >= MOD_LOW_STREAK:
                    self.pool.reset()
                    self.resets += 1
                    s.n_low = 0
                    s.i_last = 0
            else:
                s.n_low = 0


@dataclass(slots=True)
class _MapKey:
    key_idx: int
    key_num: int = 0
    n_accepted: int = 0  # values[0].n_accepted: key_only mode uses value slot 0 alone


@dataclass(slots=True)
class NgramMap:
    """``common_ngram_map`` in ``key_only`` mode (``ngram-map-k``), one per slot."""

    size_key: int
    size_value: int
    min_hits: int = 1  # unused by key_only mode (the source checks it only for values)
    keys: list[_MapKey] = field(default_factory=list)
    key_map: dict[int, int] = field(default_factory=dict)  # hash index → position; absent is 0
    key_map_last_idx: int = 0
    size_last_begin: int = 0
    idx_last_check: int = 0
    last_draft_created: bool = False
    last_draft_key: int = 0

    def _hash(self, tokens: Sequence[int], start: int) -> int:
        h = 0
        for i in range(start, start + self.size_key):
            h = (h * MAP_LCG + tokens[i]) & MASK32
        return h % MAP_HASH_SIZE

    def begin(self, tokens: Sequence[int]) -> None:
        """``common_ngram_map_begin``: a request starts with ``tokens`` (its prompt)."""
        size_begin = len(tokens)
        cleanup = self.size_last_begin
        if cleanup > size_begin:
            cut = self.size_key + self.size_value
            cleanup = size_begin - cut if size_begin > cut else 0
        if size_begin < self.idx_last_check:
            self.key_map = {h: p for h, p in self.key_map.items() if p < cleanup}
            self.key_map_last_idx = cleanup - 1 if cleanup > 0 else 0
        if size_begin < self.idx_last_check and self.keys:
            # key_only: only a key's own position decides whether it is kept.
            self.keys = [k for k in self.keys if k.key_idx < cleanup]
        self.idx_last_check = size_begin
        self.size_last_begin = size_begin

    def _matches(self, inp: Sequence[int], at: int, key: Sequence[int]) -> bool:
        # A key kept from an earlier request may sit past this context's end: no match (the
        # source would read past the vector's end there).
        if at + self.size_key > len(inp):
            return False
        return all(inp[at + k] == key[k] for k in range(self.size_key))

    def draft(self, inp: Sequence[int], sampled: int) -> list[int]:
        """``common_ngram_map_draft``: ``inp`` is the slot's tokens (without ``sampled``)."""
        self.last_draft_created = False
        self.last_draft_key = 0
        cur = len(inp)
        n, m = self.size_key, self.size_value
        if cur < 2 * n + m:
            return []
        self.idx_last_check = cur
        key = [*inp[cur - n + 1 :], sampled]
        match = 0
        at = self.key_map.get(self._hash(key, 0), 0)
        if at != 0 and at < cur - n - m - 1 and self._matches(inp, at, key):
            match = at
        top = self.size_last_begin - n - m - 1
        if match == 0 and self.size_last_begin > n + m + 1:
            for j in range(top, self.key_map_last_idx, -1):
                if self._matches(inp, j, key):
                    match = j
                    break
        if match == 0:
            lowest = max(self.size_last_begin, self.key_map_last_idx)
            for j in range(cur - n - m - 1, lowest, -1):
                if self._matches(inp, j, key):
                    match = j
                    break
        # Register the hashes of the new n-grams, in the same order (first writer wins).
        if self.size_last_begin > n + m + 1:
            for j in range(top, self.key_map_last_idx, -1):
                self.key_map.setdefault(self._hash(inp, j), j)
        lowest = max(self.size_last_begin, self.key_map_last_idx)
        for j in range(cur - n - m - 1, lowest, -1):
            self.key_map.setdefault(self._hash(inp, j), j)
        self.key_map_last_idx = max(cur - n - m - 1, self.key_map_last_idx)
        if match == 0:
            return []
        offset = next(
            (i for i, k in enumerate(self.keys) if self._matches(inp, k.key_idx, key)), None
        )
        if offset is None:
            offset = len(self.keys)
            self.keys.append(_MapKey(key_idx=match, n_accepted=m))
        entry = self.keys[offset]
        entry.key_num = min(entry.key_num + 1, MAP_MAX_VALUE_COUNT)
        self.last_draft_created = True
        self.last_draft_key = offset
        return [inp[match + n + i] for i in range(min(m, entry.n_accepted))]

    def accept(self, n_accepted: int) -> None:
        if self.last_draft_created:
            self.keys[self.last_draft_key].n_accepted = n_accepted


@dataclass(frozen=True, slots=True, order=True)
class LlamaKnobs:
    """One llama.cpp n-gram configuration, named as ``--spec-type`` and ``--spec-ngram-*`` name it.

    ``ngram-mod``: ``n_match`` (``--spec-ngram-mod-n-match``), ``n_min``, ``n_max`` (the depth).
    ``ngram-map-k``: ``n_match`` is ``size_n``, ``n_max`` is ``size_m`` (the depth), ``n_min`` is
    ``min_hits``. ``slots`` is the server's ``--parallel``; ``n_ctx`` its context per slot (None:
    unbounded).
    """

    spec_type: str  # "ngram-mod" | "ngram-map-k"
    n_match: int
    n_min: int
    n_max: int
    slots: int = 1
    n_ctx: int | None = None

    def __post_init__(self) -> None:
        if self.spec_type not in SPEC_TYPES:
            raise ValueError(f"llama.cpp spec type {self.spec_type!r}: expected {SPEC_TYPES}")
        if self.n_match < 1 or self.n_max < 1 or self.n_min < 0 or self.slots < 1:
            raise ValueError(f"llama.cpp knobs {self}: n_match, n_max, slots >= 1; n_min >= 0")

    def with_depth(self, k: int) -> LlamaKnobs:
        return LlamaKnobs(self.spec_type, self.n_match, self.n_min, k, self.slots, self.n_ctx)

    def server(self) -> LlamaServer:
        return LlamaServer(self)


SPEC_TYPES = ("ngram-mod", "ngram-map-k")


@dataclass(slots=True)
class _Slot:
    tokens: list[int] = field(default_factory=list)  # what the slot's cache holds
    last_used: int = -1


class LlamaServer:
    """A llama.cpp server running one n-gram configuration, fed recorded requests in order."""

    def __init__(self, knobs: LlamaKnobs, slot_prompt_similarity: float = 0.1) -> None:
        self.knobs = knobs
        self.similarity = slot_prompt_similarity
        self.slots = [_Slot() for _ in range(knobs.slots)]
        self.clock = 0
        self.mod: NgramModProposer | None = None
        self.maps: list[NgramMap] = []
        if knobs.spec_type == "ngram-mod":
            self.mod = NgramModProposer(knobs.n_match, knobs.n_min, knobs.n_max, knobs.slots)
        else:
            self.maps = [
                NgramMap(knobs.n_match, knobs.n_max, knobs.n_min) for _ in range(knobs.slots)
            ]

    def pick_slot(self, prompt: Sequence[int]) -> int:
        """``get_available_slot`` with every slot idle (requests are served one at a time)."""
        best, chosen = 0.0, None
        if self.similarity != 0.0 and prompt:
            for i, s in enumerate(self.slots):
                if not s.tokens:
                    continue
                sim = _common_prefix(s.tokens, prompt) / len(prompt)
                if sim > best and sim > self.similarity:
                    best, chosen = sim, i
        if chosen is None:
            t_last = -1
            for i, s in enumerate(self.slots):
                if chosen is None or s.last_used <= t_last:
                    t_last, chosen = s.last_used, i
        assert chosen is not None
        return chosen

    def _draft(self, slot: int, context: Sequence[int], sampled: int) -> list[int]:
        if self.mod is not None:
            return self.mod.draft(slot, context, sampled)
        return self.maps[slot].draft(context, sampled)

    def _accept(self, slot: int, n_accepted: int) -> None:
        if self.mod is not None:
            self.mod.accept(slot, n_accepted)
        else:
            self.maps[slot].accept(n_accepted)

    def serve(
        self, prompt: Sequence[int], output: Sequence[int], max_tokens: int | None = None
    ) -> Replay:
        """One request, as the server takes its steps; the state carries to the next request.

        ``max_tokens``: the request's limit (``n_remaining`` caps each draft at the tokens left
        to generate, less one); None: the output's own length, so the last steps never draft
        past it (an output that stopped early could have been drafted past its end by the
        server — what it would have said there is unknowable)."""
        knobs = self.knobs
        slot = self.pick_slot(prompt)
        if self.mod is not None:
            self.mod.begin(slot, prompt)
        else:
            self.maps[slot].begin(prompt)
        n = len(output)
        limit = n if max_tokens is None else max_tokens
        by_position = [0] * knobs.n_max
        rejected: list[int] = []
        early = [0, 0, 0]
        passes = drafts = draft_tokens = accepted = 0
        context = list(prompt)  # the slot's tokens: the prompt and output[: j - 1]
        if n > 0:
            passes, j = 1, 1
            while j < n:
                passes += 1
                context_len = len(prompt) + j - 1
                cap = limit - j - 1
                if knobs.n_ctx is not None:
                    cap = min(cap, knobs.n_ctx - context_len - 2)
                d = 0
                draft: list[int] = []
                if cap > 0:
                    context.extend(output[len(context) - len(prompt) : j - 1])
                    draft = self._draft(slot, context, output[j - 1])[:cap]
                    d = len(draft)
                if d == 0:
                    j += 1
                    continue
                a = 0
                while a < d and j + a < n and draft[a] == output[j + a]:
                    a += 1
                drafts += 1
                draft_tokens += d
                accepted += a
                for i in range(a):
                    by_position[i] += 1
                if a < d:
                    rejected.append(j + a)
                if j < FIRST_TOKENS:
                    early[0] += 1
                    early[1] += d
                    early[2] += a
                self._accept(slot, a)
                j += a + 1
        self.clock += 1
        s = self.slots[slot]
        s.tokens = [*prompt, *output[:-1]] if n else list(prompt)
        s.last_used = self.clock
        return Replay(
            k=knobs.n_max,
            output_tokens=n,
            passes=passes,
            drafts=drafts,
            draft_tokens=draft_tokens,
            accepted=accepted,
            accepted_by_position=tuple(by_position),
            rejected_at=tuple(rejected),
            early=(early[0], early[1], early[2]),
        )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
