"""How targets and the ingress find the draft replicas: one named Ray actor per application.

    DraftWorker replica ──announce(DraftAnnouncement) every HEARTBEAT_S──> DraftRegistry
                                                                            "draft-registry/<app>"
    TargetWorker (DraftPoolWatcher) ──fresh()──> addresses for RemoteDraftSource   (namespace
    OpenAIIngress (/metrics) ─────────fresh()──> counters for the metrics page       "outrider")

Draft replicas create the registry on their first heartbeat (`get_if_exists`, so every
replica of the application gets the same one); readers only look it up, and an application
without draft replicas has none. It is detached: it outlives the replica that happened to
create it, so a draft replica's death cannot take the others' entries with it.

Staleness: an entry nobody refreshed for `STALE_S` is a dead replica (killed, or its node
gone) and is dropped; the clock is the registry's own, so clocks on other nodes do not matter.
Only public Ray APIs: a named actor, looked up by name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import ray

from outrider.cluster.messages import DraftAnnouncement

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0
STALE_S = 10.0
NAMESPACE = "outrider"


class DraftRegistry:
    """The latest announcement of each draft replica, with the time it arrived."""

    def __init__(self, stale_s: float = STALE_S, clock: Callable[[], float] = time.monotonic):
        self.stale_s, self.clock = stale_s, clock
        self.entries: dict[str, tuple[float, DraftAnnouncement]] = {}  # replica -> (arrival, announcement)

    def announce(self, announcement: DraftAnnouncement) -> None:
        self.entries[announcement.replica] = (self.clock(), announcement)

    def withdraw(self, replica: str) -> None:
        self.entries.pop(replica, None)

    def fresh(self) -> list[DraftAnnouncement]:
        """The replicas heard from within `stale_s`, by address; the others are forgotten."""
        now = self.clock()
        self.entries = {r: e for r, e in self.entries.items() if now - e[0] < self.stale_s}
        return sorted((a for _, a in self.entries.values()), key=lambda a: a.address)


def registry_name(app_name: str) -> str:
    return f"draft-registry/{app_name}"


def open_registry(app_name: str):
    """The application's registry actor, created by the first caller (draft replicas)."""
    actor = ray.remote(DraftRegistry).options(
        name=registry_name(app_name),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
    )
    return actor.remote()


def draft_announcements(app_name: str, timeout_s: float = 5.0) -> list[DraftAnnouncement]:
    """What each live draft replica of `app_name` announced last; [] before any did."""
    try:
        registry = ray.get_actor(registry_name(app_name), namespace=NAMESPACE)
    except ValueError:  # no draft replica has announced itself yet
        return []
    return ray.get(registry.fresh.remote(), timeout=timeout_s)


def draft_endpoints(app_name: str) -> list[str]:
    """Addresses of the draft replicas of `app_name` that announced themselves recently."""
    return [announcement.address for announcement in draft_announcements(app_name)]


def wait_for_draft_endpoints(app_name: str, timeout_s: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = draft_endpoints(app_name)
        if found:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"no draft replica of application {app_name!r} announced itself in {timeout_s:.0f} s")


class DraftPoolWatcher:
    """Keeps a RemoteDraftSource's addresses in step with the draft deployment's replicas.

    When Serve scales the draft deployment up or down, the set of fresh announcements
    changes and the client follows it (`RemoteDraftSource.set_endpoints`): new replicas get
    sequences, the sequences of a departed one move with their whole context.
    """

    def __init__(self, source, addresses: Sequence[str], app_name: str, period_s: float = HEARTBEAT_S):
        self.source, self.app_name, self.period_s = source, app_name, period_s
        self.addresses = sorted(addresses)  # what the source was last given
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draft-pool-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                found = draft_endpoints(self.app_name)
            except Exception as error:  # the registry can blip; the last known pool stays in use
                log.debug("draft registry unreadable: %s", error)
                continue
            if found and sorted(found) != self.addresses:
                log.info("draft pool changed: %s -> %s", self.addresses, found)
                self.source.set_endpoints(found)
                self.addresses = sorted(found)

    def stop(self) -> None:
        self._stop.set()
