"""The server-process runner, with the api's pure-Python fake rollout in this interpreter (the
protocol is the same for every backend and environment)."""

import os
import shutil
import signal
import socket
import sys
import time

import pytest

from drivetrain.api import PluginError, Prompt, SamplingParams
from drivetrain.api.errors import RolloutStalled
from drivetrain.rollout.config import BackendConfig
from drivetrain.rollout.errors import RolloutProcessError
from drivetrain.rollout.process.client import start_server_rollout
from drivetrain.testing import FakeRollout, FakeRolloutConfig

pytestmark = pytest.mark.timeout(120)

CONFIG = FakeRolloutConfig(vocab_size=8, max_model_len=32, seed=3)
LAUNCH = BackendConfig(python=sys.executable, start_timeout_s=60)
PROMPTS = [Prompt(token_ids=(1, 2)), Prompt(token_ids=(3,))]


@pytest.fixture
def remote():
    process = start_server_rollout("fake", CONFIG, LAUNCH)
    yield process
    process.shutdown()


def test_remote_generation_equals_in_process(remote):
    params = SamplingParams(n=3, max_new_tokens=6, seed=11, temperature=0.8)
    assert remote.generate(PROMPTS, params) == FakeRollout(CONFIG).generate(PROMPTS, params)
    assert remote.channel.info["pid"] == remote.channel.process.pid
    assert remote.weight_version == 0
    assert remote.sleep(1) is False  # nothing freed: the fake holds no accelerator memory
    remote.wake_up()


