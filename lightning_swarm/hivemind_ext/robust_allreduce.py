"""hivemind's butterfly all-reduce with checked inputs and outputs, and optionally CenteredClip instead of the mean.

In hivemind 1.1.12 every peer of an averaging group reduces one slice of the tensors: ``TensorPartReducer`` adds
each sender's part scaled by the weight the sender wrote into its own message and divides by the sum of weights,
and ``TensorPartContainer`` adds whatever each reducer sends back to the local tensors. So one sender decides the
average with weight 1e9, and one NaN (a part, a weight) poisons it for the whole group. Here:

- :class:`RobustTensorPartReducer` keeps every sender's part until all have arrived, screens them
  (:func:`lightning_swarm.aggregation.screen_contributions`: finite positive weight, at most the sender's bound,
  finite part) and aggregates what passed with the weighted mean or CenteredClip. Refused senders are named in one
  log line per round. The screening and aggregation run in one aggregation thread per process, not on hivemind's
  event loop: it goes on receiving and sending the other parts meanwhile (CenteredClip of one part takes several
  times the mean's arithmetic, and a blocked loop stalls the whole round).
- :class:`CheckedTensorPartContainer` refuses a non-finite result from a reducer: that slice keeps its local value
  (as hivemind does when a reducer fails), and the reducer is named in the log.
- :class:`RobustAveraging` (a mixin for hivemind averagers) runs every round with these; subclasses give the
  per-sender weight bounds (:meth:`RobustAveraging.sender_weight_bounds`).

- With ``verify_reducers`` (on by default), each result is an exact combination of the parts, stated to the senders,
  and every member checks every other reducer's slice before applying it
  (:mod:`~lightning_swarm.hivemind_ext.result_verification`): a reducer whose lie goes beyond one clipped sender's
  reach is refused and kept out of later groups.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from collections import defaultdict
from typing import AsyncIterator, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer, TensorPartReducer
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from lightning_swarm.aggregation import (
    DEFAULT_CENTERED_CLIP_ITERS,
    Refusal,
    SenderTrust,
    aggregate_parts,
    all_finite,
    check_aggregation_options,
    screen_contributions,
)
from lightning_swarm import reducer_checks
from lightning_swarm.hivemind_ext.part_checks import CheckedPartStreams
from lightning_swarm.hivemind_ext.result_records import ResultRecords, StatedResults
from lightning_swarm.hivemind_ext.result_verification import ReportMailbox, zero_slices
from lightning_swarm.hivemind_ext.stream_ends import held_open
from lightning_swarm.small_rounds import lone_sender_refusal, two_sender_records

log = logging.getLogger(__name__)


_EXECUTOR: Tuple[int, Optional[ThreadPoolExecutor]] = (0, None)
# a sender whose trust (SenderTrust) is below this is named in the log (honest peers' trust is often a little below 1)
LOGGED_TRUST = 0.5
# how long a peer leaving a round spends telling its groupmates (each answers at once when reachable)
LEAVE_NOTICE_TIMEOUT = 2.0


def aggregation_executor() -> ThreadPoolExecutor:
    """This process's aggregation thread: one, so that parts are aggregated one at a time (each with torch's
    threads) and never on hivemind's event loop, which meanwhile receives and sends the other parts (torch releases
    the GIL). Made anew in a forked child, which does not inherit the parent's thread."""
    global _EXECUTOR
    pid, executor = _EXECUTOR
    if executor is None or pid != os.getpid():
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_swarm_aggregation")
        _EXECUTOR = (os.getpid(), executor)
    return executor


