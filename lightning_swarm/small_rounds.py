"""The alignment screen's rules for parts that only 1 or 2 senders entered (issue 24, finding 0).

The screen (:func:`lightning_swarm.aggregation.aligned_centered_clip`) and the senders' records
(:class:`~lightning_swarm.aggregation.SenderTrust`) judge rounds of 3 or more senders. With short epochs (the tiny
recipe's 32 samples are 2 local steps) most gradient rounds have 1 or 2 senders with samples: CenteredClip of 2 is
their mean, and a lone part is the result, so a loud gradient ascent (-1e3 x) decided them, and with AdamW one such
round spoils hundreds of steps. The clip of 2 senders is :func:`lightning_swarm.aggregation._two_sender_clip`; what
the reducer refuses and records is here.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from lightning_swarm.aggregation import TRUSTED_RECORD, Refusal

# with the alignment screen, the only sender of a part is believed only if seen before with at least this trust
LONE_SENDER_MIN_TRUST = TRUSTED_RECORD
# with the alignment screen, of 2 senders, one whose part is more than this many times as long as the other's is
# recorded as an outlier (honest parts of one round differ by their noise: a few times at most)
LOUD_RATIO = 10.0


def lone_sender_refusal(sender: int, record: Optional[float]) -> Optional[Refusal]:
    """With the alignment screen: whether the only sender of a part is refused (its Refusal), or None if believed.
    Nothing can check a lone part, and one loud gradient (-1e3 x) left in an adaptive optimizer's statistics spoils
    hundreds of steps: it is believed only from a sender seen in earlier rounds of 2 or more senders of this run with
    a record (``record``: :meth:`SenderTrust.record`, None: never seen) of at least ``LONE_SENDER_MIN_TRUST``.
    Refused, every sender keeps its own part there: no one applies the lone part but its sender, and a lone honest
    sender (its groupmate a NaN sender it did not know, refused) makes its step on its own gradient, where zeros
    for everyone lost that step (test_byzantine_swarm.py's nan case: one of its 6 epochs, in runs that ended up to
    13% above the clean swarm's loss).
    The group's members then step apart by one local step; the state round that follows merges them."""
    if record is not None and record >= LONE_SENDER_MIN_TRUST:
        return None
    return Refusal(sender, f"the only sender of a part, not seen before in this run or with a record below "
                           f"{LONE_SENDER_MIN_TRUST:g} from past rounds")


def two_sender_records(senders: Sequence[int], agreement: float, scales: Sequence[float],
                       ) -> tuple[Dict[int, Tuple[float, float]], List[Refusal]]:
    """With the alignment screen, the records (:class:`SenderTrust`) of a part that 2 senders entered, from their
    ``agreement`` (the cosine of the angle between their parts, at least 0) and their clip scales in
    :func:`_two_sender_clip`: one more than ``LOUD_RATIO`` times as long as the other is recorded as an outlier
    (record ``LOUD_RATIO`` x its scale, evidence 1; also returned as a Refusal for the log), so that a x1e3 part (or
    -1e3 x: gradient ascent) is remembered from its first round, even in a swarm that never has 3 senders; the other
    is only marked as seen (record 1, evidence 0). Otherwise both are recorded as going along (record 1) with the
    agreement as evidence: parts that point the same way say both senders did their job, while parts at a right
    angle or opposed say nothing of who lies (a quiet liar looks like an honest peer in a round of 2). An honest
    sender outvoted once in a round of 3 (its slice mostly noise) would otherwise keep that record for the rest of a
    swarm whose rounds have 2 senders; a liar regains its record only by sending what an honest sender sends.
    Returns (records by sender, refusals)."""
    loud_senders = {sender for sender, scale in zip(senders, scales) if LOUD_RATIO * scale < 1.0}
    records, loud = {}, []
    for sender, scale in zip(senders, scales):
        if sender in loud_senders:
            records[sender] = (LOUD_RATIO * scale, 1.0)
            loud.append(Refusal(sender, f"its part is more than {LOUD_RATIO:g} times as long as the other sender's"))
        else:
            records[sender] = (1.0, 0.0 if loud_senders else float(agreement))
    return records, loud
