"""DFlash over the Draft stream: the verifier sends each request's target features with its tokens, the drafter
service builds its context from them, and a drafter restarted mid-stream gets every request's features again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from random_targets import random_dflash_drafter, random_target, target_features, word_tokenizer
from treeserve import feature_region, serving
from treeserve.drafter import server as drafter_server
from treeserve.drafter.server import DrafterServicer
from treeserve.framing import FramedCall
from treeserve.loading import LoadedModel
from treeserve.params import GenerationParams
from treeserve.v1 import drafter_pb2, drafter_pb2_grpc, generation_pb2, verifier_pb2, verifier_pb2_grpc
from treeserve.verifier import generate
from treeserve.verifier import drafter_link
from treeserve.verifier.adaptive import AdaptiveSpeculation
from treeserve.verifier.drafter_link import DrafterLink
from treeserve.verifier.round import CONTEXT_LAG_ROWS, Choice, FixedSpeculation
from treeserve.verifier.server import VerifierServicer
from treeserve.wire import features_to_proto

VOCAB = 64
PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [9, 8, 7, 6], [5, 5, 5, 5, 5, 6], [4, 20, 4, 21, 4]]


@pytest.fixture(scope="module")
def target():
    return LoadedModel("tiny", random_target("qwen3", seed=11, vocab_size=VOCAB, weight_scale=2.0),
                       word_tokenizer(VOCAB))


def recording_drafter(target):
    """A DFlash drafter that also keeps, per request context, every feature row it received."""
    drafter = random_dflash_drafter(target.model, "ddtree")
    drafter.contexts = []
    new_context, extend = drafter.new_context, drafter.extend

    def recording_new_context():
        context = new_context()
        context.received = []
        drafter.contexts.append(context)
        return context

    def recording_extend(context, tokens, features):
        if features is not None:
            context.received.append(features.clone())
        extend(context, tokens, features)

    drafter.new_context, drafter.extend = recording_new_context, recording_extend
    return drafter


async def start_drafter(tmp_path, drafter):
    """On a Unix socket, as `treeserve up` runs it: the verifier's link takes the Draft stream as frames."""
    return await drafter_server.start(f"unix://{tmp_path}/drafter.sock", DrafterServicer(drafter))


async def start_verifier(tmp_path, target, link: DrafterLink, speculation=None):
    """The verifier service with one drafter link (and `speculation`, default fixed); returns (service, scheduler,
    scheduler task)."""
    servicer = VerifierServicer("tiny", [link], default_budget=8, default_max_new_tokens=30, max_batch=8)
    verifier = await serving.start(f"unix://{tmp_path}/verifier.sock", servicer.register)
    scheduler = servicer.attach(target, None, speculation)
    task = asyncio.ensure_future(scheduler.run())
    await scheduler.connect(link)
    return verifier, scheduler, task


async def stop_all(scheduler_task, verifier, link, drafter_service) -> None:
    scheduler_task.cancel()
    await verifier.stop(0)
    await link.close()
    await drafter_service.stop(0)


def request(prompt, max_new_tokens=30):
    return verifier_pb2.VerifierServiceGenerateRequest(
        prompt_token_ids=prompt, stop=generation_pb2.StopConditions(max_new_tokens=max_new_tokens, ignore_eos=True),
        speculation=generation_pb2.SpeculationParams(budget=8))


async def collect(stub, message):
    tokens = []
    async for reply in stub.Generate(message):
        tokens.extend(reply.token_ids)
    return tokens


def expected(target, prompt, max_new_tokens=30):
    return generate(target.model, target.tokenizer, prompt,
                    GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True)).token_ids


def check_received_features(target, drafter, complete: bool = True):
    """Each context got exactly the target's features of its tokens but the last, as a fresh forward gives them
    (or, not `complete`, of its oldest tokens: rows may come later than their tokens)."""
    checked = 0
    for context in drafter.contexts:
        if not context.received:
            continue
        received = torch.cat(context.received)
        assert received.shape[0] == len(context.tokens) - 1 or not complete
        want = target_features(target.model, context.tokens[:received.shape[0]], drafter.feature_layer_ids)
        torch.testing.assert_close(received, want, atol=1e-4, rtol=1e-4)
        checked += 1
    return checked