def screen_and_aggregate(parts: Sequence[Optional[torch.Tensor]], weights: Sequence[float],
                         max_weights: Optional[Sequence[float]], aggregation: str, tau: Optional[float],
                         iters: int, min_alignment: Optional[float] = None,
                         trust: Optional[Sequence[Optional[float]]] = None,
                         statement: Optional[list] = None, own: Optional[int] = None,
                         ) -> Tuple[Optional[torch.Tensor], List[Refusal], Dict[int, Tuple[float, float]]]:
    """One part's group result from each sender's part and weight (None if no sender's contribution was accepted),
    the refusals (see :func:`lightning_swarm.aggregation.screen_contributions`), and each accepted sender's record
    for :class:`~lightning_swarm.aggregation.SenderTrust`: (its alignment factor times its clip scale, see
    :func:`lightning_swarm.aggregation.aligned_centered_clip`; its evidence, its weight relative to the median accepted
    weight, at most 1); empty without ``min_alignment`` or with 1 accepted sender; with 2, a loud one is judged low,
    else both are judged by how far their parts agree (:func:`lightning_swarm.small_rounds.two_sender_records`).
    ``trust``: each sender's weight factor from its past rounds (with ``min_alignment``; None: a sender never seen,
    factor 1). With the screen, a part that only one sender entered is refused unless that sender was seen before
    (:func:`lightning_swarm.small_rounds.lone_sender_refusal`), and of 2 senders a loud one is recorded
    (:func:`lightning_swarm.small_rounds.two_sender_records`). ``statement``: if a list, the result is an exact
    combination of the parts and its :class:`~lightning_swarm.reducer_checks.Combination` (coefficients by sender
    index) is appended; ``own``: the reducer's own sender index (None: it sends nothing)."""
    accepted, accepted_weights, refusals = screen_contributions(parts, weights, max_weights)
    if not accepted:
        if statement is not None:
            statement.append(reducer_checks.keep_combination(len(parts)))
        return None, refusals, {}
    if min_alignment is not None and aggregation == "centered_clip" and len(accepted) == 1:
        refusal = lone_sender_refusal(accepted[0], None if trust is None else trust[accepted[0]])
        if refusal is not None:  # every sender keeps its own part (lone_sender_refusal says why)
            if statement is not None:
                statement.append(reducer_checks.keep_combination(len(parts)))
            return None, refusals + [refusal], {}
    made: Optional[list] = [] if statement is not None else None
    result, judged = aggregate_parts(
        [parts[i] for i in accepted], accepted_weights, aggregation, tau, iters, min_alignment,
        None if trust is None else [1.0 if trust[i] is None else trust[i] for i in accepted], statement=made,
        own=accepted.index(own) if own is not None and own in accepted else None)
    if statement is not None:
        statement.append(reducer_checks.remapped(made[0], accepted, len(parts)))
    if judged is None or len(accepted) < 2:
        return result, refusals, {}
    if len(accepted) == 2:
        records, loud = two_sender_records(accepted, judged[0][0], [scale for _, scale in judged])
        return result, refusals + loud, records
    for sender, (factor, _) in zip(accepted, judged):
        if factor < 1.0:
            refusals.append(Refusal(sender, f"weight lowered: its part goes along less than {min_alignment:g} of "
                                            "the group's estimate"))
    median = float(torch.tensor(accepted_weights).median())
    return result, refusals, {sender: (factor * scale, min(1.0, weight / median))
                              for sender, (factor, scale), weight in zip(accepted, judged, accepted_weights)}


