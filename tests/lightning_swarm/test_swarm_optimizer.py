"""SwarmOptimizer: throttled leader search, no matchmaking while alone, hivemind's RPC names (real DHTs and averagers)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
import time

import hivemind
import pytest
import torch
from hivemind.averaging.control import StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture

from lightning_swarm.hivemind_ext.lifetime import SwarmDHT
from lightning_swarm.hivemind_ext.matchmaking import ThrottledPotentialLeaders, default_poll_interval
from lightning_swarm.hivemind_ext.optimizer import SwarmGradientAverager, SwarmOptimizer, SwarmStateAverager

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def dht():
    node = SwarmDHT(start=True, host_maddrs=LOCAL)  # a DHT process that dies fails the test at once (no hang)
    yield node
    node.shutdown()


def _search(dht: hivemind.DHT, poll_interval: float, seconds: float, declare_other_after: float = None,
            keep_other_out: bool = False):
    """Look for a leader for up to `seconds` as an averager of prefix "mm" that does not declare itself.

    If `declare_other_after` is set, another peer declares itself as an averager that many seconds into the search;
    with `keep_other_out`, the searcher keeps that peer out of its groups.
    Returns (leader found or None, seconds from sending that declaration to finding it, number of DHT polls).
    """
    other = SwarmDHT(start=True, host_maddrs=LOCAL, initial_peers=dht.get_visible_maddrs())

    async def run():
        key_manager = GroupKeyManager(dht, "mm", initial_group_bits="", target_group_size=None)
        kept_out = {other.peer_id: "a test"} if keep_other_out else {}
        leaders = ThrottledPotentialLeaders(dht.peer_id, 1.0, None, poll_interval=poll_interval,
                                            kept_out=lambda: kept_out)
        step = StepControl(scheduled_time=get_dht_time() + seconds, deadline=get_dht_time() + seconds,
                           allow_retries=False, weight=1.0, data_for_gather=b"")
        step.attach(MPFuture(), MPFuture())  # as an averager attaches them (else its __del__ raises)
        step.allow_allreduce()
        declared_at = None

        async def declare_other():
            nonlocal declared_at
            await asyncio.sleep(declare_other_after)
            other_keys = GroupKeyManager(other, "mm", initial_group_bits="", target_group_size=None)
            # the clock starts when the declaration is sent: the searcher may read it from the DHT before the store
            # call returns to the declaring peer (a CI run found the leader first and had no delay to compare)
            declared_at = time.monotonic()
            await other_keys.declare_averager(other_keys.current_key, other.peer_id, get_dht_time() + 30, True)

        declaring = asyncio.create_task(declare_other()) if declare_other_after is not None else None
        found = None
        async with leaders.begin_search(step, key_manager, declare=False):
            try:
                found = await asyncio.wait_for(leaders.pop_next_leader(), timeout=seconds)
            except asyncio.TimeoutError:
                pass
        delay = time.monotonic() - declared_at if found is not None else None
        if declaring is not None:
            await asyncio.wait_for(declaring, timeout=10)  # finished before `other` shuts down, never left pending
        return found, delay, leaders.num_polls

    try:
        return asyncio.run(run())
    finally:
        other.shutdown()


def test_lone_search_polls_at_most_once_per_interval(dht):
    found, _, polls = _search(dht, poll_interval=0.5, seconds=2.0)
    assert found is None
    assert 2 <= polls <= 5  # 2 s / 0.5 s + the first poll; hivemind's own loop polls back to back


def test_throttled_search_still_finds_a_leader_within_an_interval(dht):
    found, delay, _ = _search(dht, poll_interval=0.5, seconds=6.0, declare_other_after=0.7)
    assert found is not None, "the leader declared during the search was never found"
    assert delay < 0.5 + 1.0  # one poll interval, plus slack for a loaded machine


def test_search_never_asks_a_peer_kept_out_of_its_groups_to_lead_it(dht):
    # a NaN sender kept out by one honest peer went on leading groups that honest peer joined and then left at the
    # all-reduce: every such round was lost for the other honest members too (test_byzantine_swarm.py's nan case)
    found, _, polls = _search(dht, poll_interval=0.2, seconds=2.0, declare_other_after=0.3, keep_other_out=True)
    assert found is None and polls >= 3, (found, polls)  # it read the declaration more than once and skipped it


def test_default_poll_interval():
    assert default_poll_interval(2.0) == pytest.approx(0.2)
    assert default_poll_interval(15.0) == 0.5
    with pytest.raises(ValueError, match="poll_interval"):
        ThrottledPotentialLeaders(None, 1.0, None, poll_interval=-1)


@pytest.mark.parametrize("optimizer_class, expect_schedules", [(hivemind.Optimizer, True), (SwarmOptimizer, False)])
def test_lone_peer_does_not_preschedule_averaging(dht, optimizer_class, expect_schedules):
    """Alone, hivemind pre-schedules a gradient averaging round before every epoch's end; SwarmOptimizer does not."""
    model = torch.nn.Linear(8, 1)
    optimizer = optimizer_class(
        dht=dht, run_id=f"alone_{optimizer_class.__name__}", target_batch_size=64, batch_size_per_step=16,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1), params=model.parameters(), matchmaking_time=1.0,
        averaging_timeout=5.0, verbose=False,
    )
    schedules = []
    schedule_step = optimizer.grad_averager.schedule_step
    optimizer.grad_averager.schedule_step = lambda *args, **kwargs: schedules.append(1) or schedule_step(*args, **kwargs)
    try:
        for _ in range(12):  # 3 global epochs, each well under matchmaking_time
            model(torch.randn(16, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert optimizer.local_epoch == 3
        assert bool(schedules) == expect_schedules
    finally:
        optimizer.shutdown()


@pytest.mark.parametrize("schedule, expect_round", [(SwarmOptimizer._maybe_schedule_state_averaging, True),
                                                     (hivemind.Optimizer._maybe_schedule_state_averaging, False)],
                         ids=["ours", "hivemind"])
def test_one_slow_gradient_round_does_not_stop_state_rounds_being_prescheduled(dht, schedule, expect_round):
    """hivemind measures the delay from an epoch's end to its state round only at epochs whose state round was
    pre-scheduled. One gradient round that waited out a dead groupmate (30 s) raised it above matchmaking_time, and
    the peer never pre-scheduled a state round again: its rounds began after its groupmates' groups had formed and
    found nobody (client-mode peers of an 8-peer swarm with churn). SwarmOptimizer bounds the delays, so the round is
    pre-scheduled before the epoch's end; usual delays are left as measured."""
    model = torch.nn.Linear(8, 1)
    optimizer = SwarmOptimizer(
        dht=dht, run_id="slow_round", target_batch_size=64, batch_size_per_step=16,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1), params=model.parameters(), matchmaking_time=3.0,
        averaging_timeout=10.0, verbose=False)
    scheduled = []
    schedule_step = optimizer.state_averager.schedule_step
    optimizer.state_averager.schedule_step = lambda *args, **kwargs: scheduled.append(schedule_step(*args, **kwargs))
    try:
        delay = optimizer.delay_before_state_averaging
        for interval in (0.0, 1.0, 1.0):  # the seed, then gradient rounds of a second
            delay.update(task_size=1, interval=interval)
        usual = delay.ema_seconds_per_sample
        optimizer._bound_state_round_delays()
        assert delay.ema_seconds_per_sample == usual, "a usual delay was changed"
        delay.update(task_size=1, interval=30.0)  # a gradient round that waited out a dead groupmate
        with optimizer.tracker.pause_updates():  # the swarm's progress as this test sets it: 2 peers, the end near
            optimizer.tracker.global_progress = dataclasses.replace(
                optimizer.tracker.global_progress, num_peers=2, eta_next_epoch=get_dht_time() + 0.5)
            schedule(optimizer)
        assert bool(scheduled) == expect_round, f"pre-scheduled: {scheduled}"
    finally:
        for control in scheduled:
            control.cancel()
        optimizer.shutdown()


def test_the_process_keeps_its_interrupt_handler():
    """hivemind.Optimizer leaves SIGINT ignored in the process that made it (Ctrl+C and Jupyter's interrupt do
    nothing); SwarmOptimizer puts the handler back."""
    before = signal.getsignal(signal.SIGINT)
    after = {}
    for optimizer_class in (hivemind.Optimizer, SwarmOptimizer):
        dht = SwarmDHT(start=True, host_maddrs=LOCAL)  # each its own: nothing of the first optimizer's is left
        try:
            model = torch.nn.Linear(4, 1)
            optimizer = optimizer_class(
                dht=dht, run_id=f"sigint_{optimizer_class.__name__}", target_batch_size=64, batch_size_per_step=16,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1), params=model.parameters(),
                matchmaking_time=1.0, averaging_timeout=5.0, verbose=False)
            after[optimizer_class] = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, before)
            optimizer.shutdown()
        finally:
            dht.shutdown()
    assert after[hivemind.Optimizer] is signal.SIG_IGN and after[SwarmOptimizer] is before


