"""The hivemind private API this package relies on, as data: one entry per symbol, checked by the tests.

When you touch another private hivemind name, add a :class:`PrivateSymbol` to :data:`PRIVATE_SYMBOLS` and a line to
the list in :mod:`lightning_swarm.hivemind_ext`'s docstring (a test checks both). After a hivemind upgrade,
``missing_symbols()`` (and ``tests/lightning_swarm/test_hivemind_ext.py``) names what moved.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import warnings
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import List, Optional, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# the hivemind releases whose private API the list below was checked against
SUPPORTED_HIVEMIND_RANGE = ">=1.1.12,<1.2"
SUPPORTED_HIVEMIND = SpecifierSet(SUPPORTED_HIVEMIND_RANGE)
# set to 1 to try another hivemind release anyway (a warning instead of an ImportError)
IGNORE_VERSION_ENV = "LIGHTNING_SWARM_IGNORE_HIVEMIND_VERSION"


@dataclass(frozen=True)
class PrivateSymbol:
    """One private hivemind name that lightning_swarm uses.

    Args:
        module: hivemind module that defines it, e.g. ``"hivemind.optim.optimizer"``.
        name: dotted path inside the module: ``"Optimizer._make_state_averager"`` (class attribute or method),
            ``"_BASE_COMPRESSION_TYPES"`` (module attribute), or with ``instance=True`` ``"Class.attribute"``.
        why: what we use it for.
        used_in: module of ``lightning_swarm.hivemind_ext`` that uses it.
        instance: the attribute is set on instances (in a method of the class or of a hivemind base class), not
            defined on the class: it is checked by finding the assignment ``self.<attribute> = ...`` in the source.
    """

    module: str
    name: str
    why: str
    used_in: str
    instance: bool = False

    @property
    def qualified_name(self) -> str:
        return f"{self.module}.{self.name}"


def _symbols(module: str, used_in: str, entries: List[Tuple[str, str]], instance: bool = False) -> List[PrivateSymbol]:
    return [PrivateSymbol(module, name, why, used_in, instance) for name, why in entries]


_OPTIMIZER = "hivemind.optim.optimizer"
_TRACKER = "hivemind.optim.progress_tracker"
_MATCHMAKING = "hivemind.averaging.matchmaking"

PRIVATE_SYMBOLS: Tuple[PrivateSymbol, ...] = tuple(
    _symbols(_OPTIMIZER, "optimizer", [
        ("Optimizer._make_progress_tracker", "overridden to build a ThrottledProgressTracker"),
        ("Optimizer._make_state_averager", "overridden to build a SwarmStateAverager with hivemind's arguments"),
        ("Optimizer._maybe_schedule_gradient_averaging", "overridden: no pre-scheduled rounds while alone"),
        ("Optimizer._maybe_schedule_state_averaging", "overridden: pre-schedule state rounds in a swarm"),
        ("Optimizer._average_gradients_and_load_into_optimizer",
         "extended: a peer follows a gradient group one epoch ahead"),
        ("Optimizer._load_local_gradients_into_optimizer",
         "overridden after a failed round: the gradient kept in the averager, not the zeroed accumulators"),
        ("Optimizer._load_averaged_gradients_into_optimizer_", "loads that gradient, as hivemind does"),
    ])
    + _symbols("hivemind.optim.grad_averager", "optimizer", [
        ("GradientAverager._new_averaged_grads", "set while a round was begun with this epoch's gradient"),
    ], instance=True)
    + _symbols("hivemind.optim.state_averager", "optimizer", [
        ("TrainingStateAverager._update_scheduler", "steps the LR schedule to the epoch a peer follows"),
    ])
    + _symbols("hivemind.optim.state_averager", "optimizer", [
        ("TrainingStateAverager.delay_before_averaging", "bounded with Optimizer.delay_before_state_averaging"),
    ], instance=True)
    + _symbols(_OPTIMIZER, "optimizer", [
        ("Optimizer.delay_before_state_averaging", "seeded with 0 s and bounded: state rounds get pre-scheduled"),
        ("Optimizer.matchmaking_time", "argument of the state averager, as hivemind passes it"),
        ("Optimizer.allreduce_timeout", "argument of the state averager, as hivemind passes it"),
        ("Optimizer.shutdown_timeout", "argument of the state averager, as hivemind passes it"),
        ("Optimizer.offload_optimizer", "argument of the state averager, as hivemind passes it"),
        ("Optimizer.status_loglevel", "argument of the state averager and tracker, as hivemind passes it"),
        ("Optimizer.next_chunk_timeout", "argument of the state averager, as hivemind passes it"),
        ("Optimizer.auxiliary", "argument of the state averager, as hivemind passes it"),
        ("Optimizer.scheduled_state", "the pre-scheduled state round, moved to the epoch a peer follows"),
    ], instance=True)
    + _symbols("hivemind.p2p.servicer", "optimizer", [
        ("ServicerBase._get_handle_name", "subclassed averagers serve RPCs under hivemind's class names"),
    ])
    + _symbols(_MATCHMAKING, "matchmaking", [
        ("PotentialLeaders", "subclassed: the leader search polls the DHT at a bounded rate"),
        ("PotentialLeaders._update_queue_periodically", "overridden: hivemind's loop with a pause between polls"),
    ])
    + _symbols(_MATCHMAKING, "matchmaking", [
        ("PotentialLeaders.peer_id", "read/rebuilt by the throttled leader search"),
        ("PotentialLeaders.min_matchmaking_time", "read/rebuilt by the throttled leader search"),
        ("PotentialLeaders.target_group_size", "read/rebuilt by the throttled leader search"),
        ("PotentialLeaders.search_end_time", "deadline of the search loop"),
        ("PotentialLeaders.max_assured_time", "updated by the search loop as hivemind does"),
        ("PotentialLeaders.leader_queue", "filled by the search loop as hivemind does"),
        ("PotentialLeaders.past_attempts", "leaders already tried, skipped by the search loop"),
        ("PotentialLeaders.running", "search loop events, as hivemind's loop uses them"),
        ("PotentialLeaders.update_triggered", "search loop events, as hivemind's loop uses them"),
        ("PotentialLeaders.update_finished", "search loop events, as hivemind's loop uses them"),
        ("Matchmaking.potential_leaders", "replaced by ThrottledPotentialLeaders"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "matchmaking", [
        ("DecentralizedAverager._matchmaking", "intercepted as hivemind assigns it, to swap in the throttled search"),
    ], instance=True)
    + _symbols("hivemind.dht.dht", "lifetime", [
        ("DHT._inner_pipe", "the DHT process's end of the request pipe, wrapped to read whole requests"),
        ("DHT._outer_pipe", "the creator's end of the request pipe, wrapped to send one thread's request at a time"),
    ], instance=True)
    + _symbols("hivemind.utils.mpfuture", "lifetime", [
        ("MPFuture._update_lock", "replaced when the DHT process dies: it may have died holding it"),
        ("MPFuture._initialization_lock", "replaced when the DHT process dies: it may have died holding it"),
        ("SharedBytes._lock", "replaced when the DHT process dies: it may have died holding it"),
    ])
    + _symbols("hivemind.averaging.key_manager", "group_keys", [
        ("GroupKeyManager.update_key_on_not_enough_peers", "overridden: a peer alone under its key moves to another"),
    ])
    + _symbols("hivemind.averaging.key_manager", "group_keys", [
        ("GroupKeyManager.group_bits", "the peer's current group key bits, replaced when it moves"),
        ("GroupKeyManager.prefix", "the averager's key prefix, for the log"),
    ], instance=True)
    + _symbols(_MATCHMAKING, "group_keys", [
        ("Matchmaking.group_key_manager", "its class is switched to MovingGroupKeyManager"),
        ("Matchmaking.client_mode", "a client-mode peer also moves after a search that found no group"),
    ], instance=True)
    + _symbols(_MATCHMAKING, "group_keys", [
        ("Matchmaking.look_for_group", "wrapped for client-mode peers: a search that found no group moves the key"),
    ])
    + _symbols("hivemind.averaging.averager", "group_keys", [
        ("DecentralizedAverager._matchmaking", "intercepted as hivemind assigns it, to switch its key manager"),
    ], instance=True)
    + _symbols("hivemind.utils.timed_storage", "matchmaking", [
        ("MAX_DHT_TIME_DISCREPANCY_SECONDS", "the search loop's margin, as in hivemind"),
    ])
    + _symbols(_TRACKER, "tracker", [
        ("ProgressTracker._parse_swarm_progress_data", "overridden: count our own samples from live progress"),
    ])
    + _symbols(_TRACKER, "tracker", [
        ("ProgressTracker._local_public_key", "finds our own record among the swarm's progress records"),
        ("ProgressTracker.should_report_progress", "replaced by an event that wakes the reporter at a bounded rate"),
        ("ProgressTracker.shutdown_triggered", "set on shutdown, before the last report"),
        ("ProgressTracker.global_state_updated", "set on shutdown to wake the fetcher"),
        ("ProgressTracker.shutdown_complete", "awaited on shutdown"),
        ("ProgressTracker.training_progress_key", "DHT key of the progress records (also for the monitor's revert)"),
        ("ProgressTracker.metadata_expiration", "expiration of the 'left the run' record"),
    ], instance=True)
    + _symbols("hivemind.optim.grad_averager", "grad_averager", [
        ("GradientAverager._grad_accumulators", "read to load the sample-weighted mean into the averager"),
        ("GradientAverager.load_accumulators_into_averager_", "overridden: mean over samples, not local steps"),
        ("GradientAverager.reset_accumulated_grads_", "extended: a new accumulation moves the worker momentum again"),
    ])
    + _symbols("hivemind.optim.grad_averager", "grad_averager", [
        ("GradientAverager._anchor_batch_size", "the batch size hivemind scales accumulated gradients by"),
        ("GradientAverager.local_samples_accumulated", "samples in the accumulators"),
    ], instance=True)
    + _symbols("hivemind.averaging.partition", "robust_allreduce", [
        ("TensorPartReducer.reset_accumulators", "overridden: keep each sender's part instead of a running sum"),
        ("TensorPartReducer.accumulate_part", "overridden: hivemind's wait-for-part logic, storing the part"),
        ("TensorPartReducer.check_current_part_finished", "overridden: aggregate the screened parts in a thread"),
        ("TensorPartReducer.finalize", "extended: log the refused senders, record their alignment, once per round"),
        ("TensorPartContainer.register_processed_part", "extended: refuse a non-finite result from a reducer"),
        ("TensorPartContainer.finalize", "extended: log the reducers whose results were refused"),
    ])
    + _symbols("hivemind.averaging.partition", "robust_allreduce", [
        ("TensorPartReducer.current_part_index", "reducer state, handled as hivemind's reducer does"),
        ("TensorPartReducer.current_part_accumulated_from", "reducer state, handled as hivemind's reducer does"),
        ("TensorPartReducer.current_part_future", "reducer state, handled as hivemind's reducer does"),
        ("TensorPartReducer.num_current_senders", "reducer state, handled as hivemind's reducer does"),
        ("TensorPartReducer.sender_failed_after", "reducer state, handled as hivemind's reducer does"),
        ("TensorPartReducer.num_parts_received", "reducer state, handled as hivemind's reducer does"),
        ("TensorPartReducer.accumulator", "reducer state, handled as hivemind's reducer does"),
        ("TensorPartReducer.denominator", "reducer state, handled as hivemind's reducer does"),
        ("TensorPartReducer.finished", "marks hivemind's reducer done before it is replaced"),
        ("TensorPartContainer._input_parts_by_peer", "the local part kept where a reducer's result is refused"),
        ("TensorPartContainer.finished", "marks hivemind's container done before it is replaced"),
    ], instance=True)
    + _symbols("hivemind.averaging.allreduce", "robust_allreduce", [
        ("AllReduceRunner.tensor_part_container", "replaced by a CheckedTensorPartContainer"),
        ("AllReduceRunner.tensor_part_reducer", "replaced by a RobustTensorPartReducer"),
        ("AllReduceRunner.parts_for_local_averaging", "re-taken from the replacement container"),
        ("AllReduceRunner.sender_peer_ids", "names the senders and orders their weight bounds"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "gathered_checks", [
        ("DecentralizedAverager._aggregate_with_group", "extended: malformed gathered data of a member replaced"),
        ("DecentralizedAverager.serializer", "decodes the members' gathered data as hivemind does"),
    ])
    + _symbols("hivemind.averaging.allreduce", "part_checks", [
        ("AllReduceRunner._accumulate_parts_streaming", "extended: a sender's parts are checked before decoding"),
        ("AllReduceRunner._get_peer_stub", "extended: a reducer's results are checked before decoding"),
        ("AllReduceRunner.rpc_aggregate_part", "extended: the reducer's end stays open until the sender closes"),
    ])
    + _symbols(_MATCHMAKING, "stream_ends", [
        ("Matchmaking._request_join_group", "relied on: the follower closes its stream after the leader's last answer"),
    ])
    + _symbols("hivemind.averaging.partition", "part_checks", [
        ("TensorPartContainer._input_parts_by_peer", "the parts sent to a reducer: its results must match them"),
    ], instance=True)
    + _symbols("hivemind.averaging.allreduce", "part_checks", [
        ("AllReduceRunner.sender_peer_ids", "names the sender whose part is refused"),
        ("AllReduceRunner.parts_for_local_averaging", "the shapes and dtypes every sender's parts must have"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "robust_allreduce", [
        ("DecentralizedAverager._run_allreduce_inplace_", "overridden: hivemind's, building a RobustAllReduceRunner"),
    ])
    + _symbols("hivemind.averaging.partition", "robust_allreduce", [
        ("TensorPartContainer.register_failed_reducer", "extended: a failed reducer's slice can't be checked"),
    ])
    + _symbols("hivemind.averaging.allreduce", "result_records", [
        ("AllReduceRunner._accumulate_parts_streaming", "extended: each result gets the reducer's header attached"),
        ("AllReduceRunner._get_peer_stub", "extended: each result message is recorded for the check"),
    ])
    + _symbols("hivemind.averaging.allreduce", "result_records", [
        ("AllReduceRunner.tensor_part_reducer", "holds the statements attached to the results"),
        ("AllReduceRunner.tensor_part_container", "holds the results kept for the check"),
    ], instance=True)
    + _symbols("hivemind.averaging.allreduce", "result_verification", [
        ("AllReduceRunner.tensor_part_container", "holds the results kept for the check"),
        ("AllReduceRunner.sender_peer_ids", "the members that exchange reports"),
        ("AllReduceRunner.tensor_part_reducer", "holds the parts and results the reducer's claims are made from"),
    ], instance=True)
    + _symbols("hivemind.averaging.partition", "result_records", [
        ("TensorPartContainer._input_parts_by_peer", "this peer's own parts, kept with the results for the check"),
    ], instance=True)
    + _symbols("hivemind.averaging.partition", "result_verification", [
        ("TensorPartReducer.num_parts_received", "a sender that sent none of its parts failed the round"),
        ("TensorPartReducer.num_parts", "whether this peer's reducer had parts to collect"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "result_verification", [
        ("DecentralizedAverager._p2p", "calls the other members' rpc_reducer_report"),
    ], instance=True)
    + _symbols("hivemind.p2p.servicer", "result_verification", [
        ("ServicerBase._rpc_handlers", "reset per class: rpc_reducer_report is collected for each averager class"),
        ("ServicerBase._stub_type", "reset with the handlers it is built from"),
    ])
    + _symbols("hivemind.averaging.averager", "robust_allreduce", [
        ("DecentralizedAverager._p2p", "passed to the all-reduce runner, as hivemind does"),
        ("DecentralizedAverager._running_groups", "where the runner is registered, as hivemind does (failed at once "
                                                  "when this peer leaves the group)"),
        ("DecentralizedAverager._averaging_alpha", "applied to each averaged update, as hivemind does"),
        ("DecentralizedAverager._state_updated", "set after each update, as hivemind does"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "robust_allreduce", [
        ("DecentralizedAverager._step", "extended: remembers the rounds under way (a round this peer leaves)"),
    ])
    + _symbols("hivemind.averaging.control", "robust_allreduce", [
        ("StepControl._allow_retries", "cleared on the round this peer leaves, or a merge that got part of its "
                                       "results: it is not retried"),
    ], instance=True)
    + _symbols("hivemind.averaging.partition", "robust_allreduce", [
        ("TensorPartContainer.failed_size", "values of failed reducers' slices: a merging round fails on any"),
        ("TensorPartContainer.total_size", "the round's values, for the share received"),
    ], instance=True)
    + _symbols("hivemind.optim.state_averager", "state_snapshot", [
        ("TrainingStateAverager.get_current_state", "extended: under the optimizer's lock, labelled with the epoch "
                                                    "of the update the state holds"),
    ])
    + _symbols("hivemind.optim.state_averager", "state_snapshot", [
        ("TrainingStateAverager.lock_optimizer", "held while the state is read: no optimizer step half done"),
        ("TrainingStateAverager.pending_updates", "whether a background update is under way"),
    ], instance=True)
    + _symbols("hivemind.optim.state_averager", "state", [
        ("TrainingStateAverager._update_scheduler", "steps the LR schedule to a new epoch set by the monitor"),
    ])
    + _symbols("hivemind.averaging.averager", "state_download", [
        ("DecentralizedAverager._outer_pipe", "sends the download request to the averager's process"),
        ("DecentralizedAverager._averaged_tensors", "shapes a plain averager's downloaded state must have"),
        ("DecentralizedAverager._p2p", "the averager process's p2p, to call the donor"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "state_download", [
        ("DecentralizedAverager.serializer", "decodes the donor's metadata as hivemind does"),
        ("DecentralizedAverager._load_state_from_peers", "overridden: verified, retried, logged download"),
    ])
    + _symbols("hivemind.optim.state_averager", "state_download", [
        ("TrainingStateAverager.main_parameters", "shapes the downloaded parameters must have"),
        ("TrainingStateAverager.extra_tensors", "shapes the downloaded extra tensors must have"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "auth_guards", [
        ("DecentralizedAverager._step", "overridden: adds this peer's join proof to the data it sends its group"),
        ("DecentralizedAverager._aggregate_with_group", "overridden: checks every member's proof first"),
    ])
    + _symbols(_MATCHMAKING, "auth_guards", [
        ("Matchmaking.current_followers", "a leader's followers: a user already seated there is refused a second seat"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "auth_guards", [
        ("DecentralizedAverager._matchmaking", "where a leader's followers are read"),
    ], instance=True)
    + _symbols("hivemind.averaging.control", "auth_guards", [
        ("StepControl._data_for_gather", "replaced by the same data with this peer's join proof inside"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "round_groups", [
        ("DecentralizedAverager._aggregate_with_group", "extended: remembers the groups of finished rounds"),
    ])
    + _symbols("hivemind.averaging.averager", "round_groups", [
        ("DecentralizedAverager._running_groups", "a groupmate's part waits until its group is registered here"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "weight_bounds", [
        ("DecentralizedAverager._step", "extended: the round's StepControl kept for its weight bounds"),
        ("DecentralizedAverager._run_internal", "runs the method a pipe message names: _note_round_counts is sent so"),
    ])
    + _symbols("hivemind.averaging.averager", "weight_bounds", [
        ("DecentralizedAverager._outer_pipe", "sends the tracker's counts of the round's epoch to the averager"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "epoch_rounds", [
        ("DecentralizedAverager._step", "extended: the round's epoch put on its StepControl"),
        ("DecentralizedAverager._run_internal", "runs the method a pipe message names: _set_round_epoch is sent so"),
    ])
    + _symbols("hivemind.averaging.averager", "epoch_rounds", [
        ("DecentralizedAverager._outer_pipe", "sends the epoch of the next round to the averager's process"),
    ], instance=True)
    + _symbols(_MATCHMAKING, "epoch_rounds", [
        ("Matchmaking.step_control", "the round being matched, whose epoch names the group key"),
    ], instance=True)
    + _symbols("hivemind.averaging.key_manager", "epoch_rounds", [
        ("GroupKeyManager.current_key", "overridden: the key names the epoch of the round being matched"),
    ])
    + _symbols("hivemind.averaging.key_manager", "epoch_rounds", [
        ("GroupKeyManager.prefix", "the averager's key prefix, to which the epoch is appended"),
        ("GroupKeyManager.group_bits", "the group bits, kept in the key as hivemind's"),
    ], instance=True)
    + _symbols("hivemind.averaging.averager", "state_serving", [
        ("DecentralizedAverager.rpc_download_state", "overridden: token holders only, bounded downloads at once"),
        ("DecentralizedAverager.serializer", "decodes the requester's proof as the averagers' join proofs"),
    ])
    + _symbols("hivemind.p2p.servicer", "state_serving", [
        ("ServicerBase._rpc_handlers", "reset per class: rpc_download_state reads a JoinRequest (the proof inside)"),
        ("ServicerBase._stub_type", "reset with the handlers it is built from"),
    ])
    + _symbols(_OPTIMIZER, "catch_up", [
        ("Optimizer._should_load_state_from_peers", "extended: a stale state within max_stale_epochs follows the swarm"),
        ("Optimizer._update_global_epoch", "skipped while the peer sits out an epoch it arrived at as it ended"),
    ])
    + _symbols("hivemind.optim.state_averager", "catch_up", [
        ("TrainingStateAverager._update_scheduler", "steps the LR schedule to the swarm's epoch it adopts"),
    ])
    + _symbols(_TRACKER, "tracker", [
        ("ProgressTracker.lock_global_progress", "held while a fetch on demand replaces the global progress"),
        ("ProgressTracker.fetched_global_progress_this_epoch", "set by a fetch on demand, as by hivemind's fetcher"),
    ], instance=True)
    + _symbols("hivemind.utils.crypto", "keys", [
        ("RSAPrivateKey._process_wide_key", "set to the key an offline token was issued for"),
        ("RSAPrivateKey._process_wide_key_lock", "held while setting it"),
    ])
    + _symbols("hivemind.utils.crypto", "keys", [
        ("RSAPrivateKey._private_key", "the cryptography key inside, loaded from / written to PEM"),
    ], instance=True)
    + _symbols("hivemind.compression.serialization", "codecs", [
        ("_BASE_COMPRESSION_TYPES", "the decoder registry: numpy-2.4-safe 8-bit decoders are installed in it"),
    ])
)


def _resolve(symbol: PrivateSymbol):
    obj = importlib.import_module(symbol.module)
    for part in symbol.name.split("."):
        obj = getattr(obj, part)
    return obj


def _assigned_in_class(symbol: PrivateSymbol) -> bool:
    """Whether a method of the class (or of a hivemind base class) assigns ``self.<attribute>``."""
    owner_path, attribute = symbol.name.rsplit(".", 1)
    owner = _resolve(PrivateSymbol(symbol.module, owner_path, "", ""))
    assignment = re.compile(rf"^\s*(self\.\w+\s*,\s*)*self\.{attribute}\b\s*(,\s*self\.\w+\s*)*(:[^=]*)?=(?!=)", re.MULTILINE)
    for cls in inspect.getmro(owner):
        if cls.__module__.startswith("hivemind.") and assignment.search(inspect.getsource(cls)):
            return True
    return False


def symbol_exists(symbol: PrivateSymbol) -> bool:
    """Whether the installed hivemind still has ``symbol``."""
    try:
        if symbol.instance:
            return _assigned_in_class(symbol)
        _resolve(symbol)  # raises AttributeError if gone
        return True
    except (ImportError, AttributeError):
        return False


def missing_symbols() -> List[str]:
    """Qualified names of the :data:`PRIVATE_SYMBOLS` the installed hivemind no longer has."""
    return [symbol.qualified_name for symbol in PRIVATE_SYMBOLS if not symbol_exists(symbol)]


def check_hivemind_version(installed: Optional[str] = None) -> str:
    """Raise ImportError unless hivemind's version is in :data:`SUPPORTED_HIVEMIND`; return the version.

    With the environment variable ``LIGHTNING_SWARM_IGNORE_HIVEMIND_VERSION=1`` an unsupported version only warns.

    Args:
        installed: the version to check; default: the installed hivemind's.
    """
    if installed is None:
        try:
            installed = version("hivemind")
        except PackageNotFoundError as e:
            raise ImportError("lightning_swarm needs hivemind: pip install 'hivemind==1.1.12'") from e
    if Version(installed) in SUPPORTED_HIVEMIND:
        return installed
    message = (
        f"lightning_swarm uses private parts of hivemind that were checked for hivemind{SUPPORTED_HIVEMIND_RANGE}, but "
        f"hivemind {installed} is installed. Install a supported release (pip install 'hivemind==1.1.12'), or set "
        f"{IGNORE_VERSION_ENV}=1 to try this one (then run tests/lightning_swarm/test_hivemind_ext.py, which names "
        "the private symbols that moved)."
    )
    if os.environ.get(IGNORE_VERSION_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return installed
    raise ImportError(message)
