"""A peer of a screened all-reduce round for tests, honest or a lying reducer (issue 24, item 9).

The liar runs the honest reducer code and states its honest header, but adds ``--lie`` to every result it sends
(``large``: 100 on every value; ``subtle``: 16 values of the slice, random Gaussian magnitudes, the whole of norm 50
times one clipped sender's reach: the rest of the slice is the honest result). As a sender it sends its honest part.
A framer (``--lie frame``) reduces honestly and sends false reports on the others' slices. A withholder (``--lie
withhold``) averages honestly and sends no verification message (it applies what it got unchecked). Each peer averages one
tensor of ``NUMEL`` values, ``base + 0.3 * noise(seed)``, uncompressed, with CenteredClip, in one group of 3.

Usage (the first peer prints ``PEER <multiaddr>``; each prints ``PEER_ID <id>``, ``ROUND <n>`` or ``ROUND_FAILED <n>
<error>`` per round, then ``DONE``):

    python tests/lightning_swarm/lying_reducer.py --seed 0 --out a.safetensors
    python tests/lightning_swarm/lying_reducer.py --seed 1 --out b.safetensors --initial-peer /ip4/... --lie large

A peer stays online after ``DONE`` until its stdin is closed.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import logging
import os
import sys

import torch
from safetensors.torch import save_file

NUMEL = 30_000


def make_tensor(seed: int) -> torch.Tensor:
    base = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1234))
    return base + 0.3 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def install_lie(kind: str) -> None:
    """Make this process's reducer add a lie to every result it hands back (its header stays the honest one)."""
    from lightning_swarm.hivemind_ext import robust_allreduce

    honest = robust_allreduce.screen_and_aggregate

    def lying(parts, *args, **kwargs):
        result, refusals, judged = honest(parts, *args, **kwargs)
        if result is None:
            return result, refusals, judged
        if kind == "large":
            return result + 100.0, refusals, judged
        # 50 times one clipped sender's reach (its share, at most 1/2, times the farthest part), on 16 values
        reach = 0.5 * max(float((p.float() - result).norm()) for p in parts if p is not None)
        generator = torch.Generator().manual_seed(7)
        direction = torch.zeros(result.numel())
        direction[torch.randperm(result.numel(), generator=generator)[:16]] = torch.randn(16, generator=generator)
        lie = (direction * (50 * reach / float(direction.norm()))).reshape(result.shape)
        return result + lie, refusals, judged

    robust_allreduce.screen_and_aggregate = lying


def install_frame() -> None:
    """Make this process's reports on the other reducers' slices false (framing them): its projections moved by a
    thousand times their norm and error bound (its results and its own slice stay honest)."""
    from lightning_swarm import reducer_checks

    honest = reducer_checks.member_report

    def framing(*args, **kwargs):
        report = honest(*args, **kwargs)
        report.projections = report.projections + 1000.0 * (report.error + float(abs(report.projections).sum()))
        return report

    reducer_checks.member_report = framing


def install_withhold() -> None:
    """Make this process take no part in the exchange of verification messages after each round (no commitment,
    nonce or report; it applies the results unchecked): the other members can check no slice of that round."""
    from lightning_swarm.hivemind_ext.result_verification import ReportMailbox

    async def withholding(self, runner, group_id, **kwargs):
        return set()

    ReportMailbox.verify_results = withholding


def install_tamper(drop: bool = False) -> None:
    """Make this process, as a relay of client-mode members' verification messages, alter every record it serves
    (one byte of the signed message flipped), or with ``drop`` serve none; it reduces and reports honestly."""
    from lightning_swarm.hivemind_ext import relayed_messages
    from lightning_swarm.hivemind_ext.result_verification import ReportMailbox

    honest = ReportMailbox.rpc_reducer_relay

    @functools.wraps(honest)  # hivemind reads the handler's type annotations
    async def tampering(self, request, context):
        answer = await honest(self, request, context)
        if answer.peer_id and drop:
            answer.peer_id = relayed_messages.pack_records([])
        elif answer.peer_id:
            records = relayed_messages.unpack_records(bytes(answer.peer_id), 64, 1 << 24)
            altered = []
            for record in records:
                record = bytearray(record)
                record[10] ^= 0xFF  # inside the signed message
                altered.append(bytes(record))
            answer.peer_id = relayed_messages.pack_records(altered)
        return answer

    ReportMailbox.rpc_reducer_relay = tampering


