"""The TCP version transport: params versions as byte strings, from each train process
(`VersionServer`) to each rollout process (`VersionClient`), point to point, checksummed, whole
or as what changed (`rollout.sync`).

Each train process serves its rows of every version it publishes (`jaxrl.pipeline.remote`); a
lost or hung client costs its own connection thread only (every socket call has a timeout), so
a lost rollout process stalls nothing (docs/failures.md).

The exchange, one connection per request:

- the client asks `"<version> <wait_s> <base>\\n"`: `base` is the version whose bytes it holds
  (-1: none, or it wants a full copy);
- the server answers `F` + crc32 + length + the version's bytes (a full copy), or, when it was
  built with `delta` (the wire dtype's itemsize) and `base` is the version it published just
  before this one, `D` + base + crc32 + length + `jaxrl.parallel.delta.encode(base's bytes,
  the version's)`; `E` + a line when the version is not published in time or retired. The
  crc32 is always the full version's;
- the client rebuilds the bytes (`delta.decode` on its kept base), checks the crc32, and keeps
  them as its base when they are newer than the one it holds.

So a client that missed a version (its base is not the one the delta was made against), or
that asks for an older one (a part made again), gets a full copy; a transfer whose checksum
fails (or whose delta does not decode) is said in one line and asked for again as a full copy,
and after `attempts` failures in a row `TransferDamaged` ends the receiving process (dropped by
the train side, docs/failures.md) rather than let it sample from damaged weights.

Memory: a client with `delta` keeps one extra copy of its version's bytes (its base) per train
process (the rollout side's cost of delta sync; with full sync it keeps none); a server with
`delta` keeps the previous version's bytes until the delta against it is made.

Faults for tests (`SyncFaults`, from `JAXRL_SYNC_FAULTS` on the receiving process):
`damage=V` flips one byte of the first transfer of version V as it arrives (`damage=VxN`: of
the first N), `drop=V` makes the client not keep version V as its base, as a client that
missed it would be.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable

from jaxrl.core.errors import UserError
from jaxrl.parallel import delta as delta_lib

FAULTS_ENV = "JAXRL_SYNC_FAULTS"
_F = struct.Struct("<IQ")  # crc32, length
_D = struct.Struct("<qIQ")  # base version, crc32, length


class VersionGone(RuntimeError):
  """The version asked of a `VersionServer` is older than the ones it keeps."""


class TransferDamaged(UserError, RuntimeError):
  """A version's bytes failed their checksum `attempts` times in a row: this process stops
  rather than sample from damaged weights."""


class _Entry:
  """One published version: its bytes, and (made on the first request that can use it) its
  delta against the version published before it."""

  def __init__(self, data: bytes, base: tuple[int, bytes] | None):
    self.data, self.base = data, base
    self.base_version = -1 if base is None else base[0]
    self.lock = threading.Lock()
    self._crc: int | None = None
    self._delta: bytes | None = None

  def crc(self) -> int:
    with self.lock:
      if self._crc is None:
        self._crc = delta_lib.checksum(self.data)
      return self._crc

  def delta(self, itemsize: int) -> bytes:
    """The delta (b"" where it would not be smaller than the version itself)."""
    with self.lock:
      if self._delta is None:
        d = delta_lib.encode(self.base[1], self.data, itemsize)
        self._delta = d if len(d) < len(self.data) else b""
        self.base = None  # the base's bytes are no longer needed here
      return self._delta


class VersionServer:
  """Serves byte strings by version over plain TCP (module docstring). The owner `publish`es
  each version's bytes and `retire_below`s the ones no batch needs any more. `address` is what
  clients connect to (the port is picked when `port` is 0). `delta`: the itemsize to diff by
  (None: full copies only). `sent` / `sent_bytes`: transfers and bytes by kind ('full',
  'delta'), counted once a reply is sent in full; `wait_idle` waits for the replies in flight
  (a client may hold every byte before its sender thread counts it)."""

  def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0,
               delta: int | None = None):
    self.timeout_s = float(timeout_s)
    self.delta = delta
    self._sock = socket.create_server((host, port))
    self._sock.settimeout(0.2)
    self.address = f"{host}:{self._sock.getsockname()[1]}"
    self._versions: dict[int, _Entry] = {}
    self._last: tuple[int, bytes] | None = None  # the newest version published, for its delta
    self._oldest = 0  # versions below it are retired
    self._cond = threading.Condition()
    self._stop = threading.Event()
    self.served = 0  # whole versions sent
    self.sent = {"full": 0, "delta": 0}
    self.sent_bytes = {"full": 0, "delta": 0}
    self.failed: list[str] = []  # one line per connection that broke off (a lost client)
    self._active = 0  # connections being served
    self._thread = threading.Thread(target=self._accept, name="version-server", daemon=True)
    self._thread.start()

  def publish(self, version: int, data: bytes) -> None:
    data = bytes(data)
    with self._cond:
      last = self._last
      base = last if (self.delta and last is not None and last[0] < version and
                      len(last[1]) == len(data)) else None
      self._versions[version] = _Entry(data, base)
      if last is None or version > last[0]:
        self._last = (version, data)
      self._cond.notify_all()

  def get(self, version: int) -> bytes | None:
    """What is served as `version` (None: not published, or retired)."""
    with self._cond:
      entry = self._versions.get(version)
    return None if entry is None else entry.data

  def retire_below(self, version: int) -> None:
    """Forgets every version below `version`; asking for one of them is `VersionGone`."""
    with self._cond:
      self._oldest = max(self._oldest, version)
      for v in [v for v in self._versions if v < version]:
        del self._versions[v]
      self._cond.notify_all()

  def wait_idle(self, timeout_s: float = 5.0) -> bool:
    """Waits until no connection is being served (True), or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    with self._cond:
      while self._active and time.monotonic() < deadline:
        self._cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))
      return self._active == 0

  def summary(self) -> str:
    """One line: what this server sent, by kind (once the replies in flight are counted)."""
    self.wait_idle(1.0)
    n, b = self.sent, self.sent_bytes
    return (f"params versions sent: {n['full']} full ({b['full']:,} bytes), {n['delta']} as "
            f"deltas ({b['delta']:,} bytes)")

  def close(self) -> None:
    self.wait_idle(1.0)
    self._stop.set()
    with self._cond:
      self._cond.notify_all()
    self._thread.join(timeout=5)
    self._sock.close()

  def _accept(self) -> None:
    while not self._stop.is_set():
      try:
        conn, _ = self._sock.accept()
      except TimeoutError:
        continue
      except OSError:  # closed
        return
      with self._cond:
        self._active += 1
      threading.Thread(target=self._serve, args=(conn,), name="version-server-conn",
                       daemon=True).start()

  def _serve(self, conn: socket.socket) -> None:
    try:
      self._serve_one(conn)
    finally:
      with self._cond:
        self._active -= 1
        self._cond.notify_all()

  def _serve_one(self, conn: socket.socket) -> None:
    try:
      with conn:
        conn.settimeout(self.timeout_s)
        asked = _read_line(conn).split()
        version = int(asked[0])
        wait_s = min(self.timeout_s, float(asked[1])) if len(asked) > 1 else self.timeout_s
        base = int(asked[2]) if len(asked) > 2 else -1
        deadline = time.monotonic() + wait_s
        with self._cond:
          while (version not in self._versions and version >= self._oldest
                 and not self._stop.is_set() and time.monotonic() < deadline):
            self._cond.wait(0.2)
          entry = self._versions.get(version)
          gone = version < self._oldest
        if entry is None:
          why = f"version {version} is retired" if gone else f"version {version} not published"
          conn.sendall(b"E" + why.encode() + b"\n")
          return
        d = entry.delta(self.delta) if (self.delta and base >= 0 and
                                        base == entry.base_version) else b""
        kind, payload = ("delta", d) if d else ("full", entry.data)
        head = b"D" + _D.pack(base, entry.crc(), len(d)) if d else \
            b"F" + _F.pack(entry.crc(), len(payload))
        conn.sendall(head)
        conn.sendall(payload)
      with self._cond:  # one connection thread per client: count under the lock
        self.served += 1
        self.sent[kind] += 1
        self.sent_bytes[kind] += len(head) + len(payload)
    except (OSError, ValueError) as e:  # the client went away or sent garbage: its loss only
      with self._cond:
        self.failed.append(f"{type(e).__name__}: {e}"[:200])