def serve_prompts(tmp_path, target, drafter, speculation, max_new_tokens=30, messages: list | None = None,
                  one_at_a_time: bool = False):
    """PROMPTS at once (or `one_at_a_time`) through a verifier deciding by `speculation` and `drafter` served on a
    Unix socket; returns the outputs and the verifier's link to the drafter (closed). `messages`: gets every Draft
    message sent."""
    async def main():
        drafter_service = await start_drafter(tmp_path, drafter)
        link = DrafterLink(drafter_service.address, timeout_s=5.0)
        if messages is not None:
            build = link._messages
            link._messages = lambda *args: messages.extend(built := build(*args)) or built
        verifier, scheduler, task = await start_verifier(tmp_path, target, link, speculation)
        async with grpc.aio.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            if one_at_a_time:
                outputs = [await collect(stub, request(p, max_new_tokens)) for p in PROMPTS]
            else:
                outputs = await asyncio.gather(*(collect(stub, request(p, max_new_tokens)) for p in PROMPTS))
        await stop_all(task, verifier, link, drafter_service)
        return outputs, link

    return asyncio.run(main())


@pytest.mark.parametrize("region_rows, message_rows", [(None, None), (5, None), (0, None), (0, 3)],
                         ids=["feature-region", "region-of-5-rows", "in-messages", "in-messages-split-every-3-rows"])
def test_dflash_through_the_services_is_lossless_and_gets_the_target_features(tmp_path, target, monkeypatch,
                                                                             region_rows, message_rows):
    """Features go through the feature region the verifier shares with a drafter on its host (region_rows: its
    size in rows, None for the default), rows that do not fit it in the messages; with message_rows, a round's
    features in messages go out in messages of at most that many rows (as a long prompt or a large catch-up would,
    beyond gRPC's message limit). Every way, the drafter gets the same features, in order."""
    drafter = recording_drafter(target)
    row_bytes = drafter.feature_size * 4
    if message_rows:
        monkeypatch.setattr(drafter_link, "MESSAGE_FEATURE_BYTES", message_rows * row_bytes)
    messages = []  # each round's

    async def main():
        drafter_service = await start_drafter(tmp_path, drafter)
        region_bytes = feature_region.DEFAULT_REGION_BYTES if region_rows is None else region_rows * row_bytes
        link = DrafterLink(drafter_service.address, timeout_s=5.0, region_bytes=region_bytes)
        build = link._messages
        link._messages = lambda *args: messages.append(built := build(*args)) or built
        verifier, scheduler, task = await start_verifier(tmp_path, target, link)
        assert link.up and scheduler.feature_layer_ids == drafter.feature_layer_ids
        assert isinstance(link.call, FramedCall)  # a drafter on this host: frames on its own socket
        assert (link.region is not None) == (region_bytes > 0)
        assert link.region is None or not Path(link.region.path).exists()  # mapped at both ends: unlinked
        async with grpc.aio.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            outputs = await asyncio.gather(*(collect(stub, request(p)) for p in PROMPTS))
            # Alone in its batch, a request without speculation needs no features from the forward.
            plain = request(PROMPTS[0])
            plain.speculation.disabled = True
            outputs.append(await collect(stub, plain))
        stayed_up = link.up
        await stop_all(task, verifier, link, drafter_service)
        return outputs, stayed_up

    outputs, stayed_up = asyncio.run(main())
    for prompt, output in zip(PROMPTS + PROMPTS[:1], outputs):
        assert output == expected(target, prompt)
    assert check_received_features(target, drafter) == len(PROMPTS)
    assert stayed_up and (max(map(len, messages)) > 1) == bool(message_rows)
    sent = [item.features for round_messages in messages for message in round_messages for item in message.items
            if item.HasField("features") and item.features.shape[0]]
    in_region = [features.HasField("region_offset") for features in sent]
    assert any(in_region) == (region_rows != 0) and all(in_region) == (region_rows is None)
    # Finished requests, then the closed stream, gave every context block back to the drafter's pool.
    assert drafter.pool.allocator.free_count == drafter.pool.allocator.num_blocks