class RobustTensorPartReducer(TensorPartReducer):
    """A TensorPartReducer that screens each sender's part and weight and aggregates with ``aggregation``.

    Args:
        part_shapes, num_senders: as hivemind's TensorPartReducer.
        sender_names: a printable name per sender (its peer id), for the log.
        aggregation: "mean" or "centered_clip".
        centered_clip_tau, centered_clip_iters: CenteredClip's radius (None: adaptive) and iteration count.
        max_weights: the largest weight accepted from each sender (None: no bound).
        min_alignment: CenteredClip's alignment screen (None: off), see
            :func:`lightning_swarm.aggregation.aligned_centered_clip`.
        trust: each sender's weight factor from its past rounds (None: 1.0 each; an entry None: a sender never
            judged), with ``min_alignment``.
        on_alignment: called once, when the round ends, with each judged sender's (record, evidence) over this
            reducer's parts (see :class:`~lightning_swarm.aggregation.SenderTrust`; senders never judged:
            left out).
        on_protocol_break: called with a sender's index and the reason as soon as one of its parts is refused for
            what no honest peer sends (:attr:`~lightning_swarm.aggregation.Refusal.breaks_protocol`), once per
            sender.
        statements: make each result an exact combination of the parts and keep its statement for the senders
            (:mod:`~lightning_swarm.hivemind_ext.result_verification`).
        own_sender: this reducer's own sender index (None: it sends nothing), with ``statements``.
    """

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, *, sender_names: Sequence[str],
                 aggregation: str = "mean", centered_clip_tau: Optional[float] = None,
                 centered_clip_iters: int = DEFAULT_CENTERED_CLIP_ITERS,
                 max_weights: Optional[Sequence[float]] = None, min_alignment: Optional[float] = None,
                 trust: Optional[Sequence[Optional[float]]] = None,
                 on_alignment: Optional[Callable[[Dict[int, Tuple[float, float]]], None]] = None,
                 on_protocol_break: Optional[Callable[[int, str], None]] = None,
                 statements: bool = False, own_sender: Optional[int] = None):
        self.sender_names, self.aggregation = list(sender_names), aggregation
        # part index -> its Combination (reducer_checks), attached to each sender's result (result_verification)
        self.statements: Optional[Dict[int, reducer_checks.Combination]] = {} if statements else None
        # part index -> what the reducer's claims on its slice are computed from (with statements)
        self.reduced: Dict[int, reducer_checks.ReducedPart] = {}
        self.own_sender = own_sender
        self.centered_clip_tau, self.centered_clip_iters, self.max_weights = centered_clip_tau, centered_clip_iters, max_weights
        self.min_alignment, self.trust, self.on_alignment = min_alignment, trust, on_alignment
        self.on_protocol_break = on_protocol_break
        self.alignment: Dict[int, List[Tuple[float, float]]] = defaultdict(list)  # sender -> (record, evidence)/part
        self._parts_sent = [0] * num_senders  # parts each sender sent with a weight (for the log)
        self.refusals: Dict[int, Dict[str, int]] = defaultdict(lambda: defaultdict(int))  # sender -> reason -> parts
        # senders with a part refused for what no honest peer sends (reported to on_protocol_break once each; the
        # members' checks stand in for their reports: result_verification)
        self.protocol_breakers: Set[int] = set()
        self.parts_without_contribution = 0  # parts no sender entered with a positive weight (each keeps its own)
        self._parts: List[Optional[torch.Tensor]] = [None] * num_senders
        self._weights: List[float] = [0.0] * num_senders
        self._aggregations: Set[asyncio.Task] = set()  # parts being aggregated (kept referenced until done)
        self._last_part_collected = False
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        # hivemind 1.1.12's reset, keeping the senders' parts instead of a running sum
        if self.current_part_index >= self.num_parts - 1:
            self.finalize()
            return
        self.current_part_index += 1
        self.current_part_accumulated_from = 0
        self.current_part_future = asyncio.Future()
        self.num_current_senders = sum(self.current_part_index < failed for failed in self.sender_failed_after)
        self.accumulator, self.denominator = None, 0.0
        self._parts = [None] * self.num_senders
        self._weights = [0.0] * self.num_senders

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        """Keep the sender's part, wait until every sender's part is in, return the group's result (or, if no
        sender's contribution was accepted, this sender's own part: a zero change)."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # wait for the previous parts to be done (as hivemind)
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self._parts[sender_index], self._weights[sender_index] = tensor_part, weight
            self._parts_sent[sender_index] += weight != 0
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        result = await current_part_future
        return tensor_part if result is None else result

    def check_current_part_finished(self):
        if self._last_part_collected:
            return  # every part is in; the last one is being aggregated
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            last = self.current_part_index >= self.num_parts - 1
            task = asyncio.create_task(self._aggregate_part(self.current_part_future, self._parts, self._weights, last,
                                                            self.current_part_index))
            self._aggregations.add(task)
            task.add_done_callback(self._aggregations.discard)
            if last:
                self._last_part_collected = True  # finalize once its result is set
            else:
                self.reset_accumulators()  # the next part is collected while this one is aggregated

    async def _aggregate_part(self, future: asyncio.Future, parts: List[Optional[torch.Tensor]], weights: List[float],
                              last: bool, part_index: int = 0) -> None:
        """Aggregate one part in the aggregation thread (the event loop keeps receiving and sending meanwhile), then
        hand the result to the senders waiting on ``future``."""
        try:
            statement: Optional[list] = [] if self.statements is not None else None
            result, refusals, factors = await asyncio.get_running_loop().run_in_executor(
                aggregation_executor(), functools.partial(
                    screen_and_aggregate, parts, weights, self.max_weights, self.aggregation, self.centered_clip_tau,
                    self.centered_clip_iters, self.min_alignment, self.trust, statement=statement,
                    own=self.own_sender))
            if statement:
                self.statements[part_index] = statement[0]
                self.reduced[part_index] = reducer_checks.ReducedPart(list(parts), result, statement[0])
            for refusal in refusals:
                self.refusals[refusal.sender][refusal.reason] += 1
                if refusal.breaks_protocol and refusal.sender not in self.protocol_breakers:
                    self.protocol_breakers.add(refusal.sender)
                    if self.on_protocol_break is not None:
                        # now, not when the round ends: a part that waited for a late sender is aggregated after
                        # this peer's round may have ended (measured: the NaN sender then stayed in its groups)
                        self.on_protocol_break(refusal.sender, refusal.reason)
            if result is None:
                self.parts_without_contribution += 1
            for sender, judged in factors.items():
                self.alignment[sender].append(judged)
            if not future.done():
                future.set_result(result)
        except BaseException as e:
            if not future.done():
                future.set_exception(e)
            if not isinstance(e, Exception):
                raise
        finally:
            if last:
                self.finalize()

    def finalize(self):
        if not self.finished.is_set():
            texts = {sender: [f"{reason} ({count} of {self.num_parts} parts)" for reason, count in reasons.items()]
                     for sender, reasons in self.refusals.items()}
            for sender, trust in enumerate(self.trust or ()):
                if trust is not None and trust < LOGGED_TRUST and self._parts_sent[sender]:
                    texts.setdefault(sender, []).append(f"its weight x{trust:.2f} from its record in past rounds")
            for sender, text in texts.items():
                log.warning(f"[lightning_swarm] averaging: from sender {self.sender_names[sender]}: {'; '.join(text)}")
            if self.parts_without_contribution:
                # e.g. the only sender with samples was left out of the rest of the round (hivemind's
                # next_chunk_timeout): a peer that tagged along with weight 0 then gets its own zeros back there
                log.warning(f"[lightning_swarm] averaging: no sender contributed with a positive weight to "
                            f"{self.parts_without_contribution} of {self.num_parts} parts (senders left out of the "
                            f"round, refused or of weight 0): each sender keeps its own values there")
            if self.on_alignment is not None and self.alignment:
                self.on_alignment({sender: _round_alignment(judged) for sender, judged in self.alignment.items()})
        super().finalize()


def _round_alignment(judged: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """One sender's (record, evidence) over a round's parts: the evidence-weighted mean record, the mean evidence."""
    evidence = sum(e for _, e in judged)
    factor = sum(f * e for f, e in judged) / evidence if evidence > 0 else 1.0
    return factor, evidence / len(judged)


def _record_alignment(sender_trust: SenderTrust, senders: Sequence[PeerID],
                      judged: Dict[int, Tuple[float, float]]) -> None:
    """Add a round's (record, evidence) by sender index to ``sender_trust``, keyed by peer id."""
    sender_trust.update({senders[i]: record for i, record in judged.items()})


