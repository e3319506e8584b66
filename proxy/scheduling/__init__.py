"""Scheduling on a replica: which llama.cpp slot a request goes to, and when it is sent.

Routing chooses the replica; scheduling happens after that and before the relay:

* ``slots`` — the proxy's picture of a llama.cpp replica's slots and the cost model that pins a
  request (``id_slot``) to the slot where it is expected to end soonest;
* ``coalesce`` — for servers with one shared prefix cache (vLLM), holding a request until the
  in-flight request prefilling its prefix has its first token;
* ``fanout`` — copying a slot that holds a hot prefix into idle slots (llama.cpp);
* ``rates`` — each replica's measured prefill and decode speed, which every estimate uses;
* ``scheduler`` — the ``Scheduler`` the handlers call, and its ``Ticket`` per request.

Which feature applies to a replica is its dialect's ``Capabilities`` (slots and their API, a
shared prefix cache); the slot endpoints are ``proxy.backends.slot_api``.
"""

from proxy.fingerprint import common_blocks
from proxy.scheduling.config import SLOT_MODES, SchedulingConfig
from proxy.scheduling.rates import Rates
from proxy.scheduling.scheduler import REASONS, Scheduler, Ticket, requested_output
from proxy.scheduling.slots import SlotChoice, SlotRequest, SlotTable, SlotTask

__all__ = [
    "REASONS",
    "SLOT_MODES",
    "Rates",
    "Scheduler",
    "SchedulingConfig",
    "SlotChoice",
    "SlotRequest",
    "SlotTable",
    "SlotTask",
    "Ticket",
    "common_blocks",
    "requested_output",
]
