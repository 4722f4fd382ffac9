"""Disaggregated across processes: what crosses between the train processes and the rollout
processes (`mesh.rollout_processes`).

The two sides run different loops (`jaxrl.pipeline.remote`) and launch different programs, each
on its own devices. `ParamsBridge` cuts a params version into blocks and puts them back
together; a run moves the blocks over TCP (below), so that no program spans both sides and a
lost rollout process stalls nothing. Its exchange program (`send`/`receive`, and `transfer`
where one process holds every device: tests and benchmarks) moves them shard by shard over a
mesh of both sides' devices instead:

1. train side (its own program): every leaf cast to the wire dtype, flattened and concatenated
   into one buffer, cut into T x R blocks (T train devices, R devices of each rollout process),
   train device j holding row j (R blocks: the ones device i of a rollout process gets from it);
2. both sides: a `shard_map` over the union mesh (train devices, then rollout devices) whose
   `ppermute` rounds send block (j, i) from train device j to device i of every rollout process
   (max(T, R) rounds per rollout process, each a matching: no device sends or receives twice in
   a round);
3. each rollout process (its own program): its device i now holds column i; one local program
   puts the columns back in order and lays the leaves out on its rollout mesh by the parameter
   rules, in the samplers' dtype.

Every rollout process gets the whole params (it generates on its own). Rollout rows go the other
way through the coordination service's key-value store (`Channel`): host data anyway.

`VersionServer` and `fetch_version` (`jaxrl.parallel.transport`) carry byte strings by version
over plain TCP, point to point, checksummed, whole or as deltas (`rollout.sync`): the transport of params versions that survives a lost rollout process (docs/failures.md,
"Rollout processes that come and go"), which a run uses in place of the exchange: step 1, then
each train process's rows as bytes (`ParamsBridge.host_rows`), served per version by each train
process; each rollout process fetches every train process's rows and runs step 3 on them
(`ParamsBridge.from_rows`).
"""

from __future__ import annotations

import functools
import io
import json
import socket
import uuid
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.parallel import peers
# The TCP version transport lives in `transport`; these names are its, kept here for callers.
from jaxrl.parallel.transport import VersionGone, VersionServer, fetch_version  # noqa: F401


def shard_map(f, mesh, in_specs, out_specs):
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


PREFIX = "jaxrl/disaggregated/"


class ChannelClosed(RuntimeError):
  """A wait on the other side ended because this side is stopping."""