class CheckedTensorPartContainer(ResultRecords, TensorPartContainer):
    """A TensorPartContainer that refuses non-finite results from reducers: the slice keeps its local value; with
    ``keep_results``, it keeps what the check of the reducers' results needs (:class:`ResultRecords`).

    Args:
        peer_names: a printable name per group member (its peer id), for the log.
        *args, **kwargs: as hivemind's TensorPartContainer (and ``keep_results``, ``own_index``).
    """

    def __init__(self, *args, peer_names: Sequence[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.peer_names = list(peer_names)
        self.refused_parts_by_peer = [0] * self.group_size

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor):
        refused = not all_finite(part)  # on the event loop: the fast check
        if refused:
            self.refused_parts_by_peer[peer_index] += 1
            local_part = self._input_parts_by_peer[peer_index][part_index][0]
            part = torch.zeros_like(local_part) if self.return_deltas else local_part
        self.keep_result(peer_index, part_index, part, refused)
        super().register_processed_part(peer_index, part_index, part)

    def register_failed_reducer(self, peer_index: int):
        self.mark_failed(peer_index)
        super().register_failed_reducer(peer_index)

    def finalize(self):
        if not self.finished.is_set():
            for name, refused in zip(self.peer_names, self.refused_parts_by_peer):
                if refused:
                    log.warning(f"[lightning_swarm] averaging: refused {refused} non-finite result part(s) from reducer "
                                f"{name}; kept the local values there")
        super().finalize()


_RUNNER_ARGUMENTS = frozenset(inspect.signature(AllReduceRunner.__init__).parameters) - {"self", "kwargs"}


class RobustAllReduceRunner(StatedResults, CheckedPartStreams, AllReduceRunner):
    """hivemind's AllReduceRunner with :class:`CheckedTensorPartContainer` and :class:`RobustTensorPartReducer`;
    every part and result it receives is checked before it is decoded (:mod:`.part_checks`).

    Args:
        aggregation, centered_clip_tau, centered_clip_iters: see :class:`RobustTensorPartReducer`.
        max_weight_by_peer: the largest weight accepted from each sender (missing: 0, i.e. refused); None: no bound.
        min_alignment: CenteredClip's alignment screen (None: off).
        sender_trust: the senders' alignment history (updated when this peer's reducer ends the round), with
            ``min_alignment``.
        verify: state each result exactly and keep the results for the check of the reducers
            (:mod:`~lightning_swarm.hivemind_ext.result_verification`).
        on_protocol_break: called with a sender's peer id and the reason as soon as this peer's reducer refuses one
            of its parts for breaking the protocol (see :class:`RobustTensorPartReducer`); None: only refused.
        **kwargs: as hivemind's AllReduceRunner (and its TensorPartContainer).
    """

    def __init__(self, *, aggregation: str = "mean", centered_clip_tau: Optional[float] = None,
                 centered_clip_iters: int = DEFAULT_CENTERED_CLIP_ITERS,
                 max_weight_by_peer: Optional[Dict[PeerID, float]] = None, min_alignment: Optional[float] = None,
                 sender_trust: Optional[SenderTrust] = None, verify: bool = False,
                 on_protocol_break: Optional[Callable[[PeerID, str], None]] = None, **kwargs):
        super().__init__(**kwargs)
        # hivemind builds its container and reducer inline: replace both (marked finished, they finalize silently)
        self.tensor_part_container.finished.set()
        self.tensor_part_reducer.finished.set()
        container_kwargs = {k: v for k, v in kwargs.items() if k not in _RUNNER_ARGUMENTS}
        self.tensor_part_container = CheckedTensorPartContainer(
            kwargs["tensors"], self.peer_fractions, return_deltas=True,
            peer_names=[str(peer) for peer in self.ordered_peer_ids], keep_results=verify,
            own_index=self.ordered_peer_ids.index(self.peer_id), **container_kwargs,
        )
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(
            self.ordered_peer_ids.index(self.peer_id))
        max_weights = None
        if max_weight_by_peer is not None:
            # this peer's own weight too: its progress record is what the other reducers check it against
            max_weights = [max_weight_by_peer.get(peer, 0.0) for peer in self.sender_peer_ids]
        trust = on_alignment = None
        if min_alignment is not None and sender_trust is not None:
            senders = list(self.sender_peer_ids)
            trust = [sender_trust.record(peer) for peer in senders]  # None: never judged
            on_alignment = functools.partial(_record_alignment, sender_trust, senders)
        self.tensor_part_reducer = RobustTensorPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids),
            sender_names=[str(peer) for peer in self.sender_peer_ids], aggregation=aggregation,
            centered_clip_tau=centered_clip_tau, centered_clip_iters=centered_clip_iters, max_weights=max_weights,
            min_alignment=min_alignment, trust=trust, on_alignment=on_alignment, statements=verify,
            on_protocol_break=None if on_protocol_break is None else (
                lambda sender, reason: on_protocol_break(self.sender_peer_ids[sender], reason)),
            own_sender=self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None,
        )