class EveryNthRound(FixedSpeculation):
    """A speculation policy that drafts (budget 8) one round in `n`, and decodes plainly in the others."""

    def __init__(self, n: int = 5):
        self.rounds, self.n, self.reports = 0, n, []

    def observe(self, report):
        self.reports.append(report)

    def round_budgets(self, asked, batch, lookup=False):
        if not asked:
            return {}, None
        self.rounds += 1
        budget = 8 if self.rounds % self.n == 0 else 0
        return {request_id: min(budget, own) for request_id, own in asked.items() if budget}, Choice(budget)


def test_features_of_plain_rounds_reach_the_drafter_when_it_next_drafts(tmp_path, target):
    """Rounds without a draft keep their features in the verifier's pool; the next draft gets all of them, in
    order, and the output stays the target's own."""
    drafter = recording_drafter(target)
    outputs, _ = serve_prompts(tmp_path, target, drafter, EveryNthRound())
    for prompt, output in zip(PROMPTS, outputs):
        assert output == expected(target, prompt)
    assert check_received_features(target, drafter) == len(PROMPTS)
    assert all(len(context.received) < len(context.tokens) - 1 for context in drafter.contexts)  # rows came batched


def test_rows_of_plain_rounds_go_ahead_of_the_next_tree_and_are_written_meanwhile(tmp_path, target):
    """Through long runs of plain rounds, a lone request's feature rows go to its drafter on messages that ask for
    no tree once its context lags by CONTEXT_LAG_ROWS, and the drafter writes them after answering: a tree after
    plain rounds brings no more rows than that, and its block forward finds no more than that to write. A first
    tree that brings its prompt says so (DraftRound.prompt). The output stays the target's own, and every row
    reaches the drafter, in order."""
    drafter = recording_drafter(target)
    unwritten = []  # at each block forward, the most rows a context had left to write
    run_block = drafter._run_block

    def recording_run_block(contexts, budgets):
        unwritten.append(max(context.unwritten_rows for context in contexts))
        return run_block(contexts, budgets)

    drafter._run_block = recording_run_block
    messages = []
    policy = EveryNthRound(25)
    outputs, _ = serve_prompts(tmp_path, target, drafter, policy, max_new_tokens=60, messages=messages,
                               one_at_a_time=True)
    for prompt, output in zip(PROMPTS, outputs):
        assert output == expected(target, prompt, 60)
    assert check_received_features(target, drafter) == len(PROMPTS)
    items = [item for message in messages for item in message.items if not item.finished]
    ahead = [item for item in items if item.budget == 0]
    assert len(ahead) >= len(PROMPTS) and all(item.features.shape[0] >= CONTEXT_LAG_ROWS for item in ahead)
    assert max(item.features.shape[0] for item in items if item.budget) <= CONTEXT_LAG_ROWS
    assert unwritten and max(unwritten) <= CONTEXT_LAG_ROWS
    trees = [(report.requests[0].request_id, report.drafts[0].prompt) for report in policy.reports if report.drafts]
    firsts = {request_id: prompt for request_id, prompt in reversed(trees)}  # each request's first tree
    # Only a first tree brings a prompt, unless its rows went ahead of it (a request that decoded plainly first).
    assert len(firsts) == len(PROMPTS) and any(firsts.values())
    assert sum(prompt for _, prompt in trees) == sum(firsts.values())


class OwnLookupPlain(FixedSpeculation):
    """Rounds in turn: the drafter's own trees (budget 8), prompt lookup's alone, plain decoding."""

    def __init__(self):
        self.rounds, self.offered, self.reports = 0, [], []

    def observe(self, report):
        self.reports.append(report)

    def round_budgets(self, asked, batch, lookup=False):
        if not asked:
            return {}, None
        self.offered.append(lookup)
        kind, self.rounds = self.rounds % 3, self.rounds + 1
        if kind == 2:
            return {}, Choice(0)
        return {request_id: min(8, own) for request_id, own in asked.items()}, Choice(8, lookup=kind == 1)