def test_the_channel_sends_without_waiting_for_acks(remote):
    """Nagle's algorithm off: a message written in two parts (a weight tensor's header and
    body) would otherwise wait ~40 ms for the server's delayed ACK."""
    sock = socket.fromfd(remote.channel.conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


def test_remote_errors_keep_their_type_and_the_server_keeps_serving(remote):
    too_long = [Prompt(token_ids=(1,) * 40)]
    with pytest.raises(ValueError, match="exceed max_model_len"):
        remote.generate(too_long, SamplingParams())
    with pytest.raises(ValueError, match="sleep level"):
        remote.sleep(3)
    assert len(remote.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == 2


def test_clean_shutdown_exits_and_removes_the_log(remote):
    log = remote.channel.log_path
    remote.shutdown()
    assert remote.channel.process.returncode == 0
    assert not log.exists()


def test_a_dead_server_is_an_error_not_a_hang(remote):
    os.killpg(remote.channel.process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RolloutProcessError, match="fake rollout process"):
        remote.generate(PROMPTS, SamplingParams())
    assert time.monotonic() - start < 10


def test_engine_start_failures_reach_the_caller_and_leave_no_process():
    with pytest.raises(PluginError, match="unknown rollout 'nonesuch'"):
        start_server_rollout("nonesuch", CONFIG, LAUNCH)


def test_an_interpreter_that_never_connects_fails_fast(tmp_path):
    false = shutil.which("false")
    assert false
    with pytest.raises(RolloutProcessError, match="exited before connecting"):
        start_server_rollout("fake", CONFIG, BackendConfig(python=false, start_timeout_s=30))


def test_a_hung_server_times_out_instead_of_blocking():
    launch = BackendConfig(python=sys.executable, start_timeout_s=60, request_timeout_s=2)
    remote = start_server_rollout("fake", CONFIG, launch)
    os.killpg(remote.channel.process.pid, signal.SIGSTOP)  # alive, but never answers
    start = time.monotonic()
    with pytest.raises(RolloutProcessError, match="did not answer within 2 s"):
        remote.generate(PROMPTS, SamplingParams())
    assert time.monotonic() - start < 15
    remote.shutdown()


def test_a_stopped_server_is_named_within_its_stall_deadline():
    """Alive but silent (SIGSTOP): one line naming the process and the setting, within the
    stall deadline, not the request timeout (an hour) nor the exit code of our own kill; every
    later call fails at once with the same."""
    launch = BackendConfig(python=sys.executable, start_timeout_s=60, stall_timeout_s=2)
    remote = start_server_rollout("fake", CONFIG, launch)
    pid = remote.channel.process.pid
    os.killpg(pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(RolloutStalled) as stalled:
        remote.generate(PROMPTS, SamplingParams())
    assert 2 <= time.monotonic() - start < 6
    message = str(stalled.value)
    assert message.startswith(f"the fake rollout process (pid {pid}) was silent for 2 s while ")
    assert "(rollout.stall_timeout_s=2)" in message and "\n" not in message
    assert "exit code" not in message
    start = time.monotonic()
    with pytest.raises(RolloutStalled):
        remote.poll(0.0)
    assert time.monotonic() - start < 1
    remote.shutdown()


def test_a_weight_stream_into_a_stopped_server_is_bounded():
    """The stream blocks once the stopped server's socket buffer is full: the watchdog kills
    the server and the sender names the stall."""
    import torch

    launch = BackendConfig(python=sys.executable, start_timeout_s=60, stall_timeout_s=2)
    remote = start_server_rollout("fake", CONFIG, launch)
    os.killpg(remote.channel.process.pid, signal.SIGSTOP)
    weights = ((f"w{k}", torch.zeros(1 << 20)) for k in range(64))  # 256 MB: past any buffer
    start = time.monotonic()
    with pytest.raises(RolloutStalled, match="while taking the weights of version 1"):
        remote.channel.send_weights_inline(weights, 1)
    assert time.monotonic() - start < 8
    remote.shutdown()


def test_the_server_says_it_is_alive_while_it_works_on_a_call(monkeypatch):
    from multiprocessing import Pipe

    from drivetrain.rollout.process import messages, server
    from drivetrain.rollout.process.protocol import ALIVE

    monkeypatch.setattr(server, "KEEPALIVE_S", 0.05)
    ours, theirs = Pipe()
    replies = server.Replies(theirs)
    replies.working_on_call()
    assert ours.poll(5) and messages.receive(ours) == ALIVE
    replies.send(("ok", 1))
    seen = []
    while ours.poll(0.3):  # an ALIVE sent before the reply, then the reply, then nothing
        seen.append(messages.receive(ours))
    assert seen[-1] == ["ok", 1] or seen[-1] == ("ok", 1)
    assert all(m == ALIVE for m in seen[:-1])


def test_a_transport_missing_in_the_servers_environment_is_its_one_line():
    """The server rebuilds the transport's config by plugin name: an environment without the
    transport says what to install (here: denied there), not a wire decoding error."""
    from drivetrain.api import PluginError
    from drivetrain.api.config import WeightSyncConfig
    from drivetrain.api.weight_sync import Topology

    launch = BackendConfig(
        python=sys.executable, start_timeout_s=60, env=("DRIVETRAIN_PLUGINS=-ckpt_engines:disk",)
    )
    remote = start_server_rollout("fake", CONFIG, launch)
    try:
        with pytest.raises(PluginError, match="ckpt-engine 'disk' .* denied by DRIVETRAIN_PLUGINS"):
            remote.weight_receiver().connect(
                "disk", WeightSyncConfig(), rank=1, topology=Topology.one_sender(1), endpoint={}
            )
    finally:
        remote.shutdown()


@pytest.mark.parametrize("local", [True, False], ids=["own-class", "described-fields"])
def test_the_process_host_runs_a_rollout_configured_from_its_description(local):
    """``rollout.python`` for any rollout: its config type from what that environment
    describes (its own class extended with the hosting knobs where installed here too, else a
    class built from the fields), started through the registered host, rebuilt there into the
    rollout's own class (the fake's has no hosting knobs)."""
    from dataclasses import replace

    from drivetrain.api.hosting import HostingConfig
    from drivetrain.runtime.hosted_rollout import describe_in, rollout_host

    hosted = describe_in(sys.executable, "fake")
    if not local:  # as if installed only there
        hosted = replace(hosted, config_target="acme.config:Elsewhere")
    config_class = hosted.config_class()
    assert issubclass(config_class, HostingConfig)
    assert issubclass(config_class, FakeRolloutConfig) is local
    config = config_class(vocab_size=8, max_model_len=32, seed=3, python=sys.executable)
    remote = rollout_host()("fake", config)
    try:
        params = SamplingParams(n=2, max_new_tokens=5, seed=4)
        assert remote.generate(PROMPTS, params) == FakeRollout(CONFIG).generate(PROMPTS, params)
        assert remote.channel.info["pid"] != os.getpid()
    finally:
        remote.shutdown()
