"""The rollout server connection against a hostile local peer: nothing it sends is unpickled
(either direction), and stray connections to the trainer's listener are logged and skipped."""

import logging
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path

import pytest

from drivetrain.api import Prompt, SamplingParams
from drivetrain.rollout.config import BackendConfig
from drivetrain.rollout.errors import ProtocolError, RolloutProcessError
from drivetrain.rollout.process import messages
from drivetrain.rollout.process.client import start_server_rollout
from drivetrain.rollout.process.protocol import ADDRESS_ENV, AUTHKEY_ENV
from drivetrain.runtime.wire import config_fields
from drivetrain.testing import FakeRollout, FakeRolloutConfig

pytestmark = [pytest.mark.fault, pytest.mark.timeout(120)]

CONFIG = FakeRolloutConfig(vocab_size=8, max_model_len=32, seed=3)
PROMPTS = [Prompt(token_ids=(1, 2)), Prompt(token_ids=(3,))]

# A pickle whose loading calls open(marker, "w"): the file exists iff someone unpickled it.
EVIL_PICKLE = """
class Touch:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
"""


def _evil_pickle(marker: Path) -> bytes:
    namespace: dict = {}
    exec(EVIL_PICKLE, namespace)
    return pickle.dumps(("start", (namespace["Touch"](str(marker)),)))


def _script(path: Path, body: str) -> str:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return str(path)


def _accept(listener: Listener, process: subprocess.Popen, timeout_s: float) -> Connection:
    accepted: list[Connection] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not accepted and time.monotonic() < deadline and process.poll() is None:
        thread.join(0.2)
    assert accepted, "the server process did not connect"
    return accepted[0]


def test_every_message_kind_round_trips_as_json():
    from drivetrain.api import Completion, FinishReason
    from drivetrain.api.config import LoraConfig
    from drivetrain.api.weight_sync import SyncStats, Topology
    from drivetrain.rollout.config import HFRolloutConfig
    from drivetrain.testing.fake_transport import FakeTransportConfig

    kinds = [
        ("start", ("hf", HFRolloutConfig(model_path="/m", env=("A=1",)))),
        ("start", ("fake", CONFIG)),  # a plugin's own config class, declared in its spec
        ("generate", ([Prompt(messages=({"role": "user", "content": "hi"},))], SamplingParams())),
        ("ok", [Completion(0, (1,), (2, 3), (-0.5, float("-inf")), FinishReason.STOP, 4)]),
        ("weights_connect", ("fake", FakeTransportConfig(), 1, Topology((0,), (1,)), {})),
        ("ok", SyncStats(version=2, num_tensors=3, num_buckets=1, bytes=10, seconds=0.5)),
        ("x", {"address": ("127.0.0.1", 5), 7: b"\x00\xff", "$tag": [None, True, 1.5]}),
        ("ok", LoraConfig(rank=8)),
        ("tensor", "w", {"shape": (2, 3), "dtype": "bfloat16"}),
    ]
    for message in kinds:
        data = messages.encode(message)
        assert data.startswith(b"{") or data.startswith(b"[")
        assert messages.decode(data) == message


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b'{"$dataclass":"subprocess:Popen","fields":{"args":"true"}}', "is not allowed"),
        (b'{"$dataclass":"os:system","fields":{}}', "is not allowed"),
        (b'{"$enum":"signal:Signals","value":9}', "is not allowed"),
        (b'{"$eval":"1+1"}', "unknown tag"),
        (b'{"$dataclass":"drivetrain.api.rollout:Prompt","fields":{}}', "exactly one of"),
        (b"[" * 100_000, "RecursionError"),
        (b"\xff\xfe", "UnicodeDecodeError"),
    ],
)
def test_anything_else_is_a_protocol_error(data, why):
    with pytest.raises(ProtocolError, match=why):
        messages.decode(data)


def test_only_plain_data_is_sent():
    with pytest.raises(TypeError, match="plain data only, not PosixPath"):
        messages.encode(("generate", (Path("/x"),)))


def test_a_transport_config_declared_by_a_plugin_reaches_the_server():
    from drivetrain.api.weight_sync import Topology
    from drivetrain.testing.fake_transport import FakeTransportConfig

    remote = start_server_rollout("fake", CONFIG, BackendConfig(python=sys.executable))
    try:
        # The server rebuilds the config, builds the transport, which then finds no channel
        # (the fake transport works within one process): its error, not a protocol error.
        with pytest.raises(RolloutProcessError, match="WeightSyncError: no fake channel 'x'"):
            remote.weight_receiver().connect(
                "fake", FakeTransportConfig(timeout_s=7), rank=1,
                topology=Topology((0,), (1,)), endpoint={"channel": "x"},
            )  # fmt: skip
    finally:
        remote.shutdown()


@pytest.fixture
def raw_server():
    """A server process connected to this test's own listener: the test is its client."""
    authkey = secrets.token_bytes(32)
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        host, port = listener.address
        env = {**os.environ, ADDRESS_ENV: f"{host}:{port}", AUTHKEY_ENV: authkey.hex()}
        server = subprocess.Popen(
            [sys.executable, "-m", "drivetrain.rollout.process.server"], env=env
        )
        try:
            conn = _accept(listener, server, 60)
            yield conn
            conn.close()
            assert server.wait(timeout=30) == 0
        finally:
            server.kill()
            server.wait()