def test_rounds_of_lookups_trees_alone_keep_the_merged_drafters_context(tmp_path, target):
    """A merged drafter offers prompt lookup's trees alone; rounds that ask for them get the n-gram drafter's trees
    (no DFlash forward) and carry no features, which reach the DFlash context in order with the next round of its
    own trees; the output stays the target's own. The drafter's own trees say how long their lookup chain is."""
    from treeserve.drafter.merged import MergedDrafter
    from treeserve.drafter.ngram import NgramDrafter

    drafter = recording_drafter(target)
    merged = MergedDrafter(drafter)
    lookups, own, lagging = [], [], []
    propose, propose_lookup = merged.propose, merged.propose_lookup

    def recording_propose_lookup(contexts, budgets):
        # Without a DFlash forward, nor its features: rows lag the tokens by at least the tokens since the last
        # round of its own trees.
        lagging.extend(context.dflash.rows_wanted() for context in contexts)
        trees = propose_lookup(contexts, budgets)
        lookups.extend((list(context.tokens), budget, tree) for context, budget, tree in zip(contexts, budgets, trees))
        return trees

    def recording_propose(contexts, budgets):
        trees = propose(contexts, budgets)
        own.extend(trees)
        return trees

    merged.propose, merged.propose_lookup = recording_propose, recording_propose_lookup
    policy = OwnLookupPlain()
    outputs, link = serve_prompts(tmp_path, target, merged, policy)
    assert link.lookup_trees
    for prompt, output in zip(PROMPTS, outputs):
        assert output == expected(target, prompt)
    assert check_received_features(target, drafter, complete=False) == len(PROMPTS)
    assert all(policy.offered) and lookups and own and max(lagging) > 0
    assert all(tree == NgramDrafter().tree(tokens, budget) for tokens, budget, tree in lookups)
    assert all(tree.lookup_nodes is not None for tree in own)
    # The verifier reads off each own tree's accepted path what its lookup chain alone would have accepted.
    drafted = [(report.lookup, request) for report in policy.reports for request in report.requests
               if request.tree_nodes]
    assert {lookup for lookup, _ in drafted} == {False, True}
    assert all((request.lookup_accepted is None) == lookup for lookup, request in drafted)
    assert all(request.lookup_accepted <= request.accepted for lookup, request in drafted if not lookup)


def test_a_drafter_reached_over_tcp_drafts_as_over_a_unix_socket(tmp_path, target):
    """A drafter on another host is reached over TCP: the same stream carries the contexts, their target features
    and the trees, and the output stays the target's own."""
    drafter = recording_drafter(target)
    address = f"127.0.0.1:{serving.free_port()}"

    async def main():
        drafter_service = await serving.start(address, DrafterServicer(drafter).register)
        link = DrafterLink(address, timeout_s=5.0)
        verifier, scheduler, task = await start_verifier(tmp_path, target, link)
        assert link.up and not isinstance(link.call, FramedCall)  # over TCP: the gRPC stream
        async with grpc.aio.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            outputs = await asyncio.gather(*(collect(stub, request(p)) for p in PROMPTS))
        await stop_all(task, verifier, link, drafter_service)
        return outputs, scheduler

    outputs, scheduler = asyncio.run(main())
    for prompt, output in zip(PROMPTS, outputs):
        assert output == expected(target, prompt)
    assert check_received_features(target, drafter) == len(PROMPTS)
    assert scheduler.metrics.registry.get_sample_value("treeserve_drafts_total") > 0


def test_where_drafting_has_stopped_paying_new_requests_decode_plainly(tmp_path, target):
    """With adaptive speculation finding that drafting does not pay at any batch size (a DFlash drafter's request
    keeps its target features, so it costs the others even in plain rounds), requests that ask for trees and join
    a running one are admitted decoding plainly (no drafts, none of a drafting request's bookkeeping), but for
    one in CANARY_EVERY, and stream the target's own tokens either way."""
    every = AdaptiveSpeculation().give_up.CANARY_EVERY
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(every)]
    drafter = recording_drafter(target)

    async def main():
        drafter_service = await start_drafter(tmp_path, drafter)
        link = DrafterLink(drafter_service.address, timeout_s=5.0)
        verifier, scheduler, task = await start_verifier(tmp_path, target, link, AdaptiveSpeculation(give_up_after_s=0.0))
        async with grpc.aio.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # checked before it counts as an admission
                await collect(stub, request([]))
            # A plain request runs throughout, so that each of the others joins a batch of two (a lone request is
            # never given up).
            beside = request(PROMPTS[0], 480)
            beside.speculation.disabled = True
            companion = stub.Generate(beside)
            await companion.read()
            outputs = [await collect(stub, request(prompt, 16)) for prompt in prompts]  # one at a time
            assert (await companion.read()).token_ids  # still running
            companion.cancel()
        await stop_all(task, verifier, link, drafter_service)
        return outputs, scheduler, refused.value

    outputs, scheduler, refused = asyncio.run(main())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    for prompt, output in zip(prompts, outputs):
        assert output == expected(target, prompt, 16)
    # Only the last one (the canary) reached the drafter, and it drafted.
    assert len(drafter.contexts) == 1 and drafter.contexts[0].tokens[:len(prompts[-1])] == prompts[-1]
    assert check_received_features(target, drafter) == 1
    registry = scheduler.metrics.registry
    assert registry.get_sample_value("treeserve_verifier_plain_admissions_total") == len(prompts) - 1
    assert registry.get_sample_value("treeserve_drafts_total") > 0