@dataclasses.dataclass(frozen=True)
class Reply:
  """One answer of a `VersionServer`: `kind` 'full' or 'delta' (against version `base`), the
  crc32 of the full version, and the payload as it arrived."""
  kind: str
  base: int
  crc: int
  data: bytes


def request(address: str, version: int, timeout_s: float = 60.0, base: int = -1) -> Reply:
  """Asks the `VersionServer` at `address` ("host:port") for `version`, holding `base` (-1:
  none), waiting up to `timeout_s` for each step (the server waits up to the smaller of
  `timeout_s` and its own timeout for the version to be published).

  Raises:
    VersionGone: the server has retired it.
    TimeoutError: it was not published in time, or the server stopped answering.
    ConnectionError: the server went away.
  """
  host, port = address.rsplit(":", 1)
  with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
    conn.settimeout(timeout_s + 5)  # past the server's own wait, which answers first
    conn.sendall(f"{version} {timeout_s:g} {base}\n".encode())
    kind = _recv_exact(conn, 1)
    if kind == b"E":
      why = _read_line(conn, 200)
      if "retired" in why:
        raise VersionGone(f"{address}: {why}")
      raise TimeoutError(f"{address}: {why} within {timeout_s:g} s")
    if kind == b"D":
      got_base, crc, n = _D.unpack(_recv_exact(conn, _D.size))
      return Reply("delta", got_base, crc, _recv_exact(conn, n))
    if kind != b"F":
      raise ConnectionError(f"{address}: an answer of unknown kind {kind!r}")
    crc, n = _F.unpack(_recv_exact(conn, _F.size))
    return Reply("full", -1, crc, _recv_exact(conn, n))