def install_slow(seconds: float) -> None:
    """Make this process a slow member: its verification reports are ready ``seconds`` later than the others' (as
    on a peer whose cores are busy), so its messages of that phase reach the others late."""
    import time

    from lightning_swarm.hivemind_ext import result_verification

    honest = result_verification._member_reports

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return honest(*args, **kwargs)

    result_verification._member_reports = slow


def install_vanish() -> None:
    """Make this peer die, its whole process group at once (a machine that goes away), once the commitment and nonce
    phases of its first round's verification are over: its groupmates then wait for its report, and client-mode
    members for it as a relay."""
    import signal

    from lightning_swarm.hivemind_ext import result_verification

    def vanish(*args, **kwargs):
        os.killpg(os.getpgrp(), signal.SIGKILL)

    result_verification._member_reports = vanish


def install_late_commit(seconds: float) -> None:
    """Make this process a member whose verification starts ``seconds`` late (its event loop held, as on a peer whose
    cores are busy): its commitment reaches the others that much after theirs."""
    import time

    from lightning_swarm.hivemind_ext import result_verification

    honest = result_verification._failed_members

    def late(*args, **kwargs):
        time.sleep(seconds)
        return honest(*args, **kwargs)

    result_verification._failed_members = late


def install_leave() -> None:
    """Make this peer leave every group it joins at the start of the all-reduce, alive, as a peer does that keeps a
    groupmate out of its groups: its groupmates get no part from it and no reduction of its slice."""
    from hivemind.averaging.matchmaking import MatchmakingException

    from lightning_swarm.hivemind_ext.robust_allreduce import RobustAveraging

    async def leave(self, tensors, group_info, group_id=None, **kwargs):
        raise MatchmakingException("left the group (lying_reducer.py --lie leave)")

    RobustAveraging._run_allreduce_inplace_ = leave