class RobustAveraging(ReportMailbox):
    """Mixin for hivemind averager classes: every all-reduce round runs a :class:`RobustAllReduceRunner`.

    Args:
        aggregation: "mean" (hivemind's weighted mean, over screened contributions) or "centered_clip".
        centered_clip_tau: CenteredClip's radius; None: adaptive (see :func:`lightning_swarm.aggregation.centered_clip`).
        centered_clip_iters: CenteredClip's maximum number of iterations.
        max_sender_weight: a fixed bound for every sender's weight (e.g. 1.0 for state averaging, where hivemind
            gives every peer weight 1); None: :meth:`sender_weight_bounds` decides.
        centered_clip_min_alignment: with CenteredClip, the alignment screen and the senders' alignment history
            (:func:`lightning_swarm.aggregation.aligned_centered_clip`,
            :class:`~lightning_swarm.aggregation.SenderTrust`, kept in the averager's process for the whole run);
            None: off. For gradients: parameters and optimizer
            state all go along their average.
        verify_reducers: check every other member's reduced slice before applying it, and keep a reducer whose
            slice fails out of later groups (:mod:`~lightning_swarm.hivemind_ext.result_verification`); every
            member of a group must have it on (a slice that can't be checked is not applied).
        *args, **kwargs: as the averager class this is mixed into (and ``verification_timeout``).
    """

    weight_zero_merges = False  # whether a round of weight 0 merges a stale state (see _check_merge_complete)

    def __init__(self, *args, aggregation: str = "mean", centered_clip_tau: Optional[float] = None,
                 centered_clip_iters: int = DEFAULT_CENTERED_CLIP_ITERS, max_sender_weight: Optional[float] = None,
                 centered_clip_min_alignment: Optional[float] = None, verify_reducers: bool = True, **kwargs):
        self.verify_reducers = bool(verify_reducers)
        check_aggregation_options(aggregation, centered_clip_tau, centered_clip_iters, centered_clip_min_alignment)
        self.aggregation, self.centered_clip_tau, self.centered_clip_iters = aggregation, centered_clip_tau, centered_clip_iters
        self.max_sender_weight = max_sender_weight
        self.min_alignment = centered_clip_min_alignment if aggregation == "centered_clip" else None
        self.sender_trust = SenderTrust()
        super().__init__(*args, **kwargs)  # may start the averager's process: the options must be set before

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        # held open after the leader's last answer (BEGIN_ALLREDUCE) until the follower closes the stream: closed
        # at once, the answer was lost in flight on loaded machines and the group formed on the leader's side only
        async for message in held_open(super().rpc_join_group(request, context)):
            yield message

    async def sender_weight_bounds(self, group_info: GroupInfo) -> Optional[Dict[PeerID, float]]:
        """The largest weight accepted from each peer of the group (None: no bound). Runs in the averager's
        process, before each round."""
        if self.max_sender_weight is None:
            return None
        return {peer: float(self.max_sender_weight) for peer in group_info.peer_ids}

    async def _step(self, *, step: StepControl, **kwargs):
        # remembered (averager process) so that a round this peer leaves is not retried: see _leave_group_now
        self.__dict__.setdefault("_rounds_under_way", weakref.WeakSet()).add(step)
        return await super()._step(step=step, **kwargs)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: Optional[bytes] = None, **kwargs):
        # hivemind 1.1.12's DecentralizedAverager._run_allreduce_inplace_, with RobustAllReduceRunner
        group_id = group_info.group_id if group_id is None else group_id
        excluded = [str(peer) for peer in group_info.peer_ids if peer in self.excluded_peers]
        if excluded:
            reason = (f"[lightning_swarm] left a group with peer(s) kept out of this peer's groups (their reduced "
                      f"slices failed the check before): {excluded}")
            await self._leave_group_now(group_info, group_id, kwargs.get("peer_fractions"), reason)
            raise MatchmakingException(reason)
        if self.verify_reducers:
            self.open_mailbox(group_id, group_info.peer_ids)
        runner = RobustAllReduceRunner(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, aggregation=self.aggregation,
            centered_clip_tau=self.centered_clip_tau, centered_clip_iters=self.centered_clip_iters,
            max_weight_by_peer=await self.sender_weight_bounds(group_info), min_alignment=self.min_alignment,
            sender_trust=self.sender_trust, verify=self.verify_reducers,
            on_protocol_break=self._keep_out_protocol_breaker if getattr(self, "honest_parts_are_finite", False)
            else None, **kwargs,
        )
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
                if self.verify_reducers:  # an aux peer reduces: it sends its claims on its slice
                    await self.verify_results(runner, group_id)
                return
            if not self.verify_reducers:
                async for tensor, update in azip(as_aiter(*tensors), runner):
                    tensor.add_(update, alpha=self._averaging_alpha)
                    self.last_updated = get_dht_time()
                    self._state_updated.set()
                self._check_merge_complete(runner, set(), kwargs.get("weight"))
                return
            updates = [update async for update in runner]  # applied once every other reducer's slice is checked
            refused = await self.verify_results(runner, group_id)
            zero_slices(updates, runner.tensor_part_container, refused)
            for tensor, update in zip(tensors, updates):
                tensor.add_(update, alpha=self._averaging_alpha)
            self.last_updated = get_dht_time()
            self._state_updated.set()
            self._check_merge_complete(runner, refused, kwargs.get("weight"))
        finally:
            runner.tensor_part_container.release_results()
            runner.tensor_part_reducer.reduced.clear()
            self.close_mailbox_later(group_id)

    def _no_retry_of_this_round(self) -> None:
        """Clear hivemind's retry flag of the round in its all-reduce (averager process): it fails instead."""
        for step in list(self.__dict__.get("_rounds_under_way", ())):
            if step.stage == AveragingStage.RUNNING_ALLREDUCE and not step.done():
                step._allow_retries = False

    def _check_merge_complete(self, runner: RobustAllReduceRunner, refused: Set[int], weight: Optional[float]) -> None:
        """Fail a round this peer entered with weight 0 (a stale state merged into its group's:
        :class:`~lightning_swarm.hivemind_ext.catch_up.StaleStateMerge`) unless it applied every reducer's slice.

        A slice whose reducer failed or was refused keeps this peer's local values, which for such a peer are the
        stale ones: ended there, the merge left part of its parameters a step or more behind the swarm's, and from its
        next state round on, at full weight, it pulled its groupmates towards them (bench_many_peers, 16 overlapped
        peers: a newcomer merged with 75% of the results stayed 1.5x its groupmates' loss). Failed (not retried:
        its groupmates have moved on), the round leaves the peer stale, and its next state round merges again.
        What it did apply stays (hivemind applies a failed round's tensors too): closer to the group's, not worse.
        Only in averagers whose weight-0 rounds are merges (``weight_zero_merges``, set by StaleStateMerge): a
        gradient round of weight 0 (a peer with no samples) is an ordinary round."""
        if not self.weight_zero_merges or weight is None or weight != 0:
            return
        container = runner.tensor_part_container
        if not container.failed_size and not refused:
            return
        self._no_retry_of_this_round()
        received = 1.0 - container.failed_size / max(1, container.total_size)
        raise AllreduceException(
            f"[lightning_swarm] a merging round (weight 0) got {received:.1%} of its results and "
            f"{len(refused)} slice(s) refused: its state stays stale until a round merges all of it")

    async def _leave_group_now(self, group_info: GroupInfo, group_id: bytes, peer_fractions: Optional[Sequence[float]],
                               reason: str) -> None:
        """Tell the group's members at once that this peer leaves the round: each reducer gets hivemind's own
        failure message in place of this peer's parts (it drops this sender now), and a member sending parts to
        this peer's reducer gets an error at once. Without it, every other member waited ``next_chunk_timeout`` for
        this peer's parts and results (10 s of a 1.3 s epoch in the NaN swarm test): a blocked state round put an
        honest peer epochs behind its swarm, which left the other honest peer alone for those epochs.

        The round is not retried either (it fails like a round whose group fell apart: local gradients, own state):
        its groupmates of this epoch are averaging by now, and a retry met their next epoch's round instead, which
        left this peer one round out of step with them (the NaN swarm test: each epoch after, one honest peer's
        state round looked for the other while the other's gradient round waited for the first)."""
        self._no_retry_of_this_round()
        registered = self._running_groups.get(group_id)
        if registered is not None and not registered.done():
            registered.set_exception(MatchmakingException(reason))
            registered.exception()  # retrieved here: a sender that asks meanwhile gets it, nobody else awaits it
        reducers = [peer for index, peer in enumerate(group_info.peer_ids)
                    if peer != self.peer_id and (peer_fractions is None or peer_fractions[index] > 0)]

        async def tell(peer: PeerID) -> None:
            try:
                stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
                message = averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED, group_id=group_id)
                async for _ in await stub.rpc_aggregate_part(as_aiter(message)):
                    break  # its answer (INTERNAL_ERROR) says it dropped this sender
            except Exception as e:  # it drops this sender at its sender_timeout instead
                log.debug(f"could not tell {peer} that this peer left the round: {e!r}")

        try:
            await asyncio.wait_for(asyncio.gather(*(tell(peer) for peer in reducers)), LEAVE_NOTICE_TIMEOUT)
        except asyncio.TimeoutError:
            pass

    def _keep_out_protocol_breaker(self, sender: PeerID, reason: str) -> None:
        """Keep ``sender`` out of later groups, at once, as this peer's reducer refuses its part for what no honest
        peer sends (:attr:`~lightning_swarm.aggregation.Refusal.breaks_protocol`); installed only in averagers whose
        honest peers send only finite parts (``honest_parts_are_finite``: the gradient averager's local guard).
        Left in, a NaN sender cost every round it joined: its claims on its own slice are not finite, so the round
        could not be verified and each member refused every slice of it, until it was kept out for withholding 3
        rounds later. Averagers without that guard (state averaging: a peer whose parameters diverged sends them as
        they are) only refuse the part."""
        if sender != self.peer_id:
            self.exclude_peer(sender, f"its part broke the protocol: {reason}")
