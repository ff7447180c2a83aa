"""Allowlist authentication: tokens, the authority service, the clear line a refused peer gets, and (slow) real
peers on 127.0.0.1: outsiders without, with an expired or with a revoked token get no record into the DHT and
into no averaging group."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_swarm.auth.peer import SwarmAuth, resolve_auth_settings
from lightning_swarm.auth.revert import RevertOrder
from lightning_swarm.auth.service import Authority, AuthorityServer
from lightning_swarm.auth.tokens import (
    AuthError,
    check_token,
    generate_key,
    issue_token,
    read_public_key,
    save_key,
    token_to_json,
)
from lightning_swarm.hivemind_ext import auth_guards
from lightning_swarm.hivemind_ext.credentials import CredentialsError

WORKER = Path(__file__).with_name("auth_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def authority(tmp_path_factory):
    """The authority key saved in a folder, with two user keys (alice and bob) beside it."""
    root = tmp_path_factory.mktemp("authority")
    paths = {}
    for name in ("authority", "alice", "bob"):
        paths[name] = str(root / f"{name}.pem")
        save_key(generate_key(), paths[name])
    paths["root"] = root
    return paths


def _issue(authority, user, run_id="run", lifetime=3600.0, path=None):
    from lightning_swarm.auth.tokens import load_private_key

    token = issue_token(load_private_key(authority["authority"]), run_id, user,
                        read_public_key(authority[user] + ".pub"), lifetime)
    path = path or str(authority["root"] / f"{user}-{lifetime}.token")
    Path(path).write_text(token_to_json(token))
    return token, path


def test_tokens_are_bound_to_the_run_the_key_and_the_clock(authority):
    authority_key = read_public_key(authority["authority"] + ".pub")
    token, _ = _issue(authority, "alice", lifetime=60)
    assert check_token(token, authority_key, "run").ok
    assert "not signed by the authority of run 'other'" in check_token(token, authority_key, "other").reason
    assert "expired" in check_token(token, authority_key, "run", now=time.time() + 61).reason
    assert not check_token(token, read_public_key(authority["bob"] + ".pub"), "run").ok  # another authority
    token.username = "mallory"
    assert not check_token(token, authority_key, "run").ok  # tampered
    assert check_token(None, authority_key, "run").reason == "no access token"


def test_auth_settings_default_off_and_from_the_environment(monkeypatch, authority):
    assert resolve_auth_settings(None) == {}  # an open run needs no setup
    monkeypatch.setenv("LIGHTNING_SWARM_AUTH_AUTHORITY_KEY", authority["authority"] + ".pub")
    monkeypatch.setenv("LIGHTNING_SWARM_AUTH_TOKEN", "t.token")
    assert resolve_auth_settings({"key": "k.pem"}) == dict(authority_key=authority["authority"] + ".pub",
                                                           token="t.token", key="k.pem")
    monkeypatch.delenv("LIGHTNING_SWARM_AUTH_AUTHORITY_KEY")
    with pytest.raises(ValueError, match="without authority_key"):
        resolve_auth_settings({})
    with pytest.raises(ValueError, match="unknown field"):
        resolve_auth_settings({"tokn": "x"})


def test_a_peer_without_with_an_expired_or_with_a_revoked_token_gets_one_clear_line(authority):
    public = authority["authority"] + ".pub"
    with pytest.raises(AuthError, match=r"^\[lightning_swarm\] run 'run' requires an access token and none is "):
        SwarmAuth("run", public).token()
    _, expired = _issue(authority, "alice", lifetime=1)
    time.sleep(1.1)
    with pytest.raises(AuthError, match=r"^\[lightning_swarm\] cannot join run 'run': the token of 'alice' expired"):
        SwarmAuth("run", public, token=expired, key=authority["alice"]).token()

    allowlist = authority["root"] / "allowlist.txt"
    alice_line = f"alice {Path(authority['alice'] + '.pub').read_text().strip()}  # alice's laptop\n"
    allowlist.write_text("# users of run 'run'\n" + alice_line)
    from lightning_swarm.auth.tokens import load_private_key

    server = AuthorityServer(Authority(load_private_key(authority["authority"]), "run", str(allowlist),
                                       token_lifetime=30)).start()
    try:
        alice = SwarmAuth("run", public, server=server.url, username="alice", key=authority["alice"])
        token = alice.token()
        assert token.username == "alice" and token.public_key == alice.public_key.to_bytes()
        assert alice.token() is token  # not renewed before half its lifetime
        # bob signs as alice: refused
        impostor = SwarmAuth("run", public, server=server.url, username="alice", key=authority["bob"])
        with pytest.raises(AuthError, match="refused a token for user 'alice': the request is not signed by a key the allowlist "
                                             "lists for this user"):
            impostor.token()
        # the ban: alice's line is removed; her next renewal is refused, in one line
        allowlist.write_text("# users of run 'run'\n")
        alice._token = None
        with pytest.raises(AuthError, match=r"^\[lightning_swarm\] the authority of run 'run' refused a token for "
                                            r"user 'alice': this user is not on the allowlist of this run"):
            alice.token()
    finally:
        server.stop()


def test_epoch_claims_and_state_sources_need_another_peer_to_confirm_them():
    assert auth_guards.implausible_claims({"a": 10, "b": 10, "x": 1000}, own_epoch=10) == ["x"]
    assert auth_guards.implausible_claims({"a": 100, "b": 99}, own_epoch=0) == []  # a late joiner catches up
    assert auth_guards.implausible_claims({"a": 11}, own_epoch=10) == []  # the next epoch began elsewhere
    assert auth_guards.credible_newest_epoch({"a": 10, "b": 11, "x": 1000}) == 11
    assert auth_guards.credible_newest_epoch({"a": 10, "x": 1000}) == 10  # one trainer, one liar: not the lie
    assert auth_guards.credible_newest_epoch({}) is None
    assert auth_guards.plausible_sources({"a": 10.0, "b": 9.0, "x": 1e9}) == {"a": 10.0, "b": 9.0}
    assert auth_guards.plausible_sources({"a": 10.0}) == {"a": 10.0}


def test_a_join_proof_admits_its_peer_id_only(authority):
    _, path = _issue(authority, "alice")
    public = authority["authority"] + ".pub"
    alice = SwarmAuth("run", public, token=path, key=authority["alice"])
    proof = alice.join_proof("run_grad_averager", b"peer-a")
    assert alice.check_join_proof(proof, "run_grad_averager", b"peer-a").ok
    assert "not signed for this peer id" in alice.check_join_proof(proof, "run_grad_averager", b"peer-b").reason
    assert not alice.check_join_proof(proof, "run_state_averager", b"peer-a").ok
    assert alice.check_join_proof(None, "run_grad_averager", b"peer-a").reason == "no access token"
    assert alice.check_join_proof({"token": "x"}, "run_grad_averager", b"peer-a").reason == "a malformed join proof"
    with pytest.raises(CredentialsError):  # what the averagers catch: an AuthError
        SwarmAuth("run", public).join_proof("run_grad_averager", b"peer-a")


def test_the_command_line_issues_a_token_and_takes_the_old_flag_spellings(authority, tmp_path):
    from lightning_swarm.auth.__main__ import main

    out = tmp_path / "alice.token"
    main(["issue", "--authority-key", authority["authority"], "--run-id", "run", "--username", "alice",
          "--public-key", authority["alice"] + ".pub", "--lifetime", "1h", "--out", str(out)])
    authority_key = read_public_key(authority["authority"] + ".pub")
    from lightning_swarm.auth.tokens import token_from_json

    assert check_token(token_from_json(out.read_text()), authority_key, "run").ok
    with pytest.warns(FutureWarning, match="--public_key is deprecated, use --public-key"):
        main(["issue", "--authority-key", authority["authority"], "--run-id", "run", "--username", "alice",
              "--public_key", authority["alice"] + ".pub", "--out", str(out)])


def test_revert_orders_verify_only_with_the_authority_key(authority):
    from lightning_swarm.auth.tokens import load_private_key

    authority_public = read_public_key(authority["authority"] + ".pub")
    order = RevertOrder.create(load_private_key(authority["authority"]), "run", 42, "QmPeer", "ckpt/epoch_40", 60)
    assert RevertOrder.parse(json.loads(json.dumps(order.__dict__))).is_valid(authority_public, "run")
    assert not order.is_valid(authority_public, "other-run")
    forged = RevertOrder.create(load_private_key(authority["alice"]), "run", 42, "QmPeer", "ckpt/epoch_40", 60)
    assert not forged.is_valid(authority_public, "run")
    assert RevertOrder.parse({"epoch": "x"}) is None


# --------------------------------------------------------------------------------------------- real peers


def _spawn(args, log_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(WORKER.parent)]))
    for name in list(env):
        if name.startswith("LIGHTNING_SWARM_"):
            env.pop(name)
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, str(WORKER), *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _wait_line(log_path, prefix, process, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in Path(log_path).read_text(errors="replace").split("\n")[:-1]:  # complete lines only
            if line.startswith(prefix):
                return line
        if process.poll() is not None:
            break
        time.sleep(0.2)
    raise TimeoutError(f"no {prefix!r} line:\n{Path(log_path).read_text(errors='replace')[-3000:]}")


def _kill(process):
    import signal

    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_outsiders_get_no_record_in_and_into_no_averaging_group(authority, tmp_path):
    from lightning_swarm.auth.tokens import load_private_key

    public = authority["authority"] + ".pub"
    run = "authrun"
    _, alice_token = _issue(authority, "alice", run_id=run, path=str(tmp_path / "alice.token"))
    _, bob_token = _issue(authority, "bob", run_id=run, path=str(tmp_path / "bob.token"))
    carol_key = str(tmp_path / "carol.pem")
    save_key(generate_key(), carol_key)
    _, expired_token = _issue({**authority, "carol": carol_key}, "carol", run_id=run, lifetime=0.5,
                              path=str(tmp_path / "expired.token"))
    allowlist = tmp_path / "allowlist.txt"
    allowlist.write_text(f"carol {Path(carol_key + '.pub').read_text().strip()}\n")
    server = AuthorityServer(Authority(load_private_key(authority["authority"]), run, str(allowlist),
                                       token_lifetime=4)).start()
    processes = []
    try:
        common = ["--run", run, "--authority", public, "--seconds", "150", "--stop-file", str(tmp_path / "stop")]
        a = _spawn(["honest", "--name", "a", *common, "--token", alice_token, "--key", authority["alice"],
                    "--out", str(tmp_path / "a.json")], tmp_path / "a.log")
        processes.append(a)
        _, address, leader = _wait_line(tmp_path / "a.log", "PEER", a, 60).split()
        b = _spawn(["honest", "--name", "b", *common, "--token", bob_token, "--key", authority["bob"],
                    "--initial-peer", address, "--out", str(tmp_path / "b.json")], tmp_path / "b.log")
        processes.append(b)
        outsiders = {}
        for mode, extra in [("none", []), ("expired", ["--token", expired_token, "--key", carol_key]),
                            ("revoked", ["--server", server.url, "--username", "carol", "--key", carol_key])]:
            out = tmp_path / f"{mode}.json"
            outsiders[mode] = _spawn(["outsider", "--mode", mode, "--run", run, "--authority", public,
                                      "--initial-peer", address, "--leader", leader, "--out", str(out), *extra],
                                     tmp_path / f"{mode}.log")
            processes.append(outsiders[mode])
        _wait_line(tmp_path / "revoked.log", "GOT_TOKEN", outsiders["revoked"], 60)
        allowlist.write_text("")  # a moderator bans carol
        Path(str(tmp_path / "revoked.json") + ".banned").write_text("")
        for process in outsiders.values():
            assert process.wait(timeout=120) == 0, process.args
        (tmp_path / "stop").write_text("")  # the honest peers write what they saw and leave
        for process in processes:
            assert process.wait(timeout=60) == 0, [Path(tmp_path / f"{n}.log").read_text()[-3000:]
                                                    for n in ("a", "b", "none", "expired", "revoked")]
    finally:
        for process in processes:
            _kill(process)
        server.stop()

    refused = _wait_line(tmp_path / "revoked.log", "REFUSED", outsiders["revoked"], 1)
    assert ("the authority of run 'authrun' refused a token for user 'carol': this user is not on the allowlist"
            in refused)
    honest_results = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a", "b")]
    for mode in ("none", "expired", "revoked"):
        result = json.loads((tmp_path / f"{mode}.json").read_text())
        # the leader refuses an outsider's join request whatever state it is in: never ACCEPTED, and refused for
        # its missing proof (a busy leader may drop a stream without an answer)
        assert "PROTOCOL_VIOLATION" in result["codes"], (mode, result)
        assert set(result["codes"]) <= {"PROTOCOL_VIOLATION", "NO_ANSWER"}, (mode, result)
    honest_keys = sorted(result["own_key"] for result in honest_results)
    for result in honest_results:
        assert result["probe"] is None  # no outsider's record reached an honest peer
        assert result["metric_owners"] == honest_keys  # only the two honest metrics records
        assert result["groups"] and all(group == ["a", "b"] for group in result["groups"])
    logs = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    assert "refused a DHT request from a peer without a token" in logs
    assert "refused a DHT request from user 'carol': the token of 'carol' expired" in logs
    assert "refused peer" in logs and "in an averaging group: no access token" in logs


def _filled_checkpoint(root, value, epoch):
    """A TinyRegressor checkpoint whose every parameter is ``value``."""
    import torch
    from ckpt_tiny_module import TinyRegressor

    from lightning_swarm.checkpoint.checkpoint_io import save_checkpoint

    module = TinyRegressor()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.fill_(value)
    return save_checkpoint(str(root), module, global_epoch=epoch, run_id="revertrun")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_fake_revert_is_ignored_and_a_moderators_revert_is_followed(authority, tmp_path):
    import re

    import torch
    import yaml
    from test_monitor import Proc, read_jsonl, wait_for

    from lightning_swarm.checkpoint.checkpoint_io import read_checkpoint

    run = "revertrun"
    public = authority["authority"] + ".pub"
    _, alice_token = _issue(authority, "alice", run_id=run, path=str(tmp_path / "alice.token"))
    _, bob_token = _issue(authority, "bob", run_id=run, path=str(tmp_path / "bob.token"))
    poison = _filled_checkpoint(tmp_path / "poison", 9.0, epoch=1)
    good = _filled_checkpoint(tmp_path / "good", 0.25, epoch=1)
    here = str(WORKER.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, str(REPO)]), OMP_NUM_THREADS="1",
               LIGHTNING_SWARM_AUTH_AUTHORITY_KEY=public, LIGHTNING_SWARM_AUTH_TOKEN=alice_token,
               LIGHTNING_SWARM_AUTH_KEY=authority["alice"])
    (tmp_path / "peers.txt").write_text("")  # the trainer starts the swarm
    processes = []
    try:
        trainer = Proc([sys.executable, os.path.join(here, "ckpt_swarm_trainer.py"), "--run_id", run,
                        "--peers_file", str(tmp_path / "peers.txt"), "--out_dir", str(tmp_path / "a"),
                        "--stop_file", str(tmp_path / "stop"), "--ckpt_dir", str(tmp_path / "a_ckpt")],
                       str(tmp_path / "a.log"), env)
        processes.append(trainer)
        join = wait_for(lambda: next((line for line in trainer.lines if "init_args.initial_peers='" in line), None),
                        120, "the trainer's join address")
        address = json.loads(re.search(r"'(\[.*\])'", join).group(1))[0]
        progress = lambda: (read_jsonl(str(tmp_path / "a" / "progress.json")) or [{}])[0].get("global_epoch", 0)
        wait_for(lambda: progress() >= 2, 90, "the trainer to reach epoch 2")

        # an allowlisted peer fakes a revert: epoch +1000, top priority, an order signed by itself
        clean_env = {k: v for k, v in env.items() if not k.startswith("LIGHTNING_SWARM_AUTH_")}
        attacker = Proc([sys.executable, os.path.join(here, "fake_revert.py"), "--run", run, "--authority", public,
                         "--token", bob_token, "--key", authority["bob"], "--initial-peer", address,
                         "--checkpoint", poison], str(tmp_path / "attacker.log"), clean_env)
        processes.append(attacker)
        fake_epoch = int(attacker.wait_line("FAKE_REVERT", 120).split()[1])
        assert fake_epoch >= 1000
        before = progress()
        wait_for(lambda: progress() >= before + 3, 90, "the trainer to train 3 more epochs beside the attacker")
        assert progress() < fake_epoch
        trainer_log = (tmp_path / "a.log").read_text()
        assert "ignored a progress record claiming epoch" in trainer_log

        # the moderators revert (the monitor holds the authority's key); the attacker keeps announcing
        config = {"model": {"class_path": "ckpt_tiny_module.TinyRegressor"},
                  "trainer": {"strategy": {"class_path": "lightning_swarm.HivemindStrategy", "init_args": {
                      "run_id": run, "target_batch_size": 16, "load_state_timeout": 20,
                      "auth": {"authority_key": public}}}}}
        (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
        monitor = Proc([sys.executable, "-m", "lightning_swarm.monitor", "--config", "cfg.yaml",
                        "--authority-key", authority["authority"], "--initial-peers", address,
                        "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path", "monitor.id", "--no-checkpoints",
                        "--log-dir", str(tmp_path / "monitor_logs"),
                        "--refresh-period", "0.5", "--revert-to", good, "--revert-discovery-seconds", "5",
                        "--max-runtime", "200"], str(tmp_path / "monitor.log"), clean_env)
        processes.append(monitor)
        reverted_epoch = int(monitor.wait_line("[lightning_swarm.monitor] REVERTED", 150).split()[-1])
        assert reverted_epoch < fake_epoch
        wait_for(lambda: progress() >= reverted_epoch + 1, 90, "the trainer to follow the moderator's revert")
        assert progress() < fake_epoch
        assert "loading the state a moderator reverted the run to" in (tmp_path / "a.log").read_text()
        # the trainer's checkpoints after the revert hold the reverted weights (moved by a few small Adam steps)
        after = wait_for(lambda: (tmp_path / "a_ckpt" / "latest").exists() and (
            lambda c: c if c.meta["global_epoch"] > reverted_epoch else None)(read_checkpoint(str(tmp_path / "a_ckpt"))),
            60, "a trainer checkpoint after the revert")
        weights = after.model_state_dict()["mid.weight"]
        assert torch.all((weights - 0.25).abs() < 0.2), weights
        # the monitor's contribution table names the trainer by its token's user (the attacker publishes no metrics)
        contributions = tmp_path / "monitor_logs" / "contributions.json"
        users = lambda: [row["user"] for row in json.loads(contributions.read_text())] if contributions.exists() else []
        wait_for(lambda: users() == ["alice"] or None, 60, "the contribution table to name alice")
    finally:
        (tmp_path / "stop").touch()
        for process in processes:
            process.stop()


def test_a_peer_without_auth_settings_is_told_why_an_authenticated_swarm_does_not_answer(tmp_path):
    import hivemind
    from hivemind.utils.crypto import RSAPrivateKey

    from lightning_swarm.auth.authorizer import SwarmAuthorizer
    from lightning_swarm.hivemind_ext.keys import private_key_to_pem
    from lightning_swarm.strategy import HivemindStrategy

    # the authenticated peer signs with this process's own key (so the test process keeps its key)
    authority_key = generate_key()
    save_key(authority_key, str(tmp_path / "authority.pem"))
    own_key = RSAPrivateKey.process_wide()
    (tmp_path / "own.pem").write_bytes(private_key_to_pem(own_key))
    token = issue_token(authority_key, "closed", "alice", own_key.get_public_key(), 600)
    (tmp_path / "own.token").write_text(token_to_json(token))
    auth = SwarmAuth("closed", str(tmp_path / "authority.pem.pub"), token=str(tmp_path / "own.token"),
                     key=str(tmp_path / "own.pem"))
    auth.install()
    member = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], authorizer=SwarmAuthorizer(auth))
    strategy = HivemindStrategy(run_id="closed", target_batch_size=16, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                initial_peers=[str(member.get_visible_maddrs()[0])])
    try:
        with pytest.raises(RuntimeError, match=r"^\[lightning_swarm\] could not join run 'closed': none of its "
                                               r"initial peers answered .*this peer needs an access token"):
            strategy.start_dht()
    finally:
        member.shutdown()