def test_a_restarted_dflash_drafter_gets_every_request_resent(tmp_path, target):
    first, second = recording_drafter(target), recording_drafter(target)

    async def main():
        drafter_service = await start_drafter(tmp_path, first)
        link = DrafterLink(drafter_service.address, timeout_s=5.0, max_backoff_s=0.2)
        verifier, _, task = await start_verifier(tmp_path, target, link)
        async with grpc.aio.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            pending = [asyncio.ensure_future(collect(stub, request(p, 60))) for p in PROMPTS]
            while not first.contexts or min(len(c.tokens) for c in first.contexts) < 12:
                await asyncio.sleep(0.005)
            await drafter_service.stop(0)  # the drafter dies mid-stream...
            drafter_service = await start_drafter(tmp_path, second)  # ...and a new one takes its socket
            outputs = await asyncio.gather(*pending)
        await stop_all(task, verifier, link, drafter_service)
        return outputs

    outputs = asyncio.run(main())
    for prompt, output in zip(PROMPTS, outputs):
        assert output == expected(target, prompt, 60)
    # The new drafter started from nothing: its first item per request carried the whole history.
    assert check_received_features(target, second) >= 1
    assert all(len(c.tokens) > 12 for c in second.contexts if c.received)


def test_a_request_whose_context_does_not_fit_goes_on_without_trees(tmp_path, target, caplog):
    """A drafter pool of 48 context tokens holds one of these requests (up to 36 tokens), not two: the second
    request decodes without trees while the first keeps speculating; the stream stays up, every output is the
    target's own, and every block comes back."""
    from treeserve.drafter.dflash import DFlashDrafter

    small = random_dflash_drafter(target.model, "chain")
    drafter = DFlashDrafter(small.model, small.embedding, small.lm_head, "chain", max_batch=2, kv_cache_tokens=48)
    prompts = [PROMPTS[0], PROMPTS[3]]

    async def main():
        drafter_service = await start_drafter(tmp_path, drafter)
        link = DrafterLink(drafter_service.address, timeout_s=5.0)
        verifier, scheduler, task = await start_verifier(tmp_path, target, link)
        async with grpc.aio.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            outputs = await asyncio.gather(*(collect(stub, request(p)) for p in prompts))
        link_stayed_up = link.up
        await stop_all(task, verifier, link, drafter_service)
        return outputs, link_stayed_up

    with caplog.at_level("WARNING", logger="treeserve.drafter"):
        outputs, link_stayed_up = asyncio.run(main())
    for prompt, output in zip(prompts, outputs):
        assert output == expected(target, prompt)
    assert sum("gets no more trees" in record.getMessage() for record in caplog.records) == 1
    assert link_stayed_up and not any("drafter" in r.getMessage() and "down" in r.getMessage()
                                      for r in caplog.records)
    assert drafter.pool.allocator.free_count == drafter.pool.allocator.num_blocks


def test_features_of_the_wrong_shape_are_invalid_argument(tmp_path, target):
    async def main():
        service = await start_drafter(tmp_path, random_dflash_drafter(target.model, "chain"))
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            info = await stub.GetInfo(drafter_pb2.DrafterServiceGetInfoRequest())
            stream = stub.Draft()
            features = drafter_pb2.Features(data=bytes(4 * 3 * info.feature_layer_ids[-1]), shape=[3, 1],
                                            dtype="float32")
            await stream.write(drafter_pb2.DraftRequest(round=1, items=[drafter_pb2.DraftItem(
                request_id="a", new_token_ids=[1, 2, 3], budget=4, features=features)]))
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stream.read()
        await service.stop(0)
        return info, raised.value

    info, error = asyncio.run(main())
    assert info.kind == "dflash" and list(info.feature_layer_ids) == [0, 1]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "features of shape" in error.details()


