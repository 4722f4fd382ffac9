"""jaxrl.parallel.bridge.ParamsBridge: one publish from the train devices to every rollout
process's devices (`mesh.rollout_processes`), run within one process (`transfer`) on 8 simulated
devices: each rollout group receives the whole params, bit for bit in the wire dtype, laid out by
its own shardings, for train/rollout device counts that do and do not match and for several
rollout groups; a params tree other than the template's is refused. The rows' way back
(`producer.combine`) joins the parts of several processes as `globalize` does, and the
`Channel` they travel through cuts them into chunks and keeps runs apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import tiny_model_config
from jaxrl.models.transformer import abstract_model
from jaxrl.parallel import make_mesh, param_shardings
from jaxrl.parallel.bridge import Channel, ChannelClosed, ParamsBridge, pack, unpack
from jaxrl.pipeline.batch_meta import BatchMeta
from jaxrl.pipeline.producer import combine

_, ABSTRACT = abstract_model(tiny_model_config(vocab_size=64))


def _params(mesh):
  rng = np.random.default_rng(0)
  values = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), ABSTRACT)
  return jax.device_put(values, param_shardings(ABSTRACT, mesh))


# (train devices, each rollout group's devices): R = T, R > T, R < T, several groups, one device
@pytest.mark.parametrize("train, groups", [
    (4, [4]), (2, [6]), (4, [2, 2]), (3, [1, 1, 1]), (2, [3, 3]),
])
@pytest.mark.parametrize("wire, out", [(jnp.float32, None), (jnp.bfloat16, jnp.bfloat16)])
def test_every_group_gets_the_whole_params(devices, train, groups, wire, out):
  train_mesh = make_mesh(train, 1, 1, devices[:train])
  params = _params(train_mesh)
  cut = np.cumsum([train] + groups)
  group_devices = [devices[a:b] for a, b in zip(cut[:-1], cut[1:])]
  bridge = ParamsBridge(devices[:train], group_devices, ABSTRACT, wire, out)
  # Each group lays the params out on its own mesh (tensor-parallel where it has 2+ devices).
  layouts = [param_shardings(ABSTRACT, make_mesh(1, 1, len(g), g) if len(g) in (1, 2)
                             else make_mesh(len(g), 1, 1, g)) for g in group_devices]
  got = bridge.transfer(params, layouts)
  assert len(got) == len(groups)
  want = jax.tree.map(lambda x: np.asarray(x.astype(wire)), params)
  for copy, layout, g in zip(got, layouts, group_devices):
    for a, b, sh in zip(jax.tree.leaves(copy), jax.tree.leaves(want), jax.tree.leaves(layout)):
      assert a.dtype == (out or wire)
      np.testing.assert_array_equal(np.asarray(a.astype(wire)), b)
      assert a.sharding == sh and set(a.sharding.device_set) == set(g)
  # Each version moves one padded copy per rollout group.
  total = sum(x.size for x in jax.tree.leaves(params))
  assert total * len(groups) * jnp.dtype(wire).itemsize <= bridge.wire_bytes < \
      (total + train * groups[0]) * len(groups) * jnp.dtype(wire).itemsize


def test_a_tree_other_than_the_template_is_refused(devices):
  mesh = make_mesh(4, 1, 1, devices[:4])
  bridge = ParamsBridge(devices[:4], [devices[4:]], ABSTRACT, jnp.float32)
  params = _params(mesh)
  with pytest.raises(ValueError, match="is not the template's"):
    bridge.transfer({"other": params}, [NamedSharding(Mesh(np.asarray(devices[4:]), ("u",)),
                                                      P())])
  with pytest.raises(ValueError, match="equal in size"):
    ParamsBridge(devices[:4], [devices[4:6], devices[6:7]], ABSTRACT, jnp.float32)


def test_combine_joins_the_parts_of_a_batch():
  """Two processes' parts of one batch: rows joined in order, env calls and generation attempts
  the most either made (they ran in parallel), failures and counters added, reward means over
  every row (sums 3 over 2 rows and 5 over 2 rows: 8 / 4 = 2.0)."""
  def part(keys, groups, info, sums, counts, took):
    meta = BatchMeta("train", tuple(keys), group_ids=np.asarray(groups),
                     lengths=np.ones(len(keys), np.int64), versions=np.zeros(len(keys), np.int64))
    return {"meta": meta.to_json(), "time": took, "info": info, "sums": sums, "counts": counts}

  meta, info, counts, took = combine([
      part(["b0/0", "b0/1"], [0, 0], {"env/calls": 3, "env/failed/timeout": 1,
                                      "dynamic_sampling/num_gen_batches": 1},
           {"reward/correct": [3.0, 2]}, {"regenerated": 1}, 0.5),
      part(["b0/2", "b0/3"], [1, 1], {"env/calls": 5, "env/failed/timeout": 2,
                                      "dynamic_sampling/num_gen_batches": 2},
           {"reward/correct": [5.0, 2]}, {"regenerated": 0, "filtered": 2}, 0.75)])
  assert meta.keys == ("b0/0", "b0/1", "b0/2", "b0/3")
  assert list(meta.group_ids) == [0, 0, 1, 1]
  assert info == {"env/calls": 5, "env/failed/timeout": 3, "dynamic_sampling/num_gen_batches": 2,
                  "reward/correct": 2.0}
  assert counts == {"regenerated": 1, "filtered": 2} and took == 0.75


class _Store:
  """An in-memory stand-in for the coordination service's key-value client."""

  def __init__(self):
    self.kv: dict = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    assert allow_overwrite or key not in self.kv
    self.kv[key] = value

  key_value_set_bytes = key_value_set

  def key_value_try_get(self, key):
    if key not in self.kv:
      raise KeyError(f"NOT_FOUND: {key}")
    return self.kv[key]

  def blocking_key_value_get(self, key, timeout_ms):
    if key not in self.kv:
      raise TimeoutError("DEADLINE_EXCEEDED")
    return self.kv[key]

  blocking_key_value_get_bytes = blocking_key_value_get

  def key_value_delete(self, key):  # as the service does: the key and its whole directory
    for k in [k for k in self.kv if k == key or k.startswith(key + "/")]:
      del self.kv[k]


