"""Meshes and shardings: a named ('data', 'fsdp', 'tensor') mesh and logical-axis rules; several
processes (`distributed`), and their liveness (`peers`)."""

from jaxrl.parallel import distributed, peers
from jaxrl.parallel.sharding import (AXES, batch_sharding, make_mesh, param_shardings,
                                     replicated)
from jaxrl.parallel.reshard import reshard

__all__ = ["AXES", "batch_sharding", "distributed", "make_mesh", "param_shardings", "peers",
           "replicated", "reshard"]