def fetch_version(address: str, version: int, timeout_s: float = 60.0) -> bytes:
  """Version `version`'s full bytes, checksum checked (`TransferDamaged` when it fails; the
  errors of `request` otherwise)."""
  reply = request(address, version, timeout_s)
  if delta_lib.checksum(reply.data) != reply.crc:
    raise TransferDamaged(f"params version {version} from {address} failed its checksum")
  return reply.data


@dataclasses.dataclass
class SyncFaults:
  """Damage injected into arriving transfers, for tests (module docstring)."""
  damage: dict[int, int] = dataclasses.field(default_factory=dict)  # version -> transfers left
  drop: frozenset[int] = frozenset()

  @classmethod
  def parse(cls, text: str) -> "SyncFaults":
    damage, drop = {}, set()
    for item in filter(None, (s.strip() for s in text.split(","))):
      what, _, value = item.partition("=")
      try:
        if what == "damage":
          v, _, n = value.partition("x")
          damage[int(v)] = int(n or 1)
        elif what == "drop":
          drop.add(int(value))
        else:
          raise ValueError(what)
      except ValueError:
        raise UserError(f"{FAULTS_ENV}: {item!r} is not damage=V, damage=VxN or drop=V") \
            from None
    return cls(damage, frozenset(drop))

  @classmethod
  def from_env(cls, env=os.environ) -> "SyncFaults":
    return cls.parse(env.get(FAULTS_ENV, ""))

  def arrive(self, version: int, data: bytes) -> bytes:
    """`data` as it arrives: one byte flipped while version `version` has damage left."""
    left = self.damage.get(version, 0)
    if left <= 0 or not data:
      return data
    self.damage[version] = left - 1
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x40
    return bytes(flipped)


