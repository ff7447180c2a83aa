import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionInfo,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.proto import runtime_pb2
from safetensors.torch import load_file

from lightning_swarm.compression import (
    BLOCKSIZE,
    Blockwise8BitQuantization,
    Uniform8BitQuantizationFixed,
    default_compression,
    dynamic_code,
    quantize_uniform_blockwise,
    register_fixed_codecs,
    uniform_code,
)

WORKER = Path(__file__).with_name("averaging_worker.py")


@pytest.fixture(autouse=True, scope="module")
def fixed_decoders():
    register_fixed_codecs()  # as every peer does before its averagers start


def sample(kind: str, numel: int = 2**17) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if kind == "gauss":
        return torch.randn(numel, generator=generator)
    if kind == "laplace":
        uniform = torch.rand(numel, generator=generator) - 0.5
        return -uniform.sign() * torch.log1p(-2 * uniform.abs())
    if kind == "student3":  # heavy tails: gaussian over the root of a scaled chi-square with 3 degrees of freedom
        normal = torch.randn(numel, generator=generator)
        chi2 = torch.randn(3, numel, generator=generator).square().sum(0)
        return normal / (chi2 / 3).sqrt()
    if kind == "sparse":  # e.g. embedding rows of tokens absent from the batch
        return torch.randn(numel, generator=generator) * (torch.rand(numel, generator=generator) < 0.05)
    raise ValueError(kind)


def roundtrip(codec, tensor: torch.Tensor) -> tuple[torch.Tensor, runtime_pb2.Tensor]:
    message = codec.compress(tensor, CompressionInfo.from_tensor(tensor))
    return deserialize_torch_tensor(message), message


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).square().mean().sqrt())


@pytest.mark.parametrize("numel", [100, BLOCKSIZE, 3 * BLOCKSIZE + 5, 2**17 + 1])
@pytest.mark.parametrize("kind", ["gauss", "sparse"])
def test_arithmetic_uniform_quantization_matches_bitsandbytes(kind, numel):
    """The fast path gives bitsandbytes' codes for uniform_code() (ties aside) and the same absmax and error."""
    from bitsandbytes.functional import dequantize_blockwise, quantize_blockwise

    tensor = sample(kind, numel)
    zeros = BLOCKSIZE if numel >= 2 * BLOCKSIZE else numel // 4  # a whole zero block, or zeros within one
    tensor[:zeros] = 0
    codes, absmax = quantize_uniform_blockwise(tensor)
    expected_codes, state = quantize_blockwise(tensor, code=uniform_code(), blocksize=BLOCKSIZE)
    torch.testing.assert_close(absmax, state.absmax)
    nonzero_blocks = (absmax > 0).repeat_interleave(BLOCKSIZE)[:numel]
    differ = (codes.int() - expected_codes.int()).abs()[nonzero_blocks]
    assert differ.max() <= 1 and differ.float().mean() < 0.01  # only values halfway between two levels differ
    restored = dequantize_blockwise(codes, absmax=absmax, code=uniform_code(), blocksize=BLOCKSIZE)
    assert rmse(restored, tensor) <= rmse(dequantize_blockwise(expected_codes, state), tensor) * 1.001
    assert torch.equal(restored[:zeros], torch.zeros(zeros))


@pytest.mark.parametrize("kind", ["gauss", "laplace", "student3", "sparse"])
def test_blockwise_error_bounded_and_no_worse_than_hivemind_uniform(kind):
    tensor = sample(kind)
    restored, _ = roundtrip(Blockwise8BitQuantization(), tensor)
    # hivemind's Uniform8BitQuantization messages, decoded with its own codebook lookup (numpy-2.4-safe decoder)
    hivemind_restored, _ = roundtrip(Uniform8BitQuantizationFixed(), tensor)

    assert rmse(restored, tensor) <= rmse(hivemind_restored, tensor)
    assert rmse(restored, tensor) <= 0.025 * float(tensor.std())
    # absmax scaling never clips: the worst error is a fraction of the block's largest value
    block_absmax = tensor.view(-1, BLOCKSIZE).abs().amax(1, keepdim=True)
    assert bool(((restored - tensor).view(-1, BLOCKSIZE).abs() <= 0.01 * block_absmax + 1e-7).all())
    if kind == "sparse":  # the uniform code has an exact zero, so untouched entries stay exactly zero
        assert bool((restored[tensor == 0] == 0).all())


