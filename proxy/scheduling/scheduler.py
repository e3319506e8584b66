"""The scheduler: between the routing decision and the relay, where on the replica a request goes.

``Scheduler.admit`` is called once a replica has been chosen, with the body about to be sent:

* llama.cpp replica with slot scheduling on: the request is pinned to a slot (``id_slot`` set in
  the body) as ``SlotTable.choose`` decides, and recorded there so the next decision knows what
  the slot will hold. With fan-out on, a request that would queue behind a busy slot holding its
  prefix waits for that slot's running request to end, and then gets a copy of the slot in an
  idle one (``slot_fanout``), so the requests sharing the prefix decode side by side.
* a replica with one shared prefix cache (vLLM, other OpenAI-compatible servers) with coalescing
  on: the request may be held until an in-flight request has prefilled its prefix (``coalesce``).

It fills the request's ``Ticket`` (made by the handler before the scheduler may wait, and
carried by its exchange), which the relay tells about the first token
(``Ticket.first_token``, with the event that carried it, for llama.cpp's ``id_slot``) and the
handler about the end (``Ticket.end``). The record is built from the ticket's decision
(``schedule_reason``, ``slot``, ``held_ms``); ``Scheduler.learn``, a learner of the record
writer, learns the replica's rates from the finished record.

The picture of each llama.cpp replica's slots is this process's own, corrected by reading
``/slots`` in the background: traffic from elsewhere (other proxies, clients calling the server
directly) makes a slot's content unknown, and in ``auto`` mode turns pinning off on that replica
for a while (``slot_foreign``), since the picture can no longer be trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from proxy.backends import BackendInfo, Dialect, SlotApi, SlotEndpoint
from proxy.backends.slot_cache import SOURCE_NONE, SOURCE_SLOT, ServerRules
from proxy.log import get_logger
from proxy.prefixes import answered
from proxy.records import Observation, RequestRecord, monotonic
from proxy.scheduling.coalesce import InflightPrefixes, Leader, wait_for_leader
from proxy.scheduling.config import SchedulingConfig
from proxy.scheduling.fanout import FanOut, Seed
from proxy.scheduling.rates import Rates
from proxy.scheduling.slots import (
    SLOT_BUSY,
    SLOT_CLIENT,
    SLOT_FOREIGN,
    SLOT_QUEUE,
    SLOT_REASONS,
    SLOT_UNPINNED,
    SlotChoice,
    SlotRequest,
    SlotTable,
    SlotTask,
)

if TYPE_CHECKING:
    from proxy.prefixes import PrefixView

log = get_logger()

LEAD = "lead"
COALESCED = "coalesced"
COALESCE_TIMEOUT = "coalesce_timeout"
REASONS = (*SLOT_REASONS, LEAD, COALESCED, COALESCE_TIMEOUT)
OUTPUT_LIMIT_FIELDS = ("max_completion_tokens", "max_tokens", "n_predict")


def requested_output(body: Mapping[str, Any]) -> float | None:
    """The output-token limit the request set (``max_tokens`` and its spellings), if any."""
    for name in OUTPUT_LIMIT_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


class Replica(Protocol):
    """What the scheduler reads of a replica (``proxy.fleet.Replica`` is one)."""

    @property
    def url(self) -> str: ...

    @property
    def dialect(self) -> Dialect: ...

    @property
    def info(self) -> BackendInfo | None: ...

    @property
    def may_poll_slots(self) -> bool: ...


@dataclass(slots=True)
class ReplicaState:
    """What the scheduler keeps per replica."""

    url: str
    rates: Rates = field(default_factory=Rates)
    table: SlotTable | None = None
    inflight: InflightPrefixes = field(default_factory=InflightPrefixes)
    endpoint: SlotEndpoint | None = None
    foreign_seen: float = -math.inf
    fanout: FanOut = field(default_factory=FanOut)
    tickets: dict[SlotTask, Ticket] = field(default_factory=dict)
    """The ticket of each task in this replica's slot table, until the ticket ends."""


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's scheduling: the decision, and the hooks that keep the picture current."""

    state: ReplicaState | None = None
    reason: str | None = None
    slot: int | None = None
    held_ms: float = 0.0
    task: SlotTask | None = None
    leader: Leader | None = None
    body_changed: bool = False
    predicted_cached: float | None = None
    """Cached tokens the replica's cache model expects (llama.cpp slots), None: no model."""
    cache_source: str | None = None
    """Where the model expects them from: ``slot``, ``ram`` (its RAM prompt cache), ``none``."""
    measured: bool = False
    slot_api: SlotApi | None = None
    """The replica's slot API, when the request was placed on a slot."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def first_token(self, event: Mapping[str, Any], at: float | None = None) -> None:
        """The backend's first token arrived (``event``: the event or response carrying it; ``at``:
        when it was read, when that was before this is called; else now)."""
        state = self.state
        if state is None:
            return
        if self.task is not None and state.table is not None:
            api = self.slot_api
            reported = api.reported_slot(event) if api is not None else None
            state.table.first_token(self.task, monotonic(), reported, at=at)
            if self.task.slot is not None:
                self.slot = self.task.slot
        if self.leader is not None:
            state.inflight.release(self.leader)
            self.leader = None

    def end(self, *, ok: bool, usage: Observation | None = None) -> None:
        """The request ended (``ok``: it succeeded); its slot and its blocks are released.

        ``usage``: what the backend reported, folded into the cache model first, so a request
        that starts on the freed slot is weighed against the measured state, not an estimate.
        """
        if self.ended.is_set():
            return
        self.ended.set()
        state = self.state
        if state is None:
            return
        if self.task is not None:
            state.tickets.pop(self.task, None)
        if self.task is not None and state.table is not None:
            if usage is not None and usage.prompt_tokens:
                self.measure(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
            state.table.end(self.task, monotonic(), ok=ok)
        if self.leader is not None:
            state.inflight.release(self.leader)
            self.leader = None

    def measure(
        self, prompt_tokens: int | None, completion_tokens: int | None, cached_tokens: int | None
    ) -> None:
        """The backend's usage, into the replica's cache model (once)."""
        if self.measured or self.task is None or self.state is None or self.state.table is None:
            return
        self.measured = True
        self.state.table.measured(
            self.task,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
        )


class Scheduler:
    """Per-replica slot tables, in-flight prefixes and rates, and the decisions made with them."""

    def __init__(
        self,
        config: SchedulingConfig,
        *,
        tokens_per_byte: Callable[[str | None], float],
    ) -> None:
        self.config = config
        self._tokens_per_byte = tokens_per_byte
        self._states: dict[str, ReplicaState] = {}
        self._replicas: Sequence[Replica] = ()
        self._session: aiohttp.ClientSession | None = None
        self._headers: dict[str, str] = {}
        self._poller: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(
        self,
        session: aiohttp.ClientSession,
        replicas: Sequence[Replica],
        *,
        backend_api_key: str | None = None,
    ) -> None:
        """Remember the replicas and start reading ``/slots`` of those the proxy pins."""
        self._session = session
        self._replicas = replicas
        if backend_api_key:
            self._headers = {"Authorization": f"Bearer {backend_api_key}"}
        if self.config.slot_scheduling != "off" and self.config.slots_poll_s > 0:
            self._poller = asyncio.create_task(self._poll_slots())

    async def aclose(self) -> None:
        """Stop the ``/slots`` reader; safe to call more than once."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    def state(self, url: str) -> ReplicaState:
        """The scheduler's state for one replica (created on first use)."""
        state = self._states.get(url)
        if state is None:
            state = self._states[url] = ReplicaState(url=url)
        return state

    def settle(self) -> None:
        """Apply what every replica's slot table left for later (``SlotTable.settle``)."""
        for state in self._states.values():
            if state.table is not None:
                state.table.settle()

    # -- which feature applies -----------------------------------------------------------------

    def pins(self, replica: Replica) -> bool:
        """Whether requests to ``replica`` are pinned to slots."""
        mode = self.config.slot_scheduling
        info = replica.info
        has_slots = replica.dialect.capabilities.slots is not None
        if mode == "off" or not has_slots or info is None or not info.slots:
            return False
        return info.slots >= 2 or mode == "on"

    def coalesces(self, replica: Replica) -> bool:
        """Whether requests to ``replica`` may wait for an in-flight prefill of their prefix."""
        return self.config.coalesce and replica.dialect.capabilities.shared_prefix_cache

    def awaits_lookup(self, replica: Replica) -> bool:
        """Whether ``admit`` may wait for the store's answer to a lookup not waited for (the
        coalescing path needs its match before the request goes)."""
        return not self.pins(replica) and self.coalesces(replica)

    def _table(self, state: ReplicaState, replica: Replica) -> SlotTable:
        info = replica.info
        assert info is not None and info.slots
        if state.table is None or len(state.table.slots) != info.slots:
            rules = ServerRules(
                similarity=self.config.server_slot_similarity,
                unified=self.config.server_kv_unified == "on",
            )
            state.table = SlotTable(
                info.slots,
                info.ctx_per_slot,
                rules=rules,
                detect_unified=self.config.server_kv_unified == "auto",
            )
        api = replica.dialect.capabilities.slots
        if state.endpoint is None and self._session is not None and api is not None:
            state.endpoint = api.endpoint(self._session, replica.url, headers=self._headers)
        state.table.settle()  # (the slots are read from here on)
        return state.table

    # -- the decision --------------------------------------------------------------------------

    async def admit(
        self,
        ticket: Ticket,
        replica: Replica,
        view: PrefixView | None,
        body: MutableMapping[str, Any],
        *,
        model: str | None,
        stream: bool,
        plain: bool = False,
    ) -> Ticket:
        """Decide where on ``replica`` the request goes, into ``ticket`` (a new one, which the
        caller holds before this may wait: the learner ends it should the wait be cut short);
        may wait (coalescing, fan-out). When the request is pinned, ``body["id_slot"]`` is set
        and ``Ticket.body_changed`` is True.

        ``plain`` (a control-group request): nothing is decided, the server places it as it
        would without the proxy; on a replica whose slots the proxy pins the request still
        enters the slot table (``slot_unpinned``, its slot learned from the answer), so the
        picture the other requests are pinned by stays true.
        """
        if view is None or not (self.pins(replica) or self.coalesces(replica)):
            return ticket
        if plain and not self.pins(replica):
            return ticket
        state = self.state(replica.url)
        ticket.state = state
        tpb = self._tokens_per_byte(model)
        fp = view.fp
        prompt_tokens = max(fp.total_bytes * tpb, 1.0)
        tokens_per_block = fp.block_bytes * tpb
        if self.pins(replica):
            output = requested_output(body) or state.rates.typical_completion
            req = SlotRequest(
                hashes=fp.block_hashes,
                prompt_tokens=prompt_tokens,
                decode_tokens=output,
                tokens_per_block=tokens_per_block,
                fp=fp,
                data=view.rendered,
            )
            ticket.slot_api = replica.dialect.capabilities.slots
            await self._pin(ticket, state, self._table(state, replica), req, body, plain=plain)
        else:
            if view.pending is not None:  # a lookup not waited for: coalescing needs its match
                view = await answered(view)
            cached = state.inflight.cached(fp.block_hashes, view.matched_for(replica.url))
            await self._coalesce(
                ticket, state, fp.block_hashes[cached:], tokens_per_block, stream=stream
            )
        return ticket

    async def _pin(
        self,
        ticket: Ticket,
        state: ReplicaState,
        table: SlotTable,
        req: SlotRequest,
        body: MutableMapping[str, Any],
        *,
        plain: bool = False,
    ) -> None:
        now = monotonic()
        api = ticket.slot_api
        assert api is not None  # only a replica with slots is pinned
        client = api.client_slot(body)
        choice: SlotChoice
        copied: SlotChoice | None = None
        source: Seed | None = None  # the copy that would serve it better, if any
        if plain and client is None:
            choice = SlotChoice(None, SLOT_UNPINNED, 0.0, req.prompt_tokens, 0.0)
        elif client is not None:
            slot = client % len(table.slots)
            matched = table.matched_tokens(req, table.slots[slot].holds_after_queue())
            choice = SlotChoice(slot, SLOT_CLIENT, matched, req.prompt_tokens - matched, 0.0)
        elif (
            self.config.slot_scheduling == "auto"
            and now - state.foreign_seen < self.config.foreign_backoff_s
        ):
            choice = SlotChoice(None, SLOT_FOREIGN, 0.0, req.prompt_tokens, 0.0)
        else:
            useful = float(self.config.min_prefix_tokens)
            # The choice and the copy's source ask the same matches of the same states: one
            # scope computes each once (``TokenCounter.scope``).
            with table.counter.scope(req.query()):
                choice = table.choose(req, state.rates, now, useful_tokens=useful)
                # (None for a queued choice, the only one ``_fan_out`` awaits for: a source
                # is used before anything has changed the slots)
                source = self._seed_source(state, table, req, choice, now)
        task = SlotTask(
            hashes=req.hashes,
            prompt_tokens=req.prompt_tokens,
            uncached_tokens=choice.uncached_tokens,
            decode_tokens=req.decode_tokens,
            t_sent=now,
            query=req.query(),
        )
        ticket.task = task  # from here on, the ticket's end takes it out of the table
        state.tickets[task] = ticket
        if self.config.fanout and choice.reason == SLOT_QUEUE and choice.slot is not None:
            t0 = monotonic()
            copied = await self._fan_out(state, table, req, choice, task)
            ticket.held_ms = (monotonic() - t0) * 1000.0
            task.t_sent = monotonic()
            if copied is not None:  # the task is placed already
                choice = copied
        if copied is None and source is not None:
            seeded = await self._seed(ticket, state, table, req, choice, task, source)
            if seeded is not None:
                choice, copied = seeded, seeded
        if copied is None:
            # Before any await: the next request's choice sees it. The cache model's launch
            # waits for the table's next use, or a moment after the next first token
            # (``handlers._after_first_token``), off the way to the backend.
            table.place(task, choice.slot, task.t_sent, choice.pick, later=True)
        ticket.reason = choice.reason
        ticket.slot = choice.slot
        if choice.reason not in (SLOT_BUSY, SLOT_FOREIGN, SLOT_UNPINNED):
            ticket.predicted_cached = choice.matched_tokens
            if task.pick is not None:
                ticket.cache_source = task.pick.source
            else:
                ticket.cache_source = SOURCE_SLOT if choice.matched_tokens > 0 else SOURCE_NONE
        if choice.slot is not None and choice.pinned and client is None:
            api.pin(body, choice.slot)
            ticket.body_changed = True

    async def _coalesce(
        self,
        ticket: Ticket,
        state: ReplicaState,
        hashes: tuple[int, ...],
        tokens_per_block: float,
        *,
        stream: bool,
    ) -> None:
        """Wait for a leader prefilling ``hashes`` (the blocks the index does not say are cached),
        then lead the blocks nobody is computing."""
        ticket.reason = LEAD
        leader, shared = state.inflight.shared(hashes)
        if leader is not None and shared * tokens_per_block >= self.config.min_prefix_tokens:
            t0 = monotonic()
            cached = await wait_for_leader(leader, self.config.coalesce_max_wait_ms / 1000.0)
            ticket.held_ms = (monotonic() - t0) * 1000.0
            ticket.reason = COALESCED if cached else COALESCE_TIMEOUT
        expected_s = len(hashes) * tokens_per_block * state.rates.prefill_s
        ticket.leader = state.inflight.lead(hashes, streamed=stream, expected_prefill_s=expected_s)

    # -- fan-out -------------------------------------------------------------------------------

    async def _fan_out(
        self,
        state: ReplicaState,
        table: SlotTable,
        req: SlotRequest,
        choice: SlotChoice,
        task: SlotTask,
    ) -> SlotChoice | None:
        endpoint = state.endpoint
        assert choice.slot is not None
        holder = table.slots[choice.slot]
        if endpoint is None or not endpoint.save_supported or len(holder.tasks) != 1:
            return None
        running = state.tickets.get(holder.tasks[0])
        if running is None:
            return None
        return await state.fanout.take_or_copy(
            endpoint,
            table,
            req,
            holder,
            task,
            running=running.ended,
            min_tokens=self.config.min_prefix_tokens,
        )

    def _seed_source(
        self,
        state: ReplicaState,
        table: SlotTable,
        req: SlotRequest,
        choice: SlotChoice,
        now: float,
    ) -> Seed | None:
        """The copy that would serve ``req`` better than ``choice`` (``FanOut.seed_source``),
        where copies are made; None otherwise."""
        endpoint = state.endpoint
        if not self.config.slot_copy or endpoint is None or not endpoint.save_supported:
            return None
        min_tokens = float(self.config.min_prefix_tokens)
        return state.fanout.seed_source(table, choice, req, now, state.rates, min_tokens=min_tokens)

    async def _seed(
        self,
        ticket: Ticket,
        state: ReplicaState,
        table: SlotTable,
        req: SlotRequest,
        choice: SlotChoice,
        task: SlotTask,
        source: Seed,
    ) -> SlotChoice | None:
        """Seed an idle slot with a copy of ``source`` (``FanOut.seed``); None when no copy is
        made and ``task`` is still to be placed."""
        endpoint = state.endpoint
        assert endpoint is not None  # (a source is found only where copies are made)
        seeded = await state.fanout.seed(
            endpoint,
            table,
            req,
            choice,
            task,
            state.rates,
            min_tokens=float(self.config.min_prefix_tokens),
            found=source,
        )
        if seeded is None:
            return None
        made, ticket.held_ms = seeded
        return made

    # -- after the response --------------------------------------------------------------------

    def learn(self, record: RequestRecord, ticket: Ticket | None) -> None:
        """Learn from a finished request: its slot's measured content, the replica's rates.

        The record was built from ``ticket`` (the request's latest; None when it was never
        scheduled), which ends here if the request ended before the scheduler was done with it.
        """
        if ticket is not None:
            ticket.end(ok=record.status < 400 and record.error is None)
            # (once: usually the ticket's end measured it already, from the same figures)
            ticket.measure(record.prompt_tokens, record.completion_tokens, record.cached_tokens)
        if record.backend is not None and record.backend in self._states:
            self._states[record.backend].rates.observe(record)

    # -- /slots --------------------------------------------------------------------------------

    async def _poll_slots(self) -> None:
        while True:
            await asyncio.sleep(self.config.slots_poll_s)
            for replica in self._replicas:
                state = self._states.get(replica.url)
                if state is None or state.table is None or state.endpoint is None:
                    continue
                if not state.endpoint.slots_supported or not self.pins(replica):
                    continue
                if not replica.may_poll_slots:
                    continue  # asleep or quiet: a /slots read would wake it or keep it awake
                try:
                    await self.refresh(state)
                except Exception:  # the reader must outlive any one odd answer
                    log.exception("slots_read_failed", backend=replica.url)

    async def refresh(self, state: ReplicaState) -> None:
        """Read one replica's ``/slots`` and fold it into its table."""
        if state.endpoint is None or state.table is None:
            return
        observed = await state.endpoint.read()
        if observed is None:
            return
        now = monotonic()
        hold_s = 2.0 * max(self.config.slots_poll_s, 0.5)
        if state.table.reconcile(observed, now, hold_s=hold_s):
            if now - state.foreign_seen >= self.config.foreign_backoff_s:
                log.info("slots_foreign_traffic", backend=state.url)
            state.foreign_seen = now
