"""Fair share between tenants by virtual time (start-time fair queuing), as plain data.

Each tenant's served device work divided by its weight is its *virtual time*. Work that enters
(a task claimed from the ledger, a synchronous task admitted to the device queue) is tagged
with the virtual time at which it starts::

    start  = finish[tenant]                     # at least ``now`` when it comes back from idle
    finish[tenant] = start + cost / weight      # cost: the work's estimated device work

and the device serves the lowest start tag first; ``now`` is the start tag of the work the
device last began. So the next piece of work goes to the backlogged tenant that has been served
least for its weight; a tenant that was idle (no work waiting in the ledger, queued or running)
re-enters at ``now`` (no credit hoarded while it was away, and no debt either: it is served
within its share at once), while a tenant that has kept work waiting keeps its place even when
its work enters the device queue late (claims are lazy: only a few tasks a tenant has are in
the device queue at a time); ties go to whoever has waited longest, never to a tenant's name.
Within a tenant, work keeps its order (its tags increase).

Both the feeder's claims (which tenants' waiting tasks enter the device queue next: ``order``)
and the device queue (which queued job a worker takes next: the lowest tag) use this one rule,
with either ledger. With several replicas each keeps its own virtual times: each divides its
own starts fairly among the tenants whose work waits in the shared ledger, so the starts of
all the replicas together are divided fairly too. Nothing here knows threads, SQL or HTTP: the
caller holds its lock around these calls.

Classic references: Goyal, Vin and Cheng, "Start-time Fair Queueing" (1996); Linux CFS's
vruntime is the same idea for threads.
"""

from __future__ import annotations

import dataclasses

MIN_WEIGHT = 1e-9
DEFAULT_COST = 1.0


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A tenant's work that waits (in the ledger): its weight, since when its oldest item has
    waited (any clock, the same for every tenant of one call) and how many items."""

    weight: float
    since: float
    count: int


class FairShare:
    def __init__(self) -> None:
        self.now = 0.0  # the start tag of the work the device last began
        self._finish: dict[str, float] = {}  # tenant -> the finish tag of its last work entered
        self._cost: dict[str, float] = {}  # tenant -> the cost of its last work (its next one's estimate)
        self._mean_cost = DEFAULT_COST  # of the work entered lately, any tenant's (a new tenant's estimate)
        self._costed = False
        self._held: dict[str, int] = {}  # tenant -> its work entered and not yet done (queued or running)
        self._waiting: set[str] = set()  # the tenants whose work waits in the ledger, as last told

    def active(self, tenant: str) -> bool:
        """Whether the tenant has work anywhere: entered and not done, or waiting in the ledger."""
        return self._held.get(tenant, 0) > 0 or tenant in self._waiting

    def next_start(self, tenant: str) -> float:
        """The start tag the tenant's next work would get now: where its last work ended while it
        has work (a backlogged tenant keeps its place, ahead of ``now`` or behind it), at least
        ``now`` once it comes back from idle."""
        finish = self._finish.get(tenant, 0.0)
        return finish if self.active(tenant) else max(self.now, finish)

    def waiting(self, tenants: set[str] | list[str]) -> None:
        """The tenants whose work waits in the ledger now: one that comes back from idle re-enters
        at ``now``."""
        tenants = set(tenants)
        for tenant in tenants:
            if not self.active(tenant):
                self._finish[tenant] = max(self.now, self._finish.get(tenant, 0.0))
        self._waiting = tenants

    def cost_of(self, tenant: str) -> float:
        """The cost assumed for the tenant's next work when it is not known (its last work's)."""
        return self._cost.get(tenant, self._mean_cost)

    def enter(self, tenant: str, weight: float, cost: float) -> float:
        """Work of ``tenant`` enters: its start tag (the tenant is charged ``cost / weight``)."""
        cost = max(float(cost), 0.0)
        start = self.next_start(tenant)
        self._finish[tenant] = start + cost / max(weight, MIN_WEIGHT)
        self._held[tenant] = self._held.get(tenant, 0) + 1
        if cost > 0:
            self._cost[tenant] = cost
            self._mean_cost = 0.9 * self._mean_cost + 0.1 * cost if self._costed else cost
            self._costed = True
        if len(self._finish) > 4096:
            self._forget_idle()
        return start

    def done(self, tenant: str) -> None:
        """Work of ``tenant`` that entered has ended (it ran, or left without running)."""
        left = self._held.get(tenant, 0) - 1
        if left > 0:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)

    def leave(self, tenant: str, start: float, weight: float, cost: float) -> None:
        """Work that entered will not be served here (taken back to the ledger, cancelled or timed
        out while it waited): the charge is given back when it was the tenant's latest."""
        end = start + max(cost, 0.0) / max(weight, MIN_WEIGHT)
        if abs(self._finish.get(tenant, -1.0) - end) <= 1e-9 * max(1.0, abs(end)):
            self._finish[tenant] = start
        self.done(tenant)

    def began(self, start: float) -> None:
        """The device began work tagged ``start``: virtual time moves on to it."""
        self.now = max(self.now, start)

    def order(self, n: int, waiting: dict[str, Waiting]) -> list[str]:
        """The tenants of the next ``n`` pieces of waiting work, in the order this rule serves
        them (a tenant's count bounds its picks); nothing is charged."""
        finish = {t: self.next_start(t) for t in waiting}
        left = {t: w.count for t, w in waiting.items() if w.count > 0}
        picks: list[str] = []
        while len(picks) < n and left:
            tenant = min(left, key=lambda t: (finish[t], waiting[t].since))
            picks.append(tenant)
            finish[tenant] += self.cost_of(tenant) / max(waiting[tenant].weight, MIN_WEIGHT)
            left[tenant] -= 1
            if not left[tenant]:
                del left[tenant]
        return picks

    def _forget_idle(self) -> None:
        """Idle tenants at or behind ``now`` would re-enter at ``now`` anyway: nothing to remember."""
        for tenant in [t for t, f in self._finish.items() if f <= self.now and not self.active(t)]:
            del self._finish[tenant]
            self._cost.pop(tenant, None)
