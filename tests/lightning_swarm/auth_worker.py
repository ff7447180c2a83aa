"""Peers of a run with an authority, for tests: honest ones (valid token) and outsiders (none, expired, revoked).

    python auth_worker.py honest --name a --run R --authority authority.pem.pub --token a.token --key a.pem \
        --out a.json [--initial-peer ADDR] --seconds 30
    python auth_worker.py honest ... --server URL --username alice --key alice.pem   (a token from the authority)
    python auth_worker.py outsider --mode none|expired|revoked --run R --authority ... --initial-peer ADDR \
        --leader PEER_ID --out x.json [--token t --key k | --server URL --username carol --key k]

An honest peer publishes a metrics record and averages a small tensor over and over (groups of up to 3), logging
who was in each group; at the end it writes the metrics records and probe keys it sees in the DHT. An outsider
presents whatever token it has (an attacker's client does not give up when its token is refused), stores records
and sends join requests straight to the honest leader; it writes what it got back. A revoked outsider first gets
a valid token from the authority service, prints ``GOT_TOKEN``, and waits for the file ``<out>.banned`` (the
test removes it from the allowlist meanwhile) and for the token to expire.
"""

import argparse
import json
import os
import sys
import time

import torch

PROBE_KEY = "{run}_probe"


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["honest", "outsider"])
    parser.add_argument("--name", default="x")
    parser.add_argument("--mode", choices=["none", "expired", "revoked"], default=None)
    parser.add_argument("--run", required=True)
    parser.add_argument("--authority", required=True, help="authority public key")
    parser.add_argument("--token"), parser.add_argument("--key"), parser.add_argument("--server")
    parser.add_argument("--username")
    parser.add_argument("--initial-peer", default=None)
    parser.add_argument("--leader", default=None, help="base58 peer id of an honest peer (outsiders)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=30.0, help="honest peers: run at most this long")
    parser.add_argument("--stop-file", default=None, help="honest peers: stop once this file exists")
    return parser.parse_args()


def make_averager_class(authenticated: bool):
    from hivemind.averaging import DecentralizedAverager
    from hivemind.proto import averaging_pb2
    from hivemind.utils import MPFuture, get_dht_time

    from lightning_swarm.hivemind_ext.auth_guards import AuthenticatedAveraging

    class DirectJoin:
        """join_directly(leader): send a well-formed join request straight to ``leader``; the leader's answer code."""

        def join_directly(self, leader):
            future = MPFuture()
            self._outer_pipe.send(("_join_directly", [], dict(leader=leader, future=future)))
            return future.result(timeout=30)

        async def _join_directly(self, leader, future):
            try:
                gather = self.serializer.dumps([self.bandwidth, self.mode.value, self.serializer.dumps("intruder")])
                request = averaging_pb2.JoinRequest(
                    schema_hash=self._matchmaking.schema_hash, expiration=get_dht_time() + 30, gather=gather,
                    group_key=self._matchmaking.group_key_manager.current_key)
                stream = await self.get_stub(self._p2p, leader, namespace=self.prefix).rpc_join_group(request)
                async for message in stream:
                    future.set_result(averaging_pb2.MessageCode.Name(message.code))
                    return
                future.set_result("NO_ANSWER")
            except Exception as e:
                future.set_result(f"ERROR {e!r}")

    bases = (DirectJoin, AuthenticatedAveraging, DecentralizedAverager) if authenticated else \
        (DirectJoin, DecentralizedAverager)
    return type("TestAverager", bases, {})


def averager_kwargs():
    return dict(prefix="auth_test", target_group_size=4, min_group_size=2, min_matchmaking_time=2.0,
                request_timeout=1.0, start=True)


def honest(args) -> None:
    from lightning_swarm.hivemind_ext.lifetime import SwarmDHT  # hivemind.DHT whose death is noticed
    from hivemind.utils import get_dht_time

    from lightning_swarm import metrics
    from lightning_swarm.auth.authorizer import OwnerIsRequesterValidator, SwarmAuthorizer
    from lightning_swarm.auth.peer import SwarmAuth

    if args.server:  # a token from the authority service, for this process's own key
        auth = SwarmAuth(args.run, args.authority, server=args.server, username=args.username, key=args.key)
    else:
        auth = SwarmAuth(args.run, args.authority, token=args.token, key=args.key)
    auth.token()
    auth.install()
    dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                   initial_peers=[args.initial_peer] if args.initial_peer else [],
                   authorizer=SwarmAuthorizer(auth),
                   record_validators=metrics.make_validators(args.run) + [OwnerIsRequesterValidator()])
    print("PEER", dht.get_visible_maddrs()[0], dht.peer_id.to_base58(), flush=True)
    averager = make_averager_class(True)([torch.zeros(8)], dht, swarm_auth=auth, **averager_kwargs())
    groups, deadline = [], time.monotonic() + args.seconds
    try:
        while time.monotonic() < deadline and not (args.stop_file and os.path.exists(args.stop_file)):
            record = metrics.LocalMetrics(step=0, loss=1.0, samples_per_second=1.0, samples_accumulated=1,
                                          mini_steps=1, time=float(get_dht_time()))
            metrics.publish_metrics(dht, args.run, record)
            try:
                gathered = averager.step(gather=args.name, timeout=6.0, allow_retries=False)
            except Exception as e:  # no group this round (e.g. alone at first)
                print("NO_GROUP", repr(e)[:100], flush=True)
                continue
            if gathered:
                groups.append(sorted(gathered.values()))
                print("GROUP", sorted(gathered.values()), flush=True)
        metric_owners = sorted(key.decode(errors="replace")[-20:] for key in metrics.fetch_metrics(dht, args.run))
        probe = dht.get(PROBE_KEY.format(run=args.run), latest=True)
        with open(args.out, "w") as f:
            json.dump(dict(groups=groups, metric_owners=metric_owners,
                           own_key=metrics.local_public_key().decode()[-20:],
                           probe=None if probe is None else repr(probe.value)), f)
    finally:
        averager.shutdown()
        dht.shutdown()