def install_verification_timer() -> None:
    """Print how long each of this peer's verification exchanges took ("VERIFIED <seconds>"), from its averager's
    process."""
    import time

    from lightning_swarm.hivemind_ext.result_verification import ReportMailbox

    honest = ReportMailbox.verify_results

    async def timed(self, runner, group_id, **kwargs):
        start = time.monotonic()
        try:
            return await honest(self, runner, group_id, **kwargs)
        finally:
            print(f"VERIFIED {time.monotonic() - start:.2f}", flush=True)

    ReportMailbox.verify_results = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, required=True, help="seed of this peer's tensor")
    parser.add_argument("--out", required=True, help="safetensors file for the averaged tensor")
    parser.add_argument("--initial-peer", default=None, help="multiaddr of a peer to join (none: start a DHT)")
    parser.add_argument("--lie", choices=("none", "large", "subtle", "frame", "withhold", "tamper", "drop", "slow",
                                          "nan", "vanish", "leave", "latecommit"),
                        default="none",
                        help="this peer's reducer lies (large, subtle), its reports on the others' slices (frame), "
                             "it sends no verification message (withhold), or it alters the messages it relays "
                             "between client-mode members (tamper) or drops them (drop); an honest member whose "
                             "reports are ready late (slow: 1.5 verification timeouts late); a member whose part "
                             "is all NaN (nan: what the gradient averager's local guard never lets an honest peer "
                             "send); a member that dies with its whole process group after the nonce phase (vanish); a "
                             "member that leaves each group at the start of its all-reduce, alive (leave); an honest "
                             "member whose commitment comes 0.9 verification timeouts late (latecommit)")
    parser.add_argument("--group-size", type=int, default=3, help="peers in the group")
    parser.add_argument("--next-chunk-timeout", type=float, default=None,
                        help="seconds a reducer waits for a sender's next part (none: hivemind's default, no limit)")
    parser.add_argument("--rounds", type=int, default=1, help="averaging rounds, one after the other")
    parser.add_argument("--weight", type=float, default=1.0,
                        help="this peer's weight in its rounds (0: it takes the group's average, as a newcomer "
                             "merging a stale state does)")
    parser.add_argument("--no-verify", action="store_true", help="apply the reducers' results unchecked")
    parser.add_argument("--auxiliary", action="store_true",
                        help="an auxiliary peer: it reduces a slice but sends no part of its own")
    parser.add_argument("--client-mode", action="store_true",
                        help="accept no connection (as a peer behind NAT): it sends and checks, but reduces nothing")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to find a group")
    parser.add_argument("--verification-timeout", type=float, default=10.0,
                        help="seconds a member waits for the others' verification messages of one phase")
    parser.add_argument("--hang-timeout", type=float, default=300.0,
                        help="seconds after which a peer that has not printed DONE prints its threads' stacks and "
                             "exits (the test then fails with them instead of waiting on it)")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.hang_timeout, exit=True, file=sys.stdout)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)  # the test reads the peers' log lines
    # why a groupmate's results did not come (hivemind logs it at DEBUG only): a pre-check saw a reducer's results
    # missing 0.1 s into a round ("received 68.3% results"), so the round went unchecked
    logging.getLogger("hivemind.averaging.allreduce").setLevel(logging.DEBUG)
    # who joined whose group, and which requests timed out (CI once saw the reachable peer's round never end)
    logging.getLogger("hivemind.averaging.matchmaking").setLevel(logging.DEBUG)

    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import NoCompression

    from lightning_swarm.hivemind_ext.lifetime import DiesWithParent, SwarmDHT
    from lightning_swarm.hivemind_ext.relayed_messages import write_identity
    from lightning_swarm.hivemind_ext.robust_allreduce import RobustAveraging
    from lightning_swarm.hivemind_ext.round_groups import PatientGroupRegistration

    # as the strategy's averagers: a groupmate's part that arrives before this peer registered the group waits for
    # it (without, one pre-check lost the framer's whole slice in a round that ended 0.5 s after the last peer
    # joined: "Averaging: received 72.7% results", and the round went unchecked)
    # (DiesWithParent: a peer that exits uncleanly takes its averager process with it, which holds the test's pipe)
    class Averager(DiesWithParent, PatientGroupRegistration, RobustAveraging, DecentralizedAverager):
        honest_parts_are_finite = True  # as the strategy's gradient averager (its local guard)
        weight_zero_merges = True  # as the strategy's state averager: a round of weight 0 merges a stale state

    if args.lie == "frame":
        install_frame()
    elif args.lie == "withhold":
        install_withhold()
    elif args.lie in ("tamper", "drop"):
        install_tamper(drop=args.lie == "drop")
    elif args.lie == "slow":
        install_slow(1.5 * args.verification_timeout)
    elif args.lie == "vanish":
        install_vanish()
    elif args.lie == "leave":
        install_leave()
    elif args.lie == "latecommit":
        install_late_commit(0.9 * args.verification_timeout)
    elif args.lie not in ("none", "nan"):
        install_lie(args.lie)
    install_verification_timer()
    # an identity whose key this peer holds, as the strategy's peers have: client-mode members sign the messages
    # that reachable members relay between them with it
    identity = args.out + ".identity"
    if os.path.exists(identity):
        os.remove(identity)
    write_identity(identity)
    dht = SwarmDHT(initial_peers=[args.initial_peer] if args.initial_peer else None,
                   host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=args.client_mode, identity_path=identity,
                   check_if_identity_free=False, start=True)
    if not args.initial_peer:
        print("PEER", dht.get_visible_maddrs()[0], flush=True)
    tensor = make_tensor(args.seed)
    if args.lie == "nan":
        tensor.fill_(float("nan"))
    averager = Averager([tensor.clone()], dht=dht, prefix="lying_reducer_test",
                        target_group_size=args.group_size, min_group_size=args.group_size, min_matchmaking_time=3.0,
                        request_timeout=2.0, compression=NoCompression(), next_chunk_timeout=args.next_chunk_timeout,
                        part_size_bytes=2 ** 14,  # 8 parts of 4096 values: each peer reduces some
                        aggregation="centered_clip", verify_reducers=not args.no_verify,
                        verification_timeout=args.verification_timeout, client_mode=args.client_mode,
                        auxiliary=args.auxiliary, start=True)
    print("PEER_ID", dht.peer_id, flush=True)
    for round_number in range(args.rounds):
        try:
            averager.step(timeout=args.timeout, weight=args.weight)
        except Exception as e:  # the test reads why
            print("ROUND_FAILED", round_number, repr(e), flush=True)
        else:
            print("ROUND", round_number, flush=True)
    with averager.get_tensors() as tensors:
        save_file({"averaged": tensors[0].clone(), "input": tensor}, args.out)
    faulthandler.cancel_dump_traceback_later()
    print("DONE", flush=True)
    sys.stdin.read()
    averager.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