@pytest.mark.parametrize("kind", ["gauss", "student3"])
def test_codebook_trial_picks_the_better_codebook(kind):
    tensor = sample(kind)
    errors = {
        name: rmse(roundtrip(Blockwise8BitQuantization(codebooks=(code,)), tensor)[0], tensor)
        for name, code in [("uniform", uniform_code()), ("dynamic", dynamic_code())]
    }
    adaptive = rmse(roundtrip(Blockwise8BitQuantization(), tensor)[0], tensor)
    assert adaptive <= 1.02 * min(errors.values())
    assert adaptive < 0.9 * max(errors.values())


@pytest.mark.parametrize("numel", [2**16, 3 * 2**16 + 123, 2**20])
def test_large_tensors_cost_at_most_1_05_bytes_per_value(numel):
    tensor = torch.randn(numel)
    restored, message = roundtrip(default_compression(), tensor)
    assert message.compression == runtime_pb2.CompressionType.BLOCKWISE_8BIT
    assert len(message.buffer) / numel <= 1.05
    assert rmse(restored, tensor) < 0.02


@pytest.mark.parametrize("numel", [1, 1000, 2**16 - 1])
def test_small_tensors_are_float16(numel):
    tensor = torch.randn(numel)
    restored, message = roundtrip(default_compression(), tensor)
    assert message.compression == runtime_pb2.CompressionType.FLOAT16
    assert len(message.buffer) == 2 * numel
    torch.testing.assert_close(restored, tensor.half().float())