class Channel:
  """Keyed messages between the two sides over JAX's coordination service (process 0 runs it;
  every process of a run reaches it). Values of any size are cut into chunks the service takes.
  Waits poll every `poll_s`, so `should_stop()` ends them promptly."""

  CHUNK = 1 << 20

  def __init__(self, client=None, poll_s: float = 0.2, prefix: str = PREFIX):
    if client is None:
      client = peers.coordination_client()
    self.client = client
    self.poll_ms = max(1, int(poll_s * 1000))
    self.prefix = prefix  # every key's (one run's keys never meet another's)

  def set(self, key: str, value: str) -> None:
    self.client.key_value_set(self.prefix + key, value, allow_overwrite=True)

  def has(self, key: str) -> bool:
    try:
      self.client.key_value_try_get(self.prefix + key)
    except Exception:  # noqa: BLE001  (NOT_FOUND)
      return False
    return True

  def wait(self, key: str, should_stop: Callable[[], bool] = lambda: False) -> str:
    """The value of `key` once it is set; ChannelClosed if `should_stop()` first."""
    while True:
      if should_stop():
        raise ChannelClosed(key)
      try:
        return self.client.blocking_key_value_get(self.prefix + key, self.poll_ms)
      except Exception as e:  # noqa: BLE001
        if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e):
          raise

  def put_bytes(self, key: str, data: bytes) -> None:
    """`data` under `key`: chunks first, under a tag of this write's own, then `key/n` (the tag
    and the count) that makes them visible. Two writes of one key never meet: one that died part
    way (a rollout process killed while it sent a part, which another then makes again) leaves
    only chunks nobody points to, and the last complete write is the one read."""
    n = max(1, -(-len(data) // self.CHUNK))
    tag = uuid.uuid4().hex[:16]
    for i in range(n):
      self.client.key_value_set_bytes(f"{self.prefix}{key}/{tag}/{i}",
                                      data[i * self.CHUNK:(i + 1) * self.CHUNK])
    self.set(f"{key}/n", f"{tag} {n}")

  def take_bytes(self, key: str, should_stop: Callable[[], bool] = lambda: False) -> bytes:
    """The bytes `put_bytes` stored under `key`, waiting for them; then every key under `key`
    is deleted (the coordination service deletes a key's whole directory), those of a write that
    died part way too."""
    tag, n = self.wait(f"{key}/n", should_stop).split()
    parts = [self.client.blocking_key_value_get_bytes(f"{self.prefix}{key}/{tag}/{i}",
                                                      self.poll_ms) for i in range(int(n))]
    self.client.key_value_delete(f"{self.prefix}{key}")
    return b"".join(parts)


def reachable_host() -> str:
  """This host's address as the other processes of the run reach it: the one its route to the
  coordination service leaves from (127.0.0.1 when that runs on this host's loopback)."""
  from jax._src import distributed as jax_distributed  # the coordinator's address, as joined

  address = getattr(jax_distributed.global_state, "coordinator_address", None) or "127.0.0.1:1"
  host = address.rsplit(":", 1)[0].strip("[]")
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
      probe.connect((host, 9))  # a UDP connect sends nothing: it only picks the route
      return probe.getsockname()[0]
  except OSError:
    return "127.0.0.1"


def pack(arrays: dict, header: dict) -> bytes:
  """Host arrays and a JSON header as one byte string (`unpack` reverses it)."""
  head = json.dumps(header).encode()
  buf = io.BytesIO()
  np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
  return len(head).to_bytes(8, "little") + head + buf.getvalue()


def unpack(data: bytes) -> tuple[dict, dict]:
  n = int.from_bytes(data[:8], "little")
  header = json.loads(data[8:8 + n].decode())
  with np.load(io.BytesIO(data[8 + n:]), allow_pickle=False) as z:
    arrays = {k: z[k] for k in z.files}
  return arrays, header


def _rounds(T: int, R: int, K: int = 1):
  """The ppermute rounds of the block exchange to K rollout groups of R devices each (union
  index T + k * R + i): for each group k, round c pairs train j with that group's device
  (c - j) mod max(T, R), when that is < R. Each round is a matching, and every (train device,
  rollout device) pair is in exactly one round."""
  m = max(T, R)
  return [[(j, T + k * R + (c - j) % m) for j in range(T) if (c - j) % m < R]
          for k in range(K) for c in range(m)]


class ParamsBridge:
  """Publishes params versions from the train devices to every rollout process's devices
  (module docstring).

  `rollout_groups`: the devices of each rollout process (the same number each), in the order
  of the processes; each group receives the whole params. `template`: the params tree (arrays or
  ShapeDtypeStructs; shapes and dtypes, the same on both sides), `wire`: the dtype they travel in
  (the narrower of the trainer's and the samplers'), `out`: the samplers' dtype (None: as they
  travel). The train side calls `send(params)`, each rollout process `receive(shardings)`, once
  per version each, in the same order; `transfer` runs both sides where one process holds every
  device.
  """

  def __init__(self, train_devices, rollout_groups, template, wire, out=None):
    self.train = list(train_devices)
    self.groups = [list(g) for g in rollout_groups]
    if not self.groups or len({len(g) for g in self.groups}) != 1 or not self.groups[0]:
      raise ValueError(f"ParamsBridge: rollout groups must be non-empty and equal in size, got "
                       f"{[len(g) for g in self.groups]}")
    self.T, self.R, self.K = len(self.train), len(self.groups[0]), len(self.groups)
    leaves, self.treedef = jax.tree.flatten(template)
    self.shapes = [tuple(x.shape) for x in leaves]
    self.sizes = [int(np.prod(s)) for s in self.shapes]
    self.wire = jnp.dtype(wire)
    self.out = None if out is None else jnp.dtype(out)
    total = sum(self.sizes)
    self.block = max(1, -(-total // (self.T * self.R)))
    self.total = total
    self.rollout = [d for g in self.groups for d in g]
    self.union = Mesh(np.asarray(self.train + self.rollout, dtype=object), ("u",))
    self.train_line = Mesh(np.asarray(self.train, dtype=object), ("u",))
    self._placeholder: dict = {}

  @property
  def wire_bytes(self) -> int:
    """Bytes each version moves between the sides (the padded buffer, once per rollout
    process)."""
    return self.K * self.T * self.R * self.block * self.wire.itemsize

  # -- the program both sides launch --------------------------------------------------------------

  @functools.cached_property
  def _exchange(self):
    T, R, K, b = self.T, self.R, self.K, self.block
    rounds = _rounds(T, R, K)
    m = max(T, R)

    def body(x):  # x: [1, R, b], this device's row (train) or a placeholder (rollout)
      i = jax.lax.axis_index("u")
      mine = (i - T) % R  # a rollout device's index in its group
      out = jnp.zeros((1, T, b), x.dtype)
      for r, pairs in enumerate(rounds):
        if not pairs:
          continue
        k, c = divmod(r, m)
        send = jax.lax.dynamic_index_in_dim(x[0], jnp.clip((c - i) % m, 0, R - 1), 0,
                                            keepdims=False)
        got = jax.lax.ppermute(send, "u", pairs)
        slot = jnp.clip((c - mine) % m, 0, T - 1)
        placed = jax.lax.dynamic_update_index_in_dim(out[0], got, slot, 0)[None]
        receives = (i >= T + k * R) & (i < T + (k + 1) * R) & ((c - mine) % m < T)
        out = jnp.where(receives, placed, out)
      return out

    return jax.jit(shard_map(body, self.union, PartitionSpec("u"), PartitionSpec("u")))

  def _run(self, shards: list) -> jax.Array:
    """The exchange on the union-mesh array made of this process's `shards` (in union order)."""
    x = jax.make_array_from_single_device_arrays(
        (self.T + self.K * self.R, self.R, self.block),
        NamedSharding(self.union, PartitionSpec("u")), shards)
    return self._exchange(x)

  def _mine(self, devices) -> list:
    me = jax.process_index()
    return [d for d in devices if d.process_index == me]

  def _placeholders(self, devices) -> list:
    """What rollout devices feed the exchange: never read, made once."""
    for d in devices:
      if d not in self._placeholder:
        self._placeholder[d] = jax.device_put(np.zeros((1, self.R, self.block), self.wire), d)
    return [self._placeholder[d] for d in devices]

  # -- train side ----------------------------------------------------------------------------------

  @functools.cached_property
  def _pack(self):
    T, R, b, n = self.T, self.R, self.block, self.total
    wire = self.wire

    def pack_leaves(leaves):
      flat = jnp.concatenate([x.astype(wire).reshape(-1) for x in leaves])
      return jnp.pad(flat, (0, T * R * b - n)).reshape(T, R, b)

    return jax.jit(pack_leaves,
                   out_shardings=NamedSharding(self.train_line, PartitionSpec("u")))

  def _rows(self, params) -> dict:
    leaves, treedef = jax.tree.flatten(params)
    if treedef != self.treedef:  # the blocks are cut in leaf order: both sides must agree on it
      raise ValueError(f"ParamsBridge.send: params tree {treedef} is not the template's "
                       f"{self.treedef}")
    rows = self._pack(leaves)
    return {s.device: s.data for s in rows.addressable_shards}

  def rows_of(self, process: int) -> list[int]:
    """The rows of the packed buffer (train devices) `process` holds, in order."""
    return [j for j, d in enumerate(self.train) if d.process_index == process]

  def host_rows(self, params) -> bytes:
    """The train side's packing of `params` (one program on the train devices), then this
    process's rows of it (`rows_of`) as bytes, in the wire dtype: what `from_rows` unpacks."""
    by_device = self._rows(params)
    mine = [self.train[j] for j in self.rows_of(jax.process_index())]
    return b"".join(np.asarray(by_device[d]).tobytes() for d in mine)

  def from_rows(self, rows: dict, shardings):
    """A rollout process's params, laid out by `shardings` (on its rollout mesh), from every
    train process's `host_rows` (`rows`: process -> bytes): column i of the buffer onto its
    device i, then the same unpacking as `receive`."""
    full = np.zeros((self.T, self.R, self.block), self.wire)
    for q, data in rows.items():
      at = self.rows_of(q)
      got = np.frombuffer(data, self.wire)
      if got.size != len(at) * self.R * self.block:
        raise ValueError(f"ParamsBridge.from_rows: process {q} sent {got.size} values, expected "
                         f"{len(at) * self.R * self.block}")
      full[at] = got.reshape(len(at), self.R, self.block)
    group = self.group_of(jax.process_index())
    devices = self.groups[group]
    line = Mesh(np.asarray(devices, dtype=object), ("u",))
    cols = jax.make_array_from_single_device_arrays(
        (self.R, self.T, self.block), NamedSharding(line, PartitionSpec("u")),
        [jax.device_put(np.ascontiguousarray(full[:, i][None]), d)
         for i, d in enumerate(devices)])
    return self._post_for(group, shardings)(cols)

  def send(self, params) -> jax.Array:
    """The train side's part of publishing `params` (launched, not waited for). Returns the
    exchange's output: ready once every rollout process has taken part. A caller must not launch
    another program spanning both sides before it is (on CPU two such programs in flight at once
    can pair each other's transfers and hang; `jaxrl.pipeline.remote.Versions` waits)."""
    by_device = self._rows(params)
    return self._run([by_device[d] for d in self._mine(self.train)])

  # -- rollout side --------------------------------------------------------------------------------

  def _post(self, group: int, shardings):
    n = self.total
    sizes, shapes, out = self.sizes, self.shapes, self.out
    treedef = self.treedef

    def unpack_columns(cols):  # cols: [R, T, b], column i on the group's device i
      flat = cols.transpose(1, 0, 2).reshape(-1)[:n]
      leaves, at = [], 0
      for size, shape in zip(sizes, shapes):
        x = flat[at:at + size].reshape(shape)
        leaves.append(x if out is None else x.astype(out))
        at += size
      return jax.tree.unflatten(treedef, leaves)

    return jax.jit(unpack_columns, out_shardings=shardings)

  def _unpack(self, got: jax.Array, group: int, shardings):
    """Group `group`'s columns of the exchange's output as params laid out by `shardings`."""
    devices = self.groups[group]
    by_device = {s.device: s.data for s in got.addressable_shards}
    line = Mesh(np.asarray(devices, dtype=object), ("u",))
    cols = jax.make_array_from_single_device_arrays(
        (self.R, self.T, self.block), NamedSharding(line, PartitionSpec("u")),
        [by_device[d] for d in devices])
    return self._post_for(group, shardings)(cols)

  def _post_for(self, group: int, shardings):
    key = (group, tuple(jax.tree.leaves(shardings)))
    post = self._posts.get(key)
    if post is None:
      post = self._posts[key] = self._post(group, shardings)
    return post

  def group_of(self, process: int) -> int:
    """The rollout group of `process` (ValueError when it holds no rollout device)."""
    for k, g in enumerate(self.groups):
      if any(d.process_index == process for d in g):
        return k
    raise ValueError(f"process {process} holds no rollout device of this bridge")

  def receive(self, shardings):
    """A rollout process's part of publishing a version: the params, laid out by `shardings` (a
    tree like the template's, on this process's rollout mesh). Returns once the exchange is
    done."""
    group = self.group_of(jax.process_index())
    got = self._run(self._placeholders(self._mine(self.rollout)))
    jax.block_until_ready(got)  # one exchange in flight at a time (see `send`)
    return self._unpack(got, group, shardings)

  def transfer(self, params, shardings: list) -> list:
    """Both sides of one publish where this process holds every device (one process: tests and
    benchmarks of the exchange): `shardings[k]` lays out group k's copy; returns the K copies."""
    by_device = self._rows(params)
    got = self._run([by_device[d] for d in self.train] + self._placeholders(self.rollout))
    return [self._unpack(got, k, sh) for k, sh in enumerate(shardings)]

  @functools.cached_property
  def _posts(self) -> dict:
    return {}
