"""Speculative generation for one request: prefill, then rounds of draft -> verify the tree -> commit.

Invariant between rounds: the KV cache holds every committed token except the last one, which is the root of
the next tree. A round scores root + drafted nodes in one target forward, keeps the KV of the accepted path and
emits the accepted tokens plus the target's bonus token. With no drafter the tree is the root alone, which is
plain autoregressive decoding through the same code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time

import numpy as np
import torch

from treeserve.errors import TreeserveError
from treeserve.models import BatchAttention, DecoderLM, KVCache, TreeAttention
from treeserve.models.paged_kv import PagedAttention, PagedSequence
from treeserve.params import GenerationParams
from treeserve.sampling import pick_tokens, random_seed, sampling_setting
from treeserve.tokenizer import Tokenizer
from treeserve.tree import MAX_BUDGET, DraftPoolFull, DraftTree, Drafter, TreeShape
from treeserve.verifier.acceptance import chain_accepted, walk_tree
from treeserve.verifier.graphs import TreeVerifier, causal_mask
from treeserve.verifier.rows import Rows, gather, is_run


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only, a stop token included
    text: str  # detokenized, without a stop token or stop string
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    prompt_tokens: int
    rounds: int  # target forwards after prefill
    round_tokens: int  # tokens emitted by those rounds (the prefill emits the first token)
    seed: int
    prefill_s: float
    elapsed_s: float

    @property
    def mean_accepted(self) -> float:
        """Tokens per round, bonus included: 1.0 is plain decoding."""
        return self.round_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclasses.dataclass
class ForwardPlan:
    """One request's share of a target forward: tokens at positions, attending to the committed prefix in
    `cache` (contiguous, or the request's sequence in a paged pool) plus, among themselves, what `mask` (N, N)
    allows (a tree's: its TreeShape, whose ancestor mask the forward's staging unpacks for every tree at once), or
    causal when it is None (a prompt); logits wanted at `logits_rows`. `tree` is None for a prefill. Positions
    (int64, NumPy: cheaper than a tensor to make and to stage, per request and round) and mask stay on the host:
    the forward moves a whole batch's at once."""

    cache: KVCache | PagedSequence
    tokens: list[int]
    positions: np.ndarray
    mask: torch.Tensor | TreeShape | None
    logits_rows: list[int]
    tree: DraftTree | None


ROOT_ONLY_MASK = torch.ones(1, 1, dtype=torch.bool)  # shared by every plain step's plan: only ever read


@torch.inference_mode()
def forward_batch(model: DecoderLM, plans: list[ForwardPlan], feature_layer_ids: tuple[int, ...] = (),
                  verifier: TreeVerifier | None = None) -> tuple[list[Rows], list[Rows | None]]:
    """One target forward for several requests (over a paged pool, trees through `verifier`, the CUDA graphs when
    it has them, and prompts before them: in pieces through the same graphs, or packed and causal in one eager
    forward; `TreeVerifier.prefills_in_pieces` says which). Returns each plan's logits rows and, when
    `feature_layer_ids` is given, its tokens' hidden states after those layers, concatenated per token
    (N, len(ids) * hidden): the features a DFlash drafter conditions on. Both as Rows of the forward's outputs,
    valid until the next forward."""
    paged = [isinstance(plan.cache, PagedSequence) for plan in plans]
    if not any(paged):
        return _forward_packed(model, plans, feature_layer_ids, None)
    if not all(paged):
        raise TreeserveError("one forward cannot mix paged and contiguous KV caches")
    logits: list[Rows | None] = [None] * len(plans)
    features: list[Rows | None] = [None] * len(plans)
    prompts = [i for i, plan in enumerate(plans) if plan.tree is None]
    trees = [i for i, plan in enumerate(plans) if plan.tree is not None]
    verifier = verifier or TreeVerifier(model, plans[0].cache.cache, max_batch=len(plans))
    in_pieces = [i for i in prompts if verifier.prefills_in_pieces(len(plans[i].tokens))]
    packed = [i for i in prompts if i not in in_pieces]
    if in_pieces:
        found = verifier.prefill_in_pieces([plans[i].cache for i in in_pieces], [plans[i].tokens for i in in_pieces],
                                           feature_layer_ids)
        for i, plan_logits, plan_features in zip(in_pieces, *found):
            logits[i], features[i] = plan_logits, plan_features
    if packed:
        attention = PagedAttention.for_prompts([plans[i].cache for i in packed],
                                               [len(plans[i].tokens) for i in packed], verifier.kernels)
        found = _forward_packed(model, [plans[i] for i in packed], feature_layer_ids, attention, verifier)
        for i, plan_logits, plan_features in zip(packed, *found):
            logits[i], features[i] = plan_logits, plan_features
    if trees:
        found = verifier.verify([plans[i].cache for i in trees], [plans[i].tokens for i in trees],
                                [plans[i].positions for i in trees], [plans[i].mask for i in trees],
                                feature_layer_ids)
        for i, plan_logits, plan_features in zip(trees, *found):
            logits[i], features[i] = plan_logits, plan_features
    return logits, features


def _forward_packed(model: DecoderLM, plans: list[ForwardPlan], feature_layer_ids: tuple[int, ...],
                    attention: PagedAttention | None, verifier: TreeVerifier | None = None
                    ) -> tuple[list[Rows], list[Rows | None]]:
    """The plans' rows packed one after another: prompts over the paged pool through `verifier` (with
    `attention` from PagedAttention.for_prompts), or contiguous caches when `attention` is None."""
    tokens = torch.tensor([t for plan in plans for t in plan.tokens])
    positions = torch.from_numpy(np.concatenate([plan.positions for plan in plans]))
    rows, offset = [], 0
    for plan in plans:
        rows.extend(offset + r for r in plan.logits_rows)
        offset += len(plan.tokens)
    rows = torch.tensor(rows)
    if attention is None:
        device = model.device
        attention = BatchAttention([TreeAttention(plan.cache, _mask(plan).to(device)) for plan in plans])
        logits, hidden = model(tokens.to(device, non_blocking=True), positions.to(device, non_blocking=True),
                               attention, logits_rows=rows.to(device), hidden_layer_ids=feature_layer_ids)
        features = torch.cat(hidden, dim=-1) if hidden else None
    else:
        logits, features = verifier.prefill(attention, tokens, positions, rows, feature_layer_ids)
    logits_per_plan = [Rows(logits, span) for span in _spans([len(plan.logits_rows) for plan in plans])]
    if features is None:
        return logits_per_plan, [None] * len(plans)
    return logits_per_plan, [Rows(features, span) for span in _spans([len(plan.tokens) for plan in plans])]


def _spans(counts: list[int]) -> list[range]:
    """Row ranges of parts of these sizes, one after another."""
    ends = list(itertools.accumulate(counts))
    return [range(end - count, end) for end, count in zip(ends, counts)]


def _mask(plan: ForwardPlan) -> torch.Tensor:
    if plan.mask is None:
        return causal_mask(len(plan.tokens))
    return plan.mask.mask() if isinstance(plan.mask, TreeShape) else plan.mask


class TargetFeatures:
    """One request's target hidden states at the layers a drafter conditions on (`layer_ids`): `last`, the rows
    of the tokens the last forward moved into the KV cache (valid until the next forward).

    A request drafted by a drafter in another process (`keep`) has a row for every token in its KV cache kept in
    the verifier's pool, at the token's slot (TreeVerifier.keep_features): to send on, and to resend a drafter that
    lost its context (`kept_feature_rows`). Where its last forward verified a drafted tree, that forward's kept rows
    are on the host too (`recent`, rows `recent_start` on, copied as the forward was launched: FeatureCopies), so
    that a drafter drafting every round gets them without a wait on the device."""

    def __init__(self, layer_ids: tuple[int, ...], keep: bool):
        self.layer_ids, self.keep = layer_ids, keep
        self.last: Rows | None = None
        self.recent: Rows | None = None
        self.recent_start = 0

    def take(self, features: Rows | None, kept: list[int]) -> None:
        """A forward's rows for this request, of which the KV cache kept `kept` (ascending), named without a tensor
        op (Rows)."""
        if features is None:
            raise TreeserveError("this generation needs target features, and the forward gave none")
        if len(kept) == len(features):
            self.last = features
        else:
            contiguous = kept[-1] == len(kept) - 1  # ascending rows: only a prefix ends at its own length - 1
            self.last = features[:len(kept)] if contiguous else features.select(kept)


class FeatureCopies:
    """Host copies of the feature rows of drafted trees, for the requests that keep features
    (`TargetFeatures.recent`).

    The scheduler calls `prepare` as it launches a forward: the rows of each plan that verifies a drafted tree for
    a request that keeps features are copied then, one slice of each output, queued behind the forward and, from a
    GPU, into page-locked host memory, so that neither the copy's launch nor a wait for it falls between the
    verification and the next Draft message (`wait` finds it done). Plain steps and prompts copy nothing: their rows
    are read from the pool when a drafter next needs them."""

    def __init__(self):
        self.copies: list[torch.Tensor] = []  # the last forward's copies: the sources of its prepared rows
        self.copied: torch.cuda.Event | None = None  # where the last copy to the host ends, while one may run
        self.copy_event: torch.cuda.Event | None = None  # the event `copied` is, made once
        self.copy_stream: torch.cuda.Stream | None = None  # the stream it is recorded on

    def prepare(self, features: list[Rows | None], plans: list[ForwardPlan], keeps: list[bool]
                ) -> list[Rows | None]:
        """At a forward's launch, behind it on the device: a copy of the rows of each plan with a drafted tree
        that `keeps` its features (a CUDA graph's outputs are overwritten by its next replay). Returns the plans'
        features, those rows now in the copies."""
        self.copies = []
        copied = [keep and rows is not None and plan.tree is not None and plan.tree.size > 1
                  for rows, plan, keep in zip(features, plans, keeps)]
        spans = _spans_of_sources([rows for rows, copy in zip(features, copied) if copy])
        if not spans:
            return features
        copies = {}  # id(source) -> (the copy of its span, the span's first row)
        for key, (source, first, end) in spans.items():
            copies[key] = (self._host_copy(source[first:end]), first)
            self.copies.append(copies[key][0])
        prepared = []
        for rows, copy in zip(features, copied):
            if copy:
                source, first = copies[id(rows.source)]
                rows = Rows(source, _shifted(rows.index, -first))
            prepared.append(rows)
        return prepared

    def keep_recent(self, generations: list["Generation"]) -> None:
        """After a commit: each of these generations that keeps features has its last rows as `recent` where they
        are in this forward's copies, and none otherwise (its rows are then all in the pool)."""
        if not self.copies:  # (a round of plain steps: most rounds of a large batch)
            for generation in generations:
                generation.features.recent = None
            return
        for generation in generations:
            features = generation.features
            last = features.last
            if last is not None and any(last.source is copy for copy in self.copies):
                features.recent, features.recent_start = last, generation.cache.length - len(last)
            else:
                features.recent = None

    def _host_copy(self, rows: torch.Tensor) -> torch.Tensor:
        """A copy of rows that outlives their source's next overwrite, on the host: from a GPU into page-locked
        memory (as HostPicks copies), queued behind the device's work without the host waiting (`copied` marks
        where it ends)."""
        if not rows.is_cuda:
            return rows.clone()
        host = rows.to("cpu", non_blocking=True)
        if self.copy_event is None:  # (one, recorded again by each copy: as HostPicks.copy_events)
            self.copy_event, self.copy_stream = torch.cuda.Event(), torch.cuda.current_stream(rows.device)
        self.copied = self.copy_event
        self.copied.record(self.copy_stream)  # (its stream given: as StagingEvents records)
        return host

    def wait(self) -> None:
        """Until the copies have reached the host (normally long done: queued behind a forward whose picks were
        waited for)."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None


def kept_feature_rows(generations: list["Generation"], starts: list[int]) -> list[list[torch.Tensor]]:
    """Each generation's kept feature rows (it `keep`s them) from row `start` on, up to its KV cache's length (row
    i: the i-th token of its prompt and output), as parts one after another: those of its last forward from the
    host copy where it has one (`TargetFeatures.recent`, after FeatureCopies.wait), the others gathered from the
    pool; each in one gather for all of the generations (and from the pool one copy to the host).

    Rows from before a request's last forward lie at their final slots: a tree's accepted rows are moved down
    before the next forward is launched. Those of its last forward do too unless that forward verified a drafted
    tree, and then they come from the copy."""
    if not generations:
        return []
    pool = generations[0].cache.cache
    pooled, slots, copied = [], [], []
    for generation, start in zip(generations, starts):
        features, end = generation.features, generation.cache.length
        recent = features.recent
        pool_end = end if recent is None else max(start, features.recent_start)
        pooled.append(max(0, pool_end - start))
        if pooled[-1]:
            slots.append(generation.cache.slot_array(start, pooled[-1]))
        copied.append(recent[max(0, start - features.recent_start):] if recent is not None else None)
    from_pool = pool.feature_rows(np.concatenate(slots)).split(pooled) if slots else [None] * len(generations)
    present = [rows for rows in copied if rows is not None and len(rows)]
    if len(present) > 1:
        joined = iter(gather(present).split([len(rows) for rows in present]))
    else:  # (a lone request's steady round: no split, which as any torch call costs more than so few rows do)
        joined = iter([gather(present)] if present else ())
    found = []
    for pool_rows, host_rows in zip(from_pool, copied):
        parts = [pool_rows] if pool_rows is not None and len(pool_rows) else []
        if host_rows is not None and len(host_rows):
            parts.append(next(joined))
        found.append(parts or [pool.features.new_empty(0, pool.features.shape[1], device="cpu")])
    return found


def _row_span(index: range | list[int]) -> tuple[int, int]:
    """The first row of an index and the row after its last."""
    return (index.start, index.stop) if is_run(index) else (min(index), max(index) + 1)


def _spans_of_sources(parts: list[Rows]) -> dict[int, list]:
    """id(source) -> [source, first row, end row]: for each output these parts are rows of, the one slice holding
    all of their rows."""
    spans: dict[int, list] = {}
    for rows in parts:
        first, end = _row_span(rows.index)
        span = spans.get(id(rows.source))
        if span is None:
            spans[id(rows.source)] = [rows.source, first, end]
        else:
            span[1], span[2] = min(span[1], first), max(span[2], end)
    return spans


def _shifted(index: range | list[int], by: int) -> range | list[int]:
    return range(index.start + by, index.stop + by) if is_run(index) else [row + by for row in index]


def commit_round(generations: list["Generation"], plans: list[ForwardPlan], logits: list[Rows],
                 features: list[Rows | None], copies: FeatureCopies | None = None,
                 choices: list[list[int]] | None = None, hold_moves: bool = False) -> list[list[int]]:
    """Each generation's choices from its logits (or `choices`, picked already: HostPicks), moved to the host in
    one transfer (the round's one wait on the device), then committed. Those that keep features learn which of
    their rows `copies` holds on the host (FeatureCopies.prepare made them; none without it). The accepted paths'
    KV move is launched before this returns, or with `hold_moves` left for PagedKVCache.launch_held_moves. Returns
    each generation's committed tokens."""
    if not generations:
        return []
    if choices is None:
        choices = HostPicks(pick_round(generations, plans, logits)).lists()
    committed = []
    pool = plans[0].cache.cache if isinstance(plans[0].cache, PagedSequence) else None
    with pool.moves_together(hold_moves) if pool is not None else contextlib.nullcontext():  # the accepted paths' KV
        for generation, plan, plan_features, chosen in zip(generations, plans, features, choices):
            committed.append(generation.apply(plan, chosen, plan_features))
    keeping = [generation for generation in generations if generation.features.keep and not generation.finished]
    if keeping:
        (copies or FeatureCopies()).keep_recent(keeping)
    return committed


def pick_round(generations: list["Generation"], plans: list[ForwardPlan], logits: list[Rows]
               ) -> list[torch.Tensor]:
    """Each generation's picks at its plan's logits rows (on the logits' device), with one set of sampling kernels
    per sampling setting in the round rather than one per request: kernels launched per request would make a
    large sampled batch's rounds much longer than a greedy one's."""
    groups: dict[tuple, list[int]] = {}
    for i, generation in enumerate(generations):
        groups.setdefault(sampling_setting(generation.params), []).append(i)
    picks: list[torch.Tensor | None] = [None] * len(generations)
    for setting, members in groups.items():
        sizes = [len(logits[i]) for i in members]
        rows = gather([logits[i] for i in members])
        params = generations[members[0]].params
        seeds = counters = None  # greedy needs no draws
        if setting:  # sampled: each row's draw from its request's seed and counter
            seeds = np.repeat(np.asarray([generations[i].seed for i in members], dtype=np.uint64), sizes)
            counters = np.concatenate([generations[i].pick_counters(plans[i]) for i in members])
        chosen = pick_tokens(rows, params, seeds, counters)
        for i, part in zip(members, chosen.split(sizes)):
            picks[i] = part
    return picks


class HostPicks:
    """A round's picks (pick_round) on their way to the host in one copy, into page-locked memory from a GPU so
    that launching it does not wait: a caller that waits for the device anyway (`copied`) finds them there."""

    # One event a device for every round's copy, recorded again by each: a later record would only make a wait for
    # an earlier copy longer, never shorter (one stream), and an event made and destroyed each round is two driver
    # calls on the round's path.
    copy_events: dict[int, tuple[torch.cuda.Event, torch.cuda.Stream]] = {}  # with the stream it is recorded on

    def __init__(self, picks: list[torch.Tensor]):
        self.sizes = [len(pick) for pick in picks]
        flat = torch.cat(picks)
        self.copied: torch.cuda.Event | None = None
        if flat.is_cuda:
            device = flat.device.index
            flat = flat.to("cpu", non_blocking=True)
            if device not in HostPicks.copy_events:
                HostPicks.copy_events[device] = torch.cuda.Event(), torch.cuda.current_stream(device)
            self.copied, stream = HostPicks.copy_events[device]
            self.copied.record(stream)  # (its stream given: as StagingEvents records)
        self.flat = flat

    def lists(self) -> list[list[int]]:
        """Each plan's picks, once the copy has ended."""
        if self.copied is not None:
            self.copied.synchronize()
        values, start, found = self.flat.tolist(), 0, []
        for size in self.sizes:
            found.append(values[start:start + size])
            start += size
        return found


# Characters the tail decoded for a stop-string check takes beyond the longest stop string: room for what a
# tail's start may decode apart from the whole text (a character cut between tokens).
TAIL_MARGIN_CHARS = 8


class Stops:
    """Where a request's output ends (EOS or a stop token, a stop string, the length limit), and its text
    without what stopped it."""

    def __init__(self, tokenizer: Tokenizer, params: GenerationParams):
        self.tokenizer, self.params = tokenizer, params
        self.ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_ids))
        self.text_end: int | None = None  # where a matched stop string starts in the decoded text
        self.longest_stop = max(map(len, params.stop_strings), default=0)

    def reason(self, output_ids: list[int]) -> str | None:
        """Why the output ends at its newest token ("stop" or "length"); None: it goes on."""
        if output_ids[-1] in self.ids or self._stop_string_ended(output_ids):
            return "stop"
        return "length" if len(output_ids) >= self.params.max_new_tokens else None

    def _stop_string_ended(self, output_ids: list[int]) -> bool:
        if not self.params.stop_strings or not self._in_tail(output_ids):
            return False
        text = self.tokenizer.decode(output_ids)
        # Only a match that the newest token completed can be new; search a tail long enough to hold one.
        tail_start = max(0, len(self.tokenizer.decode(output_ids[:-1])) - self.longest_stop)
        found = [i for s in self.params.stop_strings if (i := text.find(s, tail_start)) >= 0]
        if found:
            self.text_end = min(found)
        return bool(found)

    def _in_tail(self, output_ids: list[int]) -> bool:
        """Whether a stop string occurs in the text of the output's last few tokens, which a match the newest token
        completed lies in: decoding only those keeps each token's check short, where the whole output's decode
        grows with it. A tail's first characters may decode apart from the whole text's (a character cut between
        tokens, a tokenizer's leading space), its end does not: the tail is taken a few characters longer than the
        longest stop string needs."""
        needed = self.longest_stop + TAIL_MARGIN_CHARS
        tokens = needed
        while True:
            tail = self.tokenizer.decode(output_ids[-tokens:])
            if len(tail) >= needed or tokens >= len(output_ids):
                return any(stop in tail for stop in self.params.stop_strings)
            tokens *= 2  # tokens of no text (special ones, parts of a character): look further back

    def text(self, output_ids: list[int], finish_reason: str | None) -> str:
        """The output's text, without a final stop token and cut before a matched stop string."""
        if finish_reason == "stop" and output_ids and output_ids[-1] in self.ids:
            output_ids = output_ids[:-1]
        text = self.tokenizer.decode(output_ids)
        return text if self.text_end is None else text[:self.text_end]