@pytest.mark.parametrize(
    "tensor",
    [torch.arange(10), torch.randint(0, 256, (2**17,), dtype=torch.uint8), torch.ones(5, dtype=torch.bool)],
    ids=["int64", "uint8_large", "bool"],
)
def test_non_float_tensors_pass_through_exactly(tensor):
    restored, message = roundtrip(default_compression(), tensor)
    assert message.compression == runtime_pb2.CompressionType.NONE
    assert restored.dtype == tensor.dtype and torch.equal(restored, tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_serialize_deserialize_through_hivemind_keeps_shape_dtype_grad(dtype):
    tensor = torch.randn(256, 512).to(dtype).requires_grad_()
    message = serialize_torch_tensor(tensor, runtime_pb2.CompressionType.BLOCKWISE_8BIT)
    restored = deserialize_torch_tensor(message)  # routed by compression type to our registered codec
    assert restored.shape == tensor.shape and restored.dtype == dtype and restored.requires_grad
    assert rmse(restored, tensor.detach()) < 0.02


def test_wire_format_is_hivemind_blockwise_8bit():
    tensor = torch.randn(3 * BLOCKSIZE + 5)
    message = Blockwise8BitQuantization().compress(tensor, CompressionInfo.from_tensor(tensor))
    num_blocks = -(-tensor.numel() // BLOCKSIZE)
    header = np.frombuffer(message.buffer, count=2, dtype=np.int64)
    assert header.tolist() == [num_blocks, 256]
    assert len(message.buffer) == 16 + 4 * num_blocks + 4 * 256 + tensor.numel()

    # a message made by hivemind's own BlockwiseQuantization decodes with our codec as hivemind would decode it
    from bitsandbytes.functional import dequantize_blockwise, quantize_blockwise

    hivemind_message = BlockwiseQuantization().compress(tensor, CompressionInfo.from_tensor(tensor))
    codes, state = quantize_blockwise(tensor, blocksize=BLOCKSIZE)
    torch.testing.assert_close(deserialize_torch_tensor(hivemind_message), dequantize_blockwise(codes, state))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_compressed_averaging_round_between_two_processes(tmp_path):
    """Two peers (separate processes, DHT on 127.0.0.1) run one all-reduce with default_compression()."""
    sys.path.insert(0, str(WORKER.parent))
    from averaging_worker import make_tensors

    outputs = [tmp_path / "peer0.safetensors", tmp_path / "peer1.safetensors"]
    command = [sys.executable, str(WORKER), "--timeout", "90"]
    logs = [tmp_path / "peer0.log", tmp_path / "peer1.log"]

    def start_peer(index: int, extra_args: list[str]) -> subprocess.Popen:
        with open(logs[index], "w") as log:
            return subprocess.Popen(
                command + ["--seed", str(index), "--out", str(outputs[index])] + extra_args,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            )

    def log_tails() -> str:
        return "\n".join(f"--- {log.name}:\n" + log.read_text()[-3000:] for log in logs if log.exists())

    peers = []
    try:
        peers.append(start_peer(0, []))
        peers.append(start_peer(1, ["--initial-peer", "-"]))  # its imports overlap the first peer's start
        line = peers[0].stdout.readline()  # "PEER <multiaddr>" once its DHT is up
        assert line.startswith("PEER "), f"first peer did not start: {line!r}\n{log_tails()}"
        peers[1].stdin.write(line.split()[1] + "\n")
        peers[1].stdin.flush()
        deadline = time.monotonic() + 180
        while not all(path.exists() for path in outputs):
            assert all(peer.poll() is None for peer in peers), f"a peer exited before averaging\n{log_tails()}"
            assert time.monotonic() < deadline, "averaging did not finish in time"
            time.sleep(0.5)
        time.sleep(0.5)  # let the file writes complete
    finally:
        for peer in peers:
            peer.stdin.close()  # the peers leave once both have their result
        for peer in peers:
            try:
                peer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                peer.kill()
                peer.wait()

    contributions = [make_tensors(0), make_tensors(1)]
    for path in outputs:
        averaged = load_file(path)
        for name, value in averaged.items():
            mean = (contributions[0][name] + contributions[1][name]) / 2
            error = value - mean
            if name == "large":  # 8-bit codes: lossy (so the codec really ran), but close to the mean
                assert 1e-4 < float(error.square().mean().sqrt()) < 0.02
                assert float(error.abs().max()) < 0.06
            else:  # float16
                assert float(error.abs().max()) < 5e-3


@pytest.mark.parametrize("numel", [1000, 3 * BLOCKSIZE + 5, 2**17])  # float16 and 8-bit messages
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_does_not_spread_to_its_neighbours(numel, bad):
    tensor = sample("gauss", numel)
    poisoned = tensor.clone()
    poisoned[numel // 2] = bad
    restored, _ = roundtrip(default_compression(), poisoned)
    neighbours = torch.ones(numel, dtype=torch.bool)
    neighbours[numel // 2] = False
    assert torch.isfinite(restored[neighbours]).all()
    assert rmse(restored[neighbours], tensor[neighbours]) < 0.02


_ISSUE_24_PROBE = """
import sys
import numpy as np
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
import torch
from lightning_swarm.compression import default_compression
from lightning_swarm.wire_checks import MalformedTensor

default_compression()  # a peer's start: installs the checked decoders
codes = b"\\x01" * 2**20
messages = {
    "0 absmax, 0-entry codebook": np.int64(0).tobytes() * 2 + codes,
    "1 absmax, 1-entry codebook": np.int64(1).tobytes() * 2 + np.float32(1).tobytes() * 2 + codes,
}
for name, buffer in messages.items():
    message = runtime_pb2.Tensor(compression=runtime_pb2.BLOCKWISE_8BIT, buffer=buffer, size=[2**20],
                                 dtype="float32")
    try:
        deserialize_torch_tensor(message)
        print(name, "DECODED")
    except MalformedTensor as e:
        print(name, "REFUSED", e)
honest = torch.randn(2**17)
restored = deserialize_torch_tensor(serialize_torch_tensor(honest, runtime_pb2.BLOCKWISE_8BIT))
print("honest", float((restored - honest).abs().max()) < 0.05 * float(honest.abs().max()))
"""


@pytest.mark.timeout(180)
def test_the_issues_crashing_blockwise_messages_are_refused():
    """Issue 24, finding 1, in a child process (the unchecked decoder died of SIGSEGV on the first message and read
    outside the buffer on the second): both are refused with the reason, an honest message still decodes."""
    probe = subprocess.run([sys.executable, "-c", _ISSUE_24_PROBE], capture_output=True, text=True, timeout=170,
                           cwd=Path(__file__).resolve().parents[2])
    assert probe.returncode == 0, f"the decoding process died (return code {probe.returncode})\n{probe.stderr[-2000:]}"
    lines = probe.stdout.splitlines()
    assert lines[0] == ("0 absmax, 0-entry codebook REFUSED 0 absmax values for 1048576 values "
                        "(256 blocks of 4096)")
    assert lines[1].startswith("1 absmax, 1-entry codebook REFUSED 1 absmax values for 1048576 values")
    assert lines[2] == "honest True"