def test_rows_may_come_after_their_tokens_but_not_after_an_own_tree(tmp_path, target):
    """A merged drafter's round of prompt lookup's trees alone may carry tokens without their feature rows; a round
    that asks for its own tree must bring every row the context lacks, or it is refused."""
    from treeserve.drafter.merged import MergedDrafter

    drafter = MergedDrafter(random_dflash_drafter(target.model, "ddtree"))

    def item(tokens, rows, lookup_only=False):
        message = drafter_pb2.DraftItem(request_id="a", new_token_ids=tokens, budget=4, lookup_only=lookup_only)
        if rows:
            features_to_proto(torch.zeros(rows, drafter.feature_size), into=message.features)
        return message

    async def main():
        service = await start_drafter(tmp_path, drafter)
        async with grpc.aio.insecure_channel(service.address) as channel:
            stream = drafter_pb2_grpc.DrafterServiceStub(channel).Draft()
            answers = []
            for round_, items in enumerate([[item([1, 2, 3], 2)], [item([4, 5], 0, lookup_only=True)],
                                            [item([6], 1, lookup_only=True)], [item([7], 3)], [item([8], 0)]], 1):
                await stream.write(drafter_pb2.DraftRequest(round=round_, items=items))
                try:
                    answers.append(len((await stream.read()).trees))
                except grpc.aio.AioRpcError as error:
                    answers.append(error)
                    break
        await service.stop(0)
        return answers

    *trees, refused = asyncio.run(main())
    assert trees == [1, 1, 1, 1]  # the rows of 4, 5 and 6 came in two later rounds
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected (1, " in refused.details()


def test_a_feature_region_that_cannot_be_mapped_is_declined_and_rows_out_of_it_are_refused(tmp_path, target):
    """The drafter answers a region it cannot map with why, and the stream goes on, features in the messages; rows
    said to lie beyond the region, or in a region a gRPC stream cannot have, are refused with why."""
    drafter = random_dflash_drafter(target.model, "chain")
    width = drafter.feature_size

    def round_of(round_, features):
        return drafter_pb2.DraftRequest(round=round_, items=[drafter_pb2.DraftItem(
            request_id=f"r{round_}", new_token_ids=[1, 2, 3], budget=4, features=features)])

    def in_region(offset):
        return drafter_pb2.Features(shape=[2, width], dtype="float32", region_offset=offset)

    async def main():
        service = await start_drafter(tmp_path, drafter)
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            info = await stub.GetInfo(drafter_pb2.DrafterServiceGetInfoRequest())
            framed = await FramedCall.open(info.draft_socket, drafter_pb2.DraftResponse)
            declined = await framed.share_region(str(tmp_path / "elsewhere"))
            await framed.write(round_of(1, features_to_proto(torch.zeros(2, width))))
            trees_after_declining = len((await framed.read()).trees)
            region = feature_region.FeatureRegion(4 << 10)
            accepted = await framed.share_region(region.path)
            region.unlink()
            placed = region.place([torch.ones(2, width)])
            await framed.write(round_of(2, features_to_proto(placed)))
            trees_in_region = len((await framed.read()).trees)
            await framed.write(round_of(3, in_region(region.size - 64)))
            with pytest.raises(ConnectionError) as beyond:
                await framed.read()
            region.close()
            streamed = stub.Draft()
            await streamed.write(round_of(1, in_region(0)))
            with pytest.raises(grpc.aio.AioRpcError) as over_grpc:
                await streamed.read()
        await service.stop(0)
        return declined, trees_after_declining, accepted, trees_in_region, str(beyond.value), over_grpc.value

    declined, trees_after_declining, accepted, trees_in_region, beyond, over_grpc = asyncio.run(main())
    assert "must be a treeserve-features-* file" in declined and trees_after_declining == 1
    assert accepted == "" and trees_in_region == 1
    assert "round 3" in beyond and "of a feature region of 4096 bytes" in beyond
    assert over_grpc.code() == grpc.StatusCode.INVALID_ARGUMENT and "this stream has none" in over_grpc.details()


def test_rows_placed_in_a_feature_region_read_back_as_written():
    """The verifier writes each item's rows, in parts, at aligned offsets one item after another; the drafter's
    mapping reads them back bit for bit, whatever the dtype (bfloat16 has no NumPy twin) or the parts' layout."""
    region = feature_region.FeatureRegion(1 << 20)
    mapped = feature_region.MappedRegion(region.path)
    region.unlink()
    try:
        items = [[torch.randn(3, 12).to(torch.bfloat16)],
                 [torch.randn(2, 7), torch.randn(7, 4).T, torch.randn(1, 7)],  # (a transposed part: not contiguous)
                 [torch.randn(5, 12).to(torch.bfloat16)[::2]]]
        placed = [region.place(parts) for parts in items]
        assert [p.offset % feature_region.ALIGNMENT for p in placed] == [0, 0, 0]
        for parts, where in zip(items, placed):
            read = mapped.rows(where.offset, where.shape, where.dtype)
            assert read.dtype == parts[0].dtype and torch.equal(read, torch.cat(parts))
        region.clear()
        assert region.place([torch.zeros(1, 12)]).offset == 0  # a new round writes from the start
        assert region.place([torch.zeros(1 << 17, 4)]) is None  # rows that do not fit: written nowhere
    finally:
        mapped.close()
        region.close()


def test_a_rounds_items_placed_together_read_back_as_each_placed_alone():
    """A round's items of many requests go to the region in one write where each item's rows start aligned anyway
    (rows of a multiple of ALIGNMENT bytes): the drafter reads each back as written, an empty item too; rows of
    another width, or items that do not all fit, are placed one by one (those that fit), as `place` places them."""
    region = feature_region.FeatureRegion(1 << 20)
    mapped = feature_region.MappedRegion(region.path)
    region.unlink()
    writes = []
    write = region._write
    region._write = lambda offset, parts: (writes.append(offset), write(offset, parts))
    try:
        wide = torch.randn(40, 32).to(torch.bfloat16)  # 64 bytes a row
        items = [[wide[:3]], [wide[3:5], wide[8:9]], [wide[:0]], [torch.randn(32, 4).T.to(torch.bfloat16)]]
        region.place([torch.zeros(1, 8)])  # (a row before them: theirs start at the next aligned offset)
        writes.clear()
        placed = region.place_items(items)
        assert len(writes) == 1 and [p.offset for p in placed] == [64, 256, 448, 448]
        for parts, where in zip(items, placed):
            assert torch.equal(mapped.rows(where.offset, where.shape, where.dtype), torch.cat(parts))
        region.clear()
        writes.clear()
        narrow = [[torch.randn(3, 7)], [torch.randn(2, 7)]]  # 28 bytes a row: each item aligned on its own
        placed = region.place_items(narrow)
        assert len(writes) == 2 and [p.offset for p in placed] == [0, 128]
        for parts, where in zip(narrow, placed):
            assert torch.equal(mapped.rows(where.offset, where.shape, where.dtype), torch.cat(parts))
        region.clear()
        too_many = [[torch.zeros(10_000, 32).to(torch.bfloat16)], [torch.zeros(10_000, 32).to(torch.bfloat16)]]
        first, second = region.place_items(too_many)
        assert first.offset == 0 and second is None  # placed one by one: the second does not fit after the first
    finally:
        mapped.close()
        region.close()


def test_a_feature_region_takes_what_room_dev_shm_has(monkeypatch):
    """Its pages are reserved as it is made (a write past what /dev/shm holds would kill the process): where there
    is no room for the size asked, half of it, and so on down to the smallest worth having; else none."""
    room = {"bytes": 20 << 20}
    reserve = feature_region.os.posix_fallocate

    def limited(fd, offset, length):
        if length > room["bytes"]:
            raise OSError(28, "No space left on device")
        reserve(fd, offset, length)

    monkeypatch.setattr(feature_region.os, "posix_fallocate", limited)
    files = set(feature_region.SHARED_MEMORY_DIR.glob(f"{feature_region.FILE_PREFIX}*"))
    region = feature_region.FeatureRegion.create(64 << 20)
    assert region.size == 16 << 20 and Path(region.path).stat().st_size == 16 << 20
    region.close()
    room["bytes"] = feature_region.SMALLEST_REGION_BYTES - 1
    assert feature_region.FeatureRegion.create(64 << 20) is None
    assert set(feature_region.SHARED_MEMORY_DIR.glob(f"{feature_region.FILE_PREFIX}*")) <= files  # none left behind


def test_rows_read_in_place_from_the_region_or_kept_for_later_are_the_ones_sent(target):
    """A round of the drafter's own trees reads its rows in the feature region in place; rows that wait for a later
    round (a round of prompt lookup's trees alone that brought some) are copied out first, since the verifier writes
    the region again for its next round. Either way the context holds what the verifier sent: the same keys and
    values as a drafter fed the same rows in the messages, however the region is written after each round, and
    whether the rows that came without a tree of the drafter's own are written after the answer (`write_ahead`)
    or with the next block forward."""
    from treeserve.drafter.merged import MergedDrafter
    from treeserve.feature_region import MappedRegion

    rows = torch.randn(12, random_dflash_drafter(target.model, "ddtree").feature_size)
    # (new tokens, rows of them, lookup's tree alone): the prompt's rows come with a round of lookup's trees.
    rounds = [([1, 2, 3, 4, 5], 4, True), ([6, 7], 2, False), ([8, 9, 10], 3, True), ([11], 1, False)]

    def serve(region, ahead: bool):
        drafter = MergedDrafter(random_dflash_drafter(target.model, "ddtree"))
        mapped = MappedRegion(region.path) if region is not None else None
        sent, trees = 0, []
        servicer = DrafterServicer(drafter)
        with servicer.stream() as answer:
            for round_, (tokens, count, lookup_only) in enumerate(rounds, 1):
                item = drafter_pb2.DraftItem(request_id="a", new_token_ids=tokens, budget=4, lookup_only=lookup_only)
                part = rows[sent:sent + count]
                if region is not None:
                    region.clear()
                    features_to_proto(region.place([part]), into=item.features)
                else:
                    features_to_proto(part, into=item.features)
                sent += count
                reply = answer(drafter_pb2.DraftRequest(round=round_, items=[item]), mapped)
                trees.append([(list(tree.token_ids), list(tree.parents)) for tree in reply.trees])
                if ahead:
                    servicer.write_ahead()
                    assert drafter.dflash.unwritten == {}
                if region is not None:
                    region.array.fill(0x7F)  # the verifier's next round, writing over this one's rows
            pool = drafter.dflash.pool.data.clone()
        if mapped is not None:
            mapped.close()
        return pool, trees

    served = {}
    for ahead in (False, True):
        region = feature_region.FeatureRegion(1 << 20)
        try:
            through_region = serve(region, ahead)
        finally:
            region.close()
        in_messages = serve(None, ahead)
        torch.testing.assert_close(through_region[0], in_messages[0], rtol=0, atol=0)
        assert through_region[1] == in_messages[1]
        served[ahead] = in_messages
    # Rows written in other groupings differ by the rounding of their projections alone.
    torch.testing.assert_close(served[True][0], served[False][0], rtol=1e-5, atol=1e-5)
    assert served[True][1] == served[False][1]


def test_a_drafter_whose_features_the_pool_has_no_room_for_is_not_used(tmp_path, target, monkeypatch):
    """A DFlash drafter that connects once the KV pool has taken the device's memory, with no room left to keep its
    features there: the verifier says why and drafts without it (its requests decode plainly, the target's own
    output), rather than fail a request later."""
    from treeserve.verifier.graphs import TreeVerifier

    def no_room(verifier, feature_layer_ids):
        raise torch.OutOfMemoryError("CUDA out of memory (as on a GPU whose KV pool took the rest)")
    monkeypatch.setattr(TreeVerifier, "keep_features", no_room)

    async def main():
        drafter_service = await start_drafter(tmp_path, random_dflash_drafter(target.model, "ddtree"))
        link = DrafterLink(drafter_service.address, timeout_s=5.0)
        verifier, scheduler, task = await start_verifier(tmp_path, target, link)
        assert not link.up and scheduler.feature_layer_ids == ()
        assert not await scheduler.connect(link)  # disabled for good: not retried
        async with grpc.aio.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            outputs = await asyncio.gather(*(collect(stub, request(p)) for p in PROMPTS))
        await stop_all(task, verifier, link, drafter_service)
        return outputs

    for prompt, output in zip(PROMPTS, asyncio.run(main())):
        assert output == expected(target, prompt)
