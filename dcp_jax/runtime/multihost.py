"""Multi-host serving on `jax.distributed` (one process per host, one mesh over every process's devices).

Process 0, the leader, schedules and serves; every other process, a follower, holds its shards of the weights and
the KV pools and runs the programs the leader runs, in the leader's order, on the leader's step buffers: the leader
sends each step's packed host buffer (`step.Placed`: every index the step needs, built once on the leader) and the
followers feed the same compiled program with it, so the scheduler's decisions are the leader's alone and identical
everywhere by construction. The channel is a TCP connection from each follower to the leader at the coordinator's
host and port + 1 (`Distributed.channel_address`). A peer that dies closes its connection: the leader's watcher
sees it at once (`StepChannel.failure`), fails what is in flight and stops; a follower's `follow` raises
`PeerLost`. `jax.distributed`'s heartbeat bounds what a socket cannot see (a hung host).
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
import struct
import threading
import time

import numpy as np

# Commands of the channel: run a program on a step buffer, allocate a fresh device state, a result for the
# followers (an offline `generate`'s outputs), stop following.
RUN, RESET, RESULT, STOP = 1, 2, 3, 4
_HEADER = struct.Struct("!iiiq")  # command, program kind index, bucket, payload bytes
# How long the leader waits for every follower (they load and compile meanwhile) and a follower retries its
# connection; a connection's hello; the heartbeat that bounds a silent peer.
CONNECT_TIMEOUT_S = 900.0
HELLO_TIMEOUT_S = 10.0
HEARTBEAT_TIMEOUT_S = 20


class PeerLost(RuntimeError):
    """Another process of the deployment died or closed its channel."""


@dataclasses.dataclass(frozen=True)
class Distributed:
    """One process of a multi-host deployment (vLLM's and jax.distributed's names)."""

    coordinator_address: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int

    def __post_init__(self):
        host, _, port = self.coordinator_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise ValueError(f"coordinator_address must be HOST:PORT, got {self.coordinator_address!r}")
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"num_processes must be an int >= 1, got {self.num_processes!r}")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes={self.num_processes}), got "
                             f"{self.process_id!r}")

    @classmethod
    def of(cls, coordinator_address: str | None, num_processes: int, process_id: int) -> Distributed | None:
        """None for one process without a coordinator (the default); else the checked deployment."""
        if coordinator_address is None:
            if num_processes != 1 or process_id != 0:
                raise ValueError("num_processes and process_id need a coordinator_address")
            return None
        return cls(coordinator_address, num_processes, process_id)

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def channel_address(self) -> tuple[str, int]:
        host, _, port = self.coordinator_address.rpartition(":")
        return host, int(port) + 1


def initialize(dist: Distributed | None) -> None:
    """Join the deployment (`jax.distributed.initialize`; CPU devices collect over gloo) before any device is
    used; a no-op for one process or when this process already joined it."""
    if dist is None:
        return
    import jax

    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (dist.num_processes, dist.process_id):
            raise ValueError(f"this process already joined a deployment as process {jax.process_index()} of "
                             f"{jax.process_count()}")
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Its preemption notifier takes SIGTERM for itself; serve's drain must see it.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(dist.coordinator_address, num_processes=dist.num_processes,
                               process_id=dist.process_id, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise PeerLost("the connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class StepChannel:
    """The leader's end: accepts every follower (each names itself once, a process id of the deployment not taken
    yet; anything else is dropped), then sends them each command; a watcher per follower notes the first one lost
    (`failure`) and calls `on_lost(message)` once, unless the channel is closing."""

    def __init__(self, dist: Distributed, *, on_lost=None, timeout_s: float = CONNECT_TIMEOUT_S):
        self._server = socket.create_server(dist.channel_address)
        self._peers: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self.failure: str | None = None
        self._closing = False
        self._on_lost = on_lost
        deadline = time.monotonic() + timeout_s
        try:
            while len(self._peers) < dist.num_processes - 1:
                self._server.settimeout(max(0.1, deadline - time.monotonic()))
                peer, _ = self._server.accept()
                try:
                    peer.settimeout(HELLO_TIMEOUT_S)
                    process_id = struct.unpack("!i", _recv_exactly(peer, 4))[0]
                except (OSError, PeerLost):
                    peer.close()
                    continue
                if not 0 < process_id < dist.num_processes or process_id in self._peers:
                    peer.close()
                    continue
                peer.settimeout(None)
                peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._peers[process_id] = peer
        except TimeoutError:
            for peer in self._peers.values():
                peer.close()
            raise PeerLost(f"{len(self._peers)} of {dist.num_processes - 1} processes connected within "
                           f"{timeout_s:.0f} s") from None
        finally:
            self._server.close()
        for process_id, peer in self._peers.items():
            threading.Thread(target=self._watch, args=(peer, process_id), daemon=True,
                             name=f"watch-process-{process_id}").start()

    def _watch(self, peer: socket.socket, process_id: int) -> None:
        try:
            while peer.recv(1):  # followers send nothing: any return is its end
                pass
        except OSError:
            pass
        self._lost(f"process {process_id} of the deployment is gone (its channel closed)")

    def _lost(self, message: str) -> None:
        with self._lock:
            first = self.failure is None and not self._closing
            self.failure = self.failure or message
        if first and self._on_lost is not None:
            self._on_lost(message)

    def send(self, command: int, kind: int = 0, bucket: int = 0, payload: bytes = b"") -> None:
        """Send one command to every follower; PeerLost once one is gone (a follower that closes after a RESULT
        it received is seen by the next send)."""
        if self.failure:
            raise PeerLost(self.failure)
        message = _HEADER.pack(command, kind, bucket, len(payload)) + payload
        lost = None
        for process_id, peer in self._peers.items():
            try:
                peer.sendall(message)
            except OSError as e:
                lost = lost or f"process {process_id} of the deployment is gone ({e})"
        if lost:
            self._lost(lost)
            raise PeerLost(lost)

    def close(self) -> None:
        """Tell the followers to stop (when they still listen) and close: their ends closing is no loss."""
        with self._lock:
            is_open, self._closing = self.failure is None and not self._closing, True
        if is_open:
            try:
                self.send(STOP)
            except PeerLost:
                pass
        self.failure = self.failure or "the channel is closed"
        for peer in self._peers.values():
            peer.close()


class FollowerChannel:
    """A follower's end: connects to the leader (retrying while it starts) and receives its commands."""

    def __init__(self, dist: Distributed, *, timeout_s: float = CONNECT_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._sock = socket.create_connection(dist.channel_address, timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise PeerLost(f"the leader at {dist.channel_address} did not answer within {timeout_s:.0f} s")
                time.sleep(0.2)
        self._sock.settimeout(None)
        self._sock.sendall(struct.pack("!i", dist.process_id))

    def recv(self) -> tuple[int, int, int, bytes]:
        """The next command: (command, program kind index, bucket, payload); PeerLost when the leader is gone."""
        try:
            command, kind, bucket, size = _HEADER.unpack(_recv_exactly(self._sock, _HEADER.size))
            return command, kind, bucket, _recv_exactly(self._sock, size)
        except (OSError, PeerLost) as e:
            raise PeerLost(f"the leader (process 0) is gone: {e}") from None

    def close(self) -> None:
        self._sock.close()


class Mirror:
    """What a leader's `ModelRunner` calls so its followers run the same programs (`ModelRunner.mirror`)."""

    def __init__(self, channel: StepChannel, kind_names: tuple[str, ...]):
        self.channel, self._kind_names = channel, kind_names

    def run(self, kind_name: str, bucket: int, packed: np.ndarray) -> None:
        self.channel.send(RUN, self._kind_names.index(kind_name), bucket, np.ascontiguousarray(packed).tobytes())

    def reset(self) -> None:
        self.channel.send(RESET)

    def result(self, value) -> None:
        """Send an offline call's outputs (or its exception: as a RuntimeError when it does not pickle)."""
        try:
            payload = pickle.dumps(value)
        except Exception:
            payload = pickle.dumps(RuntimeError(repr(value)))
        self.channel.send(RESULT, payload=payload)


def connect(dist: Distributed, runner, kind_names: tuple[str, ...], *, on_lost=None):
    """This process's channel of deployment `dist`: process 0's `StepChannel` (accepting every other process, its
    `runner` mirrored to them, `on_lost` called once one is gone), or another process's `FollowerChannel`."""
    if not dist.is_leader:
        return FollowerChannel(dist)
    channel = StepChannel(dist, on_lost=on_lost)
    runner.mirror = Mirror(channel, kind_names)
    return channel


def follow(runner, channel: FollowerChannel, kind_names: tuple[str, ...]):
    """A follower's loop: run each program the leader runs, on its buffer, until the leader sends a result (returned;
    the leader is this deployment's process 0, whose pickles it trusts) or stops (None). PeerLost when the leader
    is gone."""
    from dcp_jax.runtime.step import Placed

    while True:
        command, kind, bucket, payload = channel.recv()
        if command == RUN:
            runner.run_mirrored(kind_names[kind], Placed(bucket, np.frombuffer(payload, np.int32).copy()))
        elif command == RESET:
            runner.reset_state()
        elif command == RESULT:
            return pickle.loads(payload)
        elif command == STOP:
            return None
        else:
            raise PeerLost(f"an unknown command {command} from the leader")
