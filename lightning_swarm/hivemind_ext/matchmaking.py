"""Leader search that polls the DHT at a bounded rate.

While one of hivemind's averagers looks for a group, its ``PotentialLeaders`` re-reads the averagers declared in
the DHT whenever its queue holds no better leader than itself, and it does so back to back, without a pause: a peer
that ends up leading the group (or is alone) polls for the whole matchmaking window. Each poll is a ``DHT.get``
sent from the averager's process to the DHT's process (a multiprocessing handshake, then a DHT lookup). In a 2-peer
swarm on 2 CPU cores that cost each peer about a third of a core, taken from training.

``ThrottledPotentialLeaders`` waits at least ``poll_interval`` seconds between two polls; a leader is still found
within one interval of its declaration, and joining requests (which leaders receive over RPC) are unaffected.
``ThrottledLeaderSearch`` installs it in any hivemind averager class it is mixed into.

It also never asks a peer this peer keeps out of its groups (``RobustAveraging``'s ``excluded_peers``) to lead it:
such a leader's group would be left at the all-reduce, a round lost for the honest members that joined it too.
"""

from __future__ import annotations

import asyncio
import time
from math import isfinite
from typing import Callable, Container, Optional

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS


def default_poll_interval(min_matchmaking_time: float) -> float:
    """A tenth of the matchmaking window, at most 0.5 s: many polls per window, few per second."""
    return min(0.5, min_matchmaking_time / 10)


class ThrottledPotentialLeaders(PotentialLeaders):
    """hivemind's PotentialLeaders, polling the DHT for declared averagers at most once per ``poll_interval``.

    Args:
        poll_interval: minimum seconds between two reads of the declared averagers.
        kept_out: returns the peers this peer keeps out of its groups: never asked to lead it (a group it joins
            with one of them, it leaves; None: every declared leader is asked).
        *args: as ``hivemind.averaging.matchmaking.PotentialLeaders`` (peer_id, min_matchmaking_time,
            target_group_size).
    """

    def __init__(self, *args, poll_interval: float, kept_out: Optional[Callable[[], Container[PeerID]]] = None):
        if poll_interval < 0:
            raise ValueError(f"poll_interval must be >= 0 seconds, got {poll_interval!r}")
        super().__init__(*args)
        self.poll_interval = poll_interval
        self.kept_out = kept_out
        self.num_polls = 0  # reads of the declared averagers so far (for tests and diagnostics)

    async def _update_queue_periodically(self, key_manager: GroupKeyManager) -> None:
        # hivemind 1.1.12's loop, with a pause before each poll that comes earlier than poll_interval
        last_poll = -float("inf")
        while get_dht_time() < self.search_end_time:
            pause = last_poll + self.poll_interval - time.monotonic()
            if pause > 0:
                await asyncio.sleep(min(pause, max(0.0, self.search_end_time - get_dht_time())))
                continue  # re-check the search deadline
            last_poll = time.monotonic()
            self.num_polls += 1
            new_peers = await key_manager.get_averagers(key_manager.current_key, only_active=True)
            self.max_assured_time = max(
                self.max_assured_time, get_dht_time() + self.min_matchmaking_time - MAX_DHT_TIME_DISCREPANCY_SECONDS
            )
            self.leader_queue.clear()
            kept_out = self.kept_out() if self.kept_out is not None else ()
            for peer, peer_expiration_time in new_peers:
                if peer == self.peer_id or (peer, peer_expiration_time) in self.past_attempts or peer in kept_out:
                    continue
                self.leader_queue.store(peer, peer_expiration_time, peer_expiration_time)
                self.max_assured_time = max(self.max_assured_time, peer_expiration_time - MAX_DHT_TIME_DISCREPANCY_SECONDS)
            self.update_finished.set()

            await asyncio.wait(
                {asyncio.create_task(self.running.wait()), asyncio.create_task(self.update_triggered.wait())},
                return_when=asyncio.ALL_COMPLETED,
                timeout=self.search_end_time - get_dht_time() if isfinite(self.search_end_time) else None,
            )
            self.update_triggered.clear()


class ThrottledLeaderSearch:
    """Mixin for hivemind averager classes: their matchmaking polls for leaders at most once per
    ``leader_poll_interval`` seconds.

    Args:
        leader_poll_interval: minimum seconds between two DHT reads of the declared averagers while looking for a
            group. Default: :func:`default_poll_interval` of the averager's ``min_matchmaking_time``.
        *args, **kwargs: as the averager class this is mixed into.
    """

    def __init__(self, *args, leader_poll_interval: Optional[float] = None, **kwargs):
        if leader_poll_interval is not None and leader_poll_interval < 0:
            raise ValueError(f"leader_poll_interval must be >= 0 seconds, got {leader_poll_interval!r}")
        self.leader_poll_interval = leader_poll_interval
        super().__init__(*args, **kwargs)  # may start the averager's process: the interval must be set before

    # hivemind creates the Matchmaking inside the averager's process; replace its leader search as it is assigned
    @property
    def _matchmaking(self) -> Matchmaking:
        return self.__dict__["_matchmaking"]

    @_matchmaking.setter
    def _matchmaking(self, matchmaking: Matchmaking) -> None:
        leaders = matchmaking.potential_leaders
        interval = self.leader_poll_interval
        if interval is None:
            interval = default_poll_interval(leaders.min_matchmaking_time)
        matchmaking.potential_leaders = ThrottledPotentialLeaders(
            leaders.peer_id, leaders.min_matchmaking_time, leaders.target_group_size, poll_interval=interval,
            kept_out=lambda: getattr(self, "excluded_peers", ()),  # RobustAveraging's, where it is mixed in
        )
        self.__dict__["_matchmaking"] = matchmaking
