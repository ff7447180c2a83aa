"""Allowlist authentication for a swarm: the run's authority, access tokens, and moderator-signed reverts.

- :mod:`~lightning_swarm.auth.tokens`: keys and signed, expiring access tokens (hivemind's ``AccessToken``).
- :mod:`~lightning_swarm.auth.allowlist` / :mod:`~lightning_swarm.auth.service`: the authority that issues
  them to allowlisted users (``python -m lightning_swarm.auth serve``); tokens can also be issued offline.
- :mod:`~lightning_swarm.auth.peer`: a peer's credentials (``HivemindStrategy(auth={...})``).
- :mod:`~lightning_swarm.auth.authorizer`: hivemind's DHT authorizer and a record validator built on them.
- :mod:`~lightning_swarm.auth.revert`: revert orders signed by the authority.

Averaging groups, state downloads and epoch claims are guarded in
:mod:`lightning_swarm.hivemind_ext.auth_guards`. What stays open is written down in ``docs/security.md``.
"""