@pytest.mark.parametrize("ours, hivemind_class", [(SwarmStateAverager, TrainingStateAverager),
                                                  (SwarmGradientAverager, GradientAverager)])
def test_averagers_answer_under_hivemind_rpc_names(ours, hivemind_class):
    """Peers running hivemind's classes (and the monitor) call e.g. "<prefix>::TrainingStateAverager.rpc_download_state"."""
    ours._collect_rpc_handlers()
    methods = [handler.method_name for handler in ours._rpc_handlers]
    assert "rpc_join_group" in methods
    for method in methods:
        assert ours._get_handle_name("run", method) == hivemind_class._get_handle_name("run", method)


def test_client_mode_peer_passes_global_steps(dht):
    """A client-mode peer (its DHT accepts no connections) whose optimizer leaves client_mode to the DHT, as
    build_swarm_optimizer used to: it knows it is in client mode and passes global steps. hivemind 1.1.12 alone keeps
    client_mode=None and dies at the first global step ("State sharing priority is unused")."""
    client = SwarmDHT(start=True, client_mode=True, initial_peers=dht.get_visible_maddrs())
    model = torch.nn.Linear(8, 1)
    optimizer = SwarmOptimizer(
        dht=client, run_id="client_alone", target_batch_size=32, batch_size_per_step=16,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1), params=model.parameters(), matchmaking_time=1.0,
        averaging_timeout=5.0, client_mode=None, verbose=False,
    )
    try:
        assert client.client_mode and optimizer.client_mode is True
        assert optimizer.state_averager.client_mode and optimizer.grad_averager.client_mode
        for _ in range(4):  # 2 global epochs
            model(torch.randn(16, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert optimizer.local_epoch == 2
        assert not optimizer.state_averager.allow_state_sharing  # nobody can connect to download it
    finally:
        optimizer.shutdown()
        client.shutdown()


def test_a_peer_whose_gradient_group_was_one_epoch_ahead_takes_its_epoch(dht):
    """A synchronous gradient round that met the groupmates' next round (their rounds gathered one epoch more than
    this peer's, test_epoch_rounds.py) leaves this peer at their epoch after its global step, with the LR of their
    epoch: its state rounds (matched per epoch) then meet theirs. A claim of two epochs more, a non-number, a failed
    round are not followed."""
    model = torch.nn.Linear(8, 1)
    optimizer = SwarmOptimizer(
        dht=dht, run_id="follow_group", target_batch_size=32, batch_size_per_step=16,
        optimizer=lambda params: torch.optim.SGD(params, lr=1.0), params=model.parameters(),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
        matchmaking_time=1.0, averaging_timeout=5.0, verbose=False,
    )

    def finished_round(result=None, error=None):
        control = StepControl(scheduled_time=get_dht_time(), deadline=float("inf"), allow_retries=False,
                              weight=1.0, data_for_gather=b"")
        control.attach(MPFuture(), MPFuture())  # as the averager attaches them; triggered, like a round that ran
        control.allow_allreduce()
        control.set_exception(error) if error is not None else control.set_result(result)
        return control

    try:
        optimizer.state_averager.local_epoch = 2  # this peer's global step leads to epoch 3
        optimizer.state_averager._update_scheduler()
        me, other = dht.peer_id, "peer"
        for result, error in [({me: 3, other: 5}, None), ({me: 3, other: True}, None), ({me: 3, other: "4"}, None),
                              (None, RuntimeError("round failed")), ({me: 3, other: 3}, None)]:
            optimizer._follow_group_epoch(finished_round(result, error))
            assert optimizer.local_epoch == 2, (result, error)
        optimizer._follow_group_epoch(finished_round({me: 3, other: 4}))
        assert optimizer.local_epoch == 3  # the global step then ends at epoch 4, with the group
        assert optimizer.state_averager.optimizer.param_groups[0]["lr"] == pytest.approx(1.0 / 4)
    finally:
        optimizer.shutdown()


def test_a_failed_gradient_round_steps_on_the_peers_own_gradient(dht):
    """A peer's gradient round finds no group (the other peer of the run trains, but is far from its own epoch's end):
    the round fails and the peer steps on its own gradient. hivemind 1.1.12's GradientAverager.step zeroes the
    accumulators as it begins the round, and hivemind.Optimizer's fallback reloaded them: a failed round stepped on
    zeros and the epoch's samples were lost (test_byzantine_swarm.py's nan case: an honest peer that left a round with
    the NaN sender kept its parameters unchanged through that epoch)."""
    other_dht = SwarmDHT(start=True, host_maddrs=LOCAL, initial_peers=dht.get_visible_maddrs())
    torch.manual_seed(0)
    model, other_model = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)
    common = dict(run_id="failed_round", batch_size_per_step=16, matchmaking_time=1.0, averaging_timeout=3.0,
                  verbose=False)

    def tracker_opts():  # its own key: the process-wide one would make both peers' progress one record
        return dict(min_refresh_period=0.1, max_refresh_period=0.5, default_refresh_period=0.2,
                    private_key=RSAPrivateKey())

    optimizer = SwarmOptimizer(dht=dht, target_batch_size=48, params=model.parameters(), tracker_opts=tracker_opts(),
                               optimizer=lambda params: torch.optim.SGD(params, lr=0.1), **common)
    # its own target is far: it never looks for a group, but its progress makes the swarm 2 peers
    other = SwarmOptimizer(dht=other_dht, target_batch_size=10_000, params=other_model.parameters(),
                           tracker_opts=tracker_opts(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                           **common)
    try:
        other_model(torch.randn(16, 8)).pow(2).mean().backward()
        other.step()
        batches = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(2)]
        before = [p.detach().clone() for p in model.parameters()]
        reference = torch.nn.Linear(8, 1)
        reference.load_state_dict(model.state_dict())
        for x, y in batches:  # the gradient of the mean loss over both batches, computed apart
            torch.nn.functional.mse_loss(reference(x), y).div(len(batches)).backward()
        for index, (x, y) in enumerate(batches):  # the second step ends the epoch (48 samples): no group is found
            if index == 1:  # both peers' progress in sight: hivemind begins a round only with another peer
                deadline = time.monotonic() + 20
                while optimizer.tracker.fetch_global_progress().num_peers < 2:
                    assert time.monotonic() < deadline, "the peers' progress records never arrived"
                    time.sleep(0.1)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert optimizer.local_epoch == 1
        for param, old, ref in zip(model.parameters(), before, reference.parameters()):
            assert not torch.equal(param.detach(), old), "the failed round's step was taken on zeros"
            assert torch.allclose(param.detach(), old - 0.1 * ref.grad, atol=1e-6)
    finally:
        optimizer.shutdown()
        other.shutdown()
        other_dht.shutdown()


def test_a_donor_serves_the_state_of_the_update_it_holds_while_a_delayed_step_is_under_way(dht):
    """With delay_optimizer_step a peer is at epoch K while the update of epoch K - 1 runs in the background: until
    its optimizer step has run, the state it serves is labelled K - 1 (hivemind 1.1.12 labelled it K: a newcomer
    that downloaded then stayed one update behind its peers and, at full weight in its state rounds, pulled them
    back); once it has run, K with the updated parameters."""
    model = torch.nn.Linear(4, 1)
    optimizer = SwarmOptimizer(dht=dht, run_id="labelled_state", target_batch_size=64, batch_size_per_step=16,
                               params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                               offload_optimizer=True, delay_optimizer_step=True, delay_grad_averaging=True,
                               matchmaking_time=1.0, averaging_timeout=3.0, verbose=False)
    averager = optimizer.state_averager
    trigger = threading.Event()
    try:
        params = averager.optimizer.param_groups[0]["params"]
        for param in params:  # the averaged gradient the background step applies
            param.grad = torch.ones_like(param)
        before = [param.detach().clone() for param in params]
        epoch = averager.local_epoch
        assert averager.get_current_state()[0]["epoch"] == epoch and averager.updates_behind() == 0
        averager.step(increment_epoch=True, optimizer_step=True, delay_optimizer_step=True,
                      wait_for_trigger=lambda: trigger.wait(30))  # (the gradient round, in the background)
        assert averager.local_epoch == epoch + 1
        metadata, tensors, _ = averager.get_current_state()
        assert metadata["epoch"] == epoch and averager.updates_behind() == 1
        assert all(torch.equal(t, b) for t, b in zip(tensors, before))
        trigger.set()
        averager.step(wait_for_delayed_updates=True)
        metadata, tensors, _ = averager.get_current_state()
        assert metadata["epoch"] == epoch + 1 and averager.updates_behind() == 0
        assert all(torch.allclose(t, b - 0.1) for t, b in zip(tensors, before))
    finally:
        trigger.set()
        optimizer.shutdown()


def test_only_state_rounds_of_weight_0_are_merges():
    """A state round of weight 0 merges a newcomer's stale state, and fails if it got part of the group's state
    (RobustAveraging._check_merge_complete); a gradient round of weight 0 (a peer with no samples) is an ordinary
    round and keeps hivemind's handling of partial results."""
    assert SwarmStateAverager.weight_zero_merges is True
    assert SwarmGradientAverager.weight_zero_merges is False
