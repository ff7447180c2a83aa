"""The one place where lightning_swarm touches hivemind's private API (written for hivemind 1.1.12).

Importing this package checks that the installed hivemind is a release this list was checked against
(:data:`~lightning_swarm.hivemind_ext.private_api.SUPPORTED_HIVEMIND`) and raises a clear ImportError otherwise.
Every private name used is listed in :data:`~lightning_swarm.hivemind_ext.private_api.PRIVATE_SYMBOLS`, which
``tests/lightning_swarm/test_hivemind_ext.py`` checks against the installed hivemind. Modules and what they use:

``optimizer`` (:class:`SwarmOptimizer`: hivemind.Optimizer with less background CPU)
    - ``Optimizer._make_progress_tracker``: overridden to build a ThrottledProgressTracker.
    - ``Optimizer._make_state_averager``: overridden to build a SwarmStateAverager with hivemind's arguments,
      read from the instance attributes ``matchmaking_time``, ``allreduce_timeout``, ``shutdown_timeout``,
      ``offload_optimizer``, ``status_loglevel``, ``next_chunk_timeout``, ``auxiliary``.
    - ``Optimizer._maybe_schedule_gradient_averaging``: overridden, no pre-scheduled rounds while alone.
    - ``Optimizer._maybe_schedule_state_averaging`` and ``Optimizer.delay_before_state_averaging``: state rounds
      get pre-scheduled in a swarm (hivemind 1.1.12 never does); that delay and
      ``TrainingStateAverager.delay_before_averaging`` are bounded, so one slow gradient round does not stop a peer
      pre-scheduling state rounds for good.
    - ``ServicerBase._get_handle_name``: our averager subclasses serve RPCs under hivemind's class names.
    - ``Optimizer._average_gradients_and_load_into_optimizer``: extended, a peer whose synchronous gradient group
      was one epoch ahead takes its epoch (``TrainingStateAverager._update_scheduler`` for its LR, and its
      pre-scheduled state round, ``Optimizer.scheduled_state``, moved to that epoch).
    - ``Optimizer._load_local_gradients_into_optimizer``: overridden while ``GradientAverager._new_averaged_grads``
      is set (a round was begun with this epoch's gradient and failed): ``_load_averaged_gradients_into_optimizer_``
      loads the gradient kept in the averager (hivemind reloaded the accumulators its ``GradientAverager.step`` had
      zeroed: a zero step).
``matchmaking`` (leader search that polls the DHT at a bounded rate)
    - ``PotentialLeaders`` and ``PotentialLeaders._update_queue_periodically``: hivemind's polling loop, with a
      pause; it uses the instance attributes ``peer_id``, ``min_matchmaking_time``, ``target_group_size``,
      ``search_end_time``, ``max_assured_time``, ``leader_queue``, ``past_attempts``, ``running``,
      ``update_triggered``, ``update_finished``.
    - ``Matchmaking.potential_leaders``, ``DecentralizedAverager._matchmaking``: where the search is swapped in.
    - ``MAX_DHT_TIME_DISCREPANCY_SECONDS``: the loop's margin, as in hivemind.
``group_keys`` (groups that change every round: random initial group bits, a lonely peer moves to another key)
    - ``GroupKeyManager.update_key_on_not_enough_peers``: overridden (hivemind's is a stub); it sets
      ``GroupKeyManager.group_bits`` and logs ``GroupKeyManager.prefix``.
    - ``Matchmaking.group_key_manager``, ``DecentralizedAverager._matchmaking``: where the key manager's class is
      switched (to ``epoch_rounds``' in the swarm's averagers), as hivemind assigns the matchmaking.
    - ``Matchmaking.look_for_group``, ``Matchmaking.client_mode``: a client-mode peer's search is wrapped, so that
      one that found no group moves its key too (hivemind only moves declared peers).
``epoch_rounds`` (overlapping rounds of many peers: each round matched with rounds of its epoch)
    - ``GroupKeyManager.current_key``: overridden, ``<prefix>_e<epoch>.0b<group bits>`` from ``GroupKeyManager.prefix``,
      ``GroupKeyManager.group_bits`` and the epoch on ``Matchmaking.step_control`` (the round being matched).
    - ``DecentralizedAverager._step``: extended, the epoch is put on the round's StepControl.
    - ``DecentralizedAverager._outer_pipe`` and ``DecentralizedAverager._run_internal``: the trainer's process sends
      ``_set_round_epoch`` through the pipe, and the averager's process runs the method a message names.
``weight_bounds`` (a sender's gradient weight at most its samples on record)
    - ``DecentralizedAverager._step``: extended, the round's StepControl is kept for its bounds (its epoch).
    - ``DecentralizedAverager._outer_pipe`` and ``DecentralizedAverager._run_internal``: the trainer's process sends
      ``_note_round_counts`` (its tracker's counts of the round's epoch) through the pipe with the round's trigger.
``tracker`` (progress published at a bounded rate)
    - ``ProgressTracker._parse_swarm_progress_data`` and ``ProgressTracker._local_public_key``: count our own
      samples from the live progress, not from our possibly older DHT record.
    - ``ProgressTracker.should_report_progress``: replaced by a throttled event.
    - ``ProgressTracker.shutdown_triggered``, ``global_state_updated``, ``shutdown_complete``,
      ``training_progress_key``, ``metadata_expiration``: a shutdown that waits for the "left the run" record.
    - ``ProgressTracker.lock_global_progress`` and ``fetched_global_progress_this_epoch``: the swarm's progress
      fetched on demand (``fetch_global_progress``), as hivemind's fetcher does it.
``catch_up`` (a newcomer trains after one download, on a state at most ``max_stale_epochs`` behind the swarm's)
    - ``Optimizer._should_load_state_from_peers``: extended, a peer whose downloaded state is not merged yet follows
      the swarm's epoch instead of downloading again, within the bound.
    - ``Optimizer._update_global_epoch``: skipped while the peer sits out an epoch it arrived at as it ended (and
      ``_maybe_schedule_gradient_averaging`` / ``_maybe_schedule_state_averaging`` with it).
    - ``TrainingStateAverager._update_scheduler``: the LR schedule of the adopted epoch.
``grad_averager`` (gradients averaged per sample, not per local step; worker momentum)
    - ``GradientAverager._anchor_batch_size``, ``GradientAverager._grad_accumulators``,
      ``GradientAverager.local_samples_accumulated``, ``GradientAverager.load_accumulators_into_averager_``.
    - ``GradientAverager.reset_accumulated_grads_``: extended, so that the worker momentum (``worker_momentum``)
      moves once per accumulation although hivemind may load the same accumulators twice (a peer alone).
``robust_allreduce`` (screened all-reduce, CenteredClip; see that module)
    - ``TensorPartReducer``: ``reset_accumulators``, ``accumulate_part``, ``check_current_part_finished`` and
      ``finalize`` overridden on hivemind's reducer state ``current_part_index``, ``current_part_accumulated_from``,
      ``current_part_future``, ``num_current_senders``, ``sender_failed_after``, ``num_parts_received``,
      ``accumulator``, ``denominator``, ``finished``.
    - ``TensorPartContainer.register_processed_part`` and ``TensorPartContainer.finalize`` extended, reading
      ``_input_parts_by_peer`` and ``finished``.
    - ``AllReduceRunner``'s ``tensor_part_container``, ``tensor_part_reducer`` and ``parts_for_local_averaging``
      replaced after hivemind built them; ``sender_peer_ids`` names the senders.
    - ``DecentralizedAverager._run_allreduce_inplace_``: hivemind's, building our runner; it uses ``_p2p``,
      ``_running_groups``, ``_averaging_alpha``, ``_state_updated`` as hivemind does.
    - ``TensorPartContainer.register_failed_reducer``: extended, a failed reducer's slice is marked uncheckable.
    - ``DecentralizedAverager._step``: extended, the rounds under way are remembered; a round this peer leaves
      (a member it keeps out is in the group) gets ``StepControl._allow_retries`` cleared: it is not retried.
    - A round entered with weight 0 (a stale state merged) that got part of its results
      (``TensorPartContainer.failed_size`` of ``total_size``) or refused a slice fails, not retried.
``result_records`` (what the check of the reducers keeps of a round's results, and the reducer's header on each)
    - ``AllReduceRunner._accumulate_parts_streaming``: extended, each result message gets the reducer's header;
      ``tensor_part_reducer`` holds the headers.
    - ``AllReduceRunner._get_peer_stub``: extended, each result message is recorded in ``tensor_part_container``
      (with ``TensorPartContainer._input_parts_by_peer``, this peer's own parts).
``result_verification`` (every other member's reduced slice is checked before it is applied, issue 24 item 9)
    - ``AllReduceRunner.tensor_part_container`` holds the kept results; ``sender_peer_ids`` exchange reports.
    - ``TensorPartReducer.num_parts_received`` and ``num_parts``: a sender that sent this reducer none of its parts
      failed the round (no verification wait for it).
    - ``DecentralizedAverager._p2p``: calls the members' ``rpc_reducer_report``; ``ServicerBase._rpc_handlers`` and
      ``ServicerBase._stub_type`` reset for each class with the mixin, so that hivemind collects that handler.
``gathered_checks`` (a group member's gathered data, checked before hivemind decodes the group's)
    - ``DecentralizedAverager._aggregate_with_group``: extended, a malformed member's blob is replaced by a client's;
      ``serializer`` decodes the blobs as hivemind does.
``part_checks`` (every part and reducer result an all-reduce receives is checked before it is decoded)
    - ``AllReduceRunner._accumulate_parts_streaming``: extended, a sender's parts are checked first (a malformed
      one leaves the sender out of the rest of the round); it reads ``sender_peer_ids`` and
      ``parts_for_local_averaging``.
    - ``AllReduceRunner._get_peer_stub``: extended, a reducer's results are checked first (a malformed one keeps
      the local values of its slice), and the stream is closed once all are in; it reads
      ``TensorPartContainer._input_parts_by_peer``.
    - ``AllReduceRunner.rpc_aggregate_part``: extended, the reducer's end stays open after its last result until
      the sender closes it (``stream_ends``).
``stream_ends`` (a handler stays open after its last message until the caller closes the stream, at most
    ``STREAM_LINGER_SECONDS``: closed at once, p2pd lost messages in flight; used by ``part_checks`` and
    ``RobustAveraging.rpc_join_group``)
    - ``Matchmaking._request_join_group``: relied on, the follower closes its stream once it has the leader's last
      answer (a test checks the body still does).
``finite_state`` (a downloaded state with NaN/Inf is refused): public API only (``load_state_from_peers``).
``lifetime`` (the DHT's and the averagers' processes, and p2pd, die with the trainer, also on SIGKILL; a DHT process
    that dies first fails its trainer's calls): ``run`` of hivemind's ``multiprocessing.Process`` subclasses,
    overridden to start a watchdog thread in the child, and the DHT's request pipe (``dht_pipe``):
    - ``DHT._inner_pipe``, ``DHT._outer_pipe``: wrapped (requests read whole, sent one thread at a time).
    - ``MPFuture._update_lock``, ``MPFuture._initialization_lock``, ``SharedBytes._lock``: replaced by new locks
      when the DHT process dies (it may have died holding one; every later hivemind child would hang on it).
``state`` (the monitor moving a state averager to another epoch)
    - ``TrainingStateAverager._update_scheduler``: steps the LR schedule to the new epoch.
    - ``ProgressTracker.training_progress_key``'s format: the monitor announces a reverted epoch under it.
``state_download`` (a newcomer's state download: whole tensors of the right shape, or a clear error and a retry)
    - ``DecentralizedAverager._load_state_from_peers``: overridden in the averager's process (stall timeout per
      part, part count and shape checks, progress log, retries); ``_outer_pipe`` sends it the request, ``_p2p``
      calls the donor, ``serializer`` decodes the metadata.
    - ``DecentralizedAverager._averaged_tensors``, ``TrainingStateAverager.main_parameters`` and
      ``TrainingStateAverager.extra_tensors``: the shapes the downloaded tensors must have.
``auth_guards`` (authentication where hivemind has no hook, see docs/security.md; it calls the run's credentials
through ``credentials.PeerCredentials``, so this package never imports ``lightning_swarm.auth``, which builds on it)
    - ``DecentralizedAverager._step``: overridden to put this peer's join proof into ``StepControl._data_for_gather``.
    - ``DecentralizedAverager._aggregate_with_group``: overridden to check every group member's proof first.
    - ``DecentralizedAverager._matchmaking``'s ``Matchmaking.current_followers``: a leader refuses a join request
      of a user already seated among its followers (one vote per person).
    - (``state_download``'s donor list, ``_donors``, is filtered to plausible donors: our own code, not hivemind's.)
    - ``ProgressTracker._parse_swarm_progress_data`` (as ``tracker``): drops epoch claims no peer confirms.
``state_serving`` (who may download this peer's state, how many at once)
    - ``DecentralizedAverager.rpc_download_state``: overridden: with an authority, token holders only (the proof is
      read from the request as a ``JoinRequest``, decoded with ``DecentralizedAverager.serializer``); at most
      ``max_state_downloads`` at once, one per requester.
    - ``ServicerBase._rpc_handlers`` and ``ServicerBase._stub_type``: reset for each class with the mixin, so that
      hivemind collects its handlers with our request type rather than inheriting a base class's.
``state_snapshot`` (a donor labels its state with the epoch of the update it holds)
    - ``TrainingStateAverager.get_current_state``: extended, read under ``TrainingStateAverager.lock_optimizer``, its
      epoch lowered while a background update (``TrainingStateAverager.pending_updates``) has not run its step.
``round_groups`` (a groupmate's part that arrives before its group is registered waits for it)
    - ``DecentralizedAverager._running_groups``: where the part's group gets registered (hivemind refuses the part
      at once if another round of the averager has set ``_pending_groups_registered``).
    - ``DecentralizedAverager._aggregate_with_group``: extended, remembers the groups of finished rounds.
``credentials`` (what ``auth_guards`` and ``optimizer`` call on the run's credentials): no hivemind name.
``keys`` (RSA keys in hivemind's classes, for ``lightning_swarm.auth``)
    - ``RSAPrivateKey._private_key``: loaded from and written to PEM files (hivemind has no loader).
    - ``RSAPrivateKey._process_wide_key`` and ``RSAPrivateKey._process_wide_key_lock``: the key an offline token was
      issued for becomes the key the process signs with.
``codecs`` (decoders of incoming tensors)
    - ``hivemind.compression.serialization._BASE_COMPRESSION_TYPES``: the process-wide decoder registry, where
      :func:`lightning_swarm.compression.register_fixed_codecs` installs numpy-2.4-safe 8-bit decoders.

To use another private name: put the code here, add a ``PrivateSymbol`` to ``private_api.PRIVATE_SYMBOLS`` and a
line above (the test checks that both lists agree).
"""

from lightning_swarm.hivemind_ext.private_api import check_hivemind_version

HIVEMIND_VERSION = check_hivemind_version()
