"""How long an averaging round needs over a link of a given rate, and the averaging timeout that lets it complete.

hivemind abandons an averaging round (matchmaking + all-reduce) after ``averaging_timeout`` seconds, whatever the
model's size: a peer behind a link too slow for its round then averages nothing, every epoch (an uncompressed round
of 25M parameters needs 80 s at 10 Mbit/s; the tiny recipe's 30 s timeout fits rounds of ~12 MB each way there).
The bytes a round puts on the link follow from the tensors and the codec, so the timeout can be derived from them.

In hivemind's all-reduce of g peers each peer sends (g-1)/g of its encoded tensors to the others and their averaged
parts back, and receives as much: 2 (g-1)/g x the encoded size each way, the whole encoded size with 2 peers, below
twice that for any group. Measured rounds took 1.1-1.5x that bound over shaped links
(docs/swarm-over-networks.md).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from hivemind.compression import CompressionBase, CompressionInfo

# a timeout of this many times the round's bound (measured rounds: 1.1-1.5x, more on a loaded CPU)
ROUND_TIME_MARGIN = 2.0


def encoded_bytes(tensors: Iterable[torch.Tensor], compression: CompressionBase) -> int:
    """Bytes of `tensors` once encoded by `compression` (its own estimate: per tensor for size-adaptive codecs).

    Args:
        tensors: what one averaging round sends (e.g. the gradients: one per trainable parameter).
        compression: the wire codec of that round.
    """
    total = 0.0
    for tensor in tensors:
        ratio = compression.estimate_compression_ratio(CompressionInfo.from_tensor(tensor))
        total += tensor.numel() * tensor.element_size() * ratio
    return int(total)


def round_bytes_each_way(encoded: int, group_size: Optional[int] = None) -> int:
    """Bytes one peer sends (and receives) in an all-reduce of `encoded` bytes per peer.

    Args:
        encoded: the encoded size of one peer's tensors (:func:`encoded_bytes`).
        group_size: peers per averaging group; None: unknown, the bound of any group (2 x encoded).
    """
    factor = 2.0 if group_size is None else 2.0 * (group_size - 1) / group_size
    return int(encoded * factor)


def averaging_timeout_for_link(bytes_each_way: int, link_mbit: float, matchmaking_time: float) -> float:
    """Seconds an averaging round of `bytes_each_way` needs at `link_mbit` Mbit/s, with matchmaking and a margin.

    Args:
        bytes_each_way: :func:`round_bytes_each_way`.
        link_mbit: the slower direction of this peer's link, in Mbit/s (a group goes at its slowest member's pace:
            give the slowest link expected in the swarm).
        matchmaking_time: the strategy's matchmaking_time (part of every round).
    """
    if not link_mbit > 0:
        raise ValueError(f"link_mbit must be a positive number of Mbit/s, got {link_mbit!r}")
    return matchmaking_time + ROUND_TIME_MARGIN * bytes_each_way * 8 / (link_mbit * 1e6)


def slowest_link_mbit(bytes_each_way: int, averaging_timeout: float, matchmaking_time: float) -> float:
    """The slowest link (Mbit/s) on which a round of `bytes_each_way` completes within `averaging_timeout`
    (the inverse of :func:`averaging_timeout_for_link`); infinite if matchmaking alone takes the timeout."""
    seconds_for_data = averaging_timeout - matchmaking_time
    if seconds_for_data <= 0:
        return math.inf
    return ROUND_TIME_MARGIN * bytes_each_way * 8 / (seconds_for_data * 1e6)


def fit_averaging_timeout(tensors: Iterable[torch.Tensor], compression: CompressionBase, averaging_timeout: float,
                          allreduce_timeout: Optional[float], matchmaking_time: float, link_mbit: Optional[float],
                          group_size: Optional[int] = None) -> tuple:
    """The averaging and all-reduce timeouts for rounds of `tensors`, and a line for the log saying why.

    With `link_mbit`, a timeout shorter than :func:`averaging_timeout_for_link` is raised to it; without, the
    timeouts are kept and the line names the slowest link they suit.

    Args:
        tensors: the tensors of one round (the parameters: gradient and state rounds send one tensor per parameter).
        compression: their wire codec.
        averaging_timeout, allreduce_timeout, matchmaking_time: the strategy's settings (allreduce_timeout None:
            the averaging timeout).
        link_mbit: the slowest link expected in the swarm, Mbit/s, or None.
        group_size: peers per averaging group, None if not limited.

    Returns:
        (averaging_timeout, allreduce_timeout, message, warn): warn is True when a timeout was raised, or when,
        without `link_mbit`, the timeouts do not suit a 50 Mbit/s home link (the message is worth a warning).
    """
    each_way = round_bytes_each_way(encoded_bytes(tensors, compression), group_size)
    size = f"an averaging round sends up to {each_way / 1e6:.1f} MB each way"
    if link_mbit is None:
        slowest = slowest_link_mbit(each_way, min(averaging_timeout, allreduce_timeout or averaging_timeout),
                                    matchmaking_time)
        message = (f"{size}: averaging_timeout={averaging_timeout:g} s suits links of {slowest:.1f} Mbit/s and faster "
                   "(set link_mbit to derive the timeouts from the slowest link of the swarm)")
        return averaging_timeout, allreduce_timeout, message, slowest > 50
    needed = averaging_timeout_for_link(each_way, link_mbit, matchmaking_time)
    if averaging_timeout >= needed and (allreduce_timeout is None or allreduce_timeout >= needed):
        return averaging_timeout, allreduce_timeout, f"{size}: the timeouts suit {link_mbit:g} Mbit/s links", False
    message = (f"{size}, at {link_mbit:g} Mbit/s ~{needed:.0f} s with matchmaking and a {ROUND_TIME_MARGIN:g}x "
               f"margin: averaging_timeout raised from {averaging_timeout:g} to {max(averaging_timeout, needed):.0f} s")
    return (max(averaging_timeout, needed), None if allreduce_timeout is None else max(allreduce_timeout, needed),
            message, True)