class VersionClient:
  """A rollout process's side of one train process's `VersionServer` (module docstring):
  `fetch(version)` returns the version's full bytes, checksum checked, asking for a delta
  against the version it holds when `delta`. Safe to call from several threads (the network
  waits hold no lock). `stats`: transfers by kind, bytes received, damaged transfers; `crcs`:
  the crc32 of every version fetched."""

  def __init__(self, address: str, delta: bool = False, faults: SyncFaults | None = None,
               say: Callable[[str], None] = print, attempts: int = 3, name: str = ""):
    self.address, self.delta, self.attempts = address, bool(delta), int(attempts)
    self.faults = faults or SyncFaults()
    self.say, self.name = say, name or address
    self._base: tuple[int, bytes | bytearray] | None = None
    self._lock = threading.Lock()
    self.stats = {"full": 0, "delta": 0, "bytes": 0, "damaged": 0}
    self.crcs: dict[int, int] = {}

  def fetch(self, version: int, timeout_s: float = 60.0):
    """Version `version`'s bytes (bytes or bytearray). Raises TransferDamaged after `attempts`
    damaged transfers in a row, and `request`'s errors."""
    with self._lock:
      held = self._base if self.delta else None
    asked = held[0] if held is not None and held[0] < version else -1
    for attempt in range(1, self.attempts + 1):
      reply = request(self.address, version, timeout_s, asked)
      data, why = self._rebuild(version, reply, held)
      with self._lock:
        self.stats[reply.kind] += 1
        self.stats["bytes"] += len(reply.data)
      if why is None:
        break
      with self._lock:
        self.stats["damaged"] += 1
      if attempt == self.attempts:
        raise TransferDamaged(
            f"params version {version} from {self.name} failed its checksum {attempt} times "
            f"in a row ({why}); this process stops rather than sample from damaged weights")
      self.say(f"jaxrl | params version {version} from {self.name}: {why}; asking for a full "
               f"copy (attempt {attempt + 1} of {self.attempts})")
      asked = -1
    with self._lock:
      self.crcs[version] = reply.crc
      if self.delta and version not in self.faults.drop and \
          (self._base is None or self._base[0] < version):  # full sync keeps nothing
        self._base = (version, data)
    return data

  def _rebuild(self, version: int, reply: Reply, held):
    """The version's bytes from `reply` and the reason they are not to be used (None: good)."""
    payload = self.faults.arrive(version, reply.data)
    if reply.kind == "delta":
      if held is None or reply.base != held[0]:
        return None, f"a delta against version {reply.base}, not the one held"
      try:
        data = delta_lib.decode(held[1], payload)
      except ValueError as e:
        return None, f"its delta against version {reply.base} does not decode ({e})"
    else:
      data = payload
    got = delta_lib.checksum(data)
    if got != reply.crc:
      what = f"delta against version {reply.base}" if reply.kind == "delta" else "full copy"
      return None, f"checksum failed (crc32 {got:08x}, sent {reply.crc:08x}; a {what})"
    return data, None


def received(clients: list[VersionClient], sync: str) -> str:
  """One line on how `clients` got their versions (`sync`: 'full' or 'delta'), with a crc32
  over every version's crc32: the same whichever way the versions came."""
  crcs = [c.crcs[v] for c in clients for v in sorted(c.crcs)]
  digest = zlib.crc32(b"".join(x.to_bytes(4, "little") for x in crcs))
  n = {k: sum(c.stats[k] for c in clients) for k in ("full", "delta", "bytes", "damaged")}
  return (f"params versions received ({sync} sync): {n['full']} full, {n['delta']} as deltas, "
          f"{n['bytes']:,} bytes, {n['damaged']} damaged; digest {digest:08x}")


def _read_line(conn: socket.socket, limit: int = 64) -> str:
  got = b""
  while not got.endswith(b"\n"):
    part = conn.recv(1)
    if not part or len(got) > limit:
      raise ValueError("a request line was cut short")
    got += part
  return got.decode().strip()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
  buf = bytearray(n)
  view, got = memoryview(buf), 0
  while got < n:
    k = conn.recv_into(view[got:], min(1 << 22, n - got))
    if k == 0:
      raise ConnectionError(f"the connection closed after {got} of {n} bytes")
    got += k
  return buf  # a bytearray: a version's bytes are not copied again