def _ask(conn: Connection, message: tuple) -> tuple:
    messages.send(conn, message)
    assert conn.poll(60), f"no reply to {message[0]}"
    return messages.receive(conn)


def test_the_server_refuses_a_pickled_request_without_running_it(raw_server, tmp_path):
    marker = tmp_path / "unpickled"
    raw_server.send_bytes(_evil_pickle(marker))
    assert raw_server.poll(60), "no reply to a pickled request"
    reply = raw_server.recv_bytes()
    assert not marker.exists(), "the server unpickled the request (and ran its code)"
    status, name, message, _ = messages.decode(reply)
    assert (status, name) == ("error", "ProtocolError")
    assert "not a drivetrain wire message" in message
    # The server keeps serving well-formed requests after refusing one.
    assert _ask(raw_server, ("weight_version", ()))[:2] == ("error", "RuntimeError")


def test_a_bad_tensor_header_fails_the_update_and_the_stream_stays_in_step(raw_server):
    # the config's fields: the server rebuilds the rollout's own class from them
    assert _ask(raw_server, ("start", ("fake", config_fields(CONFIG))))[0] == "ok"
    messages.send(raw_server, ("update_weights", (1,)))
    messages.send(raw_server, ("tensor", "w", {"shape": (2,), "dtype": "load"}))
    raw_server.send_bytes(bytes(8))
    messages.send(raw_server, ("tensor", "w", {"shape": (2,), "dtype": "float32"}))
    raw_server.send_bytes(bytes(8))
    reply = _ask(raw_server, ("end",))
    assert reply[:3] == ("error", "ValueError", "'load' is not a torch dtype")
    assert _ask(raw_server, ("weight_version", ())) == ("ok", 0)  # nothing applied, in step


def test_the_client_refuses_a_pickled_reply_without_running_it(tmp_path):
    marker = tmp_path / "unpickled"
    evil_server = _script(
        tmp_path / "evil_server",
        f"""import os, pickle
from multiprocessing.connection import Client
{EVIL_PICKLE}
host, _, port = os.environ[{ADDRESS_ENV!r}].rpartition(":")
conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[{AUTHKEY_ENV!r}]))
conn.recv_bytes()  # the start request
conn.send_bytes(pickle.dumps(("ok", Touch({str(marker)!r}))))
try:
    conn.recv_bytes()  # until the client hangs up
except EOFError:
    pass
""",
    )
    with pytest.raises(ProtocolError, match="not a drivetrain wire message"):
        start_server_rollout("fake", CONFIG, BackendConfig(python=evil_server, start_timeout_s=60))
    assert not marker.exists(), "the client unpickled the reply (and ran its code)"


def test_stray_connections_are_logged_and_the_real_server_still_starts(tmp_path, caplog):
    # Runs as the rollout "interpreter": opens four bad connections to the trainer's listener
    # (wrong key, garbage, connect-and-close, connect-and-stay-silent), then becomes the real
    # server, which keeps the silent one open until it exits.
    strays = _script(
        tmp_path / "strays_then_server",
        f"""import os, socket, sys
from multiprocessing.connection import AuthenticationError, Client
host, _, port = os.environ[{ADDRESS_ENV!r}].rpartition(":")
address = (host, int(port))
try:
    Client(address, authkey=b"not the key")
except AuthenticationError:
    pass
else:
    sys.exit("the listener accepted a wrong key")
with socket.create_connection(address) as garbage:
    garbage.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
socket.create_connection(address).close()
silent = socket.create_connection(address)
silent.set_inheritable(True)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
""",
    )
    caplog.set_level(logging.WARNING, logger="drivetrain.rollout.process.listener")
    remote = start_server_rollout("fake", CONFIG, BackendConfig(python=strays, start_timeout_s=60))
    try:
        params = SamplingParams(n=2, max_new_tokens=4, seed=5)
        assert remote.generate(PROMPTS, params) == FakeRollout(CONFIG).generate(PROMPTS, params)
    finally:
        remote.shutdown()
    skipped = [r.getMessage() for r in caplog.records if "skipped a connection" in r.getMessage()]
    assert len(skipped) == 4, skipped
    assert any("AuthenticationError" in line for line in skipped), skipped
    assert any("still unauthenticated" in line for line in skipped), skipped


def test_a_config_crosses_as_its_fields_and_the_server_rebuilds_its_own_class():
    """Nested sections included (vLLM's ``lora``); the hosting knobs are how the server was
    started: emptied (``python``) or dropped where the rollout's class lacks them."""
    from dataclasses import replace

    from drivetrain.api import LoraConfig
    from drivetrain.rollout.config import VLLMRolloutConfig
    from drivetrain.rollout.process.server import _rollout_config

    config = VLLMRolloutConfig(python="/envs/v/bin/python", env=("A=1",), lora=LoraConfig(rank=4))
    fields = messages.decode(messages.encode(config_fields(config)))
    assert _rollout_config("vllm", fields) == replace(config, python="")
    hosted = {**config_fields(CONFIG), "python": "/envs/f/bin/python", "start_timeout_s": 9.0}
    assert _rollout_config("fake", hosted) == CONFIG