def outsider(args) -> None:
    from lightning_swarm.hivemind_ext.lifetime import SwarmDHT  # hivemind.DHT whose death is noticed
    from hivemind.utils import get_dht_time
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.p2p import PeerID
    from hivemind.utils.auth import TokenAuthorizerBase
    from hivemind.utils.crypto import RSAPrivateKey

    from lightning_swarm.auth.peer import SwarmAuth
    from lightning_swarm.auth.tokens import AuthError, load_private_key, token_from_json

    key, token = RSAPrivateKey.process_wide(), None
    if args.mode == "expired":
        key, token = load_private_key(args.key), token_from_json(open(args.token).read())
    elif args.mode == "revoked":
        auth = SwarmAuth(args.run, args.authority, server=args.server, username=args.username, key=args.key)
        token, key = auth.token(), auth.private_key
        print("GOT_TOKEN", token.expiration_time, flush=True)
        while not os.path.exists(args.out + ".banned"):
            time.sleep(0.1)
        while True:  # until the authority stops renewing it: then the peer says why, in one line
            try:
                auth._token = None
                auth.token()
                time.sleep(0.5)
            except AuthError as e:
                print("REFUSED", e, flush=True)
                break
        from lightning_swarm.auth.tokens import expiration_timestamp

        time.sleep(max(0.0, expiration_timestamp(token) - time.time()) + 0.5)
    if key is not RSAPrivateKey.process_wide():
        RSAPrivateKey._process_wide_key = key

    class StaleTokenAuthorizer(TokenAuthorizerBase):
        """Presents its token whatever its state, like a client written to ignore refusals."""

        async def get_token(self):
            return token

        def is_token_valid(self, access_token):
            return True

        def does_token_need_refreshing(self, access_token):
            return False

    dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[args.initial_peer],
                   authorizer=StaleTokenAuthorizer(key) if token is not None else None,
                   record_validators=[RSASignatureValidator(key)], ensure_bootstrap_success=False)
    from lightning_swarm import metrics

    stores = []
    for _ in range(3):
        record = metrics.LocalMetrics(step=10**6, loss=0.0, samples_per_second=1e9, samples_accumulated=10**9,
                                      mini_steps=1, time=float(get_dht_time()))
        stores.append(bool(dht.store(metrics.metrics_key(args.run), record.dict(), get_dht_time() + 60,
                                     subkey=RSASignatureValidator(key).local_public_key)))
        stores.append(bool(dht.store(PROBE_KEY.format(run=args.run), args.mode, get_dht_time() + 60)))
        time.sleep(0.5)
    averager = make_averager_class(False)([torch.zeros(8)], dht, **averager_kwargs())
    codes = []
    try:
        for _ in range(4):
            codes.append(averager.join_directly(PeerID.from_base58(args.leader)))
            time.sleep(0.5)
        print("CODES", codes, flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(codes=codes, local_stores=stores), f)
    finally:
        averager.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    arguments = parse_args()
    honest(arguments) if arguments.role == "honest" else outsider(arguments)
    sys.exit(0)
