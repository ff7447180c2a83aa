"""The seam to hivemind's private API: every private name it lists exists in the installed hivemind."""

import ast
import gc
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import hivemind
import pytest
from hivemind.compression import Float16Compression
from hivemind.optim.progress_tracker import ProgressTracker

import lightning_swarm.hivemind_ext as hivemind_ext
from lightning_swarm.hivemind_ext.codecs import register_decoders
from lightning_swarm.hivemind_ext.optimizer import SwarmOptimizer
from lightning_swarm.hivemind_ext.private_api import (
    IGNORE_VERSION_ENV,
    PRIVATE_SYMBOLS,
    check_hivemind_version,
    missing_symbols,
    symbol_exists,
)


@pytest.mark.parametrize("symbol", PRIVATE_SYMBOLS, ids=lambda symbol: symbol.qualified_name)
def test_listed_private_symbol_exists(symbol):
    assert symbol_exists(symbol), f"hivemind {hivemind.__version__} has no {symbol.name}"


def test_a_symbol_that_does_not_exist_is_reported():
    from lightning_swarm.hivemind_ext import private_api

    fake = [private_api.PrivateSymbol("hivemind.optim.optimizer", "Optimizer._no_such_method", "", ""),
            private_api.PrivateSymbol("hivemind.optim.optimizer", "Optimizer.no_such_attribute", "", "", True)]
    original = private_api.PRIVATE_SYMBOLS
    private_api.PRIVATE_SYMBOLS = tuple(fake)
    try:
        assert missing_symbols() == [symbol.qualified_name for symbol in fake]
    finally:
        private_api.PRIVATE_SYMBOLS = original


def test_package_docstring_lists_every_symbol():
    documented = hivemind_ext.__doc__
    for symbol in PRIVATE_SYMBOLS:
        attribute = re.escape(symbol.name.split(".")[-1])
        assert re.search(rf"``([\w.]*\.)?{attribute}``", documented), f"{symbol.name} is not in the docstring"
        assert f"``{symbol.used_in}``" in documented, symbol.used_in


def test_every_private_symbol_is_used_inside_the_package():
    # the seam is one package: every private name is used by one of its modules
    package = hivemind_ext.__path__[0]
    for symbol in PRIVATE_SYMBOLS:
        assert (Path(package) / f"{symbol.used_in}.py").is_file(), f"{symbol.name} is used outside hivemind_ext"


def _keyword_names(function) -> set:
    """Keyword argument names of the call returned by ``function`` (a method ``return Class(a=..., b=...)``)."""
    source = textwrap.dedent(inspect.getsource(function))
    # no garbage collection while the AST is built: CPython 3.11's AST constructor keeps one recursion counter for all
    # threads, and finalizers of earlier tests' objects (run by a collection inside it) can let another thread in,
    # which raised "SystemError: AST constructor recursion depth mismatch" here once (CPython gh-106905)
    gc.disable()
    try:
        tree = ast.parse(source)
    finally:
        gc.enable()
    returned = next(node for node in ast.walk(tree) if isinstance(node, ast.Return))
    return {keyword.arg for keyword in returned.value.keywords}


def test_state_averager_gets_the_arguments_hivemind_gives_it():
    # SwarmOptimizer._make_state_averager copies hivemind's: a new argument there must be copied too
    ours = {"swarm_auth"}  # our own argument (authentication), on top of hivemind's
    assert _keyword_names(SwarmOptimizer._make_state_averager) - ours == _keyword_names(
        hivemind.Optimizer._make_state_averager)
    assert _keyword_names(SwarmOptimizer._make_progress_tracker) - ours == _keyword_names(
        hivemind.Optimizer._make_progress_tracker)


def test_progress_key_is_hivemind_trackers():
    from lightning_swarm.hivemind_ext.state import progress_key

    assert 'self.training_progress_key = f"{self.prefix}_progress"' in inspect.getsource(ProgressTracker.__init__)
    assert progress_key("run") == "run_progress"


def test_a_follower_closes_its_join_stream_once_answered():
    """stream_ends holds a leader's join handler open until the follower closes the stream: hivemind's follower
    must close it (in ``finally``) once it has the leader's last answer, or every join would cost the linger."""
    from hivemind.averaging.matchmaking import Matchmaking

    source = inspect.getsource(Matchmaking._request_join_group)
    closing = source[source.index("finally:"):]
    assert "await stream.aclose()" in closing
    assert "return await self.follower_assemble_group(leader, message)" in source


def test_unsupported_hivemind_version_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(IGNORE_VERSION_ENV, raising=False)
    assert check_hivemind_version("1.1.12") == "1.1.12"
    with pytest.raises(ImportError, match=r"checked for hivemind>=1.1.12,<1.2, but hivemind 1.2.0 is installed"):
        check_hivemind_version("1.2.0")
    monkeypatch.setenv(IGNORE_VERSION_ENV, "1")
    with pytest.warns(RuntimeWarning, match="hivemind 1.0.1 is installed"):
        assert check_hivemind_version("1.0.1") == "1.0.1"


def test_register_decoders_refuses_a_codec_of_another_type():
    with pytest.raises(ValueError, match="FLOAT16 messages, not BLOCKWISE_8BIT"):
        register_decoders({"BLOCKWISE_8BIT": Float16Compression()})
    with pytest.raises(ValueError, match="not a hivemind compression type"):
        register_decoders({"ZIP": Float16Compression()})


def test_importing_compression_leaves_hivemind_decoders_alone():
    """The numpy-2.4-safe decoders are installed when a peer builds our codec (or starts), not on import."""
    script = textwrap.dedent("""
        from hivemind.compression import serialization
        import lightning_swarm.compression as compression
        print(type(serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"]).__name__)
        compression.default_compression()
        print(type(serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"]).__name__)
        print(type(serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"]).__name__)
    """)
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert output.stdout.split() == ["BlockwiseQuantization", "Blockwise8BitQuantization", "Uniform8BitQuantizationFixed"]