class Generation:
    """One request's state. In process: call `step()` until `finished`; each call returns the tokens it
    committed. A batching server instead calls `plan(tree)` for each, runs the plans in one `forward_batch`, then
    `commit_round` for all.

    `feature_layer_ids` (the local drafter's, or a remote drafter's for a server) makes each apply keep the
    target's hidden states for the tokens it moved into the KV cache (`features.last`). Given feature layers
    without a local drafter (a server's request, drafted remotely), it keeps them all (`features.keep`) in the
    verifier's pool, which must keep them (TreeVerifier.keep_features).

    With `verifier`, the request's KV lives in blocks of the verifier's paged pool, taken as it grows and
    returned when it finishes (or on `release()`, for a request dropped before the end), and its trees are
    verified there (from CUDA graphs when the verifier has them); without, in a contiguous cache of its own
    sized for its longest possible context."""

    def __init__(self, model: DecoderLM, tokenizer: Tokenizer, prompt_ids: list[int], params: GenerationParams,
                 drafter: Drafter | None = None, budget: int = 0, feature_layer_ids: tuple[int, ...] = (),
                 verifier: TreeVerifier | None = None):
        params.validate()
        cfg = model.config
        if not prompt_ids:
            raise TreeserveError("the prompt is empty")
        outside = next((t for t in prompt_ids if not 0 <= t < cfg.vocab_size), None)
        if outside is not None:
            raise TreeserveError(f"prompt token id {outside} is outside the vocabulary [0, {cfg.vocab_size})")
        if not 0 <= budget <= MAX_BUDGET or (drafter is not None and budget == 0):
            raise TreeserveError(f"budget must be between 1 and {MAX_BUDGET}, got {budget}")
        if len(prompt_ids) + params.max_new_tokens > cfg.max_context:
            raise TreeserveError(f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                                 f"exceeds the model's context of {cfg.max_context} tokens")
        self.model, self.tokenizer, self.params = model, tokenizer, params
        # budget bounds the trees this request accepts, from the local drafter or from plan()'s caller.
        self.drafter, self.budget = drafter, budget
        self.draft_context = drafter.new_context() if drafter is not None else None
        layer_ids = tuple(drafter.feature_layer_ids if drafter is not None else feature_layer_ids)
        bad_layers = [i for i in layer_ids if not 0 <= i < cfg.num_layers]
        if bad_layers:
            raise TreeserveError(f"the drafter asks for target layer {bad_layers[0]}, but the target has "
                                 f"{cfg.num_layers} layers")
        self.features = TargetFeatures(layer_ids, keep=drafter is None and bool(layer_ids))
        if self.features.keep and (verifier is None or verifier.pool.features is None):
            raise TreeserveError(f"a request drafted in another process needs its features of target layers "
                                 f"{list(layer_ids)} kept in the verifier's pool (TreeVerifier.keep_features)")
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.seed = params.seed if params.seed is not None else random_seed()
        self.stops = Stops(tokenizer, params)
        self.verifier = verifier
        if verifier is not None:
            self.cache = verifier.pool.sequence()
        else:
            self.cache = KVCache(cfg, self.kv_tokens_needed, model.dtype, model.device)
        self.finish_reason: str | None = None
        self.rounds = self.round_tokens = self.drafted_tokens = 0
        self.last_accepted = 0  # drafted tokens the last round accepted (before a stop cut)
        self.last_lookup_accepted: int | None = None  # of them, its tree's lookup chain's (DraftTree.lookup_nodes)
        self.started = time.perf_counter()
        self.prefill_s = self.elapsed_s = 0.0

    @property
    def kv_tokens_needed(self) -> int:
        """KV rows this request can hold at most: committed tokens never exceed prompt + max_new - 1, plus one
        tree of budget + 1 nodes."""
        return len(self.prompt_ids) + self.params.max_new_tokens + self.budget

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        return bool(self.output_ids)

    def step(self) -> list[int]:
        """One prefill or round with the local drafter (if any); returns the committed tokens."""
        if self.finished:
            return []
        plan = self.plan(self.local_draft() if self.prefilled else None)
        logits, features = forward_batch(self.model, [plan], self.features.layer_ids, self.verifier)
        return commit_round([self], [plan], logits, features)[0]

    def plan(self, tree: DraftTree | None) -> ForwardPlan:
        """What the next target forward runs for this request: the prompt (first call), else the tree to verify
        (the root alone when `tree` is None: a plain decoding step). A tree from a drafter is checked here."""
        if not self.prefilled:
            n = len(self.prompt_ids)
            return ForwardPlan(self.cache, self.prompt_ids, np.arange(n), None, [n - 1], None)
        root = self.output_ids[-1]
        if tree is None:  # our own root, nothing to check: built directly, as the general path below would
            # cost host time for every request of every plain round
            return ForwardPlan(self.cache, [root], np.array([self.cache.length]), ROOT_ONLY_MASK, [0],
                               DraftTree([root], [-1]))
        tree.validate(self.model.config.vocab_size)
        if tree.tokens[0] != root or tree.size > self.budget + 1:
            raise TreeserveError(f"the drafter returned a tree that does not fit the request "
                                 f"(root {tree.tokens[0]} vs {root}, {tree.size - 1} nodes for budget {self.budget})")
        # A round emits at most depth + 1 tokens; deeper nodes could never be used.
        shape, max_depth = tree.shape(), self.params.max_new_tokens - len(self.output_ids) - 1
        if shape.height > max_depth:
            tree = tree.truncated(max_depth)
            shape = tree.shape()
        return ForwardPlan(self.cache, tree.tokens, shape.depth_array() + self.cache.length, shape,
                           list(range(tree.size)), tree)

    def pick_counters(self, plan: ForwardPlan) -> list[int]:
        """Which generated token each of the plan's logits rows decides: the counter of its random draw."""
        done = len(self.output_ids)
        depths = [0] if plan.tree is None else plan.tree.depths()
        return [done + d for d in depths]

    def apply(self, plan: ForwardPlan, choices: list[int], features: Rows | None = None) -> list[int]:
        """Commit what the target's `choices` (from `pick_round`) accept. `features`: the plan's per-token hidden
        states, when the generation has feature layers."""
        if plan.tree is None:  # prefill: the whole prompt is committed, its last row gives the first token
            kept = list(range(len(plan.tokens)))
            committed = self._commit(choices)
            self.prefill_s = time.perf_counter() - self.started
            new_context = self.prompt_ids + committed
        else:
            kept, emitted = walk_tree(plan.tree, choices)
            self.last_accepted = len(kept) - 1  # kept holds the root plus the accepted nodes
            self.last_lookup_accepted = chain_accepted(kept, plan.tree.lookup_nodes)
            committed = self._commit(emitted)
            self.rounds += 1
            self.round_tokens += len(committed)
            self.drafted_tokens += plan.tree.size - 1
            new_context = committed
        self.cache.keep(kept)
        if self.finished:
            self.release()
        if self.features.layer_ids:
            self.features.take(features, kept)
        if self.drafter is not None and not self.finished:
            last = self.features.last
            try:
                self.drafter.extend(self.draft_context, new_context, None if last is None else last.tensor())
            except DraftPoolFull:  # the drafter cannot hold this request: it goes on without trees
                self.drafter.release(self.draft_context)
                self.drafter = None
        return committed

    def stop_drafting(self) -> None:
        """Decode plainly from now on: no trees, no features kept for a drafter (a server's request, whose remote
        drafter the caller tells to forget it)."""
        self.budget, self.features = 0, TargetFeatures((), keep=False)

    def release(self) -> None:
        """Give a paged cache's blocks back to the pool (a contiguous cache goes with the generation), and the
        local drafter's context its blocks."""
        if isinstance(self.cache, PagedSequence):
            self.cache.release()
        if self.drafter is not None:
            self.drafter.release(self.draft_context)

    @property
    def committed_count(self) -> int:
        """Prompt plus generated tokens: the draft context's length."""
        return len(self.prompt_ids) + len(self.output_ids)

    def committed_since(self, start: int) -> list[int]:
        """Draft-context tokens from index `start` on, without copying the whole history."""
        if start >= len(self.prompt_ids):
            return self.output_ids[start - len(self.prompt_ids):]
        return self.prompt_ids[start:] + self.output_ids

    def local_draft(self) -> DraftTree | None:
        if self.drafter is None:
            return None
        return self.drafter.propose([self.draft_context], [self.budget])[0]

    def _commit(self, tokens: list[int]) -> list[int]:
        """Append tokens one by one, stopping at a stop token, a stop string or the length limit."""
        if (not self.params.stop_strings and self.stops.ids.isdisjoint(tokens)
                and len(self.output_ids) + len(tokens) < self.params.max_new_tokens):
            # None of them can end the output (most rounds): all at once, without checking each (what the checks
            # would leave: every token, and no finish reason)
            self.output_ids.extend(tokens)
            if tokens:
                self.finish_reason = None
            return list(tokens)
        committed = []
        for token in tokens:
            self.output_ids.append(token)
            committed.append(token)
            self.finish_reason = self.stops.reason(self.output_ids)
            if self.finished:
                self.elapsed_s = time.perf_counter() - self.started
                break
        return committed

    def text(self) -> str:
        """The output text so far, without a final stop token and cut before a matched stop string."""
        return self.stops.text(self.output_ids, self.finish_reason)

    def result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=list(self.output_ids), text=self.text(), finish_reason=self.finish_reason or "length",
            prompt_tokens=len(self.prompt_ids), rounds=self.rounds, round_tokens=self.round_tokens,
            seed=self.seed, prefill_s=self.prefill_s, elapsed_s=self.elapsed_s)


def generate(model: DecoderLM, tokenizer: Tokenizer, prompt_ids: list[int], params: GenerationParams,
             drafter: Drafter | None = None, budget: int = 0, verifier: TreeVerifier | None = None
             ) -> GenerationResult:
    """Run one request to the end; its KV blocks and draft context go back, so that the verifier and the drafter
    can serve the next. For streaming, drive a `Generation` and read what each `step()` returns."""
    generation = Generation(model, tokenizer, prompt_ids, params, drafter, budget, verifier=verifier)
    try:
        while not generation.finished:
            generation.step()
        return generation.result()
    finally:
        generation.release()
