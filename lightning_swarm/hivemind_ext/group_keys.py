"""Averaging groups that change every round (hivemind's Moshpit grid), for swarms larger than ``target_group_size``.

hivemind puts peers that share a group key (``<prefix>.0b<group bits>``) in groups of up to ``target_group_size``,
and after each round gives every member of a group a different suffix of log2(g) bits, shifted into its bits: the
members of one group scatter to different keys, and the next round's groups take one member from each. That is how
every peer's contribution reaches all N peers in about log_g(N) rounds, but only if the bits are not empty: with
hivemind's default ``initial_group_bits=""`` the key never changes and all peers look for groups under one key.

- :func:`moshpit_group_bits`: random initial bits for a swarm of about ``expected_peers`` peers, one key per
  ``target_group_size`` of them (``floor(log2(expected_peers / target_group_size))`` bits: a key holds at least
  ``target_group_size`` peers on average, so that groups stay full).
- :class:`MovingGroupKeys` (averager mixin): a peer that found no group under its key moves to a random other key
  (hivemind leaves it there, alone, round after round: ``GroupKeyManager.update_key_on_not_enough_peers`` is a stub),
  as happens when the swarm shrank below ``expected_peers`` or after churn. A client-mode peer moves too after a
  search that found no group: it declares itself under no key, so hivemind never calls the method above for it, and
  a client-mode peer under a key that holds no reachable peer (no leader) would fail every round there (measured: 16
  peers, half in client mode, g = 4, docs/swarm-at-scale.md).
"""

from __future__ import annotations

import math
import random
from typing import Optional

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.utils import get_logger

# runs in hivemind's averager process: log under hivemind's logger, whose handler shows INFO beside hivemind's own
log = get_logger("hivemind.averaging.moving_group_keys")


def moshpit_group_bits(expected_peers: Optional[int], target_group_size: Optional[int],
                       rng: Optional[random.Random] = None) -> str:
    """Random initial group bits: ``floor(log2(expected_peers / target_group_size))`` of them, "" (one key, hivemind's
    default) when either is None or the swarm fits in one group.

    Args:
        expected_peers: about how many peers average together.
        target_group_size: hivemind's averaging group size.
        rng: the random source (default: a fresh ``random.Random()``).
    """
    for name, value in dict(expected_peers=expected_peers, target_group_size=target_group_size).items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"averager_opts.{name} must be a positive number of peers or None, got {value!r}")
    if expected_peers is None or target_group_size is None or expected_peers <= target_group_size:
        return ""
    num_bits = int(math.floor(math.log2(expected_peers / target_group_size)))
    rng = rng or random.Random()
    return "".join(rng.choice("01") for _ in range(num_bits))


class MovingGroupKeyManager(GroupKeyManager):
    """hivemind's GroupKeyManager; after a search that found nobody under its key, it moves to a random other key."""

    async def update_key_on_not_enough_peers(self):
        num_bits = len(self.group_bits)
        if num_bits == 0:
            return  # one key for everyone: nowhere else to look
        current = int(self.group_bits, 2)
        other = random.choice([key for key in range(2**num_bits) if key != current])
        self.group_bits = bin(other)[2:].rjust(num_bits, "0")
        log.info(f"No group under {self.prefix}.0b{bin(current)[2:].rjust(num_bits, '0')}, trying {self.current_key}")


class MovingGroupKeys:
    """Mixin for hivemind averager classes: their matchmaking uses a :class:`MovingGroupKeyManager`.

    Put it before any other mixin that intercepts ``_matchmaking`` (it hands the object on to theirs).
    ``group_key_manager_class`` (class attribute): the key manager's class, MovingGroupKeyManager or a subclass
    (``epoch_rounds.EpochGroupKeyManager``, whose key reads the round being matched from ``matchmaking``).
    """

    group_key_manager_class = MovingGroupKeyManager

    @property
    def _matchmaking(self) -> Matchmaking:
        return self.__dict__["_matchmaking"]

    @_matchmaking.setter
    def _matchmaking(self, matchmaking: Matchmaking) -> None:
        # the same object (hivemind's Matchmaking keeps it), with the one method changed
        matchmaking.group_key_manager.__class__ = self.group_key_manager_class
        matchmaking.group_key_manager.matchmaking = matchmaking  # the round being matched: matchmaking.step_control
        if matchmaking.client_mode:
            _move_after_failed_search(matchmaking)
        mro = type(self).__mro__
        for klass in mro[mro.index(MovingGroupKeys) + 1:]:  # the next mixin that intercepts it, if any
            attribute = klass.__dict__.get("_matchmaking")
            if isinstance(attribute, property) and attribute.fset is not None:
                attribute.fset(self, matchmaking)
                return
        self.__dict__["_matchmaking"] = matchmaking


def _move_after_failed_search(matchmaking: Matchmaking) -> None:
    """A client-mode peer's search that ends without a group (``look_for_group`` gives None) moves it to another key,
    as a reachable peer's declaration that nobody answered does (see the module docstring)."""
    search = matchmaking.look_for_group

    async def look_for_group(step):
        group = await search(step)
        if group is None:
            await matchmaking.group_key_manager.update_key_on_not_enough_peers()
        return group

    matchmaking.look_for_group = look_for_group