class _DiesAfter(_Store):
  """A store whose writer dies (raises) at its `n`-th chunk: a rollout process killed while it
  sent a part."""

  def __init__(self, store, n):
    self.kv, self.left = store.kv, n

  def key_value_set_bytes(self, key, value, allow_overwrite=False):
    self.left -= 1
    if self.left < 0:
      raise ConnectionError("killed")
    super().key_value_set(key, value, allow_overwrite)


def test_channel_chunks_bytes_and_keeps_runs_apart():
  """Values larger than a chunk cross whole and are deleted when taken; two runs' channels (the
  prefix `remote.run_channel` gives each run) never read each other's keys; a wait ends with
  ChannelClosed once `should_stop()`."""
  store = _Store()
  first = Channel(store, prefix="jaxrl/disaggregated/run1/")
  second = Channel(store, prefix="jaxrl/disaggregated/run2/")
  first.CHUNK = second.CHUNK = 7
  data = bytes(range(50))
  first.put_bytes("rows/0/0/1", data)
  assert sum(k.startswith("jaxrl/disaggregated/run1/rows/0/0/1/") for k in store.kv) == 9
  first.set("done", "1")
  assert first.has("done") and not second.has("done")
  with pytest.raises(ChannelClosed):
    second.take_bytes("rows/0/0/1", should_stop=lambda: True)
  assert first.take_bytes("rows/0/0/1") == data
  assert list(store.kv) == ["jaxrl/disaggregated/run1/done"]  # the rows' keys are gone
  arrays, head = unpack(pack({"tokens": np.arange(6).reshape(2, 3)}, {"batch": 3}))
  assert head == {"batch": 3} and arrays["tokens"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_write_that_died_part_way_does_not_block_the_next():
  """A writer killed after 3 of its 8 chunks leaves no count; another process then writes the
  same key (the part made again, here of another length): the write succeeds, the reader gets
  the new bytes whole, and taking them leaves no key of either write behind."""
  store = _Store()
  dead = Channel(_DiesAfter(store, 3), prefix="run/")
  live = Channel(store, prefix="run/")
  dead.CHUNK = live.CHUNK = 7
  with pytest.raises(ConnectionError):
    dead.put_bytes("rows/2/1/0", bytes(range(50)))
  assert len(store.kv) == 3 and not live.has("rows/2/1/0/n")
  again = bytes(range(100, 140))
  live.put_bytes("rows/2/1/0", again)
  assert live.take_bytes("rows/2/1/0") == again
  assert store.kv == {}
