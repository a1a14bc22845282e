"""The verifier service: owns the target, batches requests continuously and drives the rounds.

Each round: every running request that speculates gets a tree from its drafter (one batched message per
drafter), then one target forward verifies all trees and prefills new requests together, then each request
commits what its tree earned and its stream gets those tokens. Requests join and leave between rounds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid

import grpc

from treeserve.errors import TreeserveError
from treeserve.loading import LoadedModel
from treeserve.tree import MAX_BUDGET
from treeserve.v1 import generation_pb2, verifier_pb2, verifier_pb2_grpc
from treeserve.verifier.drafter_link import DrafterLink
from treeserve.verifier.engine import Generation, forward_batch
from treeserve.wire import FINISH_REASONS, params_from_proto

log = logging.getLogger("treeserve.verifier")


@dataclasses.dataclass
class Running:
    generation: Generation
    outbox: asyncio.Queue  # VerifierServiceGenerateResponse messages, or an Exception to end the stream with
    link: DrafterLink | None  # the drafter holding this request's context; None: no speculation


class Scheduler:
    def __init__(self, target: LoadedModel, links: list[DrafterLink], max_batch: int):
        self.target, self.links, self.max_batch = target, links, max_batch
        self.waiting: dict[str, Running] = {}
        self.running: dict[str, Running] = {}
        self.wake = asyncio.Event()

    def submit(self, request_id: str, generation: Generation) -> asyncio.Queue:
        speculate = generation.budget > 0 and bool(self.links)
        link = min(self.links, key=self._load) if speculate else None
        self.waiting[request_id] = Running(generation, asyncio.Queue(), link)
        self.wake.set()
        return self.waiting[request_id].outbox

    def cancel(self, request_id: str) -> None:
        """Free the request's KV (dropping the Generation frees its cache) and tell its drafter to forget it."""
        entry = self.waiting.pop(request_id, None) or self.running.pop(request_id, None)
        if entry is not None and entry.link is not None:
            entry.link.forget(request_id)

    def _load(self, link: DrafterLink) -> int:
        return sum(1 for entry in self.running.values() if entry.link is link)

    async def run(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
            while self.waiting and len(self.running) < self.max_batch:
                request_id = next(iter(self.waiting))
                self.running[request_id] = self.waiting.pop(request_id)
            try:
                await self._round()
            except Exception as error:  # a bug or device failure: fail this batch, keep serving the next
                log.exception("round failed")
                for request_id in list(self.running):
                    self.running.pop(request_id).outbox.put_nowait(error)

    async def _drafts(self) -> dict:
        """Trees for every prefilled, speculating request, one batched round trip per drafter."""
        for entry in self.running.values():
            if entry.link is not None and not entry.link.up and not await entry.link.connect():
                healthy = [link for link in self.links if link.up]  # move to a drafter that works
                if healthy:
                    entry.link = min(healthy, key=self._load)
        by_link: dict[DrafterLink, dict[str, Generation]] = {}
        for request_id, entry in self.running.items():
            if entry.link is not None and entry.link.up and entry.generation.prefilled:
                by_link.setdefault(entry.link, {})[request_id] = entry.generation
        trees = {}
        for found in await asyncio.gather(*(link.draft(requests) for link, requests in by_link.items())):
            trees.update(found)
        return trees

    async def _round(self) -> None:
        trees = await self._drafts()
        plans = {}
        for request_id, entry in self.running.items():
            try:
                plans[request_id] = entry.generation.plan(trees.get(request_id))
            except TreeserveError as error:  # a malformed tree: verify nothing this round rather than fail
                log.warning("request %s: %s; decoding without a tree this round", request_id, error)
                plans[request_id] = entry.generation.plan(None)
        if not plans:
            return
        logits = await asyncio.to_thread(forward_batch, self.target.model, list(plans.values()))
        for (request_id, plan), rows in zip(plans.items(), logits):
            entry = self.running.get(request_id)
            if entry is None:  # cancelled while the forward ran
                continue
            committed = entry.generation.apply(plan, rows)
            entry.outbox.put_nowait(verifier_pb2.VerifierServiceGenerateResponse(token_ids=committed))
            if entry.generation.finished:
                entry.outbox.put_nowait(final_message(entry.generation))
                self.cancel(request_id)


def final_message(generation: Generation) -> verifier_pb2.VerifierServiceGenerateResponse:
    result = generation.result()
    return verifier_pb2.VerifierServiceGenerateResponse(
        finish_reason=FINISH_REASONS[result.finish_reason],
        usage=generation_pb2.Usage(prompt_tokens=result.prompt_tokens, completion_tokens=len(result.token_ids)),
        stats=generation_pb2.SpeculationStats(rounds=result.rounds, round_tokens=result.round_tokens,
                                              drafted_tokens=generation.drafted_tokens,
                                              mean_accepted=result.mean_accepted),
        seed=result.seed)


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, name: str, links: list[DrafterLink], default_budget: int, default_max_new_tokens: int,
                 max_batch: int):
        self.name, self.links = name, links
        self.default_budget, self.default_max_new_tokens, self.max_batch = (
            default_budget, default_max_new_tokens, max_batch)
        self.scheduler: Scheduler | None = None  # set once the model is loaded

    def attach(self, target: LoadedModel) -> Scheduler:
        self.target = target
        self.scheduler = Scheduler(target, self.links, self.max_batch)
        return self.scheduler

    async def Generate(self, request, context):
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is still loading its model")
        try:
            params = params_from_proto(request.sampling, request.stop, self.default_max_new_tokens)
            requested = request.speculation.budget or self.default_budget
            if requested > MAX_BUDGET:
                raise TreeserveError(f"budget must be between 1 and {MAX_BUDGET}, got {requested}")
            budget = 0 if request.speculation.disabled or not self.links else requested
            target = self.target
            generation = Generation(target.model, target.tokenizer, list(request.prompt_token_ids), params,
                                    None, budget)
        except TreeserveError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        request_id = f"{request.request_id or 'request'}-{uuid.uuid4().hex[:8]}"
        outbox = self.scheduler.submit(request_id, generation)
        try:
            while True:
                message = await outbox.get()
                if isinstance(message, Exception):
                    await context.abort(grpc.StatusCode.INTERNAL, f"verification failed: {message}")
                yield message
                if message.finish_reason:
                    return
        finally:  # finished, failed, or the client went away: free everything the request held
            self.scheduler.cancel(request_id)

    async def GetInfo(self, request, context):
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is still loading its model")
        cfg = self.target.model.config
        return verifier_pb2.VerifierServiceGetInfoResponse(
            model=self.name, vocab_size=cfg.vocab_size, max_context=cfg.max_context,
            eos_token_ids=sorted(self.target.tokenizer.eos_ids), max_budget=MAX_BUDGET,
            default_budget=self.default_budget, drafters=[link.address for link in self.links])
