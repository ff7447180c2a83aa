"""Checkpoints of a swarm run: one format from training to sampling.

- :mod:`.checkpoint_io`: the on-disk format (safetensors + JSON), reading from any fsspec URL
- :mod:`.layout`: checkpoint names, their order by epoch number, and the `latest` pointer (kept inside its root)
- :mod:`.integrity`: per-file sha256 records in meta.json, verified on every read
- :mod:`.seal`: seal.json, the sha256 of meta.json and (from the moderators' monitor) the authority's signature
- :mod:`.model_spec`: the model's class path + init args in meta.json; rebuilt only from allowed packages, plain data
- :mod:`.state_json`: optimizer/scheduler states as JSON + tensors (no pickle)
- :mod:`.saver`: :class:`CheckpointSaver`, save + keep the last K + queue uploads (used by the callback and the monitor)
- :mod:`.upload`: background uploads to the Hugging Face Hub or any fsspec URL
- :mod:`.callback`: :class:`SwarmCheckpoint`, the Lightning callback (also exported by ``lightning_swarm.callbacks``)
"""
